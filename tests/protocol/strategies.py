"""Hypothesis strategies for valid values of every wire model."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

import protocol as p
from protocol.packed import INT32_MAX, pack_floats

names = st.text(min_size=1, max_size=40)
token_ids = st.lists(st.integers(0, INT32_MAX), min_size=1, max_size=50)
# Packed floats are float32 on the wire; +-inf is allowed there, NaN never.
packed_floats = st.lists(st.floats(width=32, allow_nan=False), max_size=20)
finite = st.floats(allow_nan=False, allow_infinity=False)
unit = st.floats(0.0, 1.0)
uint64 = st.integers(0, 2**64 - 1)


def _maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | strategy


sampling_configs = st.builds(
    p.SamplingConfig,
    beam_width=st.integers(1, 8),
    top_k=_maybe(st.integers(0, 1000)),
    top_p=_maybe(st.floats(0.0, 1.0)),
    top_p_min=_maybe(st.floats(0.0, 1.0, exclude_min=True)),
    top_p_reset_ids=_maybe(st.integers(-1, INT32_MAX)),
    top_p_decay=_maybe(st.floats(0.0, 1.0, exclude_min=True)),
    min_p=_maybe(unit),
    seed=_maybe(uint64),
    temperature=_maybe(st.floats(0.0, 100.0)),
    min_tokens=_maybe(st.integers(0, 1000)),
    beam_search_diversity_rate=_maybe(st.floats(0.0, 10.0)),
    repetition_penalty=_maybe(st.floats(0.0, 10.0, exclude_min=True)),
    presence_penalty=_maybe(finite),
    frequency_penalty=_maybe(finite),
    length_penalty=_maybe(finite),
    early_stopping=_maybe(st.integers(-(2**31), 2**31)),
    no_repeat_ngram_size=_maybe(st.integers(1, 10)),
)

output_configs = st.builds(
    p.OutputConfig,
    return_log_probs=st.booleans(),
    return_context_logits=st.booleans(),
    return_generation_logits=st.booleans(),
    exclude_input_from_output=st.booleans(),
    top_n_log_probs=st.integers(0, 20),
)

guided_params = st.one_of(
    st.builds(p.GuidedDecodingParams, guide_type=st.just("json"), guide=_maybe(st.text(max_size=50))),
    st.builds(
        p.GuidedDecodingParams,
        guide_type=st.sampled_from(["json_schema", "regex", "ebnf_grammar"]),
        guide=st.text(min_size=1, max_size=50),
    ),
)


@st.composite
def submits(draw: st.DrawFn) -> p.Submit:
    sampling = draw(sampling_configs)
    by_prompt = draw(st.booleans())
    max_sequences = sampling.beam_width if sampling.beam_width > 1 else 8
    return p.Submit(
        request_id=draw(names),
        model=draw(_maybe(names)),
        prompt=draw(st.text(min_size=1, max_size=200)) if by_prompt else None,
        input_token_ids=None if by_prompt else draw(token_ids),
        max_tokens=draw(st.integers(1, 1 << 20)),
        streaming=draw(st.booleans()),
        sampling_config=sampling,
        output_config=draw(output_configs),
        end_id=draw(_maybe(st.integers(0, INT32_MAX))),
        pad_id=draw(_maybe(st.integers(0, INT32_MAX))),
        bad_words=draw(_maybe(st.lists(token_ids, max_size=4))),
        stop_words=draw(_maybe(st.lists(token_ids, max_size=4))),
        stop=draw(_maybe(st.lists(st.text(min_size=1, max_size=10), max_size=4))),
        embedding_bias=draw(_maybe(packed_floats)),
        client_id=draw(_maybe(uint64)),
        priority=draw(unit),
        num_return_sequences=draw(st.integers(1, max_sequences)),
        return_all_generated_tokens=draw(st.booleans()),
        logits_post_processor_name=draw(_maybe(names)),
        guided_decoding_params=draw(_maybe(guided_params)),
        client_request_id=draw(_maybe(names)),
        lora_config=draw(_maybe(st.builds(p.LoraConfig, name=names))),
        prompt_tuning_config=None if by_prompt else draw(_maybe(prompt_tables())),
        kv_handoff=draw(_maybe(st.builds(p.KvHandoff, transfer_id=names, kv_address=names))),
        kv_transfer_id=draw(_maybe(names)),
    )


@st.composite
def prompt_tables(draw: st.DrawFn) -> p.PromptTuningConfig:
    rows, hidden = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    data = draw(st.lists(st.floats(-4.0, 4.0, width=32), min_size=rows * hidden, max_size=rows * hidden))
    table = p.Logits(shape=[rows, hidden], data=pack_floats(data))
    return p.PromptTuningConfig(embedding_table=table)


@st.composite
def logits(draw: st.DrawFn) -> p.Logits:
    shape = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))
    count = 1
    for n in shape:
        count *= n
    return p.Logits(shape=shape, data=draw(st.binary(min_size=4 * count, max_size=4 * count)))


def rows(values: st.SearchStrategy[Any], width: int) -> st.SearchStrategy[list[list[Any]]]:
    return st.lists(st.lists(values, min_size=width, max_size=width), max_size=6)


@st.composite
def results(draw: st.DrawFn) -> p.Result:
    beams = draw(st.integers(1, 4))
    top_n = draw(st.integers(1, 3))

    def per_beam(strategy: st.SearchStrategy[Any]) -> Any:
        return draw(st.lists(strategy, min_size=beams, max_size=beams))

    return p.Result(
        is_final=draw(st.booleans()),
        output_token_ids=per_beam(st.lists(st.integers(0, INT32_MAX), max_size=20)),
        finish_reasons=per_beam(st.sampled_from(p.FinishReason)),
        sequence_index=draw(st.integers(0, 16)),
        is_sequence_final=draw(st.booleans()),
        cum_log_probs=draw(_maybe(st.just(per_beam(st.floats(allow_nan=False))))),
        log_probs=draw(_maybe(st.just(per_beam(packed_floats)))),
        top_token_ids=draw(_maybe(st.just(per_beam(rows(st.integers(0, INT32_MAX), top_n))))),
        top_log_probs=draw(_maybe(st.just(per_beam(rows(st.floats(width=32, allow_nan=False), top_n))))),
        context_logits=draw(_maybe(logits())),
        generation_logits=draw(_maybe(logits())),
        text=draw(_maybe(st.just(per_beam(st.text(max_size=20))))),
    )


responses = st.one_of(
    st.builds(p.Response, request_id=names, result=results(), client_id=_maybe(uint64)),
    st.builds(p.Response, request_id=names, error_msg=st.text(max_size=80)),
)



@st.composite
def streamed_tokens(draw: st.DrawFn) -> p.StreamedTokens:
    steps = draw(st.lists(st.tuples(names, st.lists(st.integers(0, INT32_MAX), min_size=1, max_size=4)), max_size=8))
    texts = draw(_maybe(st.lists(st.text(max_size=8), min_size=len(steps), max_size=len(steps))))
    return p.StreamedTokens(
        request_ids=[rid for rid, _ in steps],
        counts=[len(tokens) for _, tokens in steps],
        token_ids=[t for _, tokens in steps for t in tokens],
        text=texts,
    )


counts = st.integers(0, 1 << 40)
block_hashes = st.integers(-(1 << 63), (1 << 63) - 1)
worker_loads = st.builds(
    p.WorkerLoad,
    num_queued_requests=counts,
    num_active_requests=counts,
    free_num_blocks=counts,
    max_num_blocks=counts,
)
timestamps = st.floats(0.0, 4e9)
millis = st.floats(0.0, 1e9)

MESSAGES: dict[str, st.SearchStrategy[p.Message]] = {
    "submit": submits(),
    "submits": st.builds(p.SubmitBatch, submits=st.lists(submits().map(p.encode), min_size=1, max_size=4)),
    "cancel": st.builds(p.Cancel, request_id=names),
    "results": st.builds(
        p.ResultBatch,
        responses=st.lists(responses, max_size=8),
        streamed=_maybe(streamed_tokens()),
        load=_maybe(worker_loads),
    ),
    "error": st.builds(
        p.ErrorReply,
        code=st.sampled_from(p.ErrorCode),
        message=st.text(max_size=80),
        request_id=_maybe(names),
    ),
    "heartbeat": st.builds(p.Heartbeat, sender_id=names, load=_maybe(worker_loads)),
    "hello": st.builds(
        p.Hello,
        sender_id=names,
        role=st.sampled_from(["client", "gateway"]),
        heartbeat_interval_s=st.floats(0.0, 3600.0, exclude_min=True),
    ),
    "ready": st.builds(
        p.Ready,
        sender_id=names,
        role=st.sampled_from(["gateway", "worker"]),
        heartbeat_interval_s=st.floats(0.0, 3600.0, exclude_min=True),
        models=st.lists(names, max_size=3),
        vocab_size=_maybe(st.integers(1, 1 << 20)),
        max_seq_len=_maybe(st.integers(1, 1 << 20)),
        load=_maybe(worker_loads),
        tokenizer_json=_maybe(st.binary(max_size=64)),
        lora_adapters=st.lists(names, max_size=3),
        lora_loadable=st.lists(names, max_size=3),
        submit_batches=st.booleans(),
    ),
    "lora_load": st.builds(p.LoraLoad, request_id=names, name=names, path=names),
    "lora_unload": st.builds(p.LoraUnload, request_id=names, name=names),
    "lora_adapters": st.builds(p.LoraAdapters, sender_id=names, adapters=st.lists(names, max_size=4),
                               loadable=st.lists(names, max_size=4), request_id=_maybe(names)),
    "kv_events": st.builds(p.KvEvents, sender_id=names, incarnation=st.text(min_size=1, max_size=64),
                           seq=st.integers(1, 1 << 62), stored=st.lists(block_hashes, max_size=8),
                           removed=st.lists(block_hashes, max_size=8)),
    "kv_snapshot": st.builds(p.KvSnapshot, sender_id=names, incarnation=st.text(min_size=1, max_size=64),
                             seq=st.integers(0, 1 << 62), block_size=st.integers(1, 1 << 10),
                             hashes=st.lists(block_hashes, max_size=16)),
    "kv_snapshot_request": st.builds(p.KvSnapshotRequest, sender_id=names),
    "kv_transfer": st.builds(p.KvTransfer, transfer_id=names, model=names, num_layers=st.integers(1, 1 << 10),
                             block_size=st.integers(1, 1 << 10), num_kv_heads=st.integers(1, 1 << 10),
                             head_dim=st.integers(1, 1 << 10), dtype=names, tensor_parallel_size=st.integers(1, 64),
                             token_ids=st.lists(st.integers(0, INT32_MAX), max_size=50), sent_at=timestamps,
                             kv_format=st.integers(1, 8), cuda_ipc=_maybe(st.builds(
                                 p.CudaIpcBuffer, host_id=names, device_uuid=names, handle=st.binary(max_size=64),
                                 offset=st.integers(0, 1 << 40), size=st.integers(1, 1 << 40), ref_counter=names,
                                 ref_counter_offset=st.integers(0, 1 << 20), event_handle=st.binary(max_size=64),
                                 event_sync_required=st.booleans()))),
    "kv_ack": st.builds(p.KvAck, transfer_id=names, opened=st.booleans()),
    "handed_off": st.builds(p.HandedOff, request_id=names, transfer_id=names, num_blocks=st.integers(0, 1 << 20)),
    "drain": st.builds(p.Drain, sender_id=names, deadline_s=_maybe(st.floats(0.0, 1e6))),
    "worker_info": st.builds(
        p.WorkerInfo,
        worker_id=names,
        address=names,
        models=st.lists(names, min_size=1, max_size=3),
        host=names,
        pid=st.integers(1, 1 << 22),
        device=_maybe(names),
        started_at=timestamps,
        lora_adapters=st.lists(names, max_size=3),
        lora_loadable=st.lists(names, max_size=3),
        role=st.sampled_from(["prefill", "decode", "both"]),
        kv_address=_maybe(names),
    ),
    "iteration_stats": st.builds(
        p.IterationStats,
        timestamp=timestamps,
        iter=counts,
        iter_latency_ms=millis,
        num_active_requests=counts,
        num_queued_requests=counts,
        num_context_requests=counts,
        num_generation_requests=counts,
        num_scheduled_tokens=counts,
        max_num_blocks=counts,
        free_num_blocks=counts,
        used_num_blocks=counts,
        reused_blocks=counts,
        expert_tokens=_maybe(st.lists(st.lists(counts, max_size=8), max_size=4)),
    ),
    "request_stats": st.builds(
        p.RequestStats,
        request_id=names,
        state=st.sampled_from(["queued", "context", "generation", "preempted", "finished"]),
        prompt_tokens=counts,
        context_prefill_position=counts,
        num_generated_tokens=counts,
        queue_time_ms=_maybe(millis),
        time_to_first_token_ms=_maybe(millis),
        allocated_blocks=counts,
        reused_blocks=counts,
        timestamp=timestamps,
    ),
}

any_message = st.one_of(*MESSAGES.values())

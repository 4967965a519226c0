"""Request intake: every check a request passes before it may run, and the entry
it runs as (its sequences, sampling parameters resolved, adapter, prompt table,
grammar, speculation state).

Everything that can refuse a request is here, so a bad one is answered with an
error naming the problem before it takes a KV block, and a step never meets a
request it cannot run. A failure while preparing one request (a grammar that
does not compile, say) answers that request alone."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from worker.executor.beam_search import BeamSearch
from worker.executor.block_manager import BlockManager
from worker.executor.continuation import resume
from worker.executor.lora_registry import LoraRegistry
from worker.executor.request_table import Entry, RequestTable
from worker.executor.sequence import Family, Sequence
from worker.executor.siblings import Siblings
from worker.executor.spec_state import SpecState
from worker.executor.speculative import off_reason, off_reason_for_tokens
from worker.executor.speculative import validate as validate_speculative
from worker.executor.types import ExecutorConfig, Request
from worker.executor.validation import RequestError, normalize_word_list, validate_request
from worker.models.config import ModelConfig

log = logging.getLogger(__name__)


class Intake:
    def __init__(self, config: ExecutorConfig, model_config: ModelConfig, max_seq_len: int, blocks: BlockManager,
                 lora: LoraRegistry, processors: Mapping[str, Any], table: RequestTable, siblings: Siblings, *,
                 tokenizer: Any, has_draft_model: bool) -> None:
        self.config = config
        self.model_config = model_config
        self.max_seq_len = max_seq_len
        self.blocks = blocks
        self.lora = lora
        self.processors = processors  # the core's: a post-processor registered later is known here too
        self.table = table
        self.siblings = siblings
        self.tokenizer = tokenizer
        self.has_draft_model = has_draft_model
        self._guided: Any = None  # GuidedDecoder, made on the first guided request

    def admit(self, request_id: int, request: Request) -> None:
        """Start a request under the caller's id, or answer it with an error."""
        try:
            if request_id in self.table:
                raise RequestError(f"request id {request_id} is already in flight")
            entry = self.entry(request_id, request)
        except RequestError as e:
            self.table.reject(request_id, request, str(e))
            return
        except Exception as e:  # preparing one request (a grammar, say) must never end the engine
            log.exception("request %s: could not be prepared", request_id)
            self.table.reject(request_id, request, f"worker failed to start the request: {type(e).__name__}: {e}")
            return
        self.table.add(entry)
        self.siblings.add(entry.seqs)

    def entry(self, request_id: int, request: Request) -> Entry:
        """The entry `request` runs as; RequestError says why it cannot run."""
        validate_request(request, self.model_config, self.config, self.max_seq_len, self.processors)
        adapter, prompt_table, salt = self._peft_of(request)
        cfg = request.sampling_config
        beam = cfg.beam_width > 1
        width = cfg.beam_width if beam else request.num_return_sequences
        need = width * -(-(len(request.input_token_ids) + request.max_tokens) // self.blocks.block_size)
        if need > self.blocks.num_blocks:
            raise RequestError(
                f"request needs {need} KV cache blocks for prompt + max_tokens"
                f"{f' x {width} sequences' if width > 1 else ''}, but the cache holds {self.blocks.num_blocks}"
            )
        eos = self.model_config.eos_token_ids
        end_id = request.end_id if request.end_id is not None else (eos[0] if eos else -1)
        greedy = cfg.is_greedy
        params = (
            0.0 if greedy else (1.0 if cfg.temperature is None else cfg.temperature),
            float(cfg.top_k or 0),
            cfg.top_p or 1.0,  # None or 0: off
            cfg.min_p or 0.0,
        )
        seed = cfg.seed if cfg.seed is not None else 0  # TensorRT-LLM's default: reproducible
        stop_words = normalize_word_list(request.stop_words, "stop_words")
        bad_words = normalize_word_list(request.bad_words, "bad_words")
        bias = None if request.embedding_bias is None else np.asarray(request.embedding_bias, dtype=np.float32)
        grammar = None
        if request.guided_decoding_params is not None:
            grammar = self._guided_decoder().compile(request.guided_decoding_params)
        spec_config = request.speculative_config or self.config.speculative_config
        if spec_config is not None and (problem := validate_speculative(spec_config, self.model_config.vocab_size)):
            raise RequestError(problem)
        family = Family(width, is_beam=beam)
        seqs = []
        for i in range(1 if beam else request.num_return_sequences):
            seq = Sequence(
                request_id=request_id,
                request=request,
                token_ids=list(request.input_token_ids),
                num_prompt_tokens=len(request.input_token_ids),
                end_id=end_id,
                stop_words=stop_words,
                bad_words=bad_words,
                seed=seed,
                sampling_params=params,
                sequence_index=i,
                family=family,
                embedding_bias=bias,
                adapter=adapter,
                prompt_table=prompt_table,
                cache_salt=salt,
            )
            if grammar is not None:
                seq.matcher = self._guided.matcher(grammar, end_id)
            if request.resumed_token_ids:
                resume(seq, request.resumed_token_ids)
            if spec_config is not None and spec_config.num_draft_tokens > 0:
                reason = off_reason(request, spec_config, self.has_draft_model) or off_reason_for_tokens(seq)
                if reason is None:
                    seq.spec = SpecState(spec_config)
                seq.speculation_off_reason = reason
            seqs.append(seq)
        family.members.append(seqs[0])
        search = None
        if beam:
            search = BeamSearch(
                width=width,
                max_tokens=request.max_tokens,
                length_penalty=0.0 if cfg.length_penalty is None else cfg.length_penalty,
                early_stopping=1 if cfg.early_stopping is None else cfg.early_stopping,
                diversity_rate=cfg.beam_search_diversity_rate or 0.0,
            )
        return Entry(request_id, request, seqs, search)

    def _peft_of(self, request: Request) -> tuple[tuple[str, int] | None, np.ndarray | None, int | None]:
        """(adapter key, prompt table, prefix-cache salt) of a request."""
        key = None
        if request.lora_config is not None:
            try:
                key = self.lora.key(request.lora_config.name)
            except ValueError as e:
                raise RequestError(str(e)) from None
        table = None
        if request.prompt_tuning_config is not None:
            if self.config.parallel_config.tensor_parallel_size > 1:  # the vocab-parallel lookup has no rows for it
                raise RequestError("prompt_tuning_config is not supported with tensor parallelism yet")
            table = np.ascontiguousarray(request.prompt_tuning_config.embedding_table, dtype=np.float32)
        if key is None and table is None:
            return None, None, None
        digest = None if table is None else hashlib.sha256(table.tobytes()).hexdigest() + str(table.shape)
        return key, table, hash((key, digest))

    def _guided_decoder(self) -> Any:
        if self._guided is None:
            from worker.executor.guided import GuidedDecoder

            given = self.config.guided_decoding_config
            stop_ids = list(self.model_config.eos_token_ids)
            if given is None:
                self._guided = GuidedDecoder.from_tokenizer(self.tokenizer, self.model_config.vocab_size, stop_ids)
            else:
                self._guided = GuidedDecoder(given.encoded_vocab, given.tokenizer_str, self.model_config.vocab_size,
                                             stop_ids if given.stop_token_ids is None else given.stop_token_ids)
        return self._guided

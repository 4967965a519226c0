"""The in-process high-level API: text in, text out, on one Executor.

    llm = LLM("SmolLM2-135M-Instruct")
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    async for partial in llm.generate_async(prompt, streaming=True): ...

The executor is imported lazily so that `clients` stays importable (and light)
for users of the ZeroMQ client only.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.detokenizer import IncrementalDetokenizer
    from worker.executor import Executor, ExecutorConfig, Request, Response
    from worker.executor.types import FinishReason

Prompt = str | Sequence[int]


@dataclass(slots=True)
class SamplingParams:
    """Per-call generation settings; None leaves the executor's default."""

    max_tokens: int = 64
    temperature: float | None = None  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    min_tokens: int | None = None
    stop: list[str] = field(default_factory=list)  # strings, matched on the decoded text
    stop_token_ids: list[list[int]] | None = None  # token sequences, matched by the executor
    bad_token_ids: list[list[int]] | None = None
    end_id: int | None = None
    ignore_eos: bool = False
    num_return_sequences: int = 1  # with beam_width > 1: the best beams, at most beam_width
    return_log_probs: bool = False
    top_n_log_probs: int = 0
    # Beam search (TensorRT-LLM semantics: early_stopping 1 stops at beam_width
    # finished beams, 0 when none can improve, -1 never before max_tokens).
    beam_width: int = 1
    length_penalty: float | None = None
    early_stopping: int | None = None
    beam_search_diversity_rate: float | None = None
    repetition_penalty: float | None = None  # multiplicative, over prompt and output
    presence_penalty: float | None = None  # additive, over output tokens
    frequency_penalty: float | None = None  # additive x count, over output tokens
    no_repeat_ngram_size: int | None = None
    embedding_bias: list[float] | None = None  # one value per vocabulary token
    logits_post_processor: str | None = None  # a name configured in the executor
    # Guided decoding (the `guided` extra): at most one of these.
    guided_json: str | dict[str, Any] | bool | None = None  # a JSON schema, or True for any JSON
    guided_regex: str | None = None
    guided_grammar: str | None = None  # EBNF


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    log_probs: list[float] | None = None
    cum_log_prob: float | None = None
    top_log_probs: list[list[tuple[int, float]]] | None = None  # per token: (id, log prob), most likely first


@dataclass(slots=True)
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None


class GenerationError(RuntimeError):
    """The executor answered this request with an error."""


class RequestHandle:
    """One request in flight: a future (`result`, `aresult`) and a stream (iterate)."""

    def __init__(self, llm: LLM, request_id: int, prompt: str | None, prompt_ids: list[int],
                 params: SamplingParams) -> None:
        from gateway.detokenizer import IncrementalDetokenizer

        self._llm = llm
        self.request_id = request_id
        self._params = params
        self._updates: queue.Queue[Response] = queue.Queue()
        self._detok: list[IncrementalDetokenizer] = [
            IncrementalDetokenizer(llm.tokenizer) for _ in range(params.num_return_sequences)
        ]
        self.output = RequestOutput(
            request_id, prompt, prompt_ids,
            [CompletionOutput(i) for i in range(params.num_return_sequences)],
        )

    def _apply(self, response: Response) -> None:
        from worker.executor.types import FinishReason

        if response.error_msg is not None:
            self.output.error = response.error_msg
            self.output.finished = True
            return
        result = response.result
        assert result is not None
        if self._params.beam_width > 1:
            self._apply_beams(result)
            return
        out = self.output.outputs[result.sequence_index]
        if out.finish_reason is not None:
            return  # a sequence cut short by a stop string: ignore what was in flight
        detok = self._detok[result.sequence_index]
        new_ids = result.output_token_ids[0]
        out.token_ids.extend(new_ids)
        detok.add(new_ids)
        if result.log_probs is not None:
            out.log_probs = (out.log_probs or []) + list(result.log_probs[0])
            out.cum_log_prob = result.cum_log_probs[0] if result.cum_log_probs else None
        if result.top_token_ids is not None and result.top_log_probs is not None:
            out.top_log_probs = (out.top_log_probs or []) + [
                list(zip(ids, lps, strict=True))
                for ids, lps in zip(result.top_token_ids[0], result.top_log_probs[0], strict=True)]
        if result.is_sequence_final:
            detok.flush()
            out.finish_reason = result.finish_reasons[0]
        out.text = detok.text
        hit = _first_stop(out.text, self._params.stop)
        if hit is not None:
            out.text = out.text[:hit]
            out.finish_reason = FinishReason.STOP_WORDS
            if not result.is_sequence_final:
                self._llm.executor.cancel_request(self.request_id)
        self.output.finished = all(o.finish_reason is not None for o in self.output.outputs)

    def _apply_beams(self, result: Any) -> None:
        """Beam search answers with whole beams (the running ones while streaming,
        the best finished ones at the end), so each output is replaced, not extended."""
        tokenizer = self._llm.tokenizer
        for i, tokens in enumerate(result.output_token_ids):
            out = self.output.outputs[i]
            out.token_ids = list(tokens)
            out.text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
            if result.log_probs is not None:
                out.log_probs = list(result.log_probs[i])
                out.cum_log_prob = result.cum_log_probs[i] if result.cum_log_probs else None
            if result.is_final:
                out.finish_reason = result.finish_reasons[i]
        if result.is_final:
            del self.output.outputs[len(result.output_token_ids):]
            self.output.finished = True

    def _next(self, timeout: float | None) -> RequestOutput | None:
        """Apply the next response; None once the request is finished."""
        if self.output.finished:
            return None
        try:
            response = self._updates.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"request {self.request_id}: no response within {timeout} s") from None
        self._apply(response)
        if self.output.error is not None:
            raise GenerationError(self.output.error)
        return self.output

    def result(self, timeout: float | None = None) -> RequestOutput:
        while self._next(timeout) is not None:
            pass
        if self.output.error is not None:
            raise GenerationError(self.output.error)
        return self.output

    async def aresult(self) -> RequestOutput:
        return await asyncio.get_running_loop().run_in_executor(None, self.result)

    def cancel(self) -> None:
        self._llm.executor.cancel_request(self.request_id)

    def __iter__(self) -> Iterator[RequestOutput]:
        while (out := self._next(None)) is not None:
            yield out

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        while (out := await loop.run_in_executor(None, self._next, None)) is not None:
            yield out


def _first_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


class LLM:
    def __init__(self, model: str | Path | None = None, config: ExecutorConfig | None = None) -> None:
        """`model`: a checkpoint directory, a .gguf file, or the default model's name (None)."""
        from worker.executor import Executor
        from worker.models.default_model import DEFAULT_MODEL_NAME, resolve_model

        self.executor: Executor = Executor.from_model(resolve_model(model or DEFAULT_MODEL_NAME), config)
        self.tokenizer: Any = self.executor.tokenizer
        self._handles: dict[int, RequestHandle] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._dispatcher = threading.Thread(target=self._dispatch, name="llm-dispatch", daemon=True)
        self._dispatcher.start()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True).ids)
        return [int(t) for t in prompt]

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render chat messages with the model's own template (Jinja, sandboxed)."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        template = self.executor.chat_template
        if template is None:
            raise ValueError("this model has no chat template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt)

    def generate_async(self, prompt: Prompt, sampling: SamplingParams | None = None,
                       streaming: bool = False) -> RequestHandle:
        params = sampling or SamplingParams()
        prompt_ids = self.encode(prompt)
        request = self._request(prompt_ids, params, streaming)
        with self._lock:
            request_id = self.executor.enqueue_request(request)
            handle = RequestHandle(self, request_id, prompt if isinstance(prompt, str) else None, prompt_ids, params)
            self._handles[request_id] = handle
        return handle

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling: SamplingParams | None = None,
                 timeout: float | None = None) -> list[RequestOutput]:
        """Generate for one prompt or many (all enqueued at once, batched by the executor)."""
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        batch: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item,arg-type]
        handles = [self.generate_async(p, sampling) for p in batch]
        return [h.result(timeout) for h in handles]

    def _request(self, prompt_ids: list[int], p: SamplingParams, streaming: bool) -> Request:
        from worker.executor import GuidedDecodingParams, OutputConfig, Request, SamplingConfig

        guides = [g for g in (
            None if p.guided_json is None or p.guided_json is False else (
                GuidedDecodingParams("json") if p.guided_json is True else GuidedDecodingParams(
                    "json_schema", p.guided_json if isinstance(p.guided_json, str) else json.dumps(p.guided_json))),
            None if p.guided_regex is None else GuidedDecodingParams("regex", p.guided_regex),
            None if p.guided_grammar is None else GuidedDecodingParams("ebnf_grammar", p.guided_grammar),
        ) if g is not None]
        if len(guides) > 1:
            raise ValueError("give at most one of guided_json, guided_regex and guided_grammar")
        return Request(
            input_token_ids=prompt_ids,
            max_tokens=p.max_tokens,
            # Stop strings are matched on text as it streams, so such requests stream internally.
            streaming=streaming or bool(p.stop),
            sampling_config=SamplingConfig(
                temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                seed=p.seed, min_tokens=p.min_tokens, beam_width=p.beam_width, length_penalty=p.length_penalty,
                early_stopping=p.early_stopping, beam_search_diversity_rate=p.beam_search_diversity_rate,
                repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty, no_repeat_ngram_size=p.no_repeat_ngram_size,
            ),
            output_config=OutputConfig(return_log_probs=p.return_log_probs, top_n_log_probs=p.top_n_log_probs),
            embedding_bias=p.embedding_bias,
            logits_post_processor_name=p.logits_post_processor,
            guided_decoding_params=guides[0] if guides else None,
            end_id=-1 if p.ignore_eos else p.end_id,
            stop_words=p.stop_token_ids,
            bad_words=p.bad_token_ids,
            num_return_sequences=p.num_return_sequences,
        )

    def _dispatch(self) -> None:
        while not self._closed:
            for response in self.executor.await_responses(timeout=0.1):
                with self._lock:
                    handle = self._handles.get(response.request_id)
                    result = response.result
                    if response.error_msg is not None or (result is not None and result.is_final):
                        self._handles.pop(response.request_id, None)
                if handle is not None:
                    handle._updates.put(response)

    def shutdown(self) -> None:
        self._closed = True
        self._dispatcher.join()
        self.executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

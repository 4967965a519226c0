"""The in-process high-level API: text in, text out, on one Executor.

    llm = LLM("SmolLM2-135M-Instruct")
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    async for partial in llm.generate_async(prompt, streaming=True): ...

LoRA adapters (Hugging Face PEFT directories) are registered by name, at start or later,
and chosen per request:

    llm = LLM(model_dir, lora={"sql": "adapters/sql"}, max_loras=8, max_lora_rank=16)
    llm.generate(prompt, SamplingParams(lora="sql"))
    llm.load_lora("chat", "adapters/chat"); llm.unload_lora("sql")
    llm.generate(prompt, lora_request=LoRARequest("chat", 1, "adapters/chat"))  # vLLM's form

TensorRT-LLM's high-level API runs under its own names too:
`LLM(ModelConfig(model_dir=..., max_beam_width=4), kv_cache_config=KvCacheConfig(...),
capacity_scheduling_policy=..., tokenizer=...)`, `llm.get_default_sampling_config()`,
`llm.generate(prompts, sampling_config=...)`, `llm.save(dir)` (clients/llm_config.py).

It takes the SamplingParams and gives the RequestOutputs of every other API
(clients/params.py). Each executor result takes the wire's shape so that its
text (protocol/text.py: stop strings included) and its fold into the output
(clients/wire.py) are the code the service's path runs.

The executor is imported lazily so that `clients` stays importable (and light)
for users of the ZeroMQ client only.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

import protocol
from clients.llm_config import (
    KvCacheConfig,
    LoRARequest,
    ModelConfig,
    ParallelConfig,
    QuantAlgo,
    QuantConfig,
    SamplingConfig,
)
from clients.model_source import resolve_source
from clients.params import CompletionOutput, RequestOutput, SamplingParams, sampling_params
from clients.wire import Accumulator, Messages, Prompt, Tools, as_batch, embedding_of, to_submit
from protocol import FinishReason, chat_tools
from protocol.text import OutputStream

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from protocol.request import Pooling
    from worker.executor import CapacitySchedulerPolicy, Executor, ExecutorConfig, Request, Response

__all__ = [
    "LLM",
    "CapacitySchedulerPolicy",
    "CompletionOutput",
    "FinishReason",
    "GenerationError",
    "KvCacheConfig",
    "LoRARequest",
    "ModelConfig",
    "ParallelConfig",
    "QuantAlgo",
    "QuantConfig",
    "RequestHandle",
    "RequestOutput",
    "SamplingConfig",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    # The executor's enum, imported only when asked for: `clients` stays light.
    if name == "CapacitySchedulerPolicy":
        from worker.executor import CapacitySchedulerPolicy

        return CapacitySchedulerPolicy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class GenerationError(RuntimeError):
    """The executor answered this request with an error (or the LLM was shut down)."""


class RequestHandle:
    """One request in flight: a future (`result`, `aresult`) and a stream (iterate)."""

    def __init__(self, llm: LLM, request_id: int, params: SamplingParams, prompt: str | None,
                 prompt_ids: list[int]) -> None:  # fmt: skip
        self._llm = llm
        self.request_id = request_id
        beam_search = params.beam_width > 1
        self._stream = OutputStream(llm._streaming_tokenizer, list(params.stop), params.num_return_sequences,
                                    beam_search)
        self._acc = Accumulator(str(request_id), params.num_return_sequences, beam_search)
        self.output: RequestOutput = self._acc.result
        self.output.prompt = prompt
        self.output.prompt_token_ids = prompt_ids
        # Filled by the LLM's dispatcher; None: the LLM shut down.
        self._responses: queue.SimpleQueue[Response | None] = queue.SimpleQueue()
        self._error: str | None = None

    def _apply(self, response: Response | None) -> bool:
        """Fold one executor response into the output; False if it showed nothing
        (a sequence a stop string had ended)."""
        if response is None or response.error_msg is not None:
            self._error = "the LLM was shut down" if response is None else response.error_msg
            return True
        from worker.service.convert import to_wire_result  # the worker's own mapping, imported with the executor

        assert response.result is not None
        wire = to_wire_result(response.result)
        result = self._stream.apply(wire)
        if result is None:
            return False
        self._acc.add(protocol.Response.model_construct(request_id=self.output.request_id, result=result,
                                                        error_msg=None, client_id=None))  # fmt: skip
        if result.is_final and not response.result.is_final:
            self.cancel()  # a stop string ended it here: stop the executor too
        if self._llm._streaming_tokenizer is None and self._llm.tokenizer is not None:
            for out in self.output.outputs:  # a tokenizer with only encode / decode: the text, decoded whole
                out.text = self._llm.tokenizer.decode(out.token_ids)
        return True

    def _next(self, timeout: float | None) -> RequestOutput | None:
        """Apply responses up to the next one that shows something; None once the
        request is finished."""
        while self._error is None and not self.output.finished:
            try:
                response = self._responses.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.request_id}: no response within {timeout} s") from None
            if self._apply(response) and self._error is None:
                return self.output
        if self._error is not None:
            raise GenerationError(self._error)
        return None

    def result(self, timeout: float | None = None) -> RequestOutput:
        while self._next(timeout) is not None:
            pass
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


def executor_request(prompt_ids: list[int], p: SamplingParams, streaming: bool) -> Request:
    """The executor's Request for a prompt and its options (SamplingParams.request_fields)."""
    from worker.executor import GuidedDecodingParams, OutputConfig, Request, SamplingConfig
    from worker.executor.types import DraftSource, LoraConfig, SpeculativeConfig

    fields = p.request_fields()
    guide = fields.pop("guided_decoding_params")
    spec = fields.pop("speculative_config")
    lora = fields.pop("lora_config")
    return Request(
        input_token_ids=prompt_ids,
        # Stop strings are matched on text as it streams, so such requests stream internally.
        streaming=streaming or bool(p.stop),
        sampling_config=SamplingConfig(**fields.pop("sampling_config")),
        output_config=OutputConfig(**fields.pop("output_config")),
        guided_decoding_params=None if guide is None else GuidedDecodingParams(**guide),
        speculative_config=(None if spec is None
                            else SpeculativeConfig(**{**spec, "source": DraftSource(spec["source"])})),
        lora_config=None if lora is None else LoraConfig(**lora),
        **fields,
    )


# TensorRT-LLM's algorithms that tokenwire applies to a float checkpoint as it loads it.
_ON_LOAD = {QuantAlgo.FP8: "fp8", QuantAlgo.W4A16: "int4"}


def _on_load_quantization(algo: QuantAlgo | str) -> str:
    """What `quantization=` (a QuantAlgo, or "fp8" / "int4") asks of the loader."""
    if isinstance(algo, str) and algo in _ON_LOAD.values():
        return algo
    mode = _ON_LOAD.get(QuantAlgo(algo))
    if mode is None:
        raise NotImplementedError(
            f"quantization {QuantAlgo(algo).name}: tokenwire quantizes float checkpoints on load to FP8 or "
            "W4A16 (int4 round-to-nearest); AWQ and compressed-tensors checkpoints load as they are")
    return mode


class LLM:
    def __init__(self, model: str | Path | ModelConfig | None = None, config: ExecutorConfig | None = None, *,
                 tokenizer: Any = None, skip_tokenizer_init: bool = False,
                 kv_cache_config: KvCacheConfig | None = None,
                 capacity_scheduling_policy: CapacitySchedulerPolicy | None = None,
                 tensor_parallel_size: int | None = None, pipeline_parallel_size: int | None = None,
                 moe_expert_parallel_size: int | None = None, quantization: QuantAlgo | str | None = None,
                 lora: Mapping[str, str | Path] | None = None, enable_lora: bool = False,
                 max_loras: int | None = None, max_cpu_loras: int | None = None, max_lora_rank: int | None = None,
                 async_mode: bool = False) -> None:  # fmt: skip
        """`model`: a checkpoint directory (one `save` wrote included), a .gguf file, a
        Hugging Face hub id, the default model's name (None), or a ModelConfig naming
        one. `config`: the executor's settings, which TensorRT-LLM's keyword options
        (kv_cache_config, capacity_scheduling_policy, the ModelConfig's max_beam_width)
        override. `tokenizer`: a `tokenizers.Tokenizer`, or any object with `encode`
        and `decode` (default: the model's); `skip_tokenizer_init`: none at all
        (prompts are token ids, outputs have no text). Every LLM serves
        `generate_async`: `async_mode` is accepted for TensorRT-LLM's code.
        `tensor_parallel_size` / `pipeline_parallel_size`: the model split over that many
        GPUs per stage / stages, one process per GPU (worker/parallel).
        `moe_expert_parallel_size`: equal to the tensor-parallel size, a mixture-of-experts
        model's ranks hold whole experts instead of a slice of every expert (1 or None:
        sliced); tokenwire places experts over all of a stage's ranks or none.

        LoRA: `lora` maps adapter names to PEFT directories, registered at start;
        `enable_lora` makes room for adapters loaded later (`load_lora`, `lora_request=`)
        when none is given at start. `max_loras`: adapters resident on the device at once
        (more stay in host memory, at most `max_cpu_loras`); `max_lora_rank`: the largest
        rank accepted (None: the executor's defaults, PeftCacheConfig)."""
        from worker.executor import Executor, ExecutorConfig, ParallelConfig, SchedulerConfig

        model_config = model if isinstance(model, ModelConfig) else ModelConfig(model_dir=model)
        parallel = model_config.parallel_config  # auto_parallel spreads over world_size GPUs by tensor parallelism
        tp = tensor_parallel_size or (parallel.world_size if parallel.auto_parallel else parallel.tp_size)
        pp = pipeline_parallel_size or (1 if tensor_parallel_size or parallel.auto_parallel else parallel.pp_size)
        cfg = config or ExecutorConfig()
        weights_algo = quantization or model_config.quant_config.quant_algo
        if weights_algo not in (None, QuantAlgo.NO_QUANT):
            cfg = replace(cfg, quantization=_on_load_quantization(weights_algo))
        if model_config.quant_config.kv_cache_quant_algo not in (None, QuantAlgo.NO_QUANT):
            if model_config.quant_config.kv_cache_quant_algo is not QuantAlgo.FP8:
                raise NotImplementedError(f"KV cache quantization {model_config.quant_config.kv_cache_quant_algo.name}:"
                                          " tokenwire's quantized KV cache is FP8")
            cfg = replace(cfg, kv_cache_config=replace(cfg.kv_cache_config, dtype="fp8"))
        if model_config.max_beam_width > 1:
            cfg = replace(cfg, max_beam_width=model_config.max_beam_width)
        if kv_cache_config is not None:
            cfg = replace(cfg, kv_cache_config=replace(cfg.kv_cache_config, **kv_cache_config.executor_fields()))
        if moe_expert_parallel_size not in (None, 1, tp):
            raise ValueError(f"moe_expert_parallel_size {moe_expert_parallel_size}: experts are placed over all "
                             f"{tp} tensor-parallel ranks (moe_expert_parallel_size={tp}) or sliced (1)")
        expert_parallel = moe_expert_parallel_size == tp and tp > 1
        if tp * pp != 1:
            cfg = replace(cfg, parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                                              expert_parallel=expert_parallel))
        if capacity_scheduling_policy is not None:
            cfg = replace(cfg, scheduler_config=SchedulerConfig(capacity_scheduling_policy))
        if lora or enable_lora or max_loras or max_cpu_loras or max_lora_rank:
            cfg = _with_lora(cfg, lora or {}, max_loras, max_cpu_loras, max_lora_rank)
        self.model_path = resolve_source(model_config.model_dir or _default_model_name())
        self.executor: Executor = Executor.from_model(self.model_path, cfg)
        self.tokenizer: Any = None if skip_tokenizer_init else (tokenizer or self.executor.tokenizer)
        self._streaming_tokenizer = _native_tokenizer(self.tokenizer)
        self._default_max_tokens = (kv_cache_config.max_new_tokens if kv_cache_config is not None
                                    and kv_cache_config.max_new_tokens is not None else SamplingParams().max_tokens)
        self._handles: dict[int, RequestHandle] = {}
        self._lock = threading.Lock()
        self._dispatcher = threading.Thread(target=self._dispatch, name="llm-dispatch", daemon=True)
        self._dispatcher.start()

    def encode(self, prompt: Prompt) -> list[int]:
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise ValueError("this LLM has no tokenizer (skip_tokenizer_init): give prompts as token ids")
        if isinstance(self.tokenizer, Tokenizer):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True).ids)
        ids = self.tokenizer.encode(prompt)
        return [int(t) for t in getattr(ids, "ids", ids)]

    def load_lora(self, name: str, path: str | Path) -> None:
        """Register a LoRA adapter (a PEFT directory) under `name`, for requests to name in
        SamplingParams.lora; raises CheckpointError saying what is wrong with it."""
        self.executor.register_lora(name, str(path))

    def unload_lora(self, name: str) -> None:
        """Forget an adapter: requests naming it from now on fail."""
        self.executor.unregister_lora(name)

    def lora_names(self) -> list[str]:
        """The adapters registered, by name."""
        return self.executor.lora_names()

    def get_default_sampling_config(self) -> SamplingConfig:
        """A fresh SamplingConfig (SamplingParams) with this LLM's defaults, to change and pass as `sampling_config`."""
        return SamplingConfig(max_tokens=self._default_max_tokens)

    def save(self, directory: str | Path) -> Path:
        """Write the model as a Hugging Face checkpoint directory (config, safetensors
        weights, tokenizer) that `LLM(directory)` loads back."""
        from worker.models.hf_checkpoint import save_hf_checkpoint
        from worker.models.loader import load_model

        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        save_hf_checkpoint(load_model(self.model_path), target)
        return target

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            chat_template_kwargs: Mapping[str, Any] | None = None,
                            **template_vars: Any) -> str:  # fmt: skip
        """Render chat messages with the model's own template, as the gateway does
        (protocol/chat_template.py); encode the text with add_special_tokens=False.
        `chat_template_kwargs` (the OpenAI API's field) and `template_vars` (keywords, as
        transformers' apply_chat_template takes them): more variables the template reads,
        such as Qwen3's enable_thinking."""
        from protocol.chat_template import render_chat

        cfg = self.executor.model_config
        bos = None if cfg.bos_token_id is None else self.tokenizer.id_to_token(cfg.bos_token_id)
        eos = self.tokenizer.id_to_token(cfg.eos_token_ids[0]) if cfg.eos_token_ids else None
        return render_chat(self.executor.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=bos, eos_token=eos,
                           extra={**(chat_template_kwargs or {}), **template_vars})  # fmt: skip

    def chat(self, messages: Messages, params: SamplingParams | None = None, /, *, tools: Tools | None = None,
             tool_choice: str | None = None, parallel_tool_calls: bool = True, tool_parser: str | None = None,
             chat_template_kwargs: Mapping[str, Any] | None = None, timeout: float | None = None,
             **options: Any) -> RequestOutput:  # fmt: skip
        """A chat's reply, rendered with the model's template as the gateway renders it;
        `options`: SamplingParams fields, over `params`. `tools`, `tool_choice` and
        `parallel_tool_calls` as in Client.chat (a forced call is guided to the tools'
        schemas); the calls are read in `tool_parser`'s format (protocol/tool_calls.py
        PARSERS; default: the template's) into the output's tool_calls, and its text is
        then the content outside them."""
        p = sampling_params(params, options)
        submit = to_submit(None, p, messages=messages, tools=tools, tool_choice=tool_choice,
                           parallel_tool_calls=parallel_tool_calls)  # validated as the service validates it
        guide = chat_tools.forced_guide(submit)
        if guide is not None:
            p = replace(p, guided_json=guide)
        assert submit.messages is not None
        text = self.apply_chat_template(chat_tools.template_messages(submit.messages),
                                        chat_template_kwargs=chat_template_kwargs,
                                        **(chat_tools.template_extra(submit) or {}))  # fmt: skip
        if self.tokenizer is None:
            raise ValueError("this LLM has no tokenizer (skip_tokenizer_init): a chat needs one")
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        prompt_ids = [int(t) for t in getattr(ids, "ids", ids)]
        output = self._start(executor_request(prompt_ids, p, False), p, prompt_ids, prompt_ids).result(timeout)
        use = chat_tools.tool_use(submit, self.executor.chat_template, tool_parser)
        read = None if use is None else chat_tools.read_calls(use, output.text)
        if read is not None:
            output.outputs[0].text, output.outputs[0].tool_calls = read
        return output

    def generate_async(self, prompt: Prompt, params: SamplingParams | None = None, /, streaming: bool = False,
                       sampling_config: SamplingParams | None = None, lora_request: LoRARequest | None = None,
                       **options: Any) -> RequestHandle:  # fmt: skip
        """Start one request; `options`: SamplingParams fields, over `params` (or
        `sampling_config`, TensorRT-LLM's name for it). `lora_request`: the adapter to run
        under, registered first if this LLM does not hold it yet."""
        p = sampling_params(_one_of(params, sampling_config), options)
        if lora_request is not None:
            if lora_request.lora_name not in self.lora_names():
                self.load_lora(lora_request.lora_name, lora_request.lora_path)
            p = replace(p, lora=lora_request.lora_name)
        prompt_ids = self.encode(prompt)
        return self._start(executor_request(prompt_ids, p, streaming), p, prompt, prompt_ids)

    def _start(self, request: Request, params: SamplingParams, prompt: Prompt, prompt_ids: list[int]) -> RequestHandle:
        with self._lock:  # the dispatcher looks the handle up under this lock
            request_id = self.executor.enqueue_request(request)
            handle = RequestHandle(self, request_id, params, prompt if isinstance(prompt, str) else None, prompt_ids)
            self._handles[request_id] = handle
        return handle

    def embed(self, inputs: Prompt | Sequence[Prompt], /, *, pooling: Pooling | None = None,
              timeout: float | None = None) -> list[npt.NDArray[np.float32]]:  # fmt: skip
        """The embedding of each input (text or token ids), in order: the model's final
        hidden state pooled over the input ("last" token or "mean"; None: the model's own)
        at unit length, as the service's /v1/embeddings gives it. All are enqueued at once."""
        from worker.executor.types import EmbeddingConfig

        params = SamplingParams(max_tokens=1)
        handles = []
        for prompt in as_batch(inputs):
            prompt_ids = self.encode(prompt)
            request = replace(executor_request(prompt_ids, params, False), embedding_config=EmbeddingConfig(pooling))
            handles.append(self._start(request, params, prompt, prompt_ids))
        return [embedding_of(h.result(timeout)) for h in handles]

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None, /,
                 timeout: float | None = None, sampling_config: SamplingParams | None = None,
                 lora_request: LoRARequest | None = None, **options: Any) -> list[RequestOutput]:  # fmt: skip
        """Generate for one prompt or many (all enqueued at once, batched by the executor)."""
        params = _one_of(params, sampling_config)
        handles = [self.generate_async(p, params, lora_request=lora_request, **options) for p in as_batch(prompts)]
        return [h.result(timeout) for h in handles]

    def _dispatch(self) -> None:
        """Hands each response to its request. Waits with no timeout: the executor's
        shutdown wakes it, and then it fails the requests still waiting."""
        while responses := self.executor.await_responses(timeout=None):
            for response in responses:
                with self._lock:
                    handle = self._handles.get(response.request_id)
                    result = response.result
                    if response.error_msg is not None or (result is not None and result.is_final):
                        self._handles.pop(response.request_id, None)
                if handle is not None:
                    handle._responses.put(response)
        with self._lock:
            orphans, self._handles = list(self._handles.values()), {}
        for handle in orphans:
            handle._responses.put(None)

    def shutdown(self) -> None:
        self.executor.shutdown()
        self._dispatcher.join()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _with_lora(cfg: ExecutorConfig, adapters: Mapping[str, str | Path], max_loras: int | None,
               max_cpu_loras: int | None, max_lora_rank: int | None) -> ExecutorConfig:
    """`cfg` with LoRA on: the adapters to register at start and the adapter cache's bounds."""
    from worker.executor.types import PeftCacheConfig

    bounds = {"max_device_adapters": max_loras, "max_host_adapters": max_cpu_loras, "max_rank": max_lora_rank}
    peft = replace(cfg.peft_cache_config or PeftCacheConfig(),
                   **{name: value for name, value in bounds.items() if value is not None})  # fmt: skip
    return replace(cfg, peft_cache_config=peft,
                   lora_adapters={**cfg.lora_adapters, **{name: str(path) for name, path in adapters.items()}})


def _one_of(params: SamplingParams | None, sampling_config: SamplingParams | None) -> SamplingParams | None:
    if params is not None and sampling_config is not None:
        raise TypeError("give the options as params or as sampling_config, not both")
    return params if params is not None else sampling_config


def _native_tokenizer(tokenizer: Any) -> Tokenizer | None:
    """The `tokenizers.Tokenizer` that streams text incrementally: the tokenizer
    itself, or the one under a fast Hugging Face tokenizer; None for others."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


def _default_model_name() -> str:
    from worker.models.default_model import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME

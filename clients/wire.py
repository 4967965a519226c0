"""Between the user-facing types (clients/params.py) and the wire: the Submit for
a prompt and its SamplingParams, and a request's responses folded into its
RequestOutput.

The ZeroMQ clients, the jobs client and its consumer use both; the in-process
LLM folds its executor's results here too, once they have the wire's shape
(protocol/text.py fills in their text), so every API builds its outputs with
the same code.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import protocol
from clients.params import CompletionOutput, RequestOutput, SamplingParams, StreamChunk, sampling_params
from protocol import FinishReason

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from protocol.request import Pooling

Prompt = str | Sequence[int]
# Chat turns: dicts with "role" and "content", as OpenAI's API and chat templates take them.
# Chat turns as OpenAI's API takes them: role and content, an assistant's tool_calls, a
# tool's tool_call_id.
Messages = Sequence[Mapping[str, Any]]
# OpenAI's `tools` entries: {"type": "function", "function": {"name", "description", "parameters"}}.
Tools = Sequence[Mapping[str, Any]]


def to_submit(
    prompt: Prompt | None,
    params: SamplingParams,
    *,
    request_id: str | None = None,
    model: str | None = None,
    streaming: bool = False,
    messages: Messages | None = None,
    tools: Tools | None = None,
    tool_choice: str | None = None,
    parallel_tool_calls: bool = True,
) -> protocol.Submit:
    """A validated submit message (text, token ids, or chat `messages` with prompt
    None: the gateway applies the model's chat template, with `tools` when given);
    bad options raise pydantic's ValidationError, a ValueError that names the field."""
    text = prompt if isinstance(prompt, str) else None
    return protocol.Submit.model_validate(
        {
            "request_id": request_id or uuid.uuid4().hex,
            "model": model,
            "prompt": text,
            "input_token_ids": None if text is not None or prompt is None else list(prompt),
            "messages": None if messages is None else [wire_message(m) for m in messages],
            "tools": None if tools is None else [wire_tool(t) for t in tools],
            "tool_choice": tool_choice,
            "parallel_tool_calls": parallel_tool_calls,
            "streaming": streaming,
            "stop": list(params.stop) or None,
            **params.request_fields(),
        }
    )


def wire_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A chat turn in OpenAI's shape as protocol.ChatMessage's fields: an assistant's
    tool_calls ({"id", "function": {"name", "arguments"}}) flattened to id, name, arguments."""
    turn = dict(message)
    if turn.get("content") is None:
        turn["content"] = ""  # an assistant turn that only calls
    calls = turn.get("tool_calls")
    if calls:
        try:
            turn["tool_calls"] = [
                {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls
            ]
        except (KeyError, TypeError):
            raise ValueError('messages: a tool call is {"id", "function": {"name", "arguments"}}') from None
    return turn


def wire_tool(tool: Mapping[str, Any]) -> protocol.ToolSpec:
    """An OpenAI `tools` entry as protocol.ToolSpec (its parameters' schema as JSON text)."""
    function = tool.get("function")
    if tool.get("type", "function") != "function" or not isinstance(function, Mapping) or "name" not in function:
        raise ValueError('tools: each is {"type": "function", "function": {"name", "description", "parameters"}}')
    parameters = function.get("parameters")
    return protocol.ToolSpec(name=function["name"], description=function.get("description"),
                             parameters=None if parameters is None else json.dumps(parameters))  # fmt: skip


def as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text or token ids) or a sequence of them, as a list of prompts."""
    single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
    return [prompts] if single else list(prompts)  # type: ignore[list-item,arg-type]


def embedding_submit(prompt: Prompt, pooling: Pooling | None, model: str | None) -> protocol.Submit:
    """A submit that asks for the prompt's embedding (protocol.EmbeddingConfig; pooling None:
    the model's) and generates nothing."""
    msg = to_submit(prompt, SamplingParams(max_tokens=1), model=model)
    return msg.model_copy(update={"embedding_config": protocol.EmbeddingConfig(pooling=pooling)})


def embedding_of(output: RequestOutput) -> npt.NDArray[np.float32]:
    """The embedding an embedding request's output carries."""
    if output.embedding is None:
        raise RuntimeError(f"request {output.request_id} came back without an embedding")
    return output.embedding


def encode_submit(msg: protocol.Submit) -> bytes:
    """The submit's bytes, checked against the limits a gateway applies before it can
    tell which request a message is: a prompt or stop list over them fails here, at
    once, instead of being refused by the gateway and re-sent at each failover."""
    data = protocol.encode(msg)
    protocol.unpack(data)  # raises ProtocolError (a ValueError) naming the limit
    return data


def submit_from_call(prompt: Prompt | None, params: SamplingParams | None, options: dict[str, Any]) -> protocol.Submit:
    """The Submit for a call of `Client.submit` and its kin: `options` holds
    `request_id`, `model`, `streaming` and `messages` (for a chat), and
    SamplingParams fields, which go over `params` (a misspelt one raises TypeError)."""
    request_id = options.pop("request_id", None)
    model = options.pop("model", None)
    streaming = options.pop("streaming", False)
    messages = options.pop("messages", None)
    tools = options.pop("tools", None)
    tool_choice = options.pop("tool_choice", None)
    parallel_tool_calls = options.pop("parallel_tool_calls", True)
    return to_submit(prompt, sampling_params(params, options), request_id=request_id, model=model,
                     streaming=streaming, messages=messages, tools=tools, tool_choice=tool_choice,
                     parallel_tool_calls=parallel_tool_calls)  # fmt: skip


class Accumulator:
    """Folds a request's responses into its RequestOutput (`result`), and says
    what each one added (a StreamChunk)."""

    def __init__(self, request_id: str, num_sequences: int, beam_search: bool = False) -> None:
        self.result = RequestOutput(request_id, [CompletionOutput(i) for i in range(num_sequences)])
        self.beam_search = beam_search

    @classmethod
    def for_submit(cls, msg: protocol.Submit) -> Accumulator:
        acc = cls(msg.request_id, msg.num_return_sequences, msg.sampling_config.beam_width > 1)
        acc.result.prompt = msg.prompt
        acc.result.prompt_token_ids = msg.input_token_ids
        return acc

    def add(self, response: protocol.Response) -> StreamChunk:
        r = response.result
        assert r is not None
        if r.context_logits is not None:
            self.result.context_logits = _array(r.context_logits)
        if r.embedding is not None:
            self.result.embedding = _array(r.embedding)
        chunk = self._replace_beams(r) if self.beam_search else self._extend(r)
        self.result.finished = r.is_final
        return chunk

    def _extend(self, r: protocol.Result) -> StreamChunk:
        out = self.result.outputs[r.sequence_index]
        new_ids = list(r.output_token_ids[0])
        new_text = r.text[0] if r.text else ""
        out.token_ids.extend(new_ids)
        out.text += new_text
        if r.tool_calls is not None:
            out.tool_calls = list(r.tool_calls)
        if r.log_probs is not None:
            out.log_probs = out.log_probs or []
            out.log_probs.extend(r.log_probs[0])
            out.cum_log_prob = r.cum_log_probs[0] if r.cum_log_probs else None
        if r.top_token_ids is not None and r.top_log_probs is not None:
            out.top_token_ids = out.top_token_ids or []
            out.top_token_ids.extend(list(t) for t in r.top_token_ids[0])
            out.top_log_probs = out.top_log_probs or []
            out.top_log_probs.extend(list(p) for p in r.top_log_probs[0])
        if r.generation_logits is not None:
            out.generation_logits = _append_rows(out.generation_logits, _array(r.generation_logits)[0])
        ended = (r.is_sequence_final or r.is_final) and out.finish_reason is None
        if ended:
            # Once only: a sequence a stop string ended keeps STOP_WORDS, whatever
            # its request's last result says of it.
            out.finish_reason = FinishReason(r.finish_reasons[0])
        return StreamChunk(
            self.result.request_id,
            r.sequence_index,
            new_ids,
            new_text,
            out.finish_reason if ended else None,
            r.is_final,
        )

    def _replace_beams(self, r: protocol.Result) -> StreamChunk:
        """Beam search sends whole beams each time (the best ones, best first): each
        output is replaced, and the chunk carries the best beam as it stands."""
        outputs = []
        for i, tokens in enumerate(r.output_token_ids):
            out = CompletionOutput(i, list(tokens), r.text[i] if r.text else "")
            if r.is_final:
                out.finish_reason = FinishReason(r.finish_reasons[i])
            if r.log_probs is not None:
                out.log_probs = list(r.log_probs[i])
            if r.cum_log_probs is not None:
                out.cum_log_prob = r.cum_log_probs[i]
            outputs.append(out)
        self.result.outputs = outputs
        best = outputs[0]
        return StreamChunk(self.result.request_id, 0, best.token_ids, best.text, best.finish_reason, r.is_final)


def _array(logits: protocol.Logits) -> npt.NDArray[np.float32]:
    # numpy only here: the client library loads it only for requests that asked for logits.
    import numpy as np

    return np.frombuffer(logits.data, dtype="<f4").reshape(logits.shape)


def _append_rows(
    rows: npt.NDArray[np.float32] | None, new: npt.NDArray[np.float32]
) -> npt.NDArray[np.float32]:
    import numpy as np

    return new if rows is None else np.concatenate([rows, new])

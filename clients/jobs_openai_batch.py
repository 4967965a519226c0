"""OpenAI's batch input lines ({"custom_id", "method", "url", "body"}) as job options:
the body of a /v1/chat/completions or /v1/completions line in SamplingParams' names,
a /v1/responses line run as the chat it stands for (instructions as the system
message, then the input), and a /v1/embeddings line as one input's embedding job."""

from __future__ import annotations

from typing import Any

# A chat or completions body's fields in SamplingParams' names where they differ; None: ignored here.
_OPENAI_NAMES: dict[str, str | None] = {
    "max_completion_tokens": "max_tokens", "n": "num_return_sequences", "logprobs": "return_log_probs",
    "top_logprobs": "top_n_log_probs", "stream": None, "user": None,
}  # fmt: skip
# A responses body's fields in SamplingParams' names; `input` and `instructions` become messages.
_RESPONSES_NAMES: dict[str, str | None] = {
    "model": "model", "max_output_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
    "store": None, "metadata": None, "stream": None, "user": None,
}  # fmt: skip
_GENERATING = ("/v1/chat/completions", "/v1/completions")
_SERVED = (*_GENERATING, "/v1/responses", "/v1/embeddings")


def body_spec(url: str | None, body: dict[str, Any]) -> dict[str, Any]:
    """submit's keyword arguments for one batch line's body; ValueError names what is wrong."""
    if url is None or url in _GENERATING:
        return _renamed(body, _OPENAI_NAMES, keep_unknown=True)
    if url == "/v1/responses":
        return _responses(body)
    if url == "/v1/embeddings":
        return _embeddings(body)
    raise ValueError(f'"url" {url!r} is not served by the job queue; it takes {list(_SERVED)}')


def _renamed(body: dict[str, Any], names: dict[str, str | None], keep_unknown: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    for key, value in body.items():
        name = names.get(key, key if keep_unknown else None)
        if name is not None:
            spec[name] = value
    if isinstance(spec.get("stop"), str):
        spec["stop"] = [spec["stop"]]
    return spec


def _responses(body: dict[str, Any]) -> dict[str, Any]:
    unknown = set(body) - set(_RESPONSES_NAMES) - {"input", "instructions"}
    if unknown:  # tools, previous_response_id, text formats: the HTTP front's Responses API serves those
        raise ValueError(f"a /v1/responses line takes {sorted([*_RESPONSES_NAMES, 'input', 'instructions'])}; "
                         f"not {sorted(unknown)}")  # fmt: skip
    if "input" not in body:
        raise ValueError('a /v1/responses line needs "input"')
    messages = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    messages += _input_messages(body["input"])
    return {**_renamed(body, _RESPONSES_NAMES, keep_unknown=False), "messages": messages}


def _embeddings(body: dict[str, Any]) -> dict[str, Any]:
    """One input's embedding: a text or token ids, or a list of exactly one of either
    (a job is one request; a batch file holds a line per input)."""
    unknown = set(body) - {"input", "model", "encoding_format", "user"}
    if unknown:
        raise ValueError(f'a /v1/embeddings line takes "input", "model" and "encoding_format"; not {sorted(unknown)}')
    if body.get("encoding_format", "float") != "float":
        raise ValueError('a /v1/embeddings line: "encoding_format" must be "float" (job results are JSON)')
    value = body.get("input")
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        if len(value) != 1:
            raise ValueError(f'a /v1/embeddings line embeds one input; this one has {len(value)} (one line each)')
        value = value[0]
    if not value:
        raise ValueError('a /v1/embeddings line needs "input": a text or token ids')
    spec: dict[str, Any] = {"prompt": value, "embedding": {}}
    if "model" in body:
        spec["model"] = body["model"]
    return spec


def _input_messages(value: Any) -> list[dict[str, Any]]:
    """A Responses `input` (a text, or messages whose content is a text or input_text parts) as chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError('"input" must be a text or a non-empty list of messages')
    messages = []
    for item in value:
        if not isinstance(item, dict) or "role" not in item:
            raise ValueError('each "input" message needs a "role" and a "content"')
        content = item.get("content")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text") for p in content):
                raise ValueError('"input" content parts must be input_text or output_text')
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise ValueError('each "input" message needs a "role" and a "content"')
        messages.append({"role": item["role"], "content": content})
    return messages

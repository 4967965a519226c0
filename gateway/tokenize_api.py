"""vLLM's /tokenize and /detokenize: a prompt (text or chat) as the model's token ids,
and token ids as text, with the tokenizer and chat template the gateway serves with."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, model_validator

from gateway.openai_api import ChatMessageIn, ChatRequest


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = Field(None, min_length=1)
    add_special_tokens: bool = True  # a text prompt's (a chat's come from its template)
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt and messages")
        return self

    def chat(self) -> ChatRequest:
        """The chat this renders, as /v1/chat/completions would render it."""
        return ChatRequest.model_validate({"messages": self.messages, "tools": self.tools,
                                           "chat_template_kwargs": self.chat_template_kwargs})  # fmt: skip


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)

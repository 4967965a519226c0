"""The tools the tool-calling tests give a chat (over HTTP, through the ZeroMQ clients and
the job queue, and in process), with the JSON schemas their calls must validate against."""

from __future__ import annotations

from typing import Any

PARAMS: dict[str, Any] = {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False,
}  # fmt: skip
WEATHER: dict[str, Any] = {"type": "function", "function": {"name": "get_weather", "description": "the forecast",
                                                            "parameters": PARAMS}}  # fmt: skip
TIME_PARAMS: dict[str, Any] = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                               "required": ["zone"], "additionalProperties": False}  # fmt: skip
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}}
SCHEMAS = {"get_weather": PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# The random test models write Llama 3's call format when their output is held to this schema.
LLAMA_CALL: dict[str, Any] = {
    "type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": PARAMS},
    "required": ["name", "parameters"], "additionalProperties": False,
}  # fmt: skip

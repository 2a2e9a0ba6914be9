"""Tool calls on chat completions: ``tools`` with ``tool_choice`` "required" or a named function.

The reply is held by structured output (``specdec.output_format``) to JSON that is a call: a named function's
arguments under its ``parameters`` schema, or for "required" an array of ``{"name": ..., "parameters": {...}}``, each
an offered function's name with arguments under its schema (vLLM's shape; one call with ``parallel_tool_calls:
false``). Speculation leaves that output exactly what target-only decoding gives under the same format. A finished
output is answered as OpenAI's ``tool_calls`` (``content`` null, ``finish_reason`` "tool_calls"); one cut short
(``max_tokens``, a stop string) is answered as text with its own finish reason.

"auto", the default when tools are offered, needs a parser of the model's own tool-call syntax (each model family
writes calls its own way), which specdec does not have: it is refused, naming ``tool_choice``. "none" generates text
with the tools rendered into the prompt by the chat template as usual.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from specdec.server.errors import APIError
from specdec.server.schemas import ChatCompletionRequest, NamedToolChoice

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    """The calls a reply must be: ``named``'s arguments, or (None) an array of calls of the offered functions."""

    schema: dict[str, Any]  # the reply's JSON schema
    named: str | None = None

    def response_format(self) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": {"name": "tool_calls", "schema": self.schema}}

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The reply as OpenAI's ``tool_calls``; None when it is not a whole call (cut short)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.named is not None:
            pairs = [(self.named, value)]
        elif isinstance(value, list) and all(isinstance(c, dict) and {"name", "parameters"} <= c.keys() for c in value):
            pairs = [(c["name"], c["parameters"]) for c in value]
        else:
            return None
        return [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
            }
            for name, args in pairs
        ]


def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """What ``tools`` and ``tool_choice`` ask of the reply (None: text), or a 400 naming the field."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice in (None, "none", "auto"):
            return None
        raise APIError(400, "tool_choice asks for a tool call but no tools are given", "tool_choice", "invalid_value")
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in schemas:
            raise APIError(400, f"two tools are named {name!r}", f"tools.{i}.function.name", "invalid_value")
        schemas[name] = tool.function.parameters if tool.function.parameters is not None else NO_ARGUMENTS
    if choice in (None, "auto"):
        raise APIError(
            400,
            'tool_choice "auto" (the default with tools) needs a parser of this model\'s own tool-call syntax, which '
            'specdec does not have: send tool_choice "required" or {"type": "function", "function": {"name": ...}} '
            '(the call is then held to its schema), or "none"',
            "tool_choice",
            "unsupported",
        )
    if choice == "none":
        return None
    if body.response_format not in (None, {"type": "text"}) or body.structured_outputs is not None:
        raise APIError(
            400,
            "a tool call's format is its schema: response_format or structured_outputs cannot be combined with it",
            "response_format",
            "invalid_value",
        )
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in schemas:
            raise APIError(
                400, f"tool_choice names {name!r}, which is not among the tools", "tool_choice", "invalid_value"
            )
        return ToolPlan(schemas[name], name)
    calls = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": schema},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, schema in schemas.items()
            ]
        },
    }
    if body.parallel_tool_calls is False:
        calls["maxItems"] = 1
    return ToolPlan(calls)


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as the chat template reads them (OpenAI's shape)."""
    return [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None

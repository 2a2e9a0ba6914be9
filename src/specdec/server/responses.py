"""OpenAI response bodies and server-sent-event chunks, built from engine results."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from specdec.engine import GenerationResult

Kind = Literal["completion", "chat"]


@dataclass(frozen=True)
class Reply:
    """What every chunk and response of one request shares."""

    id: str
    created: int
    model: str
    kind: Kind

    def response(
        self, result: GenerationResult, prompt_tokens: int, steps: list[dict[str, Any]] | None
    ) -> dict[str, Any]:
        reason = result.finish_reason
        if self.kind == "completion":
            choice: dict[str, Any] = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": reason}
        else:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "logprobs": None,
                "finish_reason": reason,
            }
        return {
            "id": self.id,
            "object": "text_completion" if self.kind == "completion" else "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(prompt_tokens, result),
            "speculative": summary(result, steps),
        }

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        *,
        role: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> bytes:
        """One SSE event. ``text=None``: a chunk with no text (the closing chunk of a chat stream)."""
        if self.kind == "completion":
            choice: dict[str, Any] = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        else:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        body: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        body.update(extra or {})
        return sse(body)

    def usage_chunk(self, prompt_tokens: int, result: GenerationResult) -> bytes:
        """The extra last chunk OpenAI sends for ``stream_options.include_usage``: no choices, only usage."""
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return sse(
            {
                "id": self.id,
                "object": obj,
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage(prompt_tokens, result),
            }
        )


def usage(prompt_tokens: int, result: GenerationResult) -> dict[str, int]:
    completion = len(result.token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def summary(result: GenerationResult, steps: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    s = result.stats
    out: dict[str, Any] = {
        "acceptance_rate": s.acceptance_rate,
        "mean_accepted_length": s.mean_accepted_length,
        "target_passes": s.target_passes,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "policy": result.records[0].policy if result.records else None,
    }
    if steps is not None:
        out["steps"] = steps
    return out


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


DONE = b"data: [DONE]\n\n"

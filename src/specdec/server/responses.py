"""OpenAI response bodies and server-sent-event chunks, built from engine results."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from specdec.engine import GenerationResult
from specdec.sampling import TokenLogprob

Kind = Literal["completion", "chat"]


@dataclass(frozen=True)
class Reply:
    """What every chunk and response of one request shares."""

    id: str
    created: int
    model: str
    kind: Kind
    tokenizer: Any = None  # renders the tokens of log probabilities (needed only when a request asks for them)

    def logprobs(self, lps: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
        """The ``logprobs`` of a choice for these tokens, in the endpoint's shape; ``offset``: the completion
        text offset of the first one (streams carry it across chunks)."""
        if lps is None:
            return None
        if self.kind == "completion":
            tokens = [token_text(self.tokenizer, lp.token) for lp in lps]
            offsets = []
            for t in tokens:
                offsets.append(offset)
                offset += len(t)
            return {
                "tokens": tokens,
                "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{token_text(self.tokenizer, t): v for t, v in lp.top} for lp in lps],
                "text_offset": offsets,
            }

        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = token_text(self.tokenizer, token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {
            "content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]
        }

    def response(
        self, result: GenerationResult, prompt_tokens: int, steps: list[dict[str, Any]] | None
    ) -> dict[str, Any]:
        reason = result.finish_reason
        logprobs = self.logprobs(result.logprobs)
        if self.kind == "completion":
            choice: dict[str, Any] = {"index": 0, "text": result.text, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "logprobs": logprobs,
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
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        """One SSE event. ``text=None``: a chunk with no text (the closing chunk of a chat stream)."""
        if self.kind == "completion":
            choice: dict[str, Any] = {
                "index": 0,
                "text": text or "",
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
            obj = "text_completion"
        else:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
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


def token_text(tokenizer: Any, token: int) -> str:
    """A token as text: its own decoding (special tokens included; a token holding part of a UTF-8 character
    decodes to U+FFFD, as in other OpenAI-compatible servers)."""
    return str(tokenizer.decode([token]))


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

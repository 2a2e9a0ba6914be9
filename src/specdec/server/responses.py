"""OpenAI response bodies and server-sent-event chunks, built from engine results.

A request of ``n`` samples has n results: ``choices`` ``index`` 0..n-1 (each with its own finish reason),
``usage.completion_tokens`` summed over them, and ``speculative`` summed over them with each choice's own
figures under ``speculative.choices``; a streamed chunk carries one choice, its ``index`` saying which.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from specdec.engine import GenerationResult
from specdec.sampling import TokenLogprob
from specdec.server.tools import ToolPlan

Kind = Literal["completion", "chat"]


class Prompted(Protocol):
    """What an echo's log probabilities read: the prompt's ids and their scores (a result, or a stream's start)."""

    @property
    def prompt_ids(self) -> list[int]: ...

    @property
    def prompt_logprobs(self) -> list[TokenLogprob] | None: ...


@dataclass(frozen=True)
class Reply:
    """What every chunk and response of one request shares."""

    id: str
    created: int
    model: str
    kind: Kind
    tokenizer: Any = None  # renders the tokens of log probabilities (needed only when a request asks for them)
    # Completions with ``echo``: each prompt's text, before its choices' own (None: a prompt of token ids, decoded)
    echo: list[str | None] | None = None
    tools: ToolPlan | None = None  # a chat request whose reply is tool calls (``specdec.server.tools``)
    # A text chunk's bytes before and after its text, by choice index (``chunk``'s common case, made once).
    _around_text: dict[int, tuple[str, str]] = field(default_factory=dict, compare=False, repr=False)

    def logprobs(
        self, lps: list[TokenLogprob] | None, offset: int = 0, prompt: Prompted | None = None
    ) -> dict[str, Any] | None:
        """The ``logprobs`` of a choice for these tokens, in the endpoint's shape; ``offset``: the completion
        text offset of the first one (streams carry it across chunks). ``prompt``: a completion with ``echo``, whose
        prompt tokens come first (the first unscored: ``null``, as OpenAI gives it)."""
        if lps is None:
            return None
        if self.kind == "completion":
            scored: list[TokenLogprob | None] = list(lps)
            if prompt is not None and prompt.prompt_logprobs is not None:
                first = TokenLogprob(prompt.prompt_ids[0], 0.0, [])
                scored = [None, *prompt.prompt_logprobs, *lps]
                tokens = [token_text(self.tokenizer, lp.token) for lp in [first, *prompt.prompt_logprobs, *lps]]
            else:
                tokens = [token_text(self.tokenizer, lp.token) for lp in lps]
            offsets = []
            for t in tokens:
                offsets.append(offset)
                offset += len(t)
            return {
                "tokens": tokens,
                "token_logprobs": [lp.logprob if lp is not None else None for lp in scored],
                "top_logprobs": [
                    {token_text(self.tokenizer, t): v for t, v in lp.top} if lp is not None else None for lp in scored
                ],
                "text_offset": offsets,
            }

        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = token_text(self.tokenizer, token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {
            "content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]
        }

    def response(
        self, results: Sequence[GenerationResult], prompt_tokens: int, steps: list[dict[str, Any]] | None
    ) -> dict[str, Any]:
        """The whole response: one choice per result (the request's n samples, in order)."""
        choices: list[dict[str, Any]] = []
        for index, result in enumerate(results):
            reason: str = result.finish_reason
            if self.kind == "completion":
                echo = self.echo_text(index, len(results), result.prompt_ids)
                choices.append(
                    {
                        "index": index,
                        "text": echo + result.text if echo is not None else result.text,
                        "logprobs": self.logprobs(result.logprobs, prompt=result if echo is not None else None),
                        "finish_reason": reason,
                    }
                )
            else:
                message: dict[str, Any] = {"role": "assistant", "content": result.text}
                calls = self.tool_calls(result)
                if calls is not None:
                    message, reason = {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
                choices.append(
                    {
                        "index": index,
                        "message": message,
                        "logprobs": self.logprobs(result.logprobs),
                        "finish_reason": reason,
                    }
                )
        return {
            "id": self.id,
            "object": "text_completion" if self.kind == "completion" else "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(prompt_tokens, results),
            "speculative": summary(results, steps),
        }

    def tool_calls(self, result: GenerationResult) -> list[dict[str, Any]] | None:
        """A finished reply of a tool-calling request as its calls; None otherwise (text)."""
        if self.tools is None or result.finish_reason != "stop":
            return None
        return self.tools.calls(result.text)

    def echo_text(self, index: int, choices: int, prompt_ids: list[int]) -> str | None:
        """The text choice ``index`` of ``choices`` echoes (None without ``echo``): its prompt as sent, or the text of
        its token ids (checked by the engine by now)."""
        if self.echo is None:
            return None
        text = self.echo[index * len(self.echo) // choices]
        return text if text is not None else str(self.tokenizer.decode(prompt_ids, skip_special_tokens=True))

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        *,
        index: int = 0,
        role: bool = False,
        extra: dict[str, Any] | None = None,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> bytes:
        """One SSE event for choice ``index``. ``text=None``: a chunk with no text (the closing chunk of a chat
        stream). ``tool_calls``: a chat delta's calls (each whole, with its ``index``)."""
        if tool_calls is not None:
            return self._chunk_event(text, index, finish_reason, role, extra, logprobs, tool_calls).encode()
        if text is not None and finish_reason is None and not role and extra is None and logprobs is None:
            # The event of most steps: the same bytes as below, the rest of the event made once per choice (a server
            # at 16 clients sends ~3,000 of them a second from the event loop that shares the cores with the passes).
            around = self._around_text.get(index)
            if around is None:
                placeholder = "\x00specdec-text\x00"  # the event's last string (an id equal to it comes before)
                head, found, tail = self._chunk_event(placeholder, index).rpartition(json.dumps(placeholder))
                assert found, "the text's placeholder is missing from the event"
                around = self._around_text[index] = (head, tail)
            return (around[0] + json.dumps(text, ensure_ascii=False) + around[1]).encode()
        return self._chunk_event(text, index, finish_reason, role, extra, logprobs).encode()

    def _chunk_event(
        self,
        text: str | None,
        index: int,
        finish_reason: str | None = None,
        role: bool = False,
        extra: dict[str, Any] | None = None,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> str:
        if self.kind == "completion":
            choice: dict[str, Any] = {
                "index": index,
                "text": text or "",
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
            obj = "text_completion"
        else:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls is not None:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        body: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        body.update(extra or {})
        return sse_text(body)

    def usage_chunk(self, prompt_tokens: int, results: Sequence[GenerationResult]) -> bytes:
        """The extra last chunk OpenAI sends for ``stream_options.include_usage``: no choices, only usage."""
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return sse(
            {
                "id": self.id,
                "object": obj,
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage(prompt_tokens, results),
            }
        )


def token_text(tokenizer: Any, token: int) -> str:
    """A token as text: its own decoding (special tokens included; a token holding part of a UTF-8 character
    decodes to U+FFFD, as in other OpenAI-compatible servers)."""
    return str(tokenizer.decode([token]))


def usage(prompt_tokens: int, results: Sequence[GenerationResult]) -> dict[str, Any]:
    """The prompt counted once (it is prefilled once), of it the tokens the prefix cache held (OpenAI's
    ``prompt_tokens_details.cached_tokens``), the completion tokens of every sample; with a prediction, the tokens
    drafted from it that the outputs kept and those rejected (``completion_tokens_details``)."""
    completion = sum(len(r.token_ids) for r in results)
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.stats.cached_tokens for r in results)},
    }
    if any(r.stats.prediction_tokens for r in results):
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": sum(r.stats.prediction_accepted for r in results),
            "rejected_prediction_tokens": sum(r.stats.prediction_rejected for r in results),
        }
    return out


def summary(results: Sequence[GenerationResult], steps: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The speculation figures of a request: one result's, or for n > 1 the sums over them (rates from the
    sums) with each one's own under ``choices``."""
    passes = sum(r.stats.target_passes for r in results)
    drafted = sum(r.stats.drafted for r in results)
    accepted = sum(r.stats.accepted for r in results)
    emitted = sum(r.stats.new_tokens for r in results)
    policy = next((r.records[0].policy for r in results if r.records), None)
    out: dict[str, Any] = {
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": emitted / passes if passes else 0.0,
        "target_passes": passes,
        "drafted": drafted,
        "accepted": accepted,
        "policy": policy,
    }
    if steps is not None:
        out["steps"] = steps
    if len(results) > 1:
        out["choices"] = [summary([r]) for r in results]
    return out


def sse_text(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse(obj: Any) -> bytes:
    return sse_text(obj).encode()


DONE = b"data: [DONE]\n\n"

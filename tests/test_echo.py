"""Completions with ``echo``: the prompt before the completion, and with ``logprobs`` the prompt's tokens scored by the
target (what evaluation harnesses read to score a continuation: ``echo``, ``logprobs``, ``max_tokens`` 1).

Each prompt token's score is checked against an independent path: a target-only request over the tokens before it,
whose one generated position reports the same distribution's log probabilities (the CPU kernel's rows do not depend
on the rows beside them, so the two agree bit for bit).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

import specdec

PROMPT = "def fibonacci(n):\n    if n < 2:"


@pytest.fixture(scope="module")
def engine(tiny_models: dict[str, Path]) -> Any:
    return specdec.load(tiny_models["llama"], tiny_models["draft"])


def test_prompt_tokens_are_scored_as_target_only_decoding_scores_them(engine: Any) -> None:
    r = engine.generate(PROMPT, max_new_tokens=3, prompt_logprobs=3, tau=2)
    ids = r.prompt_ids
    assert [lp.token for lp in r.prompt_logprobs] == ids[1:]
    for j in range(1, len(ids)):
        alone = engine.generate(ids[:j], max_new_tokens=1, tau=0, logprobs=3, ignore_eos=True)
        first = alone.logprobs[0]
        assert r.prompt_logprobs[j - 1].top == first.top, j  # the same distribution at position j
        if first.token == ids[j]:
            assert r.prompt_logprobs[j - 1].logprob == first.logprob
    # more than one scoring pass (a chunk of PROMPT_SCORE_CHUNK rows each) gives the same scores
    from specdec import verifier

    chunk = verifier.PROMPT_SCORE_CHUNK
    try:
        verifier.PROMPT_SCORE_CHUNK = 3
        again = engine.generate(PROMPT, max_new_tokens=3, prompt_logprobs=3, tau=2)
    finally:
        verifier.PROMPT_SCORE_CHUNK = chunk
    assert [(lp.token, lp.logprob, lp.top) for lp in again.prompt_logprobs] == [
        (lp.token, lp.logprob, lp.top) for lp in r.prompt_logprobs
    ]
    # the scoring pass is the request's prefill, in pieces or not: the output is the one without scores
    assert again.token_ids == r.token_ids == engine.generate(PROMPT, max_new_tokens=3, tau=0).token_ids
    with pytest.raises(specdec.InvalidRequestError, match="prompt_logprobs must be an integer"):
        engine.start(PROMPT, prompt_logprobs=-1)
    # nothing generated: the prompt scored only, the request finished before any step
    only = engine.generate(PROMPT, max_new_tokens=0, prompt_logprobs=3)
    assert only.token_ids == [] and only.finish_reason == "length" and only.stats.target_passes == 0
    assert [(lp.token, lp.logprob, lp.top) for lp in only.prompt_logprobs] == [
        (lp.token, lp.logprob, lp.top) for lp in r.prompt_logprobs
    ]
    with pytest.raises(specdec.InvalidRequestError, match="0 only with prompt_logprobs"):
        engine.start(PROMPT, max_new_tokens=0)


@pytest.mark.server
def test_echo_over_http(engine: Any) -> None:
    from specdec.server import ServerSettings, create_app

    app = create_app(engine, ServerSettings(model_name="tiny"))
    base = {"model": "tiny", "max_tokens": 4, "temperature": 0}
    ids = engine.encode(PROMPT)

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            calls = [
                {**base, "prompt": PROMPT},
                {**base, "prompt": PROMPT, "echo": True},
                {**base, "prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 1},  # what harnesses send
                {**base, "prompt": PROMPT, "echo": True, "logprobs": 2, "n": 2},
                {**base, "prompt": PROMPT, "echo": True, "stream": True},
                {**base, "prompt": PROMPT, "echo": True, "logprobs": 2, "n": 2, "stream": True},
                {**base, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0, "n": 2},  # scoring only
                {**base, "prompt": PROMPT, "echo": True, "max_tokens": 0},
            ]
            return [await c.post("/v1/completions", json=body) for body in calls]

    try:
        plain, echoed, scored, two, streamed, streamed_scored, zero, zero_unscored = asyncio.run(main())
    finally:
        app.state.scheduler.stop()
    text = plain.json()["choices"][0]["text"]
    assert echoed.json()["choices"][0]["text"] == PROMPT + text
    assert echoed.json()["choices"][0]["logprobs"] is None
    assert echoed.json()["usage"] == plain.json()["usage"]  # the echo is not completion tokens

    choice = scored.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(engine.tokenizer.decode(ids, skip_special_tokens=True))
    assert len(lp["tokens"]) == len(ids) + 1 == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # the first token has no context
    want = engine.generate(ids, max_new_tokens=1, prompt_logprobs=1, tau=0, logprobs=1)
    assert lp["token_logprobs"][1:] == [x.logprob for x in want.prompt_logprobs] + [want.logprobs[0].logprob]
    assert all(isinstance(t, dict) and len(t) >= 1 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0

    for c in two.json()["choices"]:  # each sample echoes the prompt, scored once for both
        assert c["text"].startswith(PROMPT) and c["logprobs"]["token_logprobs"][0] is None
        assert len(c["logprobs"]["tokens"]) == len(ids) + 4
    # streamed: each choice's first chunk is its prompt (with its scores), then its own text as it comes
    events = [json.loads(x[6:]) for x in streamed.text.splitlines() if x.startswith("data: {")]
    assert events[0]["choices"][0]["text"] == PROMPT and events[0]["choices"][0]["logprobs"] is None
    assert "".join(c["text"] for e in events for c in e["choices"]) == echoed.json()["choices"][0]["text"]
    events = [json.loads(x[6:]) for x in streamed_scored.text.splitlines() if x.startswith("data: {")]
    whole = two.json()["choices"]
    for index in (0, 1):
        mine = [c for e in events for c in e["choices"] if c["index"] == index]
        assert "".join(c["text"] for c in mine) == whole[index]["text"]
        merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for c in mine:
            for key in merged:
                merged[key] += (c["logprobs"] or {}).get(key, [])
        assert merged == whole[index]["logprobs"], index  # the chunks' lists, joined, are the whole response's
    body = zero.json()
    assert [c["text"] for c in body["choices"]] == [PROMPT, PROMPT]
    assert body["usage"]["completion_tokens"] == 0 and body["choices"][0]["finish_reason"] == "length"
    lp = body["choices"][1]["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][1:] == [x.logprob for x in want.prompt_logprobs]
    assert zero_unscored.status_code == 400 and zero_unscored.json()["error"]["param"] == "max_tokens"

"""Predicted outputs (``prediction``): drafts read from text the request expects its output to repeat.

Where the output is found in the prediction (``Prediction``, unit tests on hand-made token lists), steps draft from it;
every output is the target's whatever the prediction says (greedy: identical to target-only, alone and batched with
requests with and without predictions; sampled: the exact law, ``test_distribution.py``); the server takes OpenAI's
``prediction`` field and reports ``usage.completion_tokens_details``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

import specdec
from specdec.drafters.prediction import FIRST_SPAN, MAX_SPAN, MIN_SPAN, Prediction

# -- where the output stands in the prediction -------------------------------------------------------------------


def test_reads_from_the_start_then_follows_the_output() -> None:
    p = Prediction(list(range(100, 160)))
    assert p.propose([], 50) == list(range(100, 100 + FIRST_SPAN))  # the first step reads the beginning
    p.observe(FIRST_SPAN, FIRST_SPAN, FIRST_SPAN + 1)  # all accepted, and the bonus token was the prediction's too
    out = list(range(100, 100 + FIRST_SPAN + 1))
    assert p.span == 2 * FIRST_SPAN and p.propose(out, 50) == list(range(109, 109 + 2 * FIRST_SPAN))
    assert p.propose(out, 3) == [109, 110, 111]  # never past what the engine allows (the tokens left)


def test_finds_the_output_again_after_an_edit() -> None:
    pred = list(range(1, 21))
    p = Prediction(pred)
    assert p.propose([1, 2, 3, 99], 40) == []  # the output left the prediction: the drafter's turn
    assert p.propose([1, 2, 3, 99, 6, 7], 40) == []  # two tokens in common: too few to say where it is
    assert p.propose([1, 2, 3, 99, 5, 6, 7, 8], 40) == list(range(9, 9 + FIRST_SPAN))  # rejoined: a replaced line
    inserted = [1, 2, 3, 4, 5, 50, 51, 52, 6, 7, 8, 9]
    assert p.propose(inserted, 40) == list(range(10, 10 + FIRST_SPAN))  # lines inserted, then the prediction again
    assert p.propose([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], 40) == []  # its end


def test_a_short_match_is_not_enough_where_the_output_is_found_afresh() -> None:
    p = Prediction([5, 6, 7, 8, 9])
    assert p.propose([42, 7], 10) == []  # 7 occurs, but [42, 7] does not
    assert p.propose([1, 2, 6, 7], 10) == []  # [6, 7] occurs: two tokens of four
    assert p.propose([7], 10) == [8, 9]  # all the output there is matches
    assert p.propose([5, 6, 7], 10) == [8, 9]


def test_the_longest_match_wins_then_the_place_nearest_the_last_step() -> None:
    """In repetitive text the same suffix occurs many times: the longest match wins, then the place nearest where
    the last step ended (``hint``), ahead of it first."""
    p = Prediction([1, 2, 3, 9, 5, 2, 3, 7])
    p.hint = 7  # nearer the second [2, 3], but [1, 2, 3] matches only the first
    assert p.propose([1, 2, 3], 10) == [9, 5, 2, 3, 7]
    line = [10, 11, 12, 13]
    p = Prediction(line * 5 + [20, 21])  # the last 8 tokens of the output end at 8, 12, 16 and 20 alike
    p.hint = 14
    assert p.propose(line * 4, 40) == [10, 11, 12, 13, 20, 21]  # 16: as near as 12, and ahead
    p.hint = 0
    assert p.propose(line * 4, 40) == (line * 3 + [20, 21])[:FIRST_SPAN]  # 8
    p.hint = 100
    assert p.propose(line * 4, 40) == [20, 21]


def test_a_fresh_find_reads_the_first_span_again() -> None:
    p = Prediction(list(range(1, 41)))
    p.propose([], 40)
    p.observe(FIRST_SPAN, 1, 2)  # a rejection at the second token: the span falls back
    assert p.span == 2
    rejoined = [1, 99, 98, 97, 5, 6, 7, 8]  # the output left the prediction, then rejoins it after an edit
    assert p.propose(rejoined, 40) == list(range(9, 9 + FIRST_SPAN))


def test_span_doubles_on_whole_acceptance_and_falls_back_after_a_rejection() -> None:
    p = Prediction(list(range(200)))
    spans = []
    for _ in range(4):
        spans.append(p.span)
        p.observe(p.span, p.span, p.span + 1)
    assert spans == [FIRST_SPAN, 2 * FIRST_SPAN, MAX_SPAN, MAX_SPAN]
    p.observe(MAX_SPAN, 5, 6)
    assert p.span == 6
    p.observe(6, 0, 1)
    assert p.span == MIN_SPAN


# -- the engine: every output the target's -----------------------------------------------------------------------

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, x):", "import os, sys\n"]


def _variants(text_ids: list[int]) -> dict[str, list[int]]:
    """Predictions of an output: itself, with tokens inserted, deleted and replaced mid-way, its first half,
    something else altogether."""
    k = len(text_ids) // 2
    return {
        "exact": text_ids,
        "inserted": text_ids[:k] + [7, 8, 9] + text_ids[k:],
        "deleted": text_ids[:k] + text_ids[k + 4 :],
        "replaced": text_ids[:k] + [3, 1, 4, 1, 5] + text_ids[k + 5 :],
        "half": text_ids[:k],
        "unrelated": [11, 12, 13, 14, 15] * 8,
    }


@pytest.mark.identity
@pytest.mark.parametrize("drafter", ["draft model", "prompt lookup", "none"])
def test_greedy_output_is_target_only_whatever_the_prediction(tiny_models: dict[str, Path], drafter: str) -> None:
    kwargs: dict[str, Any] = {
        "draft model": {"draft": tiny_models["draft"]},
        "prompt lookup": {"prompt_lookup": True},
        "none": {},
    }[drafter]
    engine = specdec.load(tiny_models["llama"], **kwargs)
    engine.eos_ids = frozenset()  # full-length outputs: more of each prediction read
    for prompt in PROMPTS:
        want = engine.generate(prompt, max_new_tokens=40, tau=0).token_ids
        for name, pred in _variants(want).items():
            got = engine.generate(prompt, max_new_tokens=40, prediction=pred)
            assert got.token_ids == want, (prompt, name)
            s = got.stats
            assert s.prediction_tokens == len(pred)
            assert s.accepted >= s.prediction_accepted and s.drafted >= s.prediction_accepted + s.prediction_rejected
            if name == "exact":  # read whole: few passes, nothing rejected
                assert s.prediction_accepted >= 36 and s.prediction_rejected == 0 and s.target_passes <= 6
            predicted = [r for r in got.records if r.reason == "prediction"]
            if name in ("inserted", "deleted", "replaced"):  # read up to the edit, and found again after it
                assert s.prediction_accepted >= 24, (prompt, name, s)
                after = [r for r in predicted if r.context_len - r.prompt_len > len(want) // 2]  # from the edit on
                assert sum(r.n_accepted for r in after) >= 5, (prompt, name, s)
            assert sum(r.n_emitted_accepted for r in predicted) == s.prediction_accepted
            assert all(r.draft_passes == 0 for r in predicted if r.batch_size == 1)  # no draft forward for them
            if drafter == "draft model" and name == "half":
                # the draft model took nothing in while the prediction drafted: its first draft catches up on it all
                first = next(r for r in got.records if r.reason != "prediction" and r.tau > 0)
                assert first.draft_fed == first.context_len, first
        # as text too, and a prediction of token ids outside the vocabulary is refused
        text = engine.tokenizer.decode(want)
        assert engine.generate(prompt, max_new_tokens=40, prediction=text).token_ids == want
    with pytest.raises(specdec.InvalidRequestError, match="prediction token id 999999"):
        engine.start(PROMPTS[0], prediction=[1, 999999])


@pytest.mark.identity
def test_tau_zero_ignores_the_prediction(tiny_models: dict[str, Path]) -> None:
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"])
    want = engine.generate(PROMPTS[0], max_new_tokens=20, tau=0)
    got = engine.generate(PROMPTS[0], max_new_tokens=20, tau=0, prediction=want.token_ids)
    assert got.token_ids == want.token_ids and all(r.tau == 0 for r in got.records)
    assert got.stats.target_passes == 20 and got.stats.prediction_tokens == 0


@pytest.mark.identity
def test_batched_steps_mixing_predicted_and_drafted_sequences(tiny_models: dict[str, Path]) -> None:
    """One step's passes over sequences drafting from predictions (good, edited, unrelated) and from the draft
    model, joining at different steps: each output its solo target-only one, each n-sample its own prediction."""
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"])
    engine.eos_ids = frozenset()
    wants = {p: engine.generate(p, max_new_tokens=32, tau=0).token_ids for p in PROMPTS}
    plans: list[tuple[str, list[int] | None]] = []
    for p in PROMPTS:
        v = _variants(wants[p])
        plans += [(p, v["exact"]), (p, v["replaced"]), (p, v["unrelated"]), (p, None)]
    gens: list[Any] = []
    waiting = list(plans)
    shared = 0
    while waiting or any(not g.done for g in gens):
        if waiting:  # one joins every step
            prompt, pred = waiting.pop(0)
            gens.append(engine.start(prompt, max_new_tokens=32, prediction=pred))
        events = engine.step([g for g in gens if not g.done])
        shared += any(e is not None and e.record.batch_size > 1 and e.record.reason == "prediction" for e in events)
    assert shared > 0, "no step mixed a predicted sequence with others"
    for (prompt, pred), g in zip(plans, gens):
        assert g.result().token_ids == wants[prompt], (prompt, pred is not None)
    samples = engine.start_many(PROMPTS[0], 3, max_new_tokens=32, prediction=wants[PROMPTS[0]])
    while any(not g.done for g in samples):
        engine.step([g for g in samples if not g.done])
    assert all(g.result().token_ids == wants[PROMPTS[0]] for g in samples)
    assert all(g.result().stats.prediction_accepted >= 28 for g in samples)


# -- the server ----------------------------------------------------------------------------------------------------


@pytest.mark.server
def test_server_takes_the_prediction_field_and_reports_its_tokens(default_pair: tuple[Path, Path]) -> None:
    """On the shipped pair (real text: a tiny random model's output is bytes that do not decode and encode back to
    the same tokens, so its text would not predict its tokens)."""
    import httpx

    from specdec.server import ServerSettings, create_app

    engine = specdec.load(*default_pair)
    app = create_app(engine, ServerSettings(model_name="tiny"))
    plain = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 30, "temperature": 0, "ignore_eos": True}

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            first = await c.post("/v1/completions", json=plain)
            text = first.json()["choices"][0]["text"]
            pred = {
                "type": "content",
                "content": [{"type": "text", "text": text[:10]}, {"type": "text", "text": text[10:]}],
            }
            predicted = await c.post("/v1/completions", json={**plain, "prediction": pred})
            stream = {**plain, "prediction": {"type": "content", "content": text}, "stream": True}
            streamed = await c.post("/v1/completions", json={**stream, "stream_options": {"include_usage": True}})
            bad = await c.post("/v1/completions", json={**plain, "prediction": {"type": "text", "content": "x"}})
            return [first, predicted, streamed, bad]

    try:
        first, predicted, streamed, bad = asyncio.run(main())
    finally:
        app.state.scheduler.stop()
    assert "completion_tokens_details" not in first.json()["usage"]  # no prediction: OpenAI's usage as it was
    body = predicted.json()
    assert body["choices"][0]["text"] == first.json()["choices"][0]["text"]
    details = body["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] >= 25 and details["rejected_prediction_tokens"] >= 0
    assert body["speculative"]["target_passes"] < first.json()["speculative"]["target_passes"]
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == body["choices"][0]["text"]
    assert events[-1]["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] >= 25
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prediction.type"


def test_generate_cli_takes_a_prediction_file(
    default_pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from specdec.cli import main

    models = ["--target", str(default_pair[0]), "--draft", str(default_pair[1])]
    args = ["generate", "def quicksort(arr):", *models, "--max-new-tokens", "48", "--json"]
    assert main([*args, "--tau", "0"]) == 0
    plain = json.loads(capsys.readouterr().out)
    pred = tmp_path / "pred.txt"
    pred.write_text(plain["text"], encoding="utf-8")
    assert main([*args, "--prediction", str(pred)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == plain["token_ids"] and got["stats"]["prediction_accepted"] >= 40
    assert got["stats"]["target_passes"] < 10
    assert main([*args, "--prediction", str(tmp_path / "none.txt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error: --prediction") and err.count("\n") == 1

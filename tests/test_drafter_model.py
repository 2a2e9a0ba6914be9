"""The draft-model drafter: rollback to the shared prefix, and the greedy fast path."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from specdec.drafters.base import ReachRule
from specdec.drafters.model import ModelDrafter, _common_prefix
from specdec.runtime import load_runner
from specdec.sampling import SamplingParams


def test_common_prefix_matches_a_plain_scan() -> None:
    rng = random.Random(0)  # deterministic
    for _ in range(3000):
        a = [rng.randint(0, 3) for _ in range(rng.randint(0, 30))]
        b = [rng.randint(0, 3) for _ in range(rng.randint(0, 30))]
        if rng.random() < 0.5:
            b = a[: rng.randint(0, len(a))] + b
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        assert _common_prefix(a, b) == k, (a, b)


def test_greedy_draft_is_the_argmax_chain_with_its_distributions(tiny_models: dict[str, Path]) -> None:
    runner = load_runner(tiny_models["draft"], device=torch.device("cpu"), dtype="float32")
    drafter = ModelDrafter(runner, runner.vocab_size)
    context = list(range(3, 23))
    gen = torch.Generator().manual_seed(0)
    draft = drafter.propose(drafter.new_state(), context, 5, SamplingParams(), gen)
    # Reference: feed the context, then take the argmax five times.
    cache = runner.new_cache()
    logits = runner.forward(torch.tensor(context), cache, last_only=True)[-1]
    want, tops = [], []
    for _ in range(5):
        tops.append(float(torch.softmax(logits, -1).max()))
        want.append(int(logits.argmax()))
        logits = runner.forward(torch.tensor([want[-1]]), cache, last_only=True)[-1]
    assert draft.tokens.tolist() == want and draft.probs is None  # greedy verification never reads q
    assert draft.confidence == pytest.approx(tops, rel=1e-5)
    # A confidence threshold between the 3rd and the others' top probabilities stops right before it.
    cut = tops[2] + 1e-4
    if all(t > cut for t in tops[:2]):
        stopped = drafter.propose(drafter.new_state(), context, 5, SamplingParams(), gen, min_confidence=cut)
        assert stopped.tokens.tolist() == want[:2]
    none = drafter.propose(drafter.new_state(), context, 5, SamplingParams(), gen, min_confidence=1.01)
    assert none.tokens.numel() == 0
    # Drafting again after two verified tokens reuses the cache: same as a fresh drafter.
    state = drafter.new_state()
    drafter.propose(state, context, 5, SamplingParams(), gen)
    longer = context + want[:2]
    again = drafter.propose(state, longer, 3, SamplingParams(), gen)
    fresh = drafter.propose(drafter.new_state(), longer, 3, SamplingParams(), gen)
    assert again.tokens.tolist() == fresh.tokens.tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_reach_rule_stops_after_the_token_that_drops_the_survival_chance(
    tiny_models: dict[str, Path], temperature: float
) -> None:
    runner = load_runner(tiny_models["draft"], device=torch.device("cpu"), dtype="float32")
    drafter = ModelDrafter(runner, runner.vocab_size)
    context = list(range(3, 23))
    params = SamplingParams(temperature=temperature)
    full = drafter.propose(drafter.new_state(), context, 6, params, torch.Generator().manual_seed(1))
    calls = []
    forward = runner.forward
    runner.forward = lambda *a, **k: (calls.append(1), forward(*a, **k))[1]  # type: ignore[method-assign]
    # Every token is judged 0.6 likely to pass: 0.6, 0.36, 0.216 -> the third takes it below 0.3.
    rule = ReachRule((0.6,) * 10, (0.3,))
    short = drafter.propose(drafter.new_state(), context, 6, params, torch.Generator().manual_seed(1), reach_rule=rule)
    assert short.tokens.tolist() == full.tokens.tolist()[:3]  # the token that crossed is kept
    assert len(short.confidence) == 3 and (short.probs is None) == (temperature == 0.0)
    assert len(calls) == 3  # the context, then two draft forwards: the fourth token's forward never ran
    sure = ReachRule((1.0,) * 10, (0.3,))
    kept = drafter.propose(drafter.new_state(), context, 6, params, torch.Generator().manual_seed(1), reach_rule=sure)
    assert kept.tokens.tolist() == full.tokens.tolist()


def test_reach_rule_reads_the_confidence_by_tenths() -> None:
    rule = ReachRule(tuple(b / 10 for b in range(10)), (0.05, 0.5))
    assert rule.reach(1.0, 0.95) == pytest.approx(0.9)
    assert rule.reach(0.5, 1.0) == pytest.approx(0.45)  # p = 1.0 falls in the top tenth
    assert rule.reach(1.0, 0.0) == 0.0
    assert rule.go_on(0.3, 1) and not rule.go_on(0.3, 2) and not rule.go_on(0.3, 9)  # the last threshold serves deeper
    with pytest.raises(ValueError, match="at least one"):
        ReachRule((0.5,) * 10, ())
    with pytest.raises(ValueError, match="10 entries"):
        ReachRule((0.5,) * 9, (0.1,))

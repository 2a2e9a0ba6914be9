"""The draft-model drafter: state by position, the greedy fast path, draft rules, lockstep over many sequences."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from specdec.drafters.base import Draft, DraftAsk
from specdec.drafters.model import ModelDrafter
from specdec.policy.base import DraftRule, MinConfidence, ReachRule
from specdec.runtime import load_runner
from specdec.sampling import SamplingParams


def _drafter(tiny_models: dict[str, Path]) -> ModelDrafter:
    runner = load_runner(tiny_models["draft"], device=torch.device("cpu"), dtype="float32")
    return ModelDrafter(runner, runner.vocab_size)


def _ask(
    drafter: ModelDrafter,
    context: list[int],
    tau: int,
    params: SamplingParams | None = None,
    seed: int = 0,
    rule: DraftRule | None = None,
    state: object = None,
) -> DraftAsk:
    if state is None:
        state = drafter.new_state()
        drafter.prefill(state, context)
    return DraftAsk(state, context, tau, params or SamplingParams(), torch.Generator().manual_seed(seed), rule)


def _one(drafter: ModelDrafter, ask: DraftAsk) -> Draft:
    return drafter.propose([ask])[0]


def test_greedy_draft_is_the_argmax_chain_with_its_probabilities(tiny_models: dict[str, Path]) -> None:
    drafter = _drafter(tiny_models)
    runner = drafter.runner
    context = list(range(3, 23))
    draft = _one(drafter, _ask(drafter, context, 5))
    # Reference: feed the context, then take the argmax five times.
    cache = runner.new_cache()
    logits = runner.forward(torch.tensor(context), cache, last_only=True)[-1]
    want, tops = [], []
    for _ in range(5):
        tops.append(float(torch.softmax(logits, -1).max()))
        want.append(int(logits.argmax()))
        logits = runner.forward(torch.tensor([want[-1]]), cache, last_only=True)[-1]
    assert draft.tokens == want and draft.probs is None  # greedy verification never reads q
    assert draft.tops == pytest.approx(tops, rel=1e-5)
    assert draft.token_probs == draft.tops  # greedy: the token drawn is the top one
    # A confidence threshold between the 3rd and the others' top probabilities stops right before it.
    cut = tops[2] + 1e-4
    if all(t > cut for t in tops[:2]):
        stopped = _one(drafter, _ask(drafter, context, 5, rule=MinConfidence(cut)))
        assert stopped.tokens == want[:2]
    assert _one(drafter, _ask(drafter, context, 5, rule=MinConfidence(1.01))).tokens == []


def test_rollback_by_position_equals_a_fresh_drafter(tiny_models: dict[str, Path]) -> None:
    drafter = _drafter(tiny_models)
    context = list(range(3, 23))
    first = _ask(drafter, context, 5)
    draft = _one(drafter, first)
    # Two drafts accepted and a correction: the drafter keeps the context and the two accepted tokens.
    drafter.rollback(first.state, len(context) + 2)
    assert first.state.cache.length == len(context) + 2
    longer = context + draft.tokens[:2] + [7]
    again = _one(drafter, _ask(drafter, longer, 3, state=first.state))
    fresh = _one(drafter, _ask(drafter, longer, 3))
    assert again.tokens == fresh.tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_lockstep_over_many_sequences_equals_each_alone(tiny_models: dict[str, Path], temperature: float) -> None:
    """Ragged contexts and τ (0 included), each sequence with its own generator: the batched drafts are
    the solo drafts token for token (the CPU kernel's rows do not depend on each other)."""
    drafter = _drafter(tiny_models)
    params = SamplingParams(temperature=temperature)
    contexts = [list(range(3, 23)), [5, 9, 11], list(range(40, 90)), [17] * 7]
    taus = [5, 0, 3, 7]
    alone = [_one(drafter, _ask(drafter, c, t, params, seed=i)) for i, (c, t) in enumerate(zip(contexts, taus))]
    together = drafter.propose([_ask(drafter, c, t, params, seed=i) for i, (c, t) in enumerate(zip(contexts, taus))])
    for a, b, tau in zip(alone, together, taus):
        assert a.tokens == b.tokens and len(b.tokens) == tau
        assert a.token_probs == b.token_probs
        if temperature > 0 and tau:
            assert b.probs is not None and torch.equal(a.probs, b.probs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_reach_rule_stops_after_the_token_that_drops_the_survival_chance(
    tiny_models: dict[str, Path], temperature: float
) -> None:
    drafter = _drafter(tiny_models)
    context = list(range(3, 23))
    params = SamplingParams(temperature=temperature)
    full = _one(drafter, _ask(drafter, context, 6, params, seed=1))
    ask = _ask(drafter, context, 6, params, seed=1, rule=ReachRule((0.6,) * 10, (0.3,)))
    # Every token is judged 0.6 likely to pass: 0.6, 0.36, 0.216 -> the third takes it below 0.3.
    short = _one(drafter, ask)
    assert short.tokens == full.tokens[:3]  # the token that crossed is kept
    assert len(short.tops) == 3 and (short.probs is None) == (temperature == 0.0)
    # The context, then two draft tokens fed (on the kernel's greedy draft too): the fourth token's forward never ran.
    assert ask.state.cache.length == len(context) + 2
    sure = _ask(drafter, context, 6, params, seed=1, rule=ReachRule((1.0,) * 10, (0.3,)))
    assert _one(drafter, sure).tokens == full.tokens


def test_reach_rule_reads_the_probability_by_tenths() -> None:
    rule = ReachRule(tuple(b / 10 for b in range(10)), (0.05, 0.5))
    assert rule.reach(1.0, 0.95) == pytest.approx(0.9)
    assert rule.reach(0.5, 1.0) == pytest.approx(0.45)  # p = 1.0 falls in the top tenth
    assert rule.reach(1.0, 0.0) == 0.0
    # reach 0.3 after one token (0.3 >= 0.05): go on; after two (0.3·0.3 < 0.5): stop; deeper: the last threshold.
    assert rule.go_on([0.35], [0.35])
    assert not rule.go_on([0.35, 0.95], [0.35, 0.95])
    assert not rule.go_on([0.95] * 9, [0.95] * 9)
    with pytest.raises(ValueError, match="at least one"):
        ReachRule((0.5,) * 10, ())
    with pytest.raises(ValueError, match="10 entries"):
        ReachRule((0.5,) * 9, (0.1,))


def _python_loop(drafter: ModelDrafter, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(drafter.runner), "drafts_natively", property(lambda self: False))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_kernel_greedy_draft_equals_the_python_loop(
    tiny_models: dict[str, Path], dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU kernel's one-call greedy draft (``draft_greedy``) against the drafting loop run a token at a time
    in Python: the same tokens and top probabilities, the same stops under each rule (ReachRule, MinConfidence,
    none), and caches left holding the same tokens with the same keys/values — for ragged τ, several pending
    tokens (after a fully accepted step), a catch-up longer than one kernel chunk, and many sequences at once."""
    from specdec.runtime.native import NativeRunner

    runner = load_runner(tiny_models["draft"], device=torch.device("cpu"), dtype=dtype)
    if not (isinstance(runner, NativeRunner) and runner.drafts_natively):
        pytest.skip("the CPU kernel is not available here")
    drafter = ModelDrafter(runner, runner.vocab_size)
    contexts = [list(range(3, 23)), [5, 9, 11], list(range(40, 90)), [17] * 7, [(7 * i) % 60 + 2 for i in range(200)]]
    taus = [5, 1, 3, 8, 4]
    rules: list[DraftRule | None] = [
        None,
        ReachRule(tuple(0.1 * (b + 1) for b in range(10)), (0.5, 0.3, 0.2)),
        MinConfidence(0.05),  # above the tiny draft's flat top probabilities: the first token computed, dropped
        DraftRule(),
        None,
    ]

    def run(native: bool) -> tuple[list[Draft], list[int], list[torch.Tensor]]:
        if not native:
            _python_loop(drafter, monkeypatch)
        states = [drafter.new_state() for _ in contexts]
        for st, c in zip(states, contexts[:-1]):
            drafter.prefill(st, c)  # the last one starts empty: a 200-token catch-up inside the draft call
        # Sequence 0 as after a fully accepted step: its cache two tokens behind its context.
        states[0].cache.crop(len(contexts[0]) - 3)
        asks = [
            DraftAsk(st, c, tau, SamplingParams(), torch.Generator().manual_seed(0), rule)
            for st, c, tau, rule in zip(states, contexts, taus, rules)
        ]
        drafts = drafter.propose(asks)
        # What each cache holds: the logits of one more token fed at its end.
        after = [runner.forward(torch.tensor([1]), st.cache, last_only=True) for st in states]
        monkeypatch.undo()
        return drafts, [st.cache.length - 1 for st in states], after

    (fast, fast_len, fast_after), (slow, slow_len, slow_after) = run(True), run(False)
    for a, b, tau in zip(fast, slow, taus):
        assert a.tokens == b.tokens and len(a.tokens) <= tau
        assert a.tops == pytest.approx(b.tops, rel=1e-5) and a.token_probs == a.tops and a.probs is None
    assert fast_len == slow_len
    for a, b in zip(fast_after, slow_after):
        assert torch.equal(a, b)  # the same keys and values, bit for bit
    assert len(fast[3].tokens) == taus[3] and len(fast[0].tokens) == taus[0]  # no rule or the base rule: to τ
    assert fast[2].tokens == [] and len(fast[1].tokens) == 1  # dropped at once; reach 0.1 < 0.5 after one


def test_kernel_greedy_draft_stops_where_the_rules_say(tiny_models: dict[str, Path]) -> None:
    """Stops decided inside the kernel: a MinConfidence threshold above every top probability drafts nothing (the
    first token computed, then dropped); ReachRule's depth thresholds cut after the token that crosses them."""
    from specdec.runtime.native import NativeRunner

    drafter = _drafter(tiny_models)
    if not (isinstance(drafter.runner, NativeRunner) and drafter.runner.drafts_natively):
        pytest.skip("the CPU kernel is not available here")
    context = list(range(3, 23))
    none = _ask(drafter, context, 5, rule=MinConfidence(1.01))
    assert _one(drafter, none).tokens == [] and none.state.cache.length == len(context)
    for depth in (1, 2, 4):
        thresholds = (0.9,) * (depth - 1) + (1.1,)  # reach stays 1.0 (table of ones): go on until depth
        ask = _ask(drafter, context, 6, rule=ReachRule((1.0,) * 10, thresholds))
        assert len(_one(drafter, ask).tokens) == depth
        assert ask.state.cache.length == len(context) + depth - 1


def test_kernel_draft_runs_on_the_draft_threads(tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """``set_draft_threads`` (``specdec serve --draft-threads``): the kernel's one-call draft runs on that many
    threads, every compute thread without it, and drafts the same tokens either way."""
    from specdec.runtime import native_kernel as nk
    from specdec.runtime.native import NativeRunner

    runner = load_runner(tiny_models["draft"], device=torch.device("cpu"), dtype="float32")
    if not (isinstance(runner, NativeRunner) and runner.drafts_natively):
        pytest.skip("the CPU kernel is not available here")
    seen: list[int] = []
    scratch_for = nk.FusedLlama._scratch_for

    def spy(self: Any, k: int, threads: int) -> torch.Tensor:
        seen.append(threads)
        return scratch_for(self, k, threads)

    monkeypatch.setattr(nk.FusedLlama, "_scratch_for", spy)
    monkeypatch.setattr(nk, "_DRAFT_THREADS", None)
    drafter = ModelDrafter(runner, runner.vocab_size)
    context = list(range(3, 40))

    def draft() -> list[int]:
        state = drafter.new_state()
        drafter.prefill(state, context)
        ask = DraftAsk(state, context, 4, SamplingParams(), torch.Generator().manual_seed(0), None)
        return drafter.propose([ask])[0].tokens

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        every = draft()
        assert seen[-1] == 2
        nk.set_draft_threads(1)
        assert draft() == every and seen[-1] == 1
    finally:
        torch.set_num_threads(before)

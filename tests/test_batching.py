"""Continuous batching: many requests share each draft and target pass, losslessly.

Every greedy output must equal the request's solo target-only output whatever it is batched with (ragged
τ including 0, joins and leaves mid-flight, different prompt lengths, EOS, stop strings, budgets,
cancellation); sampled requests must keep their distribution and a seeded one its output.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specdec
from specdec.engine import Engine, Generation
from specdec.sampling import SamplingParams

PROMPTS = [
    "def fibonacci(n):",
    "x",
    "import os\nimport sys\n\n\ndef main(argv):\n    for i, line in enumerate(open(argv[1])):\n        print(i, line)\n",
    "class Node:\n    def __init__(self, value, next=None):\n",
    "if __name__ == '__main__':",
    "return [y for y in",
]


@pytest.fixture(scope="module")
def engine(tiny_models: dict[str, Path]) -> Engine:
    e = specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32")
    assert e.target.batches, "the tiny checkpoints should run on the CPU kernel, which batches"
    return e


_SOLO: dict[tuple[int, int, str | None], list[int]] = {}


def solo(engine: Engine, prompt: int, max_new: int, stop: str | None = None) -> list[int]:
    """The request alone, target-only, greedy, one target pass a step (``Engine.chain_plain`` 1)."""
    key = (prompt, max_new, stop)
    if key not in _SOLO:
        chain, engine.chain_plain = engine.chain_plain, 1
        try:
            _SOLO[key] = engine.generate(PROMPTS[prompt], max_new_tokens=max_new, tau=0, stop=stop).token_ids
        finally:
            engine.chain_plain = chain
    return _SOLO[key]


def run_schedule(
    engine: Engine,
    arrivals: list[tuple[int, dict[str, Any]]],
    cancel: dict[int, int] | None = None,
    on_step: Callable[[list[Generation]], None] | None = None,
) -> list[Generation]:
    """Start request j (``engine.start(**kwargs)``) before step ``arrivals[j][0]``; cancel request j before
    step ``cancel[j]``; step every unfinished request together until all are done."""
    gens: list[Generation | None] = [None] * len(arrivals)
    step = 0
    while step <= max(a for a, _ in arrivals) or any(g is not None and not g.done for g in gens):
        for j, (at, kwargs) in enumerate(arrivals):
            if at == step:
                gens[j] = engine.start(**kwargs)
        for j, at in (cancel or {}).items():
            g = gens[j]
            if at == step and g is not None:
                g.cancel()
        active = [g for g in gens if g is not None and not g.done]
        if active:
            engine.step(active)
            if on_step is not None:
                on_step(active)
        step += 1
        assert step < 10_000
    return [g for g in gens if g is not None]


def test_greedy_outputs_equal_solo_runs_in_a_mixed_batch(engine: Engine) -> None:
    arrivals = [
        (0, dict(prompt=PROMPTS[0], max_new_tokens=40, tau=4)),
        (0, dict(prompt=PROMPTS[2], max_new_tokens=30, tau=0)),  # fallback-like: one row
        (0, dict(prompt=PROMPTS[1], max_new_tokens=25, policy="adaptive")),
        (2, dict(prompt=PROMPTS[3], max_new_tokens=35, tau=7)),  # joins mid-flight
        (3, dict(prompt=PROMPTS[4], max_new_tokens=12, tau=2)),  # leaves early
        (3, dict(prompt=PROMPTS[0], max_new_tokens=40, tau=1, stop="\n")),
        (4, dict(prompt=PROMPTS[5], max_new_tokens=40, tau=3, max_verify_passes=4)),
        (1, dict(prompt=PROMPTS[2], max_new_tokens=40, tau=5)),  # cancelled below
        (5, dict(prompt=PROMPTS[3], max_new_tokens=20, policy="heuristic")),
    ]
    shapes: list[tuple[int, int]] = []

    def record_shape(active: list[Generation]) -> None:
        last = [g.records[-1] for g in active if g.records]
        shapes.append((last[0].batch_size, last[0].rows))

    gens = run_schedule(engine, arrivals, cancel={7: 4}, on_step=record_shape)
    for j, ((_, kw), g) in enumerate(zip(arrivals, gens)):
        prompt = PROMPTS.index(kw["prompt"])
        want = solo(engine, prompt, kw["max_new_tokens"], kw.get("stop"))
        if j == 7:
            assert g.stats.finish_reason == "cancelled" and g.new_tokens == want[: len(g.new_tokens)]
        elif "max_verify_passes" in kw:
            assert g.stats.target_passes <= kw["max_verify_passes"]
            assert g.new_tokens == want[: len(g.new_tokens)]
            assert g.stats.finish_reason in ("verify_budget", "length", "stop")
        else:
            assert g.new_tokens == want, (j, kw)
            assert g.result().text == engine.generate(**{**kw, "tau": 0, "policy": None}).text
    assert max(b for b, _ in shapes) >= 6, shapes  # requests really shared passes
    assert any(rows > b for b, rows in shapes)  # with drafts: ragged blocks in one pass
    for g in gens:
        for rec in g.records:
            assert rec.rows >= rec.batch_size >= 1 and rec.rows >= rec.tau + 1


def test_step_records_carry_the_batch_and_the_budget(engine: Engine) -> None:
    gens = [
        engine.start(PROMPTS[0], max_new_tokens=8, tau=3, max_verify_passes=5),
        engine.start(PROMPTS[1], max_new_tokens=8, tau=0),
        engine.start(PROMPTS[3], max_new_tokens=8, tau=2),
    ]
    engine.step(gens)
    recs = [g.records[0] for g in gens]
    assert all(r.batch_size == 3 for r in recs)
    assert all(r.rows == sum(x.tau + 1 for x in recs) for r in recs)
    assert recs[0].max_verify_passes == 5 and recs[0].verify_passes == 1 and recs[1].max_verify_passes is None
    assert recs[1].tau == 0 and recs[1].tau_planned == 0 and recs[0].tau_planned == 3
    assert all(r.drafting == sum(x.tau > 0 for x in recs) for r in recs)


def test_a_records_policy_time_is_the_policys_own_work_in_its_rest(engine: Engine) -> None:
    """A record's ``policy_time`` is the part of its ``other_time`` that was the policies' own work: the learning after
    its request's previous step and this step's plan. A policy that takes 30 ms over the plan of the third step and
    20 ms over learning the fourth: the third step's records carry the plan, the fifth's the learning (it runs after
    the fourth step is taken), whatever else a step's rest holds."""
    from specdec.policy.fixed import FixedPolicy

    class Slow(FixedPolicy):
        def __init__(self) -> None:
            super().__init__(tau=2)
            self.plans = self.learnt = 0

        def plan(self, ctxs: Any, other_rows: int = 0, prompt_rows: int = 0) -> Any:
            self.plans += 1
            if self.plans == 3:
                time.sleep(0.03)
            return super().plan(ctxs, other_rows, prompt_rows)

        def observe_step(self, records: Any) -> None:
            self.learnt += 1
            if self.learnt == 4:
                time.sleep(0.02)

    slow = Slow()
    gens = [engine.start(PROMPTS[i], max_new_tokens=40, policy=slow, defer_prefill=False) for i in (0, 3)]
    for _ in range(5):
        engine.step(gens)
    for g in gens:
        times = [r.policy_time for r in g.records]
        assert all(0.0 <= r.policy_time <= r.other_time for r in g.records)
        assert 0.03 <= times[2] < 0.04 and 0.02 <= times[4] < 0.03
        assert all(t < 0.005 for i, t in enumerate(times) if i not in (2, 4))
        assert g.records[2].other_time >= 0.03 and g.records[4].other_time >= 0.02


def test_time_a_request_was_set_aside_is_no_part_of_its_rest(engine: Engine) -> None:
    """``Generation.set_aside``: a caller that holds a request out of its steps for a while (a benchmark stepping
    other policies' batches in turn) takes that time out of the next record's rest, and only the next one's."""
    gens = [engine.start(PROMPTS[i], max_new_tokens=40, tau=2, defer_prefill=False) for i in (0, 3)]
    engine.step(gens)
    time.sleep(0.05)
    engine.step(gens)  # not set aside: the 50 ms are in the rest
    assert all(g.records[1].other_time >= 0.05 for g in gens)
    time.sleep(0.05)
    for g in gens:
        g.set_aside(0.05)
    engine.step(gens)
    engine.step(gens)
    for g in gens:
        assert 0.0 <= g.records[2].other_time < 0.02 and 0.0 <= g.records[3].other_time < 0.02
    # Set aside for a round that held another request's prefill (a server's rotated round, a request admitted in it):
    # that prefill is in the time set aside, and is not taken out of the rest again (which went negative, and a
    # server's metrics refused the negative seconds).
    held = gens[0]
    t0 = engine.clock()
    other = engine.start(PROMPTS[2], max_new_tokens=4, tau=2, defer_prefill=False)
    held.set_aside(engine.clock() - t0)
    engine.step([held])
    assert held.records[-1].other_time >= 0.0
    other.cancel()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(
            st.integers(0, 6),  # arrival step
            st.integers(0, len(PROMPTS) - 1),  # prompt
            st.integers(0, 6),  # tau (0: one row of plain decoding)
            st.integers(1, 14),  # max_new_tokens
        ),
        min_size=1,
        max_size=7,
    ),
    st.sampled_from([0, 12, 1000]),  # prompts up to this long are prefilled by their first step
    st.sampled_from([1, 1, 4]),  # target passes a plain step may chain (Engine.chain_plain)
)
def test_random_schedules_keep_every_greedy_output_identical_to_its_solo_run(
    engine: Engine, schedule: list[tuple[int, int, int, int]], prefill_in_step: int, chain: int
) -> None:
    arrivals = [(at, dict(prompt=PROMPTS[p], max_new_tokens=n, tau=tau)) for at, p, tau, n in schedule]
    engine.prefill_in_step, engine.chain_plain = prefill_in_step, chain
    try:
        gens = run_schedule(engine, arrivals)
    finally:
        engine.prefill_in_step, engine.chain_plain = 0, 1
    for (_, p, _, n), g in zip(schedule, gens):
        assert g.new_tokens == solo(engine, p, n)


def test_a_seeded_sampled_request_gives_the_same_output_whatever_it_is_batched_with(engine: Engine) -> None:
    """With a fixed τ, each request draws from its own generator in the same order alone or batched."""
    kw = dict(prompt=PROMPTS[0], max_new_tokens=24, tau=3, temperature=1.0, top_k=20, seed=11)
    alone = engine.generate(**kw).token_ids
    others = [
        (0, dict(prompt=PROMPTS[2], max_new_tokens=30, tau=5, temperature=0.7, seed=3)),
        (0, dict(prompt=PROMPTS[1], max_new_tokens=10, tau=0)),
        (1, dict(prompt=PROMPTS[3], max_new_tokens=40, tau=2, temperature=1.0, top_p=0.9)),
    ]
    gens = run_schedule(engine, [*others[:2], (0, kw), others[2]])
    assert gens[2].new_tokens == alone


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings",
    [dict(temperature=1.0, top_k=8), dict(temperature=1.0)],  # torch's verdicts; the CPU kernel's (temperature only)
    ids=["top_k", "temperature"],
)
def test_sampled_requests_in_batches_follow_the_target_distribution(
    tiny_models: dict[str, Path], settings: dict[str, Any]
) -> None:
    """600 seeded requests run 20 at a time through shared steps, with ragged τ: the joint distribution of
    the first three tokens is the target's (chi-square against the exact enumeration, p > 1e-3; fixed
    seeds, so deterministic; the false-failure rate on a correct implementation is 1e-3 per setting)."""
    from specdec.testing import tiny_checkpoint
    from test_distribution import P_THRESHOLD, chi2_pvalue, exact_joint

    soft = tiny_checkpoint(
        Path(tiny_models["llama"]).parent / "soft-batch", "llama", seed=0, tokenizer_from=tiny_models["llama"]
    )
    e = specdec.load(tiny_models["llama"], soft, dtype="float32")
    assert e.target.batches
    e.eos_ids = frozenset()  # exactly three tokens every time
    prompt = e.encode("def fibonacci(n):")
    joint = exact_joint(tiny_models["llama"], prompt, SamplingParams(**settings))
    n, counts, drafted, accepted = 600, {}, 0, 0
    for first in range(0, n, 20):
        gens = [e.start(prompt, max_new_tokens=3, tau=1 + s % 3, seed=s, **settings) for s in range(first, first + 20)]
        while any(not g.done for g in gens):
            e.step(gens)
        for g in gens:
            key = tuple(g.new_tokens)
            counts[key] = counts.get(key, 0) + 1
            drafted += g.stats.drafted
            accepted += g.stats.accepted
            assert all(r.batch_size > 1 for r in g.records[:1])
    assert 0.05 < accepted / drafted < 0.95, "the draft should be partly accepted for this test to mean anything"
    assert chi2_pvalue(counts, joint, n) > P_THRESHOLD


def test_a_failing_step_leaves_the_other_requests_intact(engine: Engine) -> None:
    """A step that raises (here: the target pass) puts every sequence back; stepped again they go on exactly."""
    gens = [engine.start(PROMPTS[p], max_new_tokens=20, tau=3) for p in (0, 3)]
    engine.step(gens)
    forward_blocks = engine.target.forward_blocks

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected failure")

    engine.target.forward_blocks = broken  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="injected"):
            engine.step(gens)
    finally:
        engine.target.forward_blocks = forward_blocks  # type: ignore[method-assign]
    while any(not g.done for g in gens):
        engine.step(gens)
    assert [g.new_tokens for g in gens] == [solo(engine, 0, 20), solo(engine, 3, 20)]


def test_a_batched_pass_gives_each_row_the_logits_it_gets_alone(engine: Engine) -> None:
    """The runtime contract the step relies on: ragged blocks of several sequences in one pass, each row
    bit for bit what the sequence's block gives alone."""
    target = engine.target
    torch.manual_seed(0)
    prompts = [torch.randint(1, target.vocab_size, (n,)) for n in (1, 9, 30, 4)]
    blocks = [torch.randint(1, target.vocab_size, (k,)) for k in (1, 4, 7, 2)]
    alone = []
    for p, b in zip(prompts, blocks):
        c = target.new_cache()
        target.forward(p, c)
        alone.append(target.forward(b, c))
    caches = []
    for p in prompts:
        c = target.new_cache()
        target.forward(p, c)
        caches.append(c)
    together = target.forward_batch(list(zip(blocks, caches)))
    for a, t, c, p, b in zip(alone, together, caches, prompts, blocks):
        assert torch.equal(a, t) and c.length == len(p) + len(b)


def test_a_block_can_bring_its_prompt_into_the_pass(engine: Engine) -> None:
    """A request whose prefill joins a step: its block is [prompt..., draft...] in the shared pass, and only
    its last rows' logits are kept; they and the cache it leaves are bit for bit those of a prefill pass of
    its own followed by the block."""
    target = engine.target
    torch.manual_seed(1)
    prompt = torch.randint(1, target.vocab_size, (23,))
    block = torch.randint(1, target.vocab_size, (4,))
    other_prompt, other_block = torch.randint(1, target.vocab_size, (9,)), torch.randint(1, target.vocab_size, (3,))
    alone = target.new_cache()
    target.forward(prompt, alone)
    want = target.forward(block, alone)
    other = target.new_cache()
    target.forward(other_prompt, other)
    other_want = target.forward_batch([(other_block, other)])[0]
    other.crop(len(other_prompt))
    joined = target.new_cache()
    got, other_got = target.forward_batch(
        [(torch.cat([prompt, block]), joined), (other_block, other)], keep=[len(block), len(other_block)]
    )
    assert torch.equal(got, want) and torch.equal(other_got, other_want)
    assert joined.length == len(prompt) + len(block)
    # The cache it leaves behind serves the next block as a prefilled one does.
    nxt = torch.randint(1, target.vocab_size, (2,))
    joined.crop(len(prompt) + 1)
    alone.crop(len(prompt) + 1)
    assert torch.equal(target.forward(nxt, joined), target.forward(nxt, alone))
    with pytest.raises(ValueError, match="keep"):
        target.forward_batch([(block, target.new_cache()), (block, target.new_cache())], keep=[1])


@pytest.fixture
def prefill_in_step(engine: Engine) -> Any:
    """The engine with prompts of up to 1,000 tokens prefilled by their first step (put back afterwards)."""
    engine.prefill_in_step = 1000
    yield engine
    engine.prefill_in_step = 0


def test_prompts_prefilled_in_their_first_step_keep_every_output(prefill_in_step: Engine) -> None:
    engine = prefill_in_step
    arrivals = [
        (0, dict(prompt=PROMPTS[2], max_new_tokens=30, tau=3)),
        (0, dict(prompt=PROMPTS[1], max_new_tokens=20, tau=0)),
        (1, dict(prompt=PROMPTS[3], max_new_tokens=25, policy="adaptive")),  # joins a running batch
        (1, dict(prompt=PROMPTS[0], max_new_tokens=25, tau=5, stop="\n")),
        (3, dict(prompt=PROMPTS[5], max_new_tokens=20, tau=2, max_verify_passes=3)),
        (2, dict(prompt=PROMPTS[4], max_new_tokens=30, tau=4)),  # cancelled before its first step
    ]
    gens = run_schedule(engine, arrivals, cancel={5: 2})
    for j, ((_, kw), g) in enumerate(zip(arrivals, gens)):
        want = solo(engine, PROMPTS.index(kw["prompt"]), kw["max_new_tokens"], kw.get("stop"))
        if j == 5:
            assert g.stats.finish_reason == "cancelled" and g.new_tokens == [] and not g.records
            continue
        assert g.new_tokens == (want if j != 4 else want[: len(g.new_tokens)]), (j, kw)
        first = g.records[0]
        # Its prompt came into the first step's pass: the rows say so, and no pass of its own ran at start.
        assert first.rows >= len(g.prompt_ids) + first.tau
        assert g.stats.prefill_time < 0.05
        if first.tau:
            assert first.draft_fed >= len(g.prompt_ids)  # the drafter took the prompt in at its first forward
    assert gens[4].stats.target_passes <= 3
    # n samples of one prompt share one prefill, at start.
    engine.prefill_in_step = 1000
    samples = engine.start_many(PROMPTS[0], 3, max_new_tokens=6, tau=2)
    assert all(s.cache.length == len(s.prompt_ids) - 1 for s in samples)
    while any(not s.done for s in samples):
        engine.step(samples)
    assert all(s.new_tokens == solo(engine, 0, 6) for s in samples)


def test_a_seeded_sampled_request_is_the_same_with_its_prefill_in_the_step(prefill_in_step: Engine) -> None:
    engine = prefill_in_step
    kw = dict(prompt=PROMPTS[3], max_new_tokens=20, tau=3, temperature=1.0, top_k=20, seed=5)
    deferred = engine.generate(**kw)
    assert deferred.records[0].rows > 4
    engine.prefill_in_step = 0
    assert engine.generate(**kw).token_ids == deferred.token_ids


def test_a_long_prompt_comes_in_pieces_within_each_step_s_budget(prefill_in_step: Engine) -> None:
    """With a prompt budget of 24 tokens per step, a 76-token prompt is taken in over several steps (pieces with no
    record, then its first step with the rest), first come first served, while the requests already running go
    on stepping; every step's pass stays within the budget plus the running rows, and every output is its solo
    output. Drafting requests' draft caches take the same pieces in (no long draft catch-up later)."""
    engine = prefill_in_step
    engine.prefill_in_step = 24
    running = [engine.start(PROMPTS[p], max_new_tokens=30, tau=3) for p in (1, 4)]
    assert sum(len(g.prompt_ids) - 1 for g in running) <= 24, [len(g.prompt_ids) for g in running]
    engine.step(running)  # both short prompts fit the budget: they step at once
    assert all(len(g.records) == 1 for g in running)
    long_one = engine.start(PROMPTS[2], max_new_tokens=20, tau=4)  # 76 tokens
    short_one = engine.start(PROMPTS[0], max_new_tokens=20, tau=2)  # waits behind it (first come first served)
    gens = [*running, long_one, short_one]
    pieces = 0
    while not long_one.records:
        before = long_one.cache.length
        events = engine.step(gens)
        if long_one.records:  # the rest of its prompt came with its first step
            break
        assert events[2] is None and events[3] is None and not short_one.records
        assert long_one.cache.length - before == 24  # one piece: the whole budget
        assert long_one.draft_state.cache.length == long_one.cache.length  # the draft took the piece in too
        assert all(e is not None for e in events[:2])  # the running requests stepped meanwhile
        assert events[0].record.rows <= 24 + 2 * 4
        pieces += 1
        if pieces > 10:
            raise AssertionError("the long prompt never finished coming in")
    assert pieces == (len(long_one.prompt_ids) - 2) // 24
    first = long_one.records[0]
    assert first.draft_fed <= 24 + 1 + first.batch_size * 2  # the rest of its prompt only, not all of it
    while any(not g.done for g in gens):
        engine.step(gens)
    for g, p in zip(gens, (1, 4, 2, 0)):
        assert g.new_tokens == solo(engine, p, g.max_new_tokens)


def test_a_plain_request_s_prompt_is_never_taken_into_the_draft_model(prefill_in_step: Engine) -> None:
    """A request at τ = 0 never drafts: its prompt's pieces go into the target's cache alone (the drafting request
    beside it takes its own in), in the steps and in a prefill of its own, and its output is its solo output."""
    engine = prefill_in_step
    engine.prefill_in_step = 24
    plain = engine.start(PROMPTS[2], max_new_tokens=12, tau=0)  # 76 tokens: in pieces
    drafting = engine.start(PROMPTS[2], max_new_tokens=12, tau=3)
    gens = [plain, drafting]
    while any(not g.done for g in gens):
        engine.step(gens)
        if not plain.done:
            assert plain.draft_state.cache.length == 0
    assert drafting.records[0].draft_fed <= 24 + 1 + 2 * 2  # it took its pieces in as they came
    engine.prefill_in_step = 0  # a prefill of its own, at start
    alone = engine.start(PROMPTS[2], max_new_tokens=12, tau=0)
    assert alone.draft_state.cache.length == 0 and alone.cache.length == len(alone.prompt_ids) - 1
    while not alone.done:
        engine.step([alone])
    assert plain.new_tokens == drafting.new_tokens == alone.new_tokens == solo(engine, 2, 12)


def test_a_request_joining_after_the_drafts_gets_its_first_token_from_that_pass(prefill_in_step: Engine) -> None:
    """``Engine.step``'s ``join`` (a server's requests that arrived while the step drafted): each joining request whose
    prompt fits the step's prompt budget takes it in through the step's target pass and gets its first token there,
    with no draft; one whose prompt does not fit (here: the budget of 40 tokens less what the step already took) is
    not stepped and steps from the next step. Every output is its solo output; the events come in the order given,
    the joining ones last; the joined record's times are the step's and its rest is not negative."""
    engine = prefill_in_step
    engine.prefill_in_step = 40
    running = [engine.start(PROMPTS[p], max_new_tokens=24, tau=3) for p in (1, 4)]
    engine.step(running)
    late: list[Generation] = []

    def join() -> list[Generation]:  # started here, after the plan, as a server admits them
        assert not late, "join is called once a step"
        late.extend(
            [
                engine.start(PROMPTS[0], max_new_tokens=20, tau=2),  # 5 prompt tokens: fits
                engine.start(PROMPTS[2], max_new_tokens=20, tau=3),  # 76: beyond the budget, steps next time
                engine.start(PROMPTS[5], max_new_tokens=20, policy="adaptive"),  # fits what is left
                # seeded sampling: steps from the next step, so its draws are those it makes alone
                engine.start(PROMPTS[3], max_new_tokens=12, tau=2, temperature=0.9, seed=11),
            ]
        )
        return late

    events = engine.step(running, join)
    assert len(events) == len(running) + len(late) == 6
    # Every record's rest is what ran before the plan or after the pass: never negative (the joining requests' own
    # start, timed as prefill after the plan, was once taken off the others').
    assert all(e.record.other_time >= 0.0 for e in events if e is not None)
    assert all(e is not None for e in events[:2])
    taken, left_out, taken2, seeded = events[2:]
    assert left_out is None and not late[1].records and late[1].cache.length == 0
    assert seeded is None and not late[3].records
    for e, g in ((taken, late[0]), (taken2, late[2])):
        assert e is not None and e.record.tau == 0 and e.record.reason == "joined after the step's drafts"
        assert len(e.record.emitted) == 1 and g.new_tokens == e.record.emitted
        assert e.record.prompt_rows == events[0].record.prompt_rows > 0  # the shared pass's prompt rows
        assert e.record.other_time >= 0.0 and e.record.draft_time == events[0].record.draft_time
    gens = [*running, *late]
    while any(not g.done for g in gens):
        engine.step(gens, lambda: [])
    for g, p in zip(gens, (1, 4, 0, 2, 5)):
        assert g.new_tokens == solo(engine, p, g.max_new_tokens), p
    alone = engine.generate(PROMPTS[3], max_new_tokens=12, tau=2, temperature=0.9, seed=11)
    assert late[3].new_tokens == alone.token_ids
    # A step with nothing left to step still admits what joins: it steps next time, from its start.
    newcomer = engine.start(PROMPTS[3], max_new_tokens=6, tau=2)
    assert engine.step(gens, lambda: [newcomer]) == [None] * 7 and not newcomer.records
    while not newcomer.done:
        engine.step([newcomer])
    assert newcomer.new_tokens == solo(engine, 3, 6)


def test_an_observer_that_fails_loses_no_step(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    """A trace or metrics observer raising on a step or a finished request is logged; the step still returns every
    event and the tokens stay committed once (a failure there once ended the step half closed: a server stepped the
    requests again, alone, and their streams lost that step's text)."""

    class Broken:
        def on_step(self, record: Any) -> None:
            raise ValueError("counter went negative")

        def on_request(self, summary: Any) -> None:
            raise ValueError("counter went negative")

    broken = Broken()
    engine.observers.append(broken)
    try:
        gens = [engine.start(PROMPTS[p], max_new_tokens=8, tau=2) for p in (0, 3)]
        with caplog.at_level("ERROR", logger="specdec.engine"):
            while any(not g.done for g in gens):
                live = [not g.done for g in gens]
                events = engine.step(gens)
                assert all(e is not None for e, was_live in zip(events, live) if was_live)
    finally:
        engine.observers.remove(broken)
    for g, p in zip(gens, (0, 3)):
        assert g.new_tokens == solo(engine, p, 8)
        assert sum(len(r.emitted) for r in g.records) == len(g.new_tokens)
    assert "observer Broken failed on on_step" in caplog.text and "on_request" in caplog.text


@pytest.fixture
def chained(engine: Engine) -> Any:
    """The engine with plain greedy steps chaining up to 3 target passes (put back afterwards)."""
    engine.chain_plain = 3
    yield engine
    engine.chain_plain = 1


def test_chained_plain_steps_keep_every_output_and_count_their_passes(chained: Engine) -> None:
    engine = chained
    want = {
        j: solo(engine, p, n, stop)
        for j, (p, n, stop) in enumerate(
            [(0, 40, None), (2, 30, None), (0, 40, "\n"), (5, 40, None), (1, 9, None), (3, 25, None)]
        )
    }
    arrivals = [
        (0, dict(prompt=PROMPTS[0], max_new_tokens=40, tau=0)),  # chains
        (0, dict(prompt=PROMPTS[2], max_new_tokens=30, tau=3)),  # drafts: one pass a step
        (1, dict(prompt=PROMPTS[0], max_new_tokens=40, tau=0, stop="\n")),  # a stop string inside a chain
        (2, dict(prompt=PROMPTS[5], max_new_tokens=40, tau=0, max_verify_passes=7)),  # the budget cuts a chain
        (3, dict(prompt=PROMPTS[1], max_new_tokens=9, tau=0)),  # 9 tokens: the last chain is cut to what is left
        (4, dict(prompt=PROMPTS[3], max_new_tokens=25, policy="adaptive")),
    ]
    mixed: list[int] = []

    def one_pass_where_any_drafts(active: list[Generation]) -> None:
        step = [g.records[-1] for g in active if g.records]
        if any(r.tau for r in step):  # a step that drafts chains nothing (not even its plain sequences)
            mixed.append(max(r.target_passes for r in step))

    gens = run_schedule(engine, arrivals, on_step=one_pass_where_any_drafts)
    assert mixed and set(mixed) == {1}
    for j, g in enumerate(gens):
        if j == 3:
            assert g.stats.target_passes <= 7 and g.new_tokens == want[j][: len(g.new_tokens)]
            assert g.stats.finish_reason in ("verify_budget", "length", "stop")
        else:
            assert g.new_tokens == want[j], j
        assert sum(r.target_passes for r in g.records) == g.stats.target_passes
        assert g.records[-1].verify_passes == g.stats.target_passes
        for r in g.records:
            assert r.target_passes == 1 or r.tau == 0
            assert len(r.emitted) <= r.n_accepted + r.target_passes
    plain = gens[0].records
    assert max(r.target_passes for r in plain) == 3 and len(plain) < gens[0].stats.new_tokens
    assert all(r.target_passes == 1 for r in gens[1].records)  # a drafting request never chains
    assert sum(len(r.emitted) for r in gens[4].records) == 9


def test_a_trace_of_chained_steps_passes_the_consistency_checks(chained: Engine, tmp_path: Path) -> None:
    from specdec.diagnose.consistency import check_steps
    from specdec.trace import JsonlTrace, read_trace

    path = tmp_path / "t.jsonl"
    sink = JsonlTrace(path)
    chained.observers.append(sink)
    try:
        run_schedule(
            chained,
            [
                (0, dict(prompt=PROMPTS[0], max_new_tokens=30, tau=0)),
                (1, dict(prompt=PROMPTS[2], max_new_tokens=20, tau=2)),
            ],
        )
    finally:
        chained.observers.remove(sink)
        sink.close()
    trace = read_trace(path)
    assert any(s.target_passes > 1 for s in trace.steps)
    found = check_steps(trace)
    assert found.total == 0, found.examples
    # a record that claims more tokens than its passes allow is caught
    bad = [s for s in trace.steps if s.target_passes > 1][0]
    bad.target_passes = 1
    assert check_steps(trace).counts.get("too_many_emitted") == 1


def test_chained_sampled_steps_draw_what_one_pass_a_step_draws(engine: Engine) -> None:
    """Seeded sampled requests (several settings) chain their plain steps beside greedy and drafting ones: each draws
    the same tokens as with one pass a step, and as alone (its draws from its own generator, in the same order)."""
    sampled = [
        dict(prompt=PROMPTS[0], max_new_tokens=30, tau=0, temperature=1.0, seed=7),
        dict(prompt=PROMPTS[2], max_new_tokens=25, tau=0, temperature=0.8, top_k=40, seed=8),
        dict(prompt=PROMPTS[3], max_new_tokens=30, tau=0, temperature=1.2, top_p=0.9, seed=9, stop="\n"),
        dict(prompt=PROMPTS[5], max_new_tokens=7, tau=0, temperature=0.7, seed=10),  # its last chain cut short
        dict(prompt=PROMPTS[1], max_new_tokens=30, tau=0, temperature=1.0, seed=11, max_verify_passes=9),
    ]
    others = [
        (0, dict(prompt=PROMPTS[4], max_new_tokens=30, tau=0)),  # greedy, chains beside them
        (6, dict(prompt=PROMPTS[2], max_new_tokens=12, tau=2, temperature=0.9, seed=12)),  # drafts: one pass steps
    ]
    arrivals = [(j, kw) for j, kw in enumerate(sampled)] + others
    runs = {}
    for chain in (1, 4):
        engine.chain_plain = chain
        try:
            runs[chain] = [g.new_tokens for g in run_schedule(engine, arrivals)]
            if chain == 4:
                gens = run_schedule(engine, arrivals)
        finally:
            engine.chain_plain = 1
    assert runs[4] == runs[1]
    assert [g.new_tokens for g in gens] == runs[1]  # and again: nothing carried over from run to run
    chained = [r for g in gens[: len(sampled)] for r in g.records if r.target_passes > 1]
    assert chained and all(r.tau == 0 for r in chained)
    for g in gens:
        assert sum(r.target_passes for r in g.records) == g.stats.target_passes
    assert gens[4].stats.target_passes <= 9
    for kw, g in zip(sampled, gens):
        assert engine.generate(**kw).token_ids == g.new_tokens  # alone, one pass a step

"""Prefix caching: a prompt that begins as an earlier request's context did copies those keys and values instead of
computing them, and nothing about its output changes.

The store's bookkeeping (blocks found only through the prefix before them, least recently used leaves evicted first,
the capacity held), the CPU kernel's promise that makes it exact (a reused prefix gives the logits a whole prefill
gives, bit for bit), and the engine over it: greedy outputs equal to target-only solo runs with the cache warm,
through random batched schedules with shared prefixes and prompts prefilled in the steps, multi-turn prompts, seeded
samples and their drafts unchanged, n samples, prompt scores (echo) computed rather than copied; the options' errors;
the server's usage, /metrics and /health.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specdec
from specdec.engine import Engine, Generation
from specdec.errors import InvalidRequestError
from specdec.runtime.native import NativeRunner
from specdec.runtime.prefix_cache import BLOCK, PrefixCache

# ---------------------------------------------------------------------------------------------------------------
# The store alone (fake cache tensors: [layers, 2, kv_heads, positions, head_dim], each position's values its token)


def fake_kv(tokens: list[int], positions: int = 128) -> torch.Tensor:
    kv = torch.zeros(2, 2, 1, positions, 4)
    for p, t in enumerate(tokens):
        kv[:, :, :, p, :] = float(t)
    return kv


BLOCK_BYTES = 2 * 2 * 1 * BLOCK * 4 * 4  # one block of the fake tensors


def test_a_block_is_found_only_through_the_prefix_before_it() -> None:
    store = PrefixCache(1 << 20)
    a, b = list(range(1, 1 + BLOCK)), list(range(100, 100 + BLOCK))
    assert store.store(fake_kv(a + b + [7, 7]), a + b + [7, 7]) == 2  # the partial block is not kept
    out = torch.full((2, 2, 1, 128, 4), -1.0)
    assert store.restore(out, a + b + [9]) == 2 * BLOCK
    assert torch.equal(out[:, :, :, : 2 * BLOCK], fake_kv(a + b)[:, :, :, : 2 * BLOCK])
    assert (out[:, :, :, 2 * BLOCK :] == -1).all()  # nothing past the hit is written
    assert store.restore(torch.zeros(2, 2, 1, 128, 4), b + a) == 0  # b's block exists, but after a, not first
    assert store.restore(torch.zeros(2, 2, 1, 128, 4), a[:-1] + [999] + b) == 0  # one token off in the first block
    assert store.restore(torch.zeros(2, 2, 1, 128, 4), a + b[:-1]) == BLOCK  # the second block is not whole
    assert store.stats.hit_tokens == 3 * BLOCK and store.stats.stored_blocks == 2
    assert store.store(fake_kv(a + b), a + b) == 0  # kept already: nothing copied again


def test_the_least_recently_used_leaf_goes_first_and_the_capacity_holds() -> None:
    store = PrefixCache(3 * BLOCK_BYTES)
    chain = [list(range(k * BLOCK, (k + 1) * BLOCK)) for k in range(1, 5)]
    root, child = chain[0], chain[1]
    store.store(fake_kv(root + child), root + child)  # root -> child
    other = chain[2]
    store.store(fake_kv(other), other)  # a second root: 3 blocks, full
    assert store.bytes == 3 * BLOCK_BYTES
    # Use root -> child again: `other` is now the least recently used leaf, and goes for a new block.
    assert store.restore(torch.zeros(2, 2, 1, 128, 4), root + child) == 2 * BLOCK
    store.store(fake_kv(chain[3]), chain[3])
    assert store.bytes <= 3 * BLOCK_BYTES and store.stats.evicted_blocks == 1
    assert store.restore(torch.zeros(2, 2, 1, 128, 4), other) == 0
    assert store.restore(torch.zeros(2, 2, 1, 128, 4), root + child) == 2 * BLOCK
    # A chain longer than the capacity keeps what fits of its start and never evicts the block it hangs from.
    small = PrefixCache(2 * BLOCK_BYTES)
    long = [t for blk in chain for t in blk]
    assert small.store(fake_kv(long), long) == 2
    assert small.restore(torch.zeros(2, 2, 1, 128, 4), long) == 2 * BLOCK
    # A parent is never evicted before its children: fill with leaves under one root, then evict by new roots.
    tree = PrefixCache(4 * BLOCK_BYTES)
    for leaf in chain[1:]:
        tree.store(fake_kv(root + leaf), root + leaf)
    for k in range(3):
        fresh = list(range(1000 + k * BLOCK, 1000 + (k + 1) * BLOCK))
        tree.store(fake_kv(fresh), fresh)
        kept = list(tree._blocks.values())
        assert tree.stats.evicted_blocks == k + 1 and len(kept) == 4
        # every block kept still hangs from a kept parent, which counts it among its children
        assert all(b.parent is None or tree._blocks.get(b.parent.key) is b.parent for b in kept)
        assert all(b.children == sum(c.parent is b for c in kept) for b in kept)
    with pytest.raises(ValueError, match="positive capacity"):
        PrefixCache(0)


# ---------------------------------------------------------------------------------------------------------------
# The runner: a reused prefix gives the logits a whole prefill gives, bit for bit (the CPU kernel)


@pytest.fixture(scope="module")
def runners(tiny_models: dict[str, Path], default_pair: tuple[Path, Path]) -> dict[str, NativeRunner]:
    out = {
        "tiny fp32": NativeRunner.from_pretrained(tiny_models["llama"], dtype=torch.float32),
        "default target bf16": NativeRunner.from_pretrained(default_pair[0], dtype=torch.bfloat16),
    }
    for r in out.values():
        assert r.backend == "cpu-kernel"
        r.enable_prefix_cache(64 << 20)
    return out


@pytest.mark.parametrize("name", ["tiny fp32", "default target bf16"])
def test_a_reused_prefix_gives_the_logits_a_whole_prefill_gives(runners: dict[str, NativeRunner], name: str) -> None:
    r = runners[name]
    assert r.prefix_cache is not None
    r.prefix_cache.clear()
    rng = random.Random(3)
    vocab = min(r.vocab_size, 300)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    def next_logits(tokens: list[int], reuse: bool) -> tuple[torch.Tensor, int]:
        cache = r.new_cache()
        n = r.reuse_prefix(cache, tokens[:-1]) if reuse else 0
        if len(tokens) - 1 > n:
            r.forward(torch.tensor(tokens[n:-1]), cache, last_only=True)
        out = r.forward(torch.tensor(tokens[-1:]), cache)
        r.release(cache, tokens[:-1])
        return out, n

    base = fresh(3 * BLOCK + 5)
    want, hit = next_logits(base, reuse=False)  # kept on release
    assert hit == 0 and len(r.prefix_cache) == 3
    for tokens, expect_hit in [
        (base, 3 * BLOCK),  # the same prompt again
        (base[: 2 * BLOCK + 1], 2 * BLOCK),  # a prefix of it, ending on a block boundary
        (base[:BLOCK], 0),  # shorter than its first whole block of tokens before the last
        (base + fresh(40), 3 * BLOCK),  # a continuation (a conversation's next turn)
        (base[:BLOCK] + fresh(2 * BLOCK), BLOCK),  # shares only the first block
        (fresh(1) + base[1:], 0),  # differs in its first token: nothing after it can be reused
    ]:
        got, n = next_logits(tokens, reuse=True)
        assert n == expect_hit, (len(tokens), n)
        if tokens == base:
            assert torch.equal(got, want)
        ref_cache = r.new_cache()
        r.forward(torch.tensor(tokens[:-1]), ref_cache, last_only=True)
        assert torch.equal(got, r.forward(torch.tensor(tokens[-1:]), ref_cache)), (len(tokens), n)
    # A cache that already holds part of the prompt (computed, or found earlier) is extended from where it is, on and
    # off block boundaries; what it holds beyond the kept prefix stays; each way the logits are a whole prefill's.
    for held in (3, BLOCK, BLOCK + 5, 3 * BLOCK, 3 * BLOCK + 2):
        part = r.new_cache()
        r.forward(torch.tensor(base[:held]), part, last_only=True)
        assert r.reuse_prefix(part, base[:-1]) == max(held, 3 * BLOCK), held
        if part.length < len(base) - 1:
            r.forward(torch.tensor(base[part.length : -1]), part, last_only=True)
        assert torch.equal(r.forward(torch.tensor(base[-1:]), part), want), held


# ---------------------------------------------------------------------------------------------------------------
# The engine


@pytest.fixture(scope="module")
def engines(tiny_models: dict[str, Path]) -> dict[str, Engine]:
    return {
        "cached": specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32", prefix_cache=16),
        "plain": specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32"),
    }


SHARED = [(7 * k) % 250 + 5 for k in range(3 * BLOCK + 3)]  # a "system prompt" of 51 token ids
PROMPTS = [
    SHARED + [11, 12, 13],
    SHARED + [40, 41],
    SHARED[: BLOCK + 2] + [90, 91, 92, 93],
    SHARED[:20],
    [201, 202, *SHARED[2:30]],
    SHARED + SHARED[:BLOCK] + [77],
]
_SOLO: dict[tuple[int, int], list[int]] = {}


def solo(engines: dict[str, Engine], prompt: list[int], max_new: int) -> list[int]:
    """The prompt alone, target-only, greedy, on the engine without a prefix cache."""
    key = (hash(tuple(prompt)), max_new)
    if key not in _SOLO:
        _SOLO[key] = engines["plain"].generate(prompt, max_new_tokens=max_new, tau=0).token_ids
    return _SOLO[key]


def test_greedy_outputs_with_a_warm_prefix_cache_equal_target_only(engines: dict[str, Engine]) -> None:
    engine = engines["cached"]
    store = engine.target.prefix_cache
    assert store is not None and engine.drafter is not None and engine.drafter.runner.prefix_cache is not None
    store.clear()
    cold = engine.generate(PROMPTS[0], max_new_tokens=20, tau=3)
    assert cold.stats.cached_tokens == 0 and cold.token_ids == solo(engines, PROMPTS[0], 20)
    for i, prompt in enumerate(PROMPTS):
        for tau in (0, 2, 5):
            got = engine.generate(prompt, max_new_tokens=20, tau=tau)
            assert got.token_ids == solo(engines, prompt, 20), (i, tau)
            assert got.stats.cached_tokens % BLOCK == 0 and got.stats.cached_tokens <= len(prompt) - 1
    again = engine.generate(PROMPTS[1], max_new_tokens=20, tau=3)
    assert again.stats.cached_tokens == 3 * BLOCK  # the shared 51 tokens: three whole blocks
    # A conversation's next turn: the prompt is the last one's prompt and output, and more.
    first = engine.generate(PROMPTS[1], max_new_tokens=40, tau=4)
    turn = [*PROMPTS[1], *first.token_ids, 9, 10, 11]
    second = engine.generate(turn, max_new_tokens=20, tau=4)
    assert second.token_ids == solo(engines, turn, 20)
    assert second.stats.cached_tokens >= (len(PROMPTS[1]) + len(first.token_ids) - 1) // BLOCK * BLOCK


def test_seeded_samples_and_their_drafts_are_the_same_with_the_prefix_cache(engines: dict[str, Engine]) -> None:
    """The reused keys and values are the computed ones: the draft model proposes the same tokens with the same
    probabilities, and a seeded sampled request draws the same output."""
    kw: dict[str, Any] = dict(max_new_tokens=24, tau=3, temperature=1.0, top_k=30, seed=7)
    engines["cached"].generate(PROMPTS[0], **kw)  # warm
    got = engines["cached"].generate(PROMPTS[1], **kw)
    want = engines["plain"].generate(PROMPTS[1], **kw)
    assert got.stats.cached_tokens > 0
    assert got.token_ids == want.token_ids
    assert [r.draft_tokens for r in got.records] == [r.draft_tokens for r in want.records]
    assert [r.draft_token_probs for r in got.records] == [r.draft_token_probs for r in want.records]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(
            st.integers(0, 5),  # arrival step
            st.integers(0, len(PROMPTS) - 1),  # prompt
            st.integers(0, 5),  # tau
            st.integers(1, 12),  # max_new_tokens
        ),
        min_size=1,
        max_size=7,
    ),
    st.sampled_from([0, 12, 1000]),  # prompts up to this long are prefilled by their first step (in pieces beyond)
    st.booleans(),  # start with an empty prefix cache
)
def test_random_batched_schedules_with_shared_prefixes_keep_every_output(
    engines: dict[str, Engine], schedule: list[tuple[int, int, int, int]], prefill_in_step: int, cold: bool
) -> None:
    engine = engines["cached"]
    if cold:
        assert engine.target.prefix_cache is not None
        engine.target.prefix_cache.clear()
    engine.prefill_in_step = prefill_in_step
    gens: list[Generation | None] = [None] * len(schedule)
    try:
        step = 0
        while step <= max(a for a, *_ in schedule) or any(g is not None and not g.done for g in gens):
            for j, (at, p, tau, n) in enumerate(schedule):
                if at == step:
                    gens[j] = engine.start(PROMPTS[p], max_new_tokens=n, tau=tau)
            active = [g for g in gens if g is not None and not g.done]
            if active:
                engine.step(active)
            step += 1
            assert step < 1000
    finally:
        engine.prefill_in_step = 0
    for (_, p, _, n), g in zip(schedule, gens):
        assert g is not None and g.new_tokens == solo(engines, PROMPTS[p], n)


@pytest.mark.parametrize("prefill_in_step", [24, 1000])
def test_requests_arriving_together_with_a_new_preamble_compute_it_once(
    engines: dict[str, Engine], monkeypatch: pytest.MonkeyPatch, prefill_in_step: int
) -> None:
    """Four requests sharing a preamble nobody has sent before start together (their prompts taken in by the steps,
    in pieces of 24 tokens or whole): the first computes the preamble's rows, the others wait for them and copy its
    blocks (target and draft) as soon as they are in its cache, not when it finishes; every output is its solo run's."""
    engine = engines["cached"]
    target, draft = engine.target.prefix_cache, engine.drafter.runner.prefix_cache  # type: ignore[union-attr]
    assert target is not None and draft is not None
    target.clear()
    draft.clear()
    rng = random.Random(prefill_in_step)
    preamble = [rng.randrange(3, 250) for _ in range(5 * BLOCK + 7)]
    prompts = [preamble + [rng.randrange(3, 250) for _ in range(3 + 2 * j)] for j in range(4)]
    rows = {"target": 0}  # of the target's passes
    inner = engine.target.forward_blocks

    def forward_blocks(blocks: Any, *a: Any, **kw: Any) -> Any:
        rows["target"] += sum(len(ids) for ids, _ in blocks)
        return inner(blocks, *a, **kw)

    monkeypatch.setattr(engine.target, "forward_blocks", forward_blocks)
    draft_hits = draft.stats.hit_tokens
    engine.prefill_in_step = prefill_in_step
    try:
        gens = [engine.start(p, max_new_tokens=8, tau=3) for p in prompts]
        first_steps = [0] * len(gens)
        steps = 0
        while any(not g.done for g in gens):
            steps += 1
            engine.step([g for g in gens if not g.done])
            for j, g in enumerate(gens):
                if g.new_tokens and not first_steps[j]:
                    first_steps[j] = steps
            assert steps < 100
    finally:
        engine.prefill_in_step = 0
    for p, g in zip(prompts, gens):
        assert g.new_tokens == solo(engines, p, 8)
    shared = len(preamble) // BLOCK * BLOCK
    assert [g.stats.cached_tokens for g in gens] == [0] + [shared] * 3
    # Prompt rows computed: the first prompt's, and only the others' tails (beyond the shared whole blocks).
    prompt_rows = sum(len(p) - 1 for p in prompts) - 3 * shared
    assert rows["target"] <= prompt_rows + steps * len(gens) * (3 + 1)  # and each step's blocks: last token + drafts
    assert rows["target"] < sum(len(p) - 1 for p in prompts)
    assert draft.stats.hit_tokens - draft_hits >= 3 * shared  # the draft model's rows of it copied likewise
    # The later requests start as soon as the preamble is in and the budget takes their rests in (in pieces).
    rests = sum(len(p) - 1 - shared for p in prompts[1:])
    assert max(first_steps[1:]) <= first_steps[0] + -(-rests // prefill_in_step), first_steps


def test_a_prompt_sharing_little_with_one_taken_in_beside_it_does_not_wait(engines: dict[str, Engine]) -> None:
    """Two prompts sharing their first block (a chat template's header) and then 60 tokens each, started together,
    both fitting the step's budget: waiting a step would save the second a sixth of its rows, so both are taken in by
    the first step."""
    engine = engines["cached"]
    rng = random.Random(5)
    header = [rng.randrange(3, 250) for _ in range(BLOCK + 3)]
    prompts = [header + [rng.randrange(3, 250) for _ in range(60)] for _ in range(2)]
    engine.prefill_in_step = 1000
    try:
        gens = [engine.start(p, max_new_tokens=4, tau=2) for p in prompts]
        engine.step(gens)
        assert all(g.new_tokens for g in gens)  # both emitted in the first step
        while any(not g.done for g in gens):
            engine.step([g for g in gens if not g.done])
    finally:
        engine.prefill_in_step = 0
    assert all(g.new_tokens == solo(engines, p, 4) for g, p in zip(gens, prompts))


def test_prompts_prefilled_at_start_are_shared_before_their_requests_finish(engines: dict[str, Engine]) -> None:
    """Without a prompt budget (``--max-batch 1``, ``Engine.generate``) each prompt is prefilled when its request
    starts: requests started one after another behind a new preamble find it kept, target's and draft's, while the
    first is still running."""
    engine = engines["cached"]
    draft = engine.drafter.runner.prefix_cache  # type: ignore[union-attr]
    assert draft is not None
    rng = random.Random(11)
    preamble = [rng.randrange(3, 250) for _ in range(4 * BLOCK + 1)]
    prompts = [preamble + [rng.randrange(3, 250) for _ in range(4)] for _ in range(3)]
    hits = draft.stats.hit_tokens
    gens = [engine.start(p, max_new_tokens=6, tau=2) for p in prompts]
    assert [g.stats.cached_tokens for g in gens] == [0, 4 * BLOCK, 4 * BLOCK]
    assert draft.stats.hit_tokens - hits == 2 * 4 * BLOCK
    while any(not g.done for g in gens):
        engine.step([g for g in gens if not g.done])
    assert all(g.new_tokens == solo(engines, p, 6) for g, p in zip(gens, prompts))


def test_n_samples_and_scored_prompts(engines: dict[str, Engine]) -> None:
    engine = engines["cached"]
    engine.generate(PROMPTS[0], max_new_tokens=4, tau=2)  # warm
    samples = engine.start_many(PROMPTS[1], 3, max_new_tokens=10, tau=2)
    # The first sample's prefill found the shared prefix; its siblings copy its cache (counted once, at the first).
    assert [s.stats.cached_tokens for s in samples] == [3 * BLOCK, 0, 0]
    while any(not s.done for s in samples):
        engine.step([s for s in samples if not s.done])
    assert all(s.new_tokens == solo(engines, PROMPTS[1], 10) for s in samples)
    # Prompt scores (echo with logprobs) need every prompt row's logits: computed, none copied, and the same.
    scored = engine.generate(PROMPTS[1], max_new_tokens=5, tau=2, prompt_logprobs=2)
    plain = engines["plain"].generate(PROMPTS[1], max_new_tokens=5, tau=2, prompt_logprobs=2)
    assert scored.stats.cached_tokens == 0
    assert scored.prompt_logprobs == plain.prompt_logprobs and scored.token_ids == plain.token_ids


def test_prefix_cache_options(tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("lots", -3, 1.5, True):
        with pytest.raises(InvalidRequestError, match="prefix_cache must be") as info:
            specdec.load(tiny_models["llama"], prefix_cache=bad)  # type: ignore[arg-type]
        assert info.value.param == "prefix_cache"
    for off in (None, "off", 0, "0"):
        assert specdec.load(tiny_models["llama"], dtype="float32", prefix_cache=off).target.prefix_cache is None
    on = specdec.load(tiny_models["llama"], dtype="float32", prefix_cache="auto").target.prefix_cache
    assert on is not None and on.capacity_bytes == 512 << 20
    # Where it would not be exact, an asked-for size is refused and "auto" is off.
    with pytest.raises(InvalidRequestError, match="transformers"):
        specdec.load(tiny_models["llama"], runtime="hf", prefix_cache=8)
    assert specdec.load(tiny_models["llama"], runtime="hf", prefix_cache="auto").target.prefix_cache is None
    import specdec.runtime.native_kernel as nk

    monkeypatch.setenv(nk.ENV_SWITCH, "0")  # the operator path
    nk._load.cache_clear()
    try:
        with pytest.raises(InvalidRequestError, match="needs the CPU kernel"):
            specdec.load(tiny_models["llama"], dtype="float32", prefix_cache=8)
        assert specdec.load(tiny_models["llama"], dtype="float32", prefix_cache="auto").target.prefix_cache is None
    finally:
        monkeypatch.undo()
        nk._load.cache_clear()


def test_serve_refuses_a_bad_prefix_cache_in_one_line(tiny_models: dict[str, Path]) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "serve", "--target", str(tiny_models["llama"]), "--prefix-cache", "x"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and "prefix_cache must be" in lines[0], r.stderr


# ---------------------------------------------------------------------------------------------------------------
# The server


@pytest.mark.server
def test_the_server_reports_cached_prompt_tokens(tiny_models: dict[str, Path]) -> None:
    pytest.importorskip("fastapi")
    import httpx

    from specdec.server import ServerSettings, create_app

    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32", prefix_cache=16)
    app = create_app(engine, ServerSettings(model_name="tiny", max_batch=4))
    prompt = [int(t) for t in SHARED] + [3, 4, 5]

    async def main() -> tuple[list[dict[str, Any]], str, dict[str, Any]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            bodies = []
            for _ in range(2):
                r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0})
                assert r.status_code == 200, r.text
                bodies.append(r.json())
            metrics = (await client.get("/metrics")).text
            health = (await client.get("/health")).json()
            return bodies, metrics, health

    try:
        (first, second), metrics, health = asyncio.run(main())
    finally:
        app.state.scheduler.stop()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 3 * BLOCK}
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert f"specdec_prompt_cached_tokens_total {3 * BLOCK:.1f}" in metrics
    assert health["prefix_cache"]["hit_tokens"] == 3 * BLOCK and health["prefix_cache"]["capacity_mib"] == 16


@pytest.mark.server
def test_the_prefix_cache_benchmark_runs_both_servers_side_by_side(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """benchmarks/prefix_cache.py against two spawned servers over the tiny pair: every output the same on both, the
    cached server finding the preamble, the earlier turns and a wave's preamble, the other nothing."""
    preamble = tmp_path / "preamble.txt"
    preamble.write_text("def helper(x):\n    return x * 2\n\n" * 6)
    out = tmp_path / "prefix.json"
    models = f"--target {tiny_models['llama']} --draft {tiny_models['draft']} --dtype float32"
    args = ["--serve-args", models, "--concurrency", "2", "--requests", "6", "--turns", "3", "--rounds", "1"]
    args += ["--max-tokens", "8", "--preamble-file", str(preamble), "--json", str(out)]
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "prefix_cache.py"
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["identity"] == {"requests": 24, "differing": 0}
    share = {(r["workload"], r["server"]): r["cached_share"] for r in report["rows"]}
    assert not any(v for (w, server), v in share.items() if server.endswith("off") or w == "unique"), share
    assert share[("preamble", "--prefix-cache auto")] > 0.3 and share[("turns", "--prefix-cache auto")] > 0.2
    # waves of two requests sent together behind a preamble new to the server: the second copies the first's
    assert share[("burst", "--prefix-cache auto")] > 0.2

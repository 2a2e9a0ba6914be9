"""``n > 1``: n independent samples of one prompt, prefilled once (``Engine.start_many``), each exactly
distributed; and the server's ``n`` (choices by index, usage summed, streaming per index, limits).

Statistical tests use fixed seeds (stated in each docstring) and reject at p < 1e-3 (``P_THRESHOLD``), so each
outcome is deterministic; their false-failure rates over the choice of seeds are stated with them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

import specdec
from specdec.engine import Engine, Generation, sample_seed
from specdec.errors import InvalidRequestError
from specdec.runtime.base import ModelRunner
from specdec.sampling import SamplingParams
from test_distribution import P_THRESHOLD, Law, chi2_pvalue, exact_joint

PROMPT = "def fibonacci(n):"


def run_all(engine: Engine, gens: list[Generation]) -> list[list[int]]:
    """Step the samples together (one batched step for all of them) until every one is done."""
    while not all(g.done for g in gens):
        engine.step(gens)
    return [g.result().token_ids for g in gens]


# -- forks -------------------------------------------------------------------------------------------------


@pytest.mark.identity
def test_forked_caches_equal_a_fresh_prefill(tiny_models: dict[str, Path], runtime_name: str) -> None:
    """A forked cache gives the logits a fresh prefill gives, and is independent of its source; greedy samples
    continued from forks are the solo greedy output, on every runtime."""
    runtime = runtime_name.split("-")[0]
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32", runtime=runtime)
    backend = getattr(engine.target, "backend", "transformers")
    assert backend.startswith(
        {"hf": "transformers", "native-kernel": "cpu-kernel", "native-torch": "torch-"}[runtime_name]
    )
    target = engine.target
    ids = engine.encode(PROMPT)
    head, nxt, other = torch.tensor(ids[:-1]), torch.tensor(ids[-1:]), torch.tensor([5, 6, 7])
    base = target.new_cache()
    target.forward(head, base, last_only=True)
    fork = target.fork_cache(base, ids[:-1])
    assert fork.length == base.length == len(ids) - 1
    target.forward(other, fork)  # writes positions the source also writes next: it must not see them
    fresh = target.new_cache()
    target.forward(head, fresh, last_only=True)
    want = target.forward(nxt, fresh)
    assert torch.equal(target.forward(nxt, base), want)
    fork.crop(len(ids) - 1)
    assert torch.equal(target.forward(nxt, fork), want)
    # The default for runtimes that cannot copy (prefill again) holds the same.
    again = ModelRunner.fork_cache(target, base, ids)
    assert again.length == len(ids)
    assert (target.forward(other, again) - target.forward(other, base)).abs().max() < 1e-4  # one block vs two

    solo = engine.generate(PROMPT, max_new_tokens=24, tau=3)
    gens = engine.start_many(PROMPT, 3, max_new_tokens=24, tau=3)
    assert run_all(engine, gens) == [solo.token_ids] * 3
    assert [g.result().text for g in gens] == [solo.text] * 3


@pytest.mark.parametrize("kind", ["model", "prompt_lookup"])
def test_start_many_prefills_once(tiny_models: dict[str, Path], kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """n samples cost one target prefill (and one draft prefill), not n; ids are ``<id>-<j>``."""
    if kind == "model":
        engine = specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32")
        runners = {"target": engine.target, "draft": engine.drafter.runner}  # type: ignore[union-attr]
    else:
        engine = specdec.load(tiny_models["llama"], prompt_lookup=True, dtype="float32")
        runners = {"target": engine.target}
    calls = {name: 0 for name in runners}
    for name, runner in runners.items():

        def counting(*args: Any, _f: Any = runner.forward, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _f(*args, **kwargs)

        monkeypatch.setattr(runner, "forward", counting)
    gens = engine.start_many(PROMPT, 5, max_new_tokens=4, request_id="req")
    assert calls == {name: 1 for name in runners}
    assert [g.request_id for g in gens] == [f"req-{j}" for j in range(5)]
    assert engine.start_many(PROMPT, 1, max_new_tokens=4, request_id="solo")[0].request_id == "solo"
    assert all(g.cache is not gens[0].cache for g in gens[1:])
    for g in gens:
        g.cancel()


def test_start_many_refuses_bad_n(tiny_models: dict[str, Path]) -> None:
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32")
    for bad in (0, -2, 1.5, True):
        with pytest.raises(InvalidRequestError) as e:
            engine.start_many(PROMPT, bad, max_new_tokens=4)  # type: ignore[arg-type]
        assert e.value.param == "n"


# -- seeds ---------------------------------------------------------------------------------------------------


@pytest.mark.distribution
def test_seeded_samples_are_reproducible_and_distinct(tiny_models: dict[str, Path]) -> None:
    """Same seed, same n outputs; sample 0 is what n=1 gives; each sample has its own generator stream.

    Seed 7, temperature 1, 16 tokens: two distinct streams give the same 16 tokens with negligible probability."""
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32")
    kw: dict[str, Any] = dict(max_new_tokens=16, temperature=1.0, seed=7, tau=3)
    a = run_all(engine, engine.start_many(PROMPT, 4, **kw))
    b = run_all(engine, engine.start_many(PROMPT, 4, **kw))
    assert a == b
    assert a[0] == engine.generate(PROMPT, **kw).token_ids
    assert len({tuple(x) for x in a}) == 4
    assert a != run_all(engine, engine.start_many(PROMPT, 4, **{**kw, "seed": 8}))
    seeds = [sample_seed(7, j) for j in range(4)]
    assert seeds[0] == 7 and len(set(seeds)) == 4 and seeds == [sample_seed(7, j) for j in range(4)]
    assert sample_seed(None, 3) is None
    # Without a seed each sample draws fresh entropy.
    unseeded = run_all(engine, engine.start_many(PROMPT, 4, **{**kw, "seed": None}))
    assert len({tuple(x) for x in unseeded}) == 4


def test_cli_generate_n(tiny_models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """``specdec generate --n 3 --json``: one line per sample, sample j what ``start_many`` gives; bad combinations
    are one line on stderr, exit 2."""
    from specdec.cli import main

    models = ["--target", str(tiny_models["llama"]), "--draft", str(tiny_models["draft"]), "--dtype", "float32"]
    sampling = ["--temperature", "1", "--seed", "4", "--max-new-tokens", "8"]
    assert main(["generate", PROMPT, *models, *sampling, "--n", "3", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32")
    want = run_all(engine, engine.start_many(PROMPT, 3, temperature=1.0, seed=4, max_new_tokens=8))
    assert [x["index"] for x in lines] == [0, 1, 2]
    assert [x["token_ids"] for x in lines] == want
    for bad, message in [(["--n", "0"], "n must be a positive integer"), (["--n", "2", "--stream"], "--stream")]:
        assert main(["generate", PROMPT, *models, *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("specdec: error:") and message in err and "Traceback" not in err


# -- distribution ----------------------------------------------------------------------------------------------

DIST = SamplingParams(temperature=0.8, top_p=0.8)


@pytest.fixture(scope="module")
def two_token_law(tiny_models: dict[str, Path]) -> tuple[list[int], Law]:
    from specdec.api import load_tokenizer

    prompt = list(load_tokenizer(tiny_models["llama"])(PROMPT)["input_ids"])
    return prompt, exact_joint(tiny_models["llama"], prompt, DIST, depth=2)


def equal_mass_bins(probs: dict[int, float], k: int) -> dict[int, int]:
    """Tokens -> k bins of about equal mass (tokens taken in order of probability), for a well-powered test."""
    bins, mass = {}, 0.0
    for tok, p in sorted(probs.items(), key=lambda kv: -kv[1]):
        bins[tok] = min(k - 1, int(mass * k))
        mass += p
    return bins


@pytest.mark.slow
@pytest.mark.distribution
def test_n_samples_follow_the_target_law_and_are_independent(tiny_models: dict[str, Path], two_token_law: Any) -> None:
    """160 requests of n=8 (seeds 0..159, samples j > 0 seeded by ``sample_seed``), two tokens each, drafted with
    partial acceptance (about 40% at temperature 0.8, top-p 0.8): the 1,280 samples' first two tokens follow
    the exact target-only joint (enumerated with transformers in fp32), and each position its marginal; and
    samples of one request are independent: over the pairs (sample 2i, sample 2i+1) of every request (640
    pairs), the first tokens' bins (4 bins of about equal mass) follow the product of the bins' masses.
    Four chi-square tests at 1e-3: false-failure rate ≤ 4e-3 over seeds."""
    prompt, joint = two_token_law
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32")
    engine.eos_ids = frozenset()  # exactly two tokens every time
    requests, n = 160, 8
    samples: list[list[list[int]]] = []
    drafted = accepted = 0
    for seed in range(requests):
        gens = engine.start_many(
            prompt, n, max_new_tokens=2, tau=2, seed=seed, temperature=DIST.temperature, top_p=DIST.top_p
        )
        samples.append(run_all(engine, gens))
        drafted += sum(g.stats.drafted for g in gens)
        accepted += sum(g.stats.accepted for g in gens)
    assert 0.05 < accepted / drafted < 0.95, "the draft should be partly accepted for this test to mean anything"
    counts: dict[tuple, int] = {}
    for s in (tuple(s) for request in samples for s in request):
        counts[s] = counts.get(s, 0) + 1
    assert all(len(k) == 2 for k in counts)
    assert chi2_pvalue(counts, joint, requests * n) > P_THRESHOLD
    marginals = joint.marginals()
    for pos, marg in enumerate(marginals):
        cnt: dict[int, int] = {}
        for k, c in counts.items():
            cnt[k[pos]] = cnt.get(k[pos], 0) + c
        assert chi2_pvalue(cnt, marg, requests * n) > P_THRESHOLD, f"position {pos + 1}"
    bins = equal_mass_bins(marginals[0], 4)
    mass = [sum(p for t, p in marginals[0].items() if bins[t] == b) for b in range(4)]
    assert min(mass) > 0.15, mass
    pairs: dict[tuple, int] = {}
    for request in samples:
        for i in range(0, n, 2):
            key = (bins[request[i][0]], bins[request[i + 1][0]])
            pairs[key] = pairs.get(key, 0) + 1
    product = {(a, b): mass[a] * mass[b] for a in range(4) for b in range(4)}
    assert chi2_pvalue(pairs, product, requests * n // 2) > P_THRESHOLD


# -- server ----------------------------------------------------------------------------------------------------

openai = pytest.importorskip("openai")
from test_server import API_KEY, MODEL, long_context, served, with_chat_template  # noqa: E402

MAX_BATCH = 4


@pytest.fixture(scope="module")
def n_models(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    import shutil

    root = tmp_path_factory.mktemp("nserve")
    target = long_context(with_chat_template(tiny_models["llama"], root / "llama"))
    draft = root / "draft"
    shutil.copytree(tiny_models["draft"], draft)
    return target, long_context(draft)


@pytest.fixture(scope="module")
def n_server(n_models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("nserver") / "server.log"
    with served(*n_models, log, "--api-key", API_KEY, "--max-batch", str(MAX_BATCH)) as url:
        yield url


@pytest.fixture(scope="module")
def n_client(n_server: str) -> Any:
    return openai.OpenAI(base_url=f"{n_server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def n_engine(n_models: tuple[Path, Path]) -> Engine:
    """The same models in-process (as the server loads them): what its n samples must reproduce."""
    return specdec.load(*n_models)


@pytest.mark.server
def test_server_n_samples_match_the_engine(n_client: Any, n_engine: Engine) -> None:
    """n=3 seeded sampling: choices 0..2, each the engine's sample j (same seeds, the extensions top_k and min_p
    passed on), usage summed."""
    resp = n_client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=11, n=3, extra_body={"top_k": 20, "min_p": 0.5}
    )
    want = n_engine.start_many(PROMPT, 3, max_new_tokens=20, temperature=1.0, top_k=20, min_p=0.5, seed=11)
    run_all(n_engine, want)
    results = [g.result() for g in want]
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [r.text for r in results]
    assert [c.finish_reason for c in resp.choices] == [r.finish_reason for r in results]
    assert len({c.text for c in resp.choices}) == 3
    assert resp.usage.prompt_tokens == len(results[0].prompt_ids)
    assert resp.usage.completion_tokens == sum(len(r.token_ids) for r in results)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    spec = resp.model_extra["speculative"]
    assert [c["drafted"] for c in spec["choices"]] == [r.stats.drafted for r in results]
    assert spec["drafted"] == sum(r.stats.drafted for r in results)
    assert spec["target_passes"] == sum(r.stats.target_passes for r in results)


@pytest.mark.server
def test_server_streams_each_choice_by_index(n_client: Any) -> None:
    """A streamed n=3 request: every index's chunks join to the non-streamed text of the same seed, each index
    ends with one finish reason, and the usage chunk sums all three."""
    kw: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=12, n=3)
    whole = n_client.completions.create(**kw)
    chunks = list(n_client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts: dict[int, str] = {}
    finish: dict[int, list[str]] = {}
    for ch in chunks[:-1]:
        assert len(ch.choices) == 1
        c = ch.choices[0]
        assert finish.get(c.index) is None, "a chunk after its choice's finish reason"
        texts[c.index] = texts.get(c.index, "") + c.text
        if c.finish_reason is not None:
            finish[c.index] = [c.finish_reason]
    assert texts == {c.index: c.text for c in whole.choices}
    assert {j: f[0] for j, f in finish.items()} == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.server
def test_server_greedy_n_equals_solo_and_chat(n_client: Any, n_engine: Engine) -> None:
    """Greedy n=2: both choices are the solo greedy output (completions and chat)."""
    solo = n_engine.generate(PROMPT, max_new_tokens=16)
    resp = n_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, n=2)
    assert [c.text for c in resp.choices] == [solo.text] * 2
    assert resp.usage.completion_tokens == 2 * len(solo.token_ids)
    messages = [{"role": "user", "content": "hello"}]
    one = n_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    two = n_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.message.content for c in two.choices] == [one.choices[0].message.content] * 2
    stream = list(
        n_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, n=2, stream=True)
    )
    for j in range(2):
        mine = [ch.choices[0] for ch in stream if ch.choices and ch.choices[0].index == j]
        assert "".join(c.delta.content or "" for c in mine) == one.choices[0].message.content
        assert mine[-1].finish_reason == one.choices[0].finish_reason


@pytest.mark.server
def test_server_refuses_best_of_and_too_many_samples(n_client: Any) -> None:
    for kwargs, param in [
        ({"best_of": 2}, "best_of"),
        ({"n": 2, "best_of": 3}, "best_of"),
        ({"n": MAX_BATCH + 1}, "n"),  # beyond this server's --max-batch
        ({"n": 17}, "n"),  # beyond the schema's bound
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            n_client.completions.create(model=MODEL, prompt="x", max_tokens=2, **kwargs)
        assert e.value.status_code == 400
        assert e.value.body["param"] == param, e.value.body
    ok = n_client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2, best_of=2, temperature=0)
    assert len(ok.choices) == 2


@pytest.mark.server
def test_server_concurrent_n_requests_match_sequential(n_server: str) -> None:
    """Requests of n = 1, 2 and 3 (greedy, and seeded sampling) streamed by 8 clients at once, so their samples
    share batched steps (and rotate: --max-batch 4): every choice's streamed text is what the same request gets
    alone, not streamed."""
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def body(i: int) -> dict[str, Any]:
        b: dict[str, Any] = {"model": MODEL, "prompt": f"{PROMPT} {i}", "max_tokens": 12 + i, "n": 1 + i % 3}
        b.update(temperature=0) if i % 2 == 0 else b.update(temperature=1.0, seed=100 + i)
        return b

    def streamed(i: int) -> list[str]:
        oai = openai.OpenAI(base_url=f"{n_server}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        b = body(i)
        out = [""] * b["n"]
        for ch in oai.completions.create(stream=True, **b):
            out[ch.choices[0].index] += ch.choices[0].text
        return out

    with httpx.Client(base_url=n_server, headers=headers, timeout=120) as http:
        alone = [[c["text"] for c in http.post("/v1/completions", json=body(i)).json()["choices"]] for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(streamed, range(8)))
    assert [len(t) for t in alone] == [1 + i % 3 for i in range(8)]
    assert together == alone


@pytest.mark.server
def test_server_disconnect_cancels_all_samples(n_server: str) -> None:
    """A client leaving an n=3 stream mid-way frees all three samples at once (one cancelled request)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    before = httpx.get(f"{n_server}/health", timeout=5).json()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "temperature": 1.0, "n": 3, "stream": True}
    with httpx.stream("POST", f"{n_server}/v1/completions", json=body, headers=headers, timeout=60) as r:
        lines = r.iter_lines()
        got = [json.loads(line[6:]) for line in (next(lines) for _ in range(12)) if line.startswith("data: ")]
        assert {c["choices"][0]["index"] for c in got} <= {0, 1, 2}
        assert httpx.get(f"{n_server}/health", timeout=5).json()["active"] == 1
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        snap = httpx.get(f"{n_server}/health", timeout=5).json()
        if snap["active"] == 0:
            break
        time.sleep(0.1)
    assert snap["active"] == 0 and snap["queued"] == 0
    assert snap["cancelled"] == before["cancelled"] + 1


@pytest.mark.server
def test_samples_count_towards_capacity(tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process: with --max-active 2 and no queue, an n=2 request fills the server, so an n=1 request arriving
    while it runs is refused with 429. The worker's steps wait until the refusal is in, so the first request
    cannot finish before the second is counted. (Sent one after the other, the second once the first is
    counted: two posts started together through httpx's ASGI transport were not always handled concurrently.)"""
    import threading

    from specdec.server import ServerSettings, create_app

    engine = specdec.load(tiny_models["llama"], tiny_models["draft"])
    gate = threading.Event()
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda gens, join=None: (gate.wait(30), step(gens, join))[1])
    app = create_app(engine, ServerSettings(model_name="tiny", max_active=2, max_batch=2, max_queue=0))
    bodies: list[dict[str, Any]] = [
        {"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "n": 2},
        {"prompt": PROMPT, "max_tokens": 20, "temperature": 0},
    ]

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            first = asyncio.create_task(client.post("/v1/completions", json=bodies[0]))
            for _ in range(3000):  # until the n=2 request is counted (queued or running)
                snap = app.state.scheduler.snapshot()
                if snap["active"] + snap["queued"]:
                    break
                await asyncio.sleep(0.01)
            second = await client.post("/v1/completions", json=bodies[1])
            gate.set()
            return [await first, second]

    try:
        responses = asyncio.run(main())
    finally:
        gate.set()
        app.state.scheduler.stop()
    assert [r.status_code for r in responses] == [200, 429]
    assert len(responses[0].json()["choices"]) == 2 and responses[1].json()["error"]["code"] == "queue_full"
    monkeypatch.undo()
    too_many = create_app(engine, ServerSettings(model_name="tiny", max_active=2, max_batch=4))

    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=too_many)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await client.post("/v1/completions", json={"prompt": "x", "n": 3})

    try:
        r = asyncio.run(ask())
    finally:
        too_many.state.scheduler.stop()
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"

"""A draft with a tokenizer of its own, bridged through text (``specdec.drafters.bridge``).

The pair: two tiny Llama-family models with **different byte-level BPE vocabularies** (trained here on one
small repetitive corpus, 420 and 300 tokens asked for), each trained a few hundred steps on that corpus so
that the draft's text proposals are mostly right (else bridging could propose nothing and still pass the
identity tests; every test of acceptance asserts accepted draft tokens > 0).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import specdec
from specdec.api import load_tokenizer
from specdec.drafters.bridge import (
    BridgedDrafter,
    BridgeState,
    _DraftIds,
    align_proposal,
    continuation_text,
    decode,
    encode,
    leading_specials,
)
from specdec.errors import InvalidRequestError, VocabMismatchError
from specdec.sampling import SamplingParams
from specdec.testing import SAMPLE_CODE

CORPUS = (
    SAMPLE_CODE
    + """The quick brown fox jumps over the lazy dog. The lazy dog sleeps in the sun.
print("hello, world!")
"""
)
PROMPTS = ["def fibonacci(n):", "class Stack:\n", "The quick brown", "print(", "Hello there, my friend"]


def _trained(out: Path, vocab_size: int, layers: int, hidden: int, steps: int, seed: int) -> Path:
    """A tiny Llama with its own tokenizer, trained ``steps`` AdamW steps on the corpus (seconds on CPU)."""
    from transformers import AutoModelForCausalLM

    from specdec.testing import tiny_config, tiny_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer(out, vocab_size, text=CORPUS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster, and kinder to a shared machine
    ids = torch.tensor(tok(CORPUS * 8)["input_ids"])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", len(tok), layers=layers, hidden=hidden))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    length, batch = 64, 8
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - length - 1, (batch,), generator=gen).tolist()
        x = torch.stack([ids[s : s + length] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.set_num_threads(threads)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target, draft): 2-layer target with a 420-token BPE, 1-layer draft with a 300-token BPE."""
    root = tmp_path_factory.mktemp("bridge")
    target = _trained(root / "target", 420, layers=2, hidden=64, steps=300, seed=0)
    draft = _trained(root / "draft", 300, layers=1, hidden=32, steps=200, seed=1)
    return target, draft


@pytest.fixture(scope="session")
def toks(pair: tuple[Path, Path]) -> tuple[Any, Any]:
    return load_tokenizer(pair[0]), load_tokenizer(pair[1])


def test_the_pair_really_has_different_vocabularies(toks: tuple[Any, Any]) -> None:
    target_tok, draft_tok = toks
    assert len(target_tok) != len(draft_tok)
    text = "def fibonacci(n):\n    a, b = 0, 1"
    assert encode(target_tok, text) != encode(draft_tok, text)


# -- loading ---------------------------------------------------------------------------------------


def test_load_bridges_a_draft_with_its_own_tokenizer_and_says_so(
    pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    target, draft = pair
    engine = specdec.load(target, draft, dtype="float32")
    assert isinstance(engine.drafter, BridgedDrafter)
    assert engine.drafter.name == f"bridge({draft})"
    err = capsys.readouterr().err
    assert err.count("drafting through text") == 1 and str(draft) in err
    assert engine.max_context == engine.target.max_context  # draft positions are not target positions


def test_shared_refuses_and_bad_mode_names_the_field(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    with pytest.raises(VocabMismatchError, match="do not share a vocabulary"):
        specdec.load(target, draft, dtype="float32", draft_tokenizer="shared")
    with pytest.raises(InvalidRequestError) as info:
        specdec.load(target, draft, dtype="float32", draft_tokenizer="maybe")
    assert info.value.param == "draft_tokenizer"


def test_bridge_mode_with_one_tokenizer_is_exact_too(tiny_models: dict[str, Path]) -> None:
    """``draft_tokenizer="bridge"`` bridges a same-tokenizer pair (a check of the bridge with no re-tokenization
    differences at all): greedy output equals target-only."""
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32", draft_tokenizer="bridge")
    assert isinstance(engine.drafter, BridgedDrafter)
    plain = specdec.load(tiny_models["llama"], dtype="float32")
    for prompt in ("def f(x):", "class Stack:"):
        assert (
            engine.generate(prompt, max_new_tokens=16, tau=3).token_ids
            == plain.generate(prompt, max_new_tokens=16).token_ids
        )


# -- greedy identity -------------------------------------------------------------------------------


@pytest.mark.identity
@pytest.mark.parametrize("runtime", ["native", "hf"])
def test_greedy_output_equals_target_only(pair: tuple[Path, Path], runtime: str) -> None:
    target, draft = pair
    engine = specdec.load(target, draft, dtype="float32", runtime=runtime)
    plain = specdec.load(target, dtype="float32", runtime=runtime)
    accepted = rejected = 0
    prompts = PROMPTS if runtime == "native" else PROMPTS[:3]  # transformers' runtime is the slower one
    for prompt in prompts:
        reference = plain.generate(prompt, max_new_tokens=40).token_ids
        for tau in (1, 2, 3, 4):
            res = engine.generate(prompt, max_new_tokens=40, tau=tau)
            assert res.token_ids == reference, (prompt, tau)
            assert all(r.tau <= tau for r in res.records)
            accepted += sum(r.n_accepted for r in res.records)
            rejected += sum(1 for r in res.records if r.n_accepted < r.tau)
    assert accepted > 50 * len(prompts)  # the bridge proposes, and the target takes most of it
    assert rejected > 0  # and the rejection path ran too


@pytest.mark.identity
def test_batched_steps_equal_solo(pair: tuple[Path, Path]) -> None:
    """Several sequences drafted in lockstep (one draft pass per depth over all of them) and verified in one
    target pass give each one's solo output."""
    target, draft = pair
    engine = specdec.load(target, draft, dtype="float32")
    plain = specdec.load(target, dtype="float32")
    gens = [engine.start(p, max_new_tokens=30, tau=3) for p in PROMPTS]
    while not all(g.done for g in gens):
        engine.step(gens)
    for p, g in zip(PROMPTS, gens):
        assert g.result().token_ids == plain.generate(p, max_new_tokens=30).token_ids, p
    assert sum(r.n_accepted for g in gens for r in g.records) > 0
    # Half of each output predicted, an edit in it: the bridge drafts the rest, its state kept by position across
    # the steps the prediction drafted.
    wants = [plain.generate(p, max_new_tokens=30).token_ids for p in PROMPTS]
    preds = [w[:8] + [5, 6, 7] + w[11:15] for w in wants]
    gens = [engine.start(p, max_new_tokens=30, tau=3, prediction=pred) for p, pred in zip(PROMPTS, preds)]
    while not all(g.done for g in gens):
        engine.step(gens)
    for want, g in zip(wants, gens):
        reasons = {r.reason for r in g.records}
        assert g.result().token_ids == want and "prediction" in reasons and len(reasons) > 1, reasons


def test_draft_state_is_kept_by_position(pair: tuple[Path, Path]) -> None:
    """After each step the draft cache stands for exactly ``held`` (the context's draft ids, then the drafted
    tokens it fed), and the next step feeds only what differs from it."""
    target, draft = pair
    engine = specdec.load(target, draft, dtype="float32")
    gen = engine.start("def fibonacci(n):", max_new_tokens=30, tau=4)
    assert isinstance(engine.drafter, BridgedDrafter)
    draft_tok = engine.drafter.draft_tokenizer
    fed: list[int] = []
    inner = engine.drafter.runner
    original = inner.forward_batch

    def counting(blocks: Any, last_only: bool = False) -> list[torch.Tensor]:
        fed.append(sum(len(ids) for ids, _ in blocks))
        return original(blocks, last_only)

    inner.forward_batch = counting  # type: ignore[method-assign]
    try:
        while not gen.done:
            state: BridgeState = gen.draft_state
            gen.step()
            if gen.done:
                break
            assert state.inner.cache.length == len(state.held)
    finally:
        del inner.forward_batch
    context_ids = encode(draft_tok, decode(engine.tokenizer, gen.context))
    assert sum(fed) < 3 * len(context_ids)  # nothing like the whole context re-fed each step


# -- sampling --------------------------------------------------------------------------------------


def test_sampled_requests_run_and_repeat_with_a_seed(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    engine = specdec.load(target, draft, dtype="float32")
    a = engine.generate("def fibonacci(n):", max_new_tokens=24, temperature=1.0, seed=3, tau=3)
    b = engine.generate("def fibonacci(n):", max_new_tokens=24, temperature=1.0, seed=3, tau=3)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0
    assert a.stats.accepted > 0


def _exact_joint(target_dir: Path, prompt_ids: list[int], params: SamplingParams, depth: int) -> dict[tuple, float]:
    from transformers import AutoModelForCausalLM

    from specdec.sampling import logits_to_probs

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    joint: dict[tuple, float] = {(): 1.0}
    with torch.no_grad():
        for _ in range(depth):
            prefixes = [k for k, v in joint.items() if v > 1e-7]
            probs = logits_to_probs(
                model(input_ids=torch.tensor([prompt_ids + list(k) for k in prefixes])).logits[:, -1], params
            )
            joint = {
                prefix + (tok,): joint[prefix] * float(probs[row, tok])
                for row, prefix in enumerate(prefixes)
                for tok in torch.nonzero(probs[row] > 1e-7).flatten().tolist()
            }
    return joint


@pytest.mark.slow
@pytest.mark.distribution
def test_sampled_first_two_tokens_follow_the_target(pair: tuple[Path, Path]) -> None:
    """The joint law of the first two tokens of bridged speculative sampling against the exact target-only law
    (enumerated with transformers in fp32), temperature 1.5 on a prompt the models are unsure about.

    800 generations with seeds 0..799; one chi-square test at 1e-3 (pooling expected counts < 5):
    false-failure rate ≤ 1e-3 over seeds."""
    from test_distribution import P_THRESHOLD, chi2_pvalue

    target, draft = pair
    engine = specdec.load(target, draft, dtype="float32")
    engine.eos_ids = frozenset()  # exactly two tokens every time
    prompt = engine.encode("The lazy")
    settings = {"temperature": 1.5}
    joint = _exact_joint(target, prompt, SamplingParams(**settings), depth=2)
    n = 800
    counts: dict[tuple, int] = {}
    drafted = accepted = 0
    for seed in range(n):
        r = engine.generate(prompt, max_new_tokens=2, tau=1, seed=seed, **settings)
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
        drafted += r.stats.drafted
        accepted += r.stats.accepted
    assert drafted > 0 and 0.05 < accepted / drafted < 0.95, (drafted, accepted)
    assert chi2_pvalue(counts, joint, n) > P_THRESHOLD


@pytest.mark.server
def test_server_model_card_names_the_bridge_and_serves_greedy_and_sampled(pair: tuple[Path, Path]) -> None:
    import asyncio

    import httpx

    pytest.importorskip("fastapi")
    from specdec.server import ServerSettings, create_app

    target, draft = pair
    engine = specdec.load(target, draft, dtype="float32")
    plain = specdec.load(target, dtype="float32")
    app = create_app(engine, ServerSettings(model_name="pair"))

    async def main() -> tuple[Any, Any, Any]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            card = (await client.get("/v1/models/pair")).json()
            body = {"model": "pair", "prompt": "def fibonacci(n):", "max_tokens": 16}
            greedy = (await client.post("/v1/completions", json={**body, "temperature": 0})).json()
            sampled = await client.post("/v1/completions", json={**body, "temperature": 1.0, "seed": 1})
            return card, greedy, sampled

    try:
        card, greedy, sampled = asyncio.run(main())
    finally:
        app.state.scheduler.stop()
    assert card["drafter"] == f"bridge({draft})"
    assert greedy["choices"][0]["text"] == plain.generate("def fibonacci(n):", max_new_tokens=16).text
    assert sampled.status_code == 200 and sampled.json()["choices"][0]["text"]


# -- boundary handling -----------------------------------------------------------------------------


def test_proposal_after_a_clean_boundary(toks: tuple[Any, Any]) -> None:
    target_tok, _ = toks
    tail = encode(target_tok, "def fibonacci(n):")
    rest = encode(target_tok, "def fibonacci(n):\n    a, b = 0, 1")[len(tail) :]
    assert len(rest) >= 3
    text = decode(target_tok, rest)
    assert align_proposal(target_tok, tail, decode(target_tok, tail), text, complete=True) == rest
    # Not complete: the last token could still merge with more text, so it is not proposed.
    assert align_proposal(target_tok, tail, decode(target_tok, tail), text) == rest[:-1]


def test_proposal_that_merges_with_the_context_last_token(toks: tuple[Any, Any]) -> None:
    """The context ends in " br" (a split the target may well have made), the draft's text goes on "own fox":
    re-encoding the whole merges " br"+"own" into " brown", which does not reproduce the context. The proposal
    starts at the context's end: "own" encoded alone, then " fox"."""
    target_tok, _ = toks
    assert len(encode(target_tok, " brown")) == 1  # precondition: the merge exists in this vocabulary
    tail = encode(target_tok, "The quick") + encode(target_tok, " br")
    tail_text = decode(target_tok, tail)
    assert tail_text == "The quick br"
    got = align_proposal(target_tok, tail, tail_text, "own fox", complete=True)
    assert got == encode(target_tok, "own") + encode(target_tok, " fox")
    assert decode(target_tok, tail + got) == "The quick brown fox"
    assert align_proposal(target_tok, tail, tail_text, "own fox") == got[:-1]


def test_proposal_when_the_tail_is_retokenized_differently(toks: tuple[Any, Any]) -> None:
    """A tail the tokenizer would split otherwise (" brown" spelled " br"+"own") still gives the tokens after the
    first boundary at the context's end."""
    target_tok, _ = toks
    tail = encode(target_tok, "The quick br") + encode(target_tok, "own")
    assert tail != encode(target_tok, "The quick brown")
    got = align_proposal(target_tok, tail, "The quick brown", " fox jumps", complete=True)
    assert got == encode(target_tok, " fox jumps")


def test_continuation_text_and_leading_specials(toks: tuple[Any, Any]) -> None:
    _, draft_tok = toks
    left = encode(draft_tok, "The quick")
    new = encode(draft_tok, "The quick brown fox")[len(left) :]
    assert continuation_text(draft_tok, left, new) == " brown fox"
    assert leading_specials(draft_tok) == []  # this tokenizer adds no BOS

    class WithBos:
        def build_inputs_with_special_tokens(self, ids: list[int]) -> list[int]:
            return [7, *ids, 8]

    assert leading_specials(WithBos()) == [7]
    assert leading_specials(object()) == []  # a tokenizer without the hook: nothing put first


def test_draft_ids_freeze_seams_without_changing_the_encoding(toks: tuple[Any, Any]) -> None:
    """Growing text: the incremental draft ids equal encoding the whole text, and most of it is frozen."""
    _, draft_tok = toks
    ids = _DraftIds(draft_tok, [])
    text = CORPUS * 3
    for end in range(10, len(text), 37):
        assert ids.ids(text[:end]) == encode(draft_tok, text[:end]), end
    assert ids.offset > len(text) // 2


def test_bench_skips_transformers_assisted_when_it_cannot_bridge(tiny_models: dict[str, Path]) -> None:
    """transformers bridges two tokenizers only for vocabularies of different sizes: for a pair with its own
    tokenizers but equal sizes, the assisted contender is skipped with the reason in the report's notes."""
    from specdec.bench.contenders import HFModels
    from specdec.bench.run import BenchConfig, BenchModels, all_contenders

    toks = (load_tokenizer(tiny_models["llama"]), load_tokenizer(tiny_models["draft"]))
    dev = torch.device("cpu")
    hf = HFModels.load(str(tiny_models["llama"]), str(tiny_models["draft"]), torch.float32, torch.float32, dev, toks)
    assert hf.draft is None and hf.assisted_skipped is not None
    plain = specdec.load(tiny_models["llama"], dtype="float32")
    notes: list[str] = []
    keys = [c.key for c in all_contenders(BenchModels(None, plain, hf, {}), BenchConfig(prompts=[]), notes)]
    assert "hf_assisted" not in keys and "hf_target" in keys
    assert any("as many vocabulary rows" in n for n in notes)


# -- commands --------------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True, timeout=600, check=False
    )


def test_cli_generate_with_the_pair(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    common = ["--target", str(target), "--dtype", "float32", "--max-new-tokens", "24", "--json", "--tau", "3"]
    spec = _cli("generate", "def fibonacci(n):", "--draft", str(draft), *common)
    assert spec.returncode == 0, spec.stderr
    assert "drafting through text" in spec.stderr
    plain = _cli("generate", "def fibonacci(n):", "--no-draft", *[c for c in common if c not in ("--tau", "3")])
    assert plain.returncode == 0, plain.stderr
    a, b = json.loads(spec.stdout), json.loads(plain.stdout)
    assert a["token_ids"] == b["token_ids"]
    assert a["stats"]["accepted"] > 0
    refused = _cli("generate", "x", "--draft", str(draft), "--draft-tokenizer", "shared", *common)
    assert refused.returncode == 2 and "do not share a vocabulary" in refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.slow
def test_bench_and_tune_measure_the_pair(pair: tuple[Path, Path], tmp_path: Path) -> None:
    target, draft = pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def fibonacci(n):"}\n{"prompt": "The quick brown"}\n')
    out = tmp_path / "bench.json"
    res = _cli(
        "bench", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts), "--dtype", "float32",
        "--max-new-tokens", "16", "--taus", "2", "--policies", "adaptive", "--repeats", "1", "--trace-prompts", "0",
        "--json", str(out),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    report = json.loads(out.read_text())
    rows = {r["key"]: r for r in report["contenders"]}
    assert report["models"]["drafter"] == f"bridge({draft})"
    assert rows["fixed_tau2"]["identical_to_target_only"] is True
    assert rows["fixed_tau2"]["alpha"] > 0
    # transformers' assisted generation with both tokenizers (universal assisted decoding) ran, greedy and exact
    assert "hf_assisted" in rows and rows["hf_assisted"]["identical_to_target_only"] is True
    tune_out = tmp_path / "tune.json"
    res = _cli(
        "tune", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts), "--dtype", "float32",
        "--max-new-tokens", "12", "--max-tau", "3", "--json", str(tune_out),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    tuned = json.loads(tune_out.read_text())
    assert tuned["drafts"][0]["acceptance_rate"] > 0


def test_a_bridged_draft_keeps_prefixes_by_its_own_ids(pair: tuple[Path, Path]) -> None:
    """With a prefix cache the bridged draft keeps its cache by the draft ids it holds (the target's ids are not its
    own): a prompt sharing an earlier one's start finds the draft's rows too, and outputs stay target-only's."""
    target, draft = pair
    cached = specdec.load(target, draft, dtype="float32", prefix_cache=8)
    plain = specdec.load(target, draft, dtype="float32")
    assert isinstance(cached.drafter, BridgedDrafter)
    store = cached.drafter.runner.prefix_cache
    assert store is not None and cached.target.prefix_cache is not None
    start = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n" * 2
    for tail in ("    return a\n", "    print(a)\n", "    return b\n"):
        got = cached.generate(start + tail, max_new_tokens=16, tau=3)
        assert got.token_ids == plain.generate(start + tail, max_new_tokens=16, tau=0).token_ids
    assert store.stats.hit_tokens >= 2 * 16  # the later prompts found at least a block of the draft's each

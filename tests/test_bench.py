"""specdec bench: the formula, the identity check, the report's structure and its ratios, on tiny checkpoints."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from specdec.bench.contenders import Contender, EngineContender, RunResult
from specdec.bench.prompts import DEFAULT_PROMPTS, Prompt, load_prompts, parse_taus
from specdec.bench.run import BenchConfig, run_bench
from specdec.bench.stats import compare_outputs, first_difference, ideal_speedup
from specdec.cli import main
from specdec.commands.bench import load_models
from specdec.commands.common import ModelSettings
from specdec.errors import InvalidRequestError

PROMPTS = [
    Prompt("fib", "def fibonacci(n):\n"),
    Prompt("stack", "class Stack:\n    def push(self, item):"),
    Prompt("imports", "import os, sys, json\nprint("),
]
PLANT_PROMPT, PLANT_POS = "stack", 3


def test_ideal_speedup_hand_numbers() -> None:
    # (1 - 0.8^5) / (0.2 * (4 * 0.1 + 1)) = 0.67232 / 0.28
    assert ideal_speedup(0.8, 4, 0.1) == pytest.approx(2.401142857, rel=1e-9)
    assert ideal_speedup(0.5, 1, 0.0) == pytest.approx(1.5)
    assert ideal_speedup(1.0, 3, 0.5) == pytest.approx(4 / 2.5)  # every draft accepted: τ + 1 tokens per pass
    assert ideal_speedup(0.0, 4, 0.25) == pytest.approx(0.5)  # nothing accepted: pure drafting cost
    assert ideal_speedup(0.9, 0, 0.3) == 1.0


def test_first_difference_and_compare_outputs() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2  # a prefix differs at the shorter length
    mism = compare_outputs({"a": [1, 2, 3], "b": [4, 5]}, {"a": [1, 2, 3], "b": [4, 6]})
    assert mism == [{"prompt": "b", "position": 1, "expected": 5, "got": 6, "expected_len": 2, "got_len": 2}]


def test_parse_taus() -> None:
    assert parse_taus("1-4") == [1, 2, 3, 4]
    assert parse_taus("6,2, 4") == [2, 4, 6]
    assert parse_taus("1-2,5") == [1, 2, 5]
    for bad in ("0-3", "x", "", "3-a"):
        with pytest.raises(InvalidRequestError, match="--taus"):
            parse_taus(bad)


def test_load_prompts_errors(tmp_path: Path) -> None:
    cases = {
        "nojson": ("not json\n", "not valid JSON"),
        "noprompt": ('{"id": "x"}\n', "non-empty string"),
        "emptystring": ('""\n', "non-empty JSON string"),
        "number": ("3\n", "non-empty JSON string"),
        "dup": ('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n', "more than once"),
        "empty": ("\n", "holds no prompts"),
    }
    for name, (text, message) in cases.items():
        f = tmp_path / f"{name}.jsonl"
        f.write_text(text)
        with pytest.raises(InvalidRequestError, match=message):
            load_prompts(f)
    with pytest.raises(InvalidRequestError, match="not found"):
        load_prompts(tmp_path / "missing.jsonl")


def test_load_prompts_takes_strings_and_objects(tmp_path: Path) -> None:
    """One reader for every --prompts: a line may be a bare JSON string (load_test's files) or an object."""
    f = tmp_path / "mixed.jsonl"
    f.write_text(
        json.dumps("def f(x):\n") + "\n\n" + json.dumps({"prompt": "import os\n", "id": "b", "source": "s"}) + "\n"
    )
    prompts = load_prompts(f)
    assert [(q.id, q.text, q.source) for q in prompts] == [("line1", "def f(x):\n", ""), ("b", "import os\n", "s")]


def test_shipped_prompt_set() -> None:
    prompts = load_prompts(DEFAULT_PROMPTS)
    assert len(prompts) >= 20
    records = [json.loads(line) for line in DEFAULT_PROMPTS.read_text().splitlines()]
    for rec in records:
        assert rec["source"].split(":")[0].endswith(".py") and rec["prompt"].endswith("\n")
        assert 100 <= rec["tokens"] <= 300  # counted with the default pair's tokenizer when the set was cut
    assert len({r["source"].split(":")[0] for r in records}) == len(records)  # one cut per file


class PlantedMismatch(Contender):
    """Target-only decoding with one token changed: the identity check must flag it."""

    def __init__(self, inner: EngineContender) -> None:
        self.inner, self.key, self.label, self.kind, self.tau = inner, "planted", "planted", "planted", None

    def run(self, prompt_ids: list[int], max_new_tokens: int) -> RunResult:
        res = self.inner.run(prompt_ids, max_new_tokens)
        if prompt_ids == PROMPTS[1].ids and len(res.tokens) > PLANT_POS:
            res.tokens[PLANT_POS] = (res.tokens[PLANT_POS] + 1) % 100
        return res


def _settings(tiny_models: dict[str, Path]) -> ModelSettings:
    return ModelSettings(
        target=tiny_models["llama"],
        draft=tiny_models["draft"],
        prompt_lookup=False,
        no_draft=False,
        device="cpu",
        dtype="float32",
        draft_dtype=None,
        runtime="auto",
        policy="fixed",
        tau=4,
        trust_remote_code=False,
    )


@pytest.fixture(scope="module")
def report(tiny_models: dict[str, Path]) -> dict[str, Any]:
    models = load_models(_settings(tiny_models), with_hf=True)
    cfg = BenchConfig(
        prompts=[Prompt(p.id, p.text) for p in PROMPTS],
        max_new_tokens=10,
        taus=[2],
        policies=["fixed", "no-such-policy"],
        repeats=2,
        warmup_tokens=4,
        trace_prompts=1,
    )
    PROMPTS[1].ids = models.target_only.encode(PROMPTS[1].text)
    planted = PlantedMismatch(EngineContender("x", "x", "target_only", models.target_only, tau=0))
    return json.loads(json.dumps(run_bench(models, cfg, extra=[planted])))  # must survive a JSON round trip


def test_report_structure(report: dict[str, Any]) -> None:
    keys = [r["key"] for r in report["contenders"]]
    assert keys == ["target_only", "fixed_tau2", "policy_fixed", "hf_target", "hf_assisted", "hf_lookup", "planted"]
    assert any("no-such-policy" in n for n in report["notes"])
    for r in report["contenders"]:
        for field in (
            "tokens_per_s",
            "speedup_vs_target_only",
            "speedup_vs_hf_assisted",
            "alpha",
            "mean_accepted_length",
            "c",
            "ideal_speedup",
            "efficiency",
            "identical_to_target_only",
            "mismatches",
            "per_prompt",
        ):
            assert field in r, (r["key"], field)
        assert set(r["per_prompt"]) == {p.id for p in PROMPTS}
        assert all(len(v["seconds"]) == 2 for v in r["per_prompt"].values())
    assert [g["figure"] for g in report["goals"]] == ["speedup_vs_target_only", "speedup_vs_hf_assisted", "efficiency"]
    costs = report["costs"]
    assert {"1", "3"} <= set(costs["t_verify"]) and costs["t_draft_per_token"] > 0
    assert report["best"]["fixed_tau"] == 2
    assert report["peak_rss_mib"]["end"] >= report["peak_rss_mib"]["after_loading_models"] > 0
    # trace_prompts=1 and a fixed τ ran: the overhead is measured at the best fixed τ, not skipped
    t = report["trace_overhead"]
    assert (t["tau"], t["prompts"]) == (2, 1) and t["tokens_per_s_untraced"] > 0 and t["tokens_per_s_traced"] > 0
    assert math.isclose(t["overhead"], t["tokens_per_s_untraced"] / t["tokens_per_s_traced"] - 1, rel_tol=1e-12)


def test_ratios_consistent_with_tokens_per_s(report: dict[str, Any]) -> None:
    rows = {r["key"]: r for r in report["contenders"]}
    base, assisted = rows["target_only"]["tokens_per_s"], rows["hf_assisted"]["tokens_per_s"]
    for r in rows.values():
        medians = sum(v["median_s"] for v in r["per_prompt"].values())
        tokens = sum(v["tokens"] for v in r["per_prompt"].values())
        assert r["tokens"] == tokens and math.isclose(r["seconds"], medians, rel_tol=1e-12)
        assert math.isclose(r["tokens_per_s"], tokens / medians, rel_tol=1e-12)
        assert math.isclose(r["speedup_vs_target_only"], r["tokens_per_s"] / base, rel_tol=1e-12)
        assert math.isclose(r["speedup_vs_hf_assisted"], r["tokens_per_s"] / assisted, rel_tol=1e-12)
        if r["kind"] == "fixed":
            assert r["alpha_per_token"] >= r["alpha"]  # drafts after a rejection are never tried
            expected = ideal_speedup(r["alpha_per_token"], r["tau"], r["c"])
            assert math.isclose(r["ideal_speedup"], expected, rel_tol=1e-12)
            assert math.isclose(r["efficiency"], r["speedup_vs_target_only"] / expected, rel_tol=1e-12)
            assert 0.0 <= r["alpha"] <= 1.0 and 0.0 < r["mean_accepted_length"] <= r["tau"] + 1
            # Decode-only figures exclude prefill, so they are faster, and use the same ideal.
            assert r["decode_tokens_per_s"] > r["tokens_per_s"]
            decode_speedup = r["decode_tokens_per_s"] / rows["target_only"]["decode_tokens_per_s"]
            assert math.isclose(r["decode_efficiency"], decode_speedup / expected, rel_tol=1e-12)
            # The variant pricing a verify pass at its measured cost v (block pass / one-token pass):
            # E[tokens] / (τc + v), i.e. the formula with c/v, divided by v.
            v = r["verify_cost_ratio"]
            assert v > 0 and math.isclose(v, r["t_target_pass"] / rows["target_only"]["t_target_pass"], rel_tol=1e-12)
            a, tau = r["alpha_per_token"], r["tau"]
            tokens_per_pass = (1 - a ** (tau + 1)) / (1 - a) if a < 1 else tau + 1
            assert math.isclose(r["ideal_speedup_measured_verify"], tokens_per_pass / (tau * r["c"] + v), rel_tol=1e-9)
            assert math.isclose(
                r["decode_efficiency_measured_verify"],
                decode_speedup / r["ideal_speedup_measured_verify"],
                rel_tol=1e-12,
            )
        if r["kind"].startswith("hf_"):
            assert r["decode_tokens_per_s"] is None  # generate() does not report its prefill time


@pytest.mark.identity
def test_identity_check(report: dict[str, Any]) -> None:
    rows = {r["key"]: r for r in report["contenders"]}
    # fp32 greedy: speculative decoding and transformers' plain greedy match target-only exactly.
    for key in ("fixed_tau2", "policy_fixed", "hf_target"):
        assert rows[key]["identical_to_target_only"] is True, (key, rows[key]["mismatches"])
    planted = rows["planted"]
    assert planted["identical_to_target_only"] is False
    assert [(m["prompt"], m["position"]) for m in planted["mismatches"]] == [(PLANT_PROMPT, PLANT_POS)]


def test_cli_bench_writes_json_and_plot(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": p.id, "prompt": p.text}) + "\n" for p in PROMPTS[:2]))
    out_json, out_png, out_md = tmp_path / "r.json", tmp_path / "r.png", tmp_path / "r.md"
    rc = main(
        [
            "bench",
            "--target",
            str(tiny_models["llama"]),
            "--draft",
            str(tiny_models["draft"]),
            "--dtype",
            "float32",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "6",
            "--taus",
            "2",
            "--repeats",
            "1",
            "--no-hf",
            "--policies",
            "",
            "--trace-prompts",
            "0",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
            "--markdown",
            str(out_md),
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "specdec τ=2" in table and "goal:" in table
    data = json.loads(out_json.read_text())
    assert [r["key"] for r in data["contenders"]] == ["target_only", "fixed_tau2"]
    assert data["machine"]["cores"] and out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = out_md.read_text()
    assert md.startswith("| contender |") and "| specdec τ=2 |" in md and "goal" in md


def test_cli_bench_bad_input(tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["bench", "--target", str(tiny_models["llama"]), "--draft", str(tiny_models["draft"])]
    assert main([*base, "--prompts", str(tmp_path / "none.jsonl")]) == 2
    assert "prompt file not found" in capsys.readouterr().err
    assert main([*base, "--taus", "0-2"]) == 2
    err = capsys.readouterr().err
    assert "--taus" in err and len(err.strip().splitlines()) == 1


def test_ignore_eos_gives_fixed_length_outputs(tiny_models: dict[str, Path]) -> None:
    """--ignore-eos: a prompt whose target-only greedy output ends at EOS early runs to max_new_tokens in every
    contender (ours and transformers'), all identical to target-only."""
    models = load_models(_settings(tiny_models), with_hf=True)
    engine, tok = models.target_only, models.target_only.tokenizer
    max_new = 12
    found = None
    for a in range(1, engine.target.vocab_size):  # a short prompt the tiny target ends early (searched, not assumed)
        for ids in ([a, 288], [288, a]):
            text = tok.decode(ids)
            if engine.encode(text) == ids:
                r = engine.generate(ids, max_new_tokens=max_new, tau=0)
                if r.finish_reason == "stop" and 0 < len(r.token_ids) < max_new - 2:
                    found = text
                    break
        if found:
            break
    assert found is not None, "no prompt of the tiny target reaches EOS early"
    cfg = BenchConfig(
        prompts=[Prompt("eos", found)],
        max_new_tokens=max_new,
        taus=[2],
        policies=[],
        repeats=1,
        warmup_tokens=2,
        trace_prompts=0,
        ignore_eos=True,
    )
    report = json.loads(json.dumps(run_bench(models, cfg)))
    rows = {r["key"]: r for r in report["contenders"]}
    assert set(rows) == {"target_only", "fixed_tau2", "hf_target", "hf_assisted", "hf_lookup"}
    for key, row in rows.items():
        assert row["identical_to_target_only"] is True, (key, row["mismatches"])
        assert row["tokens"] == max_new, (key, row["tokens"])
    assert report["settings"]["eos"].startswith("ignored")

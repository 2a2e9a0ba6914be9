"""benchmarks/load_test.py's report side: the table, the plot of tok/s and p95 against clients, re-drawing a saved
report (``--from-json``), and a clear one-line error for a file that is not one. The load run itself needs servers
(tests/test_server.py runs real ones); these tests feed it a report by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from specdec.testing import import_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "load_test.py"


def _module() -> Any:
    return import_script(SCRIPT, "load_test_under_test")


def _row(mode: str, clients: int, tok_s: float, p95: float) -> dict[str, Any]:
    return {
        "mode": mode,
        "concurrency": clients,
        "requests": 8,
        "errors": 0,
        "tokens_per_s": tok_s,
        "requests_per_s": tok_s / 50,
        "p50_latency_s": p95 / 2,
        "p95_latency_s": p95,
        "p50_ttft_s": 0.01,
        "mean_tokens": 50.0,
        "identical_prompts": "3/3",
    }


REPORT = {
    "rows": [
        _row("plain", 1, 500.0, 0.12),
        _row("spec", 1, 1000.0, 0.08),
        _row("plain", 16, 2000.0, 0.50),
        _row("spec", 16, 3000.0, 0.40),
    ],
    "greedy_identity": {"prompt_mode_levels": 12, "differing": 0},
}


def test_the_table_gives_each_mode_against_plain_at_its_level() -> None:
    text = _module().render(REPORT)
    spec16 = next(line for line in text.splitlines() if line.startswith("| spec | 16 |"))
    assert "| 3000.0 | 1.50× |" in spec16 and "| 0.400 |" in spec16
    assert "| spec | 1 |" in text and "| 2.00× |" in text
    assert "differing from the solo target-only run: 0 of 12" in text


def test_the_report_says_how_long_the_prompts_were_and_why_long_ones_matter() -> None:
    short = {**REPORT, "rows": [{**r, "prompt_tokens": 8 * 14} for r in REPORT["rows"]]}
    text = _module().render(short)
    assert "brought 14 prompt tokens on average and got 50 tokens." in text and "does not batch away" not in text
    long = {**REPORT, "rows": [{**r, "prompt_tokens": 8 * 200} for r in REPORT["rows"]]}
    text = _module().render(long)
    assert "brought 200 prompt tokens on average" in text and "does not batch away" in text
    assert "prompt tokens on average" not in _module().render(REPORT)  # a server that sent no usage: no line


def test_the_tokens_while_every_client_was_busy_are_counted_from_the_events_inside_the_window() -> None:
    """A streamed response's tokens are shared equally among its text events (a server streams a step's tokens in one
    event); only the events inside the window count. The levels' ratios are then taken from those figures too, and a
    level where a mode has none (a run that did not stream, or a single wave of requests) has no such ratio."""
    lt = _module()
    sample = lt.Sample(latency=1.0, ttft=0.1, tokens=12, text="x", arrivals=[1.0, 2.0, 3.0, 4.0])
    assert sample.tokens_within(1.5, 3.0) == 6.0  # events at 2 and 3: 2 x 12/4
    assert sample.tokens_within(0.0, 10.0) == 12.0 and sample.tokens_within(4.0, 9.0) == 0.0
    assert lt.Sample(latency=1.0, ttft=0.1, tokens=5, text="").tokens_within(0.0, 9.0) == 0.0  # not streamed

    def busy(row: dict[str, Any], tok_s: float | None) -> dict[str, Any]:
        return {**row, "steady_tokens_per_s": tok_s}

    rows = [
        busy(_row("plain", 16, 2000.0, 0.5), 2400.0),
        busy(_row("tau3", 16, 2800.0, 0.5), 3300.0),
        busy(_row("spec", 16, 2700.0, 0.4), 3630.0),
        busy(_row("unbatched", 16, 700.0, 1.5), 660.0),
        busy(_row("plain", 4, 900.0, 0.2), None),
        busy(_row("spec", 4, 1000.0, 0.2), 1100.0),
    ]
    by_level = {r["concurrency"]: r for r in lt.ratios(rows)}
    assert by_level[16]["policy_vs_best"] == pytest.approx(2700 / 2800)  # the whole rounds' figures
    assert by_level[16]["policy_vs_best_steady"] == pytest.approx(3630 / 3300)
    assert by_level[16]["best_batched_vs_unbatched_steady"] == pytest.approx(3630 / 660)
    assert by_level[4]["policy_vs_best_steady"] is None and by_level[4]["best_batched_vs_unbatched_steady"] is None
    table = lt.render({"rows": rows, "greedy_identity": None})
    assert "| spec | 16 | 8 | 0 | 2700.0 | 1.35× | 3630.0 |" in table
    assert "| 0.400 | 1.10 | 5.50× |" in table  # the level's ratios, all clients busy
    assert "| plain | 4 | 8 | 0 | 900.0 | 1.00× | – |" in table


def test_a_saved_report_is_redrawn_as_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    saved, png = tmp_path / "load.json", tmp_path / "load.png"
    saved.write_text(json.dumps(REPORT))
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--from-json", str(saved), "--plot", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "| plain | 16 |" in run.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_a_file_that_is_not_a_report_is_one_line_of_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": [{"mode": "plain"}]}')
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--from-json", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2
    assert run.stderr.startswith(f"load_test: error: {bad}: not a report written by --json")
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr


def test_the_modes_take_turns_in_an_order_rotated_each_round() -> None:
    order = _module().round_order
    modes = ["plain", "spec", "tau2"]
    rounds = [order(modes, r) for r in range(4)]
    assert rounds[0] == modes and rounds[3] == modes
    assert [r[0] for r in rounds[:3]] == modes  # each mode first once in len(modes) rounds
    assert all(sorted(r) == sorted(modes) for r in rounds)
    assert order([], 2) == []


def test_a_round_sends_twice_the_clients_requests_by_default_and_bad_counts_are_refused() -> None:
    """Short rounds, many of them: by default a round is twice the clients' requests (at least 16), six rounds a
    level; ``--requests`` sets it whatever the clients. A count below 1 is a one-line error."""
    mod = _module()
    assert [mod.requests_at(None, c) for c in (1, 4, 8, 16, 32)] == [16, 16, 16, 32, 64]
    assert mod.requests_at(96, 32) == 96 and mod.ROUNDS == 6
    for flag in ("--requests", "--rounds"):
        run = subprocess.run(
            [sys.executable, str(SCRIPT), "--url", "http://127.0.0.1:9", flag, "0"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 2 and f"load_test.py: error: {flag}: expected 1 or more, got 0" in run.stderr
        assert "Traceback" not in run.stderr


def test_each_level_warms_every_mode_before_its_measured_rounds() -> None:
    """A level's first batches of its size pay one-off costs, which landed on whichever mode ran first: each level
    starts with one unmeasured burst per mode, then its rotated rounds; none with --level-warmup 0."""
    schedule = _module().level_schedule
    modes = ["plain", "spec", "tau2"]
    got = schedule(modes, [1, 16], 2, 16)
    assert got[:3] == [("warm", m, 1) for m in modes]
    assert got[3:9] == [("round", m, 1) for m in ["plain", "spec", "tau2", "spec", "tau2", "plain"]]
    assert got[9:12] == [("warm", m, 16) for m in modes] and len(got) == 18
    assert (
        all(kind == "round" for kind, _, _ in schedule(modes, [1, 16], 2, 0)) and len(schedule(modes, [4], 3, 0)) == 9
    )


def test_a_negative_level_warmup_is_one_line_of_error() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--url", "http://127.0.0.1:9", "--level-warmup", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "--level-warmup: expected 0 or more new tokens, got -1" in run.stderr
    assert "Traceback" not in run.stderr


def test_the_summary_reads_the_batching_goals_level_by_level() -> None:
    """Policy ÷ the best of plain and fixed τ (overall and round by round), the best batched mode and the policy ÷
    --max-batch 1, the policy's p95; a level without the policy is left out, a ratio without its modes is None."""
    mod = _module()
    rows = [
        {**_row("plain", 16, 2000.0, 0.5), "round_tokens_per_s": [2000.0, 2000.0]},
        {**_row("tau2", 16, 3200.0, 0.4), "round_tokens_per_s": [3000.0, 3400.0]},
        {**_row("spec", 16, 3040.0, 0.35), "round_tokens_per_s": [3100.0, 2980.0]},
        _row("unbatched", 16, 1000.0, 1.2),
        _row("plain", 4, 900.0, 0.2),
        _row("spec", 1, 1000.0, 0.08),
    ]
    by = {r["concurrency"]: r for r in mod.ratios(rows)}
    assert sorted(by) == [1, 16]  # no policy at 4 clients
    r16 = by[16]
    assert r16["policy_vs_best"] == pytest.approx(3040 / 3200) and r16["best_other"] == "tau2"
    assert r16["policy_vs_best_rounds"] == pytest.approx([3100 / 3000, 2980 / 3400])
    assert r16["best_batched_vs_unbatched"] == pytest.approx(3.2) and r16["policy_vs_unbatched"] == pytest.approx(3.04)
    assert r16["policy_p95_s"] == 0.35
    assert by[1]["policy_vs_best"] is None and by[1]["best_batched_vs_unbatched"] is None
    text = mod.render({"rows": rows, "greedy_identity": None})
    line = next(x for x in text.splitlines() if x.startswith("| 16 | 0.95"))
    assert "(0.88-1.03) against tau2" in line and "| 3.20× | 3.04× | 0.350 |" in line
    assert next(x for x in text.splitlines() if x.startswith("| 1 | –"))


def test_another_server_is_held_against_the_policy_and_the_best_batched_mode() -> None:
    """``--other NAME=URL`` rows (llama.cpp's server, say): per level the policy and the best batched mode ÷ its
    tokens/s and its p95; its identity line reports its own solo agreement and its agreement with ours."""
    mod = _module()
    rows = [
        _row("plain", 16, 2000.0, 0.5),
        _row("spec", 16, 3000.0, 0.35),
        _row("llama.cpp", 16, 1500.0, 0.9),
        _row("spec", 1, 1000.0, 0.08),
        _row("llama.cpp", 1, 800.0, 0.1),
    ]
    by = {r["concurrency"]: r for r in mod.ratios(rows, ["llama.cpp"])}
    assert by[16]["vs_other"]["llama.cpp"] == pytest.approx({"policy": 2.0, "best_batched": 2.0, "p95_s": 0.9})
    assert by[1]["vs_other"]["llama.cpp"]["policy"] == pytest.approx(1.25)
    assert mod.ratios(rows)[0]["vs_other"] == {}  # no --other named: nothing against it
    # another server whose name starts like a batched mode is not one of the policy's rivals
    named = [*rows, _row("plain-vllm", 16, 9000.0, 0.2)]
    assert mod.ratios(named, ["plain-vllm"])[1]["best_other"] == "plain"
    seen = {"prompt_levels": 30, "differing": 4, "solo_equal_to_specdec": 11, "prompts": 15}
    text = mod.render({"rows": rows, "greedy_identity": None, "other_identity": {"llama.cpp": seen}})
    assert "llama.cpp: greedy outputs differing from its own solo run: 4 of 30" in text
    assert "equal to specdec's on 11 of 15 prompts" in text
    assert "| 16 | 2.00× | 2.00× | 0.900 |" in text and "| 1 | 1.25× | 1.25× | 0.100 |" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--other", "llama.cpp"], "expected NAME=http://HOST:PORT"),
        (["--other", "tau3=http://127.0.0.1:1"], "the name 'tau3' is taken"),
        (["--other", "x=http://127.0.0.1:1", "--other-body", "[1]"], "--other-body: expected a JSON object"),
        (["--other", "x=http://127.0.0.1:1", "--other-body", "{"], "--other-body: not JSON"),
    ],
)
def test_bad_other_servers_are_one_line_errors(argv: list[str], message: str) -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr


def test_prompt_files_read_as_bench_reads_them(tmp_path: Path) -> None:
    """--prompts takes bench's files (objects with "prompt") and bare strings; a bad file is a one-line error."""
    mod = _module()
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "def f(x):\n", "id": "a"}) + "\n" + json.dumps("import os\n") + "\n")
    assert mod.parse_args(["--modes", "plain", "--prompts", str(f)]).prompt_list == ["def f(x):\n", "import os\n"]
    for text, message in [
        (None, "prompt file not found"),
        ("{\n", "p.jsonl:1: not valid JSON"),
        ("[1]\n", "p.jsonl:1: expected"),
    ]:
        if text is None:
            f.unlink()
        else:
            f.write_text(text)
        run = subprocess.run(
            [sys.executable, str(SCRIPT), "--modes", "plain", "--prompts", str(f)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr

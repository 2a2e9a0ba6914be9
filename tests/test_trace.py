"""JSONL traces: what the engine writes, that nothing is lost, and that the reader is strict about the schema."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from specdec.records import GenerationStats, RequestSummary, StepRecord
from specdec.trace import JsonlTrace, TraceError, read_trace


def _record(rid: str = "r1", step: int = 0, tau: int = 3, n: int = 2) -> StepRecord:
    flags = [True] * n + [False] * (tau - n)
    drafts = list(range(10, 10 + tau))
    correction = "plain" if tau == 0 else ("bonus" if n == tau else "recovered")
    return StepRecord(
        request_id=rid,
        step=step,
        prompt_len=5,
        context_len=5 + step,
        policy="fixed",
        reason="fixed",
        tau=tau,
        draft_tokens=drafts,
        accept_flags=flags,
        n_accepted=n,
        correction=correction,
        emitted=drafts[:n] + [99],
        draft_time=0.001,
        verify_time=0.002,
        other_time=0.0005,
    )


def _summary(rid: str = "r1", steps: int = 1) -> RequestSummary:
    stats = GenerationStats(
        prompt_tokens=5, new_tokens=3 * steps, steps=steps, target_passes=steps, finish_reason="length", latency=0.01
    )
    return RequestSummary(request_id=rid, policy="fixed", prompt_len=5, stats=stats, prompt_ids=[1, 2, 3, 4, 5])


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_engine_trace_matches_the_generation(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    import specdec

    path = tmp_path / "t.jsonl"
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], tau=3, trace=path)
    res = engine.generate("def fibonacci(n):", max_new_tokens=24)
    lines = _lines(path)
    assert lines[0]["type"] == "header" and lines[0]["v"] == 1
    steps = [x for x in lines if x["type"] == "step"]
    (req,) = [x for x in lines if x["type"] == "request"]
    assert len(steps) == res.stats.target_passes == req["target_passes"]
    assert [t for s in steps for t in s["emitted"]] == res.token_ids
    assert [s["step"] for s in steps] == list(range(len(steps)))
    assert req["prompt_ids"] == res.prompt_ids and req["new_tokens"] == len(res.token_ids)
    assert all(s["ts"] >= lines[0]["ts"] for s in steps)

    trace = read_trace(path)
    (r,) = trace.requests
    assert r.summary is not None and len(r.steps) == len(steps) and r.temperature == 0.0 and not trace.bad_lines


def test_lines_are_flushed_per_request_and_survive_a_hard_kill(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    code = (
        f"import os, sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_trace import _record, _summary\n"
        "from specdec.trace import JsonlTrace\n"
        f"t = JsonlTrace({str(path)!r})\n"
        "t.on_step(_record('a', 0)); t.on_step(_record('a', 1)); t.on_request(_summary('a', 2))\n"
        "os._exit(1)  # no close, no atexit, no buffer flush\n"
    )
    subprocess.run([sys.executable, "-c", code], check=False, timeout=60)
    assert [x["type"] for x in _lines(path)] == ["header", "step", "step", "request"]


def test_concurrent_writers_produce_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    trace = JsonlTrace(path)

    def work(i: int) -> None:
        for s in range(300):
            trace.on_step(_record(f"r{i}", s))
        trace.on_request(_summary(f"r{i}", 300))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    trace.close()
    parsed = read_trace(path)
    assert not parsed.bad_lines
    assert sorted(len(r.steps) for r in parsed.requests) == [300] * 4
    assert all([s.step for s in r.steps] == list(range(300)) for r in parsed.requests)


def test_reader_tolerates_a_torn_last_line_and_splits_reused_ids(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with JsonlTrace(path) as t:
        t.on_step(_record("x", 0))
        t.on_request(_summary("x"))
    with JsonlTrace(path, record_prompts=False) as t:  # a second session appended, same request id
        t.on_step(_record("x", 0))
        t.on_request(_summary("x"))
    with open(path, "a") as f:
        f.write('{"type": "step", "v": 1, "request_id": "y", "st')
    trace = read_trace(path)
    assert len(trace.headers) == 2
    assert [len(r.steps) for r in trace.requests] == [1, 1]
    first, second = (r.summary for r in trace.requests)
    assert first is not None and first.prompt_ids is not None
    assert second is not None and second.prompt_ids is None
    assert len(trace.bad_lines) == 1 and "line 7" in trace.bad_lines[0]


def test_reader_gives_records_and_reports_lines_it_cannot_build(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with JsonlTrace(path) as t:
        t.on_step(_record("x", 0))
        t.on_step(_record("x", 1, tau=0, n=0))
        t.on_request(_summary("x", steps=2))
    line = {k: v for k, v in _record("y", 0).to_json().items() if k != "reason"}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")  # a step line without a field that has no default
        f.write(json.dumps({"type": "request", "v": 1, "request_id": "y", "policy": "fixed"}) + "\n")
    trace = read_trace(path)
    (req,) = trace.requests
    assert req.steps == [_record("x", 0), _record("x", 1, tau=0, n=0)] and req.summary == _summary("x", steps=2)
    assert len(req.written) == 2 and all(ts > 0 for ts in req.written)
    assert trace.bad_lines == ["line 5: step line without reason", "line 6: request line without prompt_len"]


def test_several_files_read_as_one_trace(tmp_path: Path) -> None:
    """A fleet's replicas each write a file (``serve --ray --trace``): read together, a request id two replicas both
    used stays two requests, a replica that served nothing adds only its header, and an unreadable line is named with
    its file."""
    a, b, idle = tmp_path / "run.a.jsonl", tmp_path / "run.b.jsonl", tmp_path / "run.c.jsonl"
    for path, steps in ((a, 2), (b, 1)):
        with JsonlTrace(path, meta={"replica": path.stem}) as t:
            for s in range(steps):
                t.on_step(_record("x", s))
            t.on_request(_summary("x", steps))
    JsonlTrace(idle).close()
    with open(b, "a") as f:
        f.write('{"type": "step", "v": 1, "request_id": "y", "st')
    trace = read_trace([a, b, idle])
    assert [h["meta"].get("replica") for h in trace.headers] == ["run.a", "run.b", None]
    assert [(r.request_id, len(r.steps), r.file) for r in trace.requests] == [("x", 2, str(a)), ("x", 1, str(b))]
    assert len({r.key for r in trace.requests}) == 2 and [r.session for r in trace.requests] == [1, 2]
    assert trace.bad_lines == [f"{b}: line 4: not JSON (torn line?)"]
    assert trace.path == f"{a}, {b}, {idle}" and read_trace([a]).path == str(a)
    with pytest.raises(TraceError, match="given twice"):
        read_trace([a, tmp_path / "." / "run.a.jsonl"])
    also_idle = tmp_path / "run.d.jsonl"
    JsonlTrace(also_idle).close()
    with pytest.raises(TraceError, match="hold no step or request lines"):
        read_trace([idle, also_idle])
    with pytest.raises(TraceError, match="no trace file given"):
        read_trace([])
    (tmp_path / "v2.jsonl").write_text(json.dumps({"type": "step", "v": 2}) + "\n")
    with pytest.raises(TraceError, match=f"trace {tmp_path / 'v2.jsonl'}, line 1: trace schema version 2"):
        read_trace([a, tmp_path / "v2.jsonl"])


def test_reader_rejects_other_schema_versions_and_missing_files(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"type": "step", "v": 99}) + "\n")
    with pytest.raises(TraceError, match="version 99"):
        read_trace(path)
    with pytest.raises(TraceError, match="does not exist"):
        read_trace(tmp_path / "missing.jsonl")
    with pytest.raises(TraceError, match="cannot open"):
        JsonlTrace(tmp_path / "t.jsonl" / "sub")  # a file used as a directory


def test_generate_cli_writes_a_trace(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    from specdec.cli import main

    path = tmp_path / "cli.jsonl"
    rc = main(
        [
            "generate",
            "hello",
            "--target",
            str(tiny_models["llama"]),
            "--draft",
            str(tiny_models["draft"]),
            "--max-new-tokens",
            "8",
            "--trace",
            str(path),
            "--json",
        ]
    )
    assert rc == 0
    (req,) = read_trace(path).requests
    assert req.summary is not None and sum(len(s.emitted) for s in req.steps) == req.summary.stats.new_tokens


def test_a_step_line_holds_every_field_of_the_record_and_copies_its_lists() -> None:
    """``StepRecord.to_json`` (a trace's step line) is the record's fields, as ``dataclasses.asdict`` gives them, plus
    the line's type and version; its lists are the line's own (a line changed later does not change the record)."""
    from dataclasses import asdict, fields

    rec = _record("z", 2, tau=3, n=1)
    rec.draft_token_probs, rec.draft_confidence, rec.tau_planned, rec.max_verify_passes = [0.5, 0.4, 0.3], [0.6], 4, 9
    line = rec.to_json()
    assert line == {**asdict(rec), "type": "step", "v": line["v"]}
    assert set(line) == {f.name for f in fields(StepRecord)} | {"type", "v"}
    line["emitted"].append(7)
    line["accept_flags"][0] = False
    assert rec.emitted == [10, 99] and rec.accept_flags == [True, False, False]
    assert StepRecord.from_json(rec.to_json()) == rec

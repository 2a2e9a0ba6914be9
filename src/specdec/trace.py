"""JSONL traces: one line per step and one per finished request (schema: docs/trace.md).

Writing is an engine observer (``JsonlTrace``); reading (``read_trace``) is what ``diagnose``
and ``audit --trace`` use. Lines are buffered and flushed when a request finishes, at least
once a second while a long request runs, and on ``close``; a hard kill can lose at most the
step lines written since the last flush (never a line half-written by a clean exit).
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import IO, Any

from specdec.errors import SpecdecError
from specdec.records import TRACE_SCHEMA_VERSION, RequestSummary, StepRecord

FLUSH_INTERVAL_S = 1.0


class TraceError(SpecdecError):
    """A trace file is missing, unreadable or not in a schema this version reads."""


class JsonlTrace:
    """Engine observer appending the trace of every step and request to ``path``.

    Thread-safe: the server calls it from worker threads. ``meta`` (any JSON object) is
    written into the header line, e.g. the models and settings of the run.
    ``record_prompts=False`` drops prompt token ids from request lines.
    """

    def __init__(self, path: str | Path, meta: dict[str, Any] | None = None, record_prompts: bool = True) -> None:
        self.path = Path(path)
        self.record_prompts = record_prompts
        self._lock = threading.Lock()
        try:
            if self.path.parent and not self.path.parent.exists():
                self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file: IO[str] | None = open(self.path, "a", encoding="utf-8", buffering=1 << 16)  # noqa: SIM115
        except OSError as e:
            raise TraceError(f"cannot open trace file {self.path} for writing: {e.strerror or e}") from e
        self._last_flush = time.monotonic()
        header = {
            "type": "header",
            "v": TRACE_SCHEMA_VERSION,
            "schema": "specdec-trace",
            "ts": time.time(),
            "pid": os.getpid(),
            "specdec_version": _version(),
            "meta": meta or {},
        }
        self._write(header, flush=True)
        # Flush at interpreter exit even if the owner never calls close() (weakref: do not keep it alive).
        ref = weakref.ref(self)
        self._atexit = lambda: t.close() if (t := ref()) is not None else None
        atexit.register(self._atexit)

    def on_step(self, record: StepRecord) -> None:
        line = record.to_json()
        line["ts"] = time.time()
        self._write(line, flush=False)

    def on_request(self, summary: RequestSummary) -> None:
        line = summary.to_json()
        line["ts"] = time.time()
        if not self.record_prompts:
            line.pop("prompt_ids", None)
        self._write(line, flush=True)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()
                self._file.close()
                self._file = None
        atexit.unregister(self._atexit)

    def __enter__(self) -> JsonlTrace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, obj: dict[str, Any], flush: bool) -> None:
        text = json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n"
        with self._lock:
            if self._file is None:
                raise TraceError(f"trace {self.path} is closed")
            self._file.write(text)
            now = time.monotonic()
            if flush or now - self._last_flush >= FLUSH_INTERVAL_S:
                self._file.flush()
                self._last_flush = now


def _version() -> str:
    try:
        from specdec import __version__

        return str(__version__)
    except ImportError:
        return "unknown"


# -- reading ------------------------------------------------------------------------------------


@dataclass
class TraceRequest:
    """One request of a trace: its steps in order and its summary line (None if it never finished)."""

    key: str  # request_id, made unique across sessions appended to the same file
    request_id: str
    steps: list[StepRecord] = field(default_factory=list)
    summary: RequestSummary | None = None
    session: int = 0
    written: list[float] = field(default_factory=list)  # each step line's ``ts`` (0.0 where absent)
    first_line: int = 0  # line number of its first line in the file (requests are listed as they finish)
    file: str = ""  # the trace file it was read from (one of several: a fleet's replicas each write their own)

    @property
    def prompt_len(self) -> int:
        if self.summary is not None:
            return self.summary.prompt_len
        return self.steps[0].prompt_len if self.steps else 0

    @property
    def temperature(self) -> float | None:
        settings = (self.summary.settings if self.summary is not None else None) or {}
        t = settings.get("temperature")
        return float(t) if t is not None else None


@dataclass
class Trace:
    path: str  # the file read, or the files, comma-separated
    headers: list[dict[str, Any]]
    requests: list[TraceRequest]
    bad_lines: list[str]  # "line N: why" for lines that could not be read (a torn last line after a kill)

    @property
    def steps(self) -> list[StepRecord]:
        return [s for r in self.requests for s in r.steps]


# what a step line must hold: StepRecord's fields without a default (later fields default for older lines)
STEP_FIELDS = tuple(f.name for f in fields(StepRecord) if f.default is MISSING and f.default_factory is MISSING)


def read_trace(path: str | Path | Sequence[str | Path]) -> Trace:
    """Parse a trace file (several sessions may be appended to one file), or several files as one trace.

    Several files are what a fleet writes (``specdec serve --ray --trace run.jsonl``: one ``run.<replica>.jsonl``
    per replica): their sessions are numbered on from file to file, so request keys stay unique, and each
    unreadable line is named with its file.
    """
    if isinstance(path, (str, Path)):
        return _read_one(Path(path))
    paths = [Path(p) for p in path]
    if not paths:
        raise TraceError("no trace file given")
    if len(paths) == 1:
        return _read_one(paths[0])
    seen: set[Path] = set()
    for p in paths:
        if p.resolve() in seen:
            raise TraceError(f"trace file {p} is given twice")
        seen.add(p.resolve())
    headers: list[dict[str, Any]] = []
    requests: list[TraceRequest] = []
    bad: list[str] = []
    for p in paths:
        part = _read_one(p, allow_empty=True, sessions_before=len(headers))
        requests.extend(part.requests)
        headers.extend(part.headers)
        bad.extend(f"{part.path}: {why}" for why in part.bad_lines)
    if not requests:
        raise TraceError(f"traces {', '.join(map(str, paths))} hold no step or request lines")
    return Trace(path=", ".join(map(str, paths)), headers=headers, requests=requests, bad_lines=bad)


def _read_one(p: Path, allow_empty: bool = False, sessions_before: int = 0) -> Trace:
    """One file; its sessions numbered on from ``sessions_before`` (the files read before it, as one trace)."""
    if not p.is_file():
        raise TraceError(f"trace file {p} does not exist")
    headers: list[dict[str, Any]] = []
    done: list[TraceRequest] = []
    open_: dict[str, TraceRequest] = {}  # request_id -> its request while no summary line has closed it
    bad: list[str] = []
    session = sessions_before
    with open(p, encoding="utf-8", errors="replace") as f:
        for no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = _parse_line(raw, no, bad)
            except TraceError as e:
                raise TraceError(f"trace {p}, {e}") from None
            if obj is None:
                continue
            kind = obj.get("type")
            if kind == "header":
                session += 1
                headers.append(obj)
                done.extend(open_.values())  # requests cut off by the end of the previous session
                open_.clear()
            elif kind == "step":
                missing = [k for k in STEP_FIELDS if k not in obj]
                if missing:
                    bad.append(f"line {no}: step line without {', '.join(missing)}")
                    continue
                req = _open(open_, str(obj["request_id"]), session, len(done), no)
                req.steps.append(StepRecord.from_json(obj))
                req.written.append(float(obj.get("ts", 0.0)))
            elif kind == "request":
                try:
                    summary = RequestSummary.from_json(obj)
                except KeyError as e:
                    bad.append(f"line {no}: request line without {e.args[0]}")
                    continue
                req = _open(open_, str(summary.request_id), session, len(done), no)
                req.summary = summary
                done.append(open_.pop(req.request_id))
            else:
                bad.append(f"line {no}: unknown line type {kind!r}")
    by_key = done + list(open_.values())
    if not by_key and not allow_empty:
        raise TraceError(f"trace {p} holds no step or request lines" + (f" ({bad[0]})" if bad else ""))
    for req in by_key:
        req.file = str(p)
    return Trace(path=str(p), headers=headers, requests=by_key, bad_lines=bad)


def _parse_line(raw: str, no: int, bad: list[str]) -> dict[str, Any] | None:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        bad.append(f"line {no}: not JSON (torn line?)")
        return None
    if not isinstance(obj, dict):
        bad.append(f"line {no}: not a JSON object")
        return None
    v = obj.get("v")
    if v != TRACE_SCHEMA_VERSION:
        raise TraceError(
            f"line {no}: trace schema version {v!r} is not supported (this specdec reads "
            f"version {TRACE_SCHEMA_VERSION})"
        )
    return obj


def _open(open_: dict[str, TraceRequest], request_id: str, session: int, n_done: int, line: int) -> TraceRequest:
    req = open_.get(request_id)
    if req is None:
        # Keys stay unique when an id is reused (a later session appended to the file, a client-chosen id).
        req = open_[request_id] = TraceRequest(
            key=f"{request_id}@{session}.{n_done}", request_id=request_id, session=session, first_line=line
        )
    return req

"""The server as users run it: a real ``specdec serve`` process on 127.0.0.1, driven by the ``openai`` client."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.server

openai = pytest.importorskip("openai")

LONG_CONTEXT = 4096
API_KEY = "test-key-123"
MODEL = "tiny"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPTS = ["def fibonacci(n):", "class Stack:", "import os, sys", "The quick brown fox", "print(", "    return a"]


def with_chat_template(src: Path, dst: Path) -> Path:
    """A copy of a tiny checkpoint whose tokenizer has a (simple) chat template."""
    from transformers import AutoTokenizer

    shutil.copytree(src, dst)
    tok = AutoTokenizer.from_pretrained(str(dst))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(dst))
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(target: Path, draft: Path, log: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "specdec.cli",
        "serve",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--port",
        str(port),
        "--model-name",
        MODEL,
        "--log-level",
        "warning",
        *extra,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # generous: imports are slow on a busy machine
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server did not come up:\n{log.read_text()}")


@contextlib.contextmanager
def served(target: Path, draft: Path, log: Path, *extra: str) -> Iterator[str]:
    """``start_server`` as a context: the server's URL, then the server stopped (bounded) and its log checked for
    tracebacks."""
    proc, url = start_server(target, draft, log, *extra)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.fixture(scope="module")
def chat_target(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return long_context(with_chat_template(tiny_models["llama"], tmp_path_factory.mktemp("chat") / "llama"))


@pytest.fixture(scope="module")
def chat_draft(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("chat") / "draft"
    shutil.copytree(tiny_models["draft"], dst)
    return long_context(dst)


def long_context(path: Path) -> Path:
    """A longer context (RoPE: the weights do not change) so a request can run long enough to be abandoned
    mid-way: the tiny models fill their 256-token window in a few tens of milliseconds."""
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = LONG_CONTEXT
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trace") / "serve.jsonl"


@pytest.fixture(scope="module")
def server(
    chat_target: Path, chat_draft: Path, trace_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with served(chat_target, chat_draft, log, "--api-key", API_KEY, "--trace", str(trace_file)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> Any:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(chat_target: Path, chat_draft: Path) -> Any:
    """The same models in-process: what the server must reproduce."""
    import specdec

    return specdec.load(chat_target, chat_draft)


def health(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/health", timeout=5).json()


def test_completion_matches_engine_and_counts_usage(client: Any, engine: Any) -> None:
    for prompt in PROMPTS[:3]:
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        expected = engine.generate(prompt, max_new_tokens=24)
        choice = resp.choices[0]
        assert choice.text == expected.text
        assert choice.finish_reason == expected.finish_reason
        assert resp.usage.prompt_tokens == len(engine.tokenizer(prompt)["input_ids"])
        assert resp.usage.completion_tokens == len(expected.token_ids)
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
        spec = resp.model_extra["speculative"]
        assert spec["target_passes"] == expected.stats.target_passes
        assert spec["drafted"] > 0 and 0 <= spec["acceptance_rate"] <= 1


def test_trace_records_served_requests(client: Any, trace_file: Path) -> None:
    resp = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=9, temperature=0)
    request_id = resp.id.removeprefix("cmpl-")
    lines = [json.loads(line) for line in trace_file.read_text().splitlines()]
    assert lines[0]["type"] == "header" and lines[0]["meta"]["command"] == "serve"
    steps = [x for x in lines if x["type"] == "step" and x["request_id"] == request_id]
    summary = [x for x in lines if x["type"] == "request" and x["request_id"] == request_id]
    assert sum(len(s["emitted"]) for s in steps) == resp.usage.completion_tokens
    assert len(summary) == 1 and summary[0]["target_passes"] == len(steps)


def test_token_id_prompt_and_plain_decoding(client: Any, engine: Any) -> None:
    ids = engine.tokenizer("class Stack:")["input_ids"]
    plain = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=20, temperature=0, extra_body={"speculative": {"tau": 0}}
    )
    spec = client.completions.create(model=MODEL, prompt="class Stack:", max_tokens=20, temperature=0)
    assert plain.choices[0].text == spec.choices[0].text  # greedy speculation is lossless
    assert plain.model_extra["speculative"]["drafted"] == 0
    assert plain.model_extra["speculative"]["target_passes"] == plain.usage.completion_tokens


def test_stream_equals_non_streamed_text(client: Any) -> None:
    for prompt in PROMPTS[:3]:
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_stream_ends_with_done_and_carries_steps(server: str) -> None:
    body = {
        "model": MODEL,
        "prompt": "def fibonacci(n):",
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "speculative": {"steps": True, "tau": 3},
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", f"{server}/v1/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream; charset=utf-8"
        # Written as it comes (chunked, no length), not cached or buffered by a proxy, with the request's id.
        assert r.headers["transfer-encoding"] == "chunked" and "content-length" not in r.headers
        assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
        assert len(r.headers["x-request-id"]) == 24
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert {e["id"] for e in events} == {"cmpl-" + r.headers["x-request-id"]}
    steps = [e["speculative"]["step"] for e in events if "step" in e.get("speculative", {})]
    assert steps and [s["step"] for s in steps] == list(range(len(steps)))
    for s in steps:
        assert s["tau"] <= 3 and len(s["draft_pieces"]) == len(s["draft_tokens"]) == s["tau"]
        assert len(s["emitted_pieces"]) == len(s["emitted"]) <= s["n_accepted"] + 1
    assert sum(len(s["emitted"]) for s in steps) == events[-1]["usage"]["completion_tokens"] == 12
    closing = events[-2]
    assert closing["choices"][0]["finish_reason"] == "length"
    assert closing["speculative"]["target_passes"] == len(steps)


def test_chat_uses_the_chat_template(client: Any, engine: Any) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def fib"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    rendered = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = engine.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    expected = engine.generate(ids, max_new_tokens=16)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    assert resp.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected.text


def test_stop_sequences(client: Any) -> None:
    full = client.completions.create(model=MODEL, prompt="import os, sys", max_tokens=40, temperature=0)
    text = full.choices[0].text
    # A stop string from the middle of the greedy output, free of replacement characters.
    starts = [i for i in range(4, len(text) - 2) if "\ufffd" not in text[i : i + 2]]
    assert starts, f"greedy output too short to pick a stop string from: {text!r}"
    stop = text[starts[0] : starts[0] + 2]
    expected = text[: text.find(stop)]
    cut = client.completions.create(model=MODEL, prompt="import os, sys", max_tokens=40, temperature=0, stop=[stop])
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt="import os, sys", max_tokens=40, temperature=0, stop=stop, stream=True
    )
    pieces = list(streamed)
    assert "".join(c.choices[0].text for c in pieces) == expected
    assert pieces[-1].choices[0].finish_reason == "stop"


def test_models_health_metrics_and_auth(server: str, client: Any) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert health(server)["status"] == "ok"  # open without a key
    # --threads auto: every usable CPU, a step's lockstep draft on every one of them (no --draft-threads)
    h = health(server)
    cpus = len(os.sched_getaffinity(0))
    assert h["threads"] == cpus and h["draft_threads"] == cpus
    assert h["prefill_in_step"] == 256  # batching: short prompts join the step's pass
    assert h["chain_plain"] == 4  # batching: a step where nothing drafts chains four passes
    if h["runtime"] == "cpu-kernel":  # bf16 weights: the caches in bf16 too (kv_dtype auto)
        assert h["kv_dtype"] == "bf16"
    # No cost file measured on these models: the batch plans start from passes measured as the server started (or,
    # where a busy machine made every try implausible, from the steps alone: tune.starting_costs says which).
    assert "measured now" in h["costs"] or "implausible each time" in h["costs"], h["costs"]
    metrics = httpx.get(f"{server}/metrics", timeout=5).text
    assert "specdec_spec_decode_num_draft_tokens_total" in metrics
    # The loaded heap is out of the garbage collector's scans, and its pauses are measured.
    samples = {s.name: s for f in text_string_to_metric_families(metrics) for s in f.samples}
    assert samples["specdec_gc_frozen_objects"].value > 10_000  # torch, the models, the engine
    assert "specdec_gc_pause_seconds_count" in samples
    if sys.platform.startswith("linux"):  # the process's CPU, and its own threads' (from /proc)
        assert samples["process_cpu_seconds_total"].value > 0
        threads = {
            s.labels["thread"]: s.value
            for f in text_string_to_metric_families(metrics)
            for s in f.samples
            if s.name == "specdec_server_thread_cpu_seconds_total"
        }
        assert set(threads) == {"event_loop", "scheduler"} and min(threads.values()) >= 0
    denied = httpx.post(f"{server}/v1/completions", json={"prompt": "x"}, timeout=5)
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=f"{server}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="x", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="best_of=3"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, best_of=3)


def _request(i: int) -> dict[str, Any]:
    """Request i of the concurrency test: greedy, and every fourth one seeded sampling (also reproducible)."""
    body: dict[str, Any] = {
        "prompt": PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)),
        "max_tokens": 10 + i % 7,
        "temperature": 0.0,
    }
    if i % 4 == 3:
        body.update(temperature=0.8, seed=1000 + i)
    return body


def test_concurrent_clients_match_solo_outputs(server: str) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    distinct = 16
    with httpx.Client(base_url=server, headers=headers, timeout=300) as http:
        solo = [http.post("/v1/completions", json=_request(i)).json()["choices"][0]["text"] for i in range(distinct)]

    def client_run(c: int) -> list[tuple[int, str]]:
        out = []
        oai = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=300)
        for k in range(4):
            i = (c + 5 * k) % distinct
            body = _request(i)
            kwargs = {
                "model": MODEL,
                "prompt": body["prompt"],
                "max_tokens": body["max_tokens"],
                "temperature": body["temperature"],
                "seed": body.get("seed"),
            }
            if (c + k) % 2:
                text = "".join(ch.choices[0].text for ch in oai.completions.create(stream=True, **kwargs))
            else:
                text = oai.completions.create(**kwargs).choices[0].text
            out.append((i, text))
        return out

    with ThreadPoolExecutor(16) as pool:
        results = [r for rs in pool.map(client_run, range(16)) for r in rs]
    assert len(results) == 64
    mismatches = [(i, text, solo[i]) for i, text in results if text != solo[i]]
    assert not mismatches
    snap = health(server)
    assert snap["active"] == 0 and snap["queued"] == 0 and snap["rejected"] == 0


def _wait_idle(url: str, timeout: float = 15) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = health(url)
        if snap["active"] == 0 and snap["queued"] == 0:
            return snap
        time.sleep(0.1)
    raise AssertionError(f"requests still held after {timeout} s: {health(url)}")


def test_disconnect_mid_stream_frees_the_request(server: str, client: Any) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    before = health(server)["cancelled"]
    body = {
        "model": MODEL,
        "prompt": "def fibonacci(n):",
        "max_tokens": 240,
        "temperature": 0,
        "stream": True,
        "speculative": {"steps": True, "tau": 1},
    }
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=headers, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(line.startswith("data: ") for line in got)
        assert health(server)["active"] == 1
    # The connection is closed: the generation must be cancelled and dropped, not run to 240 tokens.
    snap = _wait_idle(server)
    assert snap["cancelled"] == before + 1
    # A non-streamed request whose client gives up is cancelled too (thousands of tokens: far longer than 0.2 s).
    with pytest.raises(httpx.ReadTimeout):
        long_body = {**body, "stream": False, "max_tokens": LONG_CONTEXT - 64}
        httpx.post(f"{server}/v1/completions", json=long_body, headers=headers, timeout=0.2)
    snap = _wait_idle(server)
    assert snap["cancelled"] == before + 2
    # ...and the server keeps serving.
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0).usage.completion_tokens


def test_cli_refuses_bad_flags(tiny_models: dict[str, Path]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "serve", "--target", "/nonexistent/dir", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("specdec: error:") and "Traceback" not in proc.stderr


def test_cli_refuses_bad_draft_threads(capsys: pytest.CaptureFixture[str]) -> None:
    """``--draft-threads`` outside 1..--threads, or with --ray: one line naming the flag, exit 2, before any model
    loads."""
    from specdec.cli import main

    assert main(["serve", "--threads", "2", "--draft-threads", "3"]) == 2
    err = capsys.readouterr().err
    assert err == "specdec: error: --draft-threads must be an integer from 1 to the compute threads (2), got '3'\n"
    assert main(["serve", "--ray", "--draft-threads", "1"]) == 2
    err = capsys.readouterr().err
    assert err == "specdec: error: --draft-threads: with --ray each replica computes on its --replica-cpus\n"


def test_threads_setting() -> None:
    from specdec.commands.serve import serve_threads
    from specdec.errors import InvalidRequestError
    from specdec.runtime.cpu import usable_cpus

    assert serve_threads("auto") == usable_cpus()
    assert serve_threads("3") == 3
    for bad in ("0", "-2", "many"):
        with pytest.raises(InvalidRequestError, match="--threads must be a positive integer or auto"):
            serve_threads(bad)


def test_apply_threads_sets_the_pass_and_draft_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--threads N``: every pass on N threads, a step's lockstep draft too unless ``--draft-threads`` says fewer
    (refused outside 1..N, by name); ``set_draft_threads`` refuses a count below 1 and never exceeds the compute
    threads."""
    import torch

    from specdec.commands.serve import apply_threads
    from specdec.errors import InvalidRequestError
    from specdec.runtime import native_kernel as nk

    monkeypatch.setattr(nk, "_DRAFT_THREADS", None)
    before = torch.get_num_threads()
    try:
        assert apply_threads("3") == 3 and nk.pass_threads() == 3 and nk.draft_threads() == 3
        assert apply_threads("3", "2") == 3 and nk.pass_threads() == 3 and nk.draft_threads() == 2
        assert apply_threads("3") == 3 and nk.draft_threads() == 3  # unset again: every thread
        assert apply_threads("1") == 1 and nk.draft_threads() == 1
        for bad in ("0", "2", "x", "-1"):
            with pytest.raises(InvalidRequestError, match=r"--draft-threads must be an integer from 1 to .*\(1\)"):
                apply_threads("1", bad)
        torch.set_num_threads(2)
        nk.set_draft_threads(4)
        assert nk.draft_threads() == 2  # at most the compute threads
        nk.set_draft_threads(None)
        assert nk.draft_threads() == 2
        with pytest.raises(ValueError, match="positive"):
            nk.set_draft_threads(0)
    finally:
        torch.set_num_threads(before)


def test_the_load_test_sends_through_the_openai_package_too(server: str) -> None:
    """``load_test.py --client openai``: the openai package's AsyncOpenAI sends the measured requests, as a Python
    application would (several times the load test's own client's CPU a request): the same text and tokens as the own
    client, streamed and whole, the specdec fields through its ``extra_body``, an error response as one line, and a
    small run with every greedy output identical to its solo run."""
    import asyncio

    from specdec.testing import import_script

    lt = import_script(Path(__file__).parents[1] / "benchmarks/load_test.py", "load_test_sdk")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    model = httpx.get(server + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}

    async def go() -> tuple[Any, list[Any], str]:
        conn = lt.StreamConnection(server, headers, 60)
        client = lt.openai_client(server, API_KEY, 60)
        try:
            own = await lt.one_request(conn, body)
            sdk = [
                await lt.one_request_openai(client, body, model),
                await lt.one_request_openai(
                    client, {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}, model
                ),
                await lt.one_request_openai(client, {**body, "speculative": {"tau": 2}}, model),
            ]
            with pytest.raises(RuntimeError, match="HTTP 400") as bad:
                await lt.one_request_openai(client, {**body, "max_tokens": -1}, model)
            return own, sdk, str(bad.value)
        finally:
            await conn.close()
            await client.close()

    own, (streamed, whole, tau2), error = asyncio.run(go())
    assert own.text and streamed.text == whole.text == tau2.text == own.text
    assert streamed.tokens == whole.tokens == own.tokens == 12 and streamed.ttft <= streamed.latency
    assert whole.ttft != whole.ttft  # nan: not streamed
    assert "max_tokens" in error
    argv = ["--url", server, "--api-key", API_KEY, "--concurrency", "3", "--requests", "5", "--rounds", "1"]
    args = lt.parse_args([*argv, "--modes", "tau2", "--client", "openai"])
    args.max_tokens, args.prompt_list = 10, PROMPTS[:3]
    report = asyncio.run(lt.main_async(args, {"batched": server}))
    assert report["greedy_identity"] == {"prompt_mode_levels": 3, "differing": 0}
    assert all(r["requests"] == 5 and r["errors"] == 0 and r["client_cpu_ms_per_request"] > 0 for r in report["rows"])


async def _answer() -> int:
    return 42


def test_the_load_test_client_reads_what_httpx_reads(server: str) -> None:
    """benchmarks/load_test.py streams through its own keep-alive HTTP/1.1 connection (httpx cost ~0.3 of a core at
    16 clients on the machine it measured): the same text, token count and errors as through httpx, several requests
    on one connection, and a small run of the whole load test with every greedy output identical to solo."""
    import asyncio

    from specdec.testing import import_script

    lt = import_script(Path(__file__).parents[1] / "benchmarks/load_test.py", "load_test_e2e")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}

    async def go() -> tuple[list[Any], Any, str]:
        conn = lt.StreamConnection(server, headers, 60)
        try:
            raw = [await lt.one_request(conn, {**body, "max_tokens": n}) for n in (12, 5, 12)]
            async with httpx.AsyncClient(base_url=server, headers=headers, timeout=60) as http:
                ref = await lt.one_request_httpx(http, body)
            with pytest.raises(RuntimeError, match="HTTP 400") as bad:
                await lt.one_request(conn, {**body, "max_tokens": -1})
            after = await lt.one_request(conn, body)  # the connection still serves after an error response
            # --no-stream: a whole response on the same connection
            whole = await lt.one_request(
                conn, {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
            )
            return [*raw, after, whole], ref, str(bad.value)
        finally:
            await conn.close()

    samples, ref, error = asyncio.run(go())
    assert samples[0].text == samples[2].text == samples[3].text == ref.text and ref.text
    assert samples[0].tokens == ref.tokens == 12 and samples[1].tokens == 5
    assert samples[1].text == ref.text[: len(samples[1].text)] and samples[0].ttft <= samples[0].latency
    assert samples[4].text == ref.text and samples[4].tokens == 12 and samples[4].ttft != samples[4].ttft  # nan
    assert "max_tokens" in error
    argv = ["--url", server, "--api-key", API_KEY, "--concurrency", "3", "--requests", "5", "--rounds", "2"]
    args = lt.parse_args([*argv, "--modes", "plain", "tau2"])
    args.max_tokens, args.prompt_list = 10, PROMPTS[:3]
    report = asyncio.run(lt.main_async(args, {"batched": server}))
    assert report["greedy_identity"] == {"prompt_mode_levels": 6, "differing": 0}
    assert all(r["requests"] == 10 and r["errors"] == 0 and r["tokens_per_s"] > 0 for r in report["rows"])
    assert all(len(r["round_tokens_per_s"]) == 2 and min(r["round_tokens_per_s"]) > 0 for r in report["rows"])
    # 5 requests through 3 clients: every client busy from the first response's end to the third's (the first client
    # then finds no request left), the tokens streamed meanwhile counted (a round whose three first responses ended in
    # the same step has no such stretch: at least one of the two has one)
    assert all(r["steady_tokens_per_s"] > 0 and 1 <= len(r["round_steady_tokens_per_s"]) <= 2 for r in report["rows"])
    # what the load generator itself took from the machine, per request: CPU it spent, so more than nothing
    assert all(0 < r["client_cpu_ms_per_request"] < 1e3 for r in report["rows"])
    assert "Load generator (this process" in lt.render(report)
    # what the server's event loop spent a request, from its /metrics (its threads' CPU: on Linux, from /proc)
    if sys.platform.startswith("linux"):
        assert all(0 <= r["server_loop_cpu_ms_per_request"] < 1e3 for r in report["rows"])
    assert asyncio.run(lt.server_loop_cpu("http://127.0.0.1:9", headers, 5)) is None  # nothing there: no figure
    # uvloop where installed (the server's extra brings it): the generator's own CPU per streamed chunk is lower
    run, name = lt.event_loop()
    assert name == "uvloop" and run(_answer()) == 42
    # --no-stream: whole responses, no time to first token
    whole = lt.parse_args([*argv, "--modes", "tau2", "--no-stream", "--rounds", "1"])
    whole.max_tokens, whole.prompt_list = 10, PROMPTS[:3]
    unstreamed = asyncio.run(lt.main_async(whole, {"batched": server}))
    assert unstreamed["greedy_identity"] == {"prompt_mode_levels": 3, "differing": 0}
    row = unstreamed["rows"][0]
    assert row["errors"] == 0 and 0 < row["mean_tokens"] <= 10 and row["p50_ttft_s"] != row["p50_ttft_s"]
    assert row["steady_tokens_per_s"] is None  # no events to place in time
    assert "| – |" in lt.render(unstreamed)
    # Another OpenAI server beside ours (here the same one, asked through plain bodies and --other-body's fields):
    # its own mode, held to its own solo outputs, and those compared with ours.
    other = ["--other", f"same={server}", "--other-body", '{"speculative": {"tau": 3}}', "--rounds", "1"]
    args = lt.parse_args([*argv, "--modes", "plain", *other])
    args.max_tokens, args.prompt_list = 10, PROMPTS[:3]
    report = asyncio.run(lt.main_async(args, {"batched": server}))
    assert [r["mode"] for r in report["rows"]] == ["plain", "same"] and report["rows"][1]["requests"] == 5
    assert report["other_identity"] == {
        "same": {"prompt_levels": 3, "differing": 0, "solo_equal_to_specdec": 3, "prompts": 3}
    }


def test_the_load_test_waits_out_a_full_queue_as_the_server_asks(
    chat_target: Path, chat_draft: Path, tmp_path: Path
) -> None:
    """More clients than a server runs and queues (here one running, none waiting): its 429s carry the wait in whole
    seconds (``Retry-After``) and in milliseconds (``retry-after-ms``, what the OpenAI SDKs read first), and the load
    test's clients, its own and the openai package's, wait what the server asks and try again: every request answered,
    none an error, the refusals counted apart, every greedy output identical to its solo run. Fails where a 429 is
    an error (the load test until session 78: at 96 clients against the default queue, 220 of 384 requests)."""
    import asyncio

    from specdec.testing import import_script

    lt = import_script(Path(__file__).parents[1] / "benchmarks/load_test.py", "load_test_refused")
    with served(chat_target, chat_draft, tmp_path / "server.log", "--max-active", "1", "--max-queue", "0") as url:
        body = {"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0}

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                return list(await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(4))))

        refused = [r for r in asyncio.run(burst()) if r.status_code == 429]
        assert refused, "four requests at once through one slot and no queue: some must be refused"
        for r in refused:
            seconds, ms = int(r.headers["retry-after"]), int(r.headers["retry-after-ms"])
            assert 1 <= seconds <= 60 and 1 <= ms <= 60_000 and seconds - 1 <= ms / 1000 <= seconds, (seconds, ms)
        for client in ("own", "openai"):
            argv = ["--url", url, "--concurrency", "4", "--requests", "8", "--rounds", "1", "--level-warmup", "0"]
            args = lt.parse_args([*argv, "--modes", "tau2", "--client", client])
            args.max_tokens, args.prompt_list = 10, PROMPTS[:3]
            report = asyncio.run(lt.main_async(args, {"batched": url}))
            (row,) = report["rows"]
            assert row["requests"] == 8 and row["errors"] == 0 and row["refused"] > 0, (client, row)
            assert report["greedy_identity"] == {"prompt_mode_levels": 3, "differing": 0}
            assert "Refused with 429" in lt.render(report)

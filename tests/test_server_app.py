"""The app in-process (``create_app`` over tiny checkpoints): every bad input gets the right 4xx in OpenAI's
shape, and the scheduler's limits (429, 408, 413, 401) and interleaving behave."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from specdec.errors import InvalidRequestError  # noqa: E402
from specdec.server import ServerSettings, create_app  # noqa: E402

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def engine(tiny_models: dict[str, Path]) -> Any:
    import specdec

    return specdec.load(tiny_models["llama"], tiny_models["draft"])


def run(app: Any, coro_fn: Any) -> Any:
    """Run ``coro_fn(client)`` against the app, then stop its worker thread."""

    async def main() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await coro_fn(client)

    try:
        return asyncio.run(main())
    finally:
        app.state.scheduler.stop()


@pytest.fixture
def app(engine: Any) -> Iterator[Any]:
    app = create_app(engine, ServerSettings(model_name="tiny", max_body_bytes=4096))
    yield app
    app.state.scheduler.stop()
    engine.observers.clear()


BAD_COMPLETIONS: list[tuple[bytes, int, str | None, str]] = [
    (b"{", 400, None, "invalid_json"),
    (b'{"prompt": "caf\xe9"}', 400, None, "invalid_utf8"),
    (b"[1, 2]", 400, None, "invalid_request"),
    (b'"just a string"', 400, None, "invalid_request"),
    (b"", 400, None, "invalid_request"),
    (b'{"max_tokens": 3}', 400, "prompt", "missing_field"),
    (b'{"prompt": 5}', 400, "prompt", "invalid_value"),
    (b'{"prompt": ""}', 400, "prompt", "invalid_value"),
    (b'{"prompt": []}', 400, "prompt", "invalid_value"),
    (
        b'{"prompt": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q"]}',
        400,
        "prompt",
        "invalid_value",
    ),
    (b'{"prompt": ["a", "b", "c", "d", "e", "f", "g", "h", "i"], "n": 2}', 400, "n", "invalid_value"),
    (b'{"prompt": ["a", [1, 2]]}', 400, "prompt", "invalid_value"),
    (b'{"prompt": [1, -4]}', 400, "prompt", "invalid_value"),
    (b'{"prompt": [100000]}', 400, "prompt", "invalid_value"),
    (b'{"prompt": "\\ud800"}', 400, "prompt", "invalid_value"),
    (b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens", "invalid_value"),
    (b'{"prompt": "x", "max_tokens": -3}', 400, "max_tokens", "invalid_value"),
    (b'{"prompt": "x", "max_tokens": "ten"}', 400, "max_tokens", "invalid_value"),
    (b'{"prompt": "x", "max_tokens": 2.5}', 400, "max_tokens", "invalid_value"),
    (b'{"prompt": "x", "max_tokens": 100000}', 400, "max_tokens", "context_length_exceeded"),
    (b'{"prompt": "x", "temperature": -1}', 400, "temperature", "invalid_value"),
    (b'{"prompt": "x", "temperature": NaN}', 400, "temperature", "invalid_value"),
    (b'{"prompt": "x", "temperature": "hot"}', 400, "temperature", "invalid_value"),
    (b'{"prompt": "x", "top_p": 0}', 400, "top_p", "invalid_value"),
    (b'{"prompt": "x", "top_k": -1}', 400, "top_k", "invalid_value"),
    (b'{"prompt": "x", "min_p": 1.5}', 400, "min_p", "invalid_value"),
    (b'{"prompt": "x", "min_p": -0.1}', 400, "min_p", "invalid_value"),
    (b'{"prompt": "x", "seed": 1e30}', 400, "seed", "invalid_value"),
    (b'{"prompt": "x", "seed": 100000000000000000000000}', 400, "seed", "invalid_value"),
    (b'{"prompt": "x", "stop": ""}', 400, "stop", "invalid_value"),
    (b'{"prompt": "x", "stop": [1]}', 400, "stop", "invalid_value"),
    (b'{"prompt": "x", "stream": "yes"}', 400, "stream", "invalid_value"),
    (b'{"prompt": "x", "n": 0}', 400, "n", "invalid_value"),
    (b'{"prompt": "x", "n": 17}', 400, "n", "invalid_value"),
    (b'{"prompt": "x", "best_of": 3}', 400, "best_of", "unsupported"),
    (b'{"prompt": "x", "n": 2, "best_of": 3}', 400, "best_of", "unsupported"),
    (b'{"prompt": [-1], "echo": true}', 400, "prompt", "invalid_value"),  # token ids checked before they are echoed
    (b'{"prompt": [[5], [100000]], "echo": true}', 400, "prompt.1", "invalid_value"),
    (b'{"prompt": "x", "prediction": "x"}', 400, "prediction", "invalid_value"),
    (b'{"prompt": "x", "prediction": {"type": "text", "content": "x"}}', 400, "prediction.type", "invalid_value"),
    (b'{"prompt": "x", "prediction": {"type": "content"}}', 400, "prediction.content", "missing_field"),
    (b'{"prompt": "x", "logprobs": 6}', 400, "logprobs", "invalid_value"),
    (b'{"prompt": "x", "logprobs": -1}', 400, "logprobs", "invalid_value"),
    (b'{"prompt": "x", "presence_penalty": 2.5}', 400, "presence_penalty", "invalid_value"),
    (b'{"prompt": "x", "frequency_penalty": -3}', 400, "frequency_penalty", "invalid_value"),
    (b'{"prompt": "x", "repetition_penalty": 0}', 400, "repetition_penalty", "invalid_value"),
    (b'{"prompt": "x", "logit_bias": {"abc": 1}}', 400, "logit_bias", "invalid_value"),
    (b'{"prompt": "x", "logit_bias": {"5": 101}}', 400, "logit_bias.5", "invalid_value"),
    (b'{"prompt": "x", "logit_bias": {"100000": 1}}', 400, "logit_bias", "invalid_value"),
    (b'{"prompt": "x", "min_tokens": -1}', 400, "min_tokens", "invalid_value"),
    (b'{"prompt": "x", "max_tokens": 4, "min_tokens": 5}', 400, "min_tokens", "invalid_value"),
    (b'{"prompt": "x", "ignore_eos": "yes"}', 400, "ignore_eos", "invalid_value"),
    (b'{"prompt": "x", "model": "gpt-4"}', 404, "model", "model_not_found"),
    (b'{"prompt": "x", "model": 3}', 400, "model", "invalid_value"),
    (b'{"prompt": "x", "speculative": {"policy": "nope"}}', 400, "speculative.policy", "invalid_value"),
    (b'{"prompt": "x", "speculative": {"policy": "adaptive:max_tau=3"}}', 400, "speculative.policy", "invalid_value"),
    (b'{"prompt": "x", "speculative": {"tau": -1}}', 400, "speculative.tau", "invalid_value"),
    (b'{"prompt": "x", "speculative": {"tau": 2, "policy": "adaptive"}}', 400, "speculative.tau", "invalid_value"),
    (
        b'{"prompt": "x", "speculative": {"max_verify_passes": 0}}',
        400,
        "speculative.max_verify_passes",
        "invalid_value",
    ),
    (b'{"prompt": "x", "speculative": {"bogus": 1}}', 400, "speculative.bogus", "invalid_value"),
    (b'{"prompt": "x", "speculative": 4}', 400, "speculative", "invalid_value"),
]


@pytest.mark.parametrize(("body", "status", "param", "code"), BAD_COMPLETIONS)
def test_bad_completion_requests(app: Any, body: bytes, status: int, param: str | None, code: str) -> None:
    async def go(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})

    r = run(app, go)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["param"], err["code"]) == (param, code), err
    assert err["message"] and err["type"] in ("invalid_request_error", "not_found_error")


BAD_CHATS: list[tuple[dict[str, Any], str | None, str]] = [
    ({}, "messages", "missing_field"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": "hi"}, "messages", "invalid_value"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "invalid_value"),
    ({"messages": [{"content": "hi"}]}, "messages.0.role", "missing_field"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages.0.content",
        "invalid_value",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
        "max_completion_tokens",
        "invalid_value",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        "invalid_value",
    ),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs", "invalid_value"),
    # The tiny tokenizer has no chat template: a clear 400, not a crash.
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages", "no_chat_template"),
    # Fields that would change what is generated are refused, named, rather than ignored ...
    *[
        ({"messages": [{"role": "user", "content": "hi"}], name: value}, name, "unsupported")
        for name, value in (
            ("functions", [{"name": "f"}]),
            ("function_call", {"name": "f"}),
            ("modalities", ["text", "audio"]),
            ("audio", {"voice": "alloy", "format": "wav"}),
            ("web_search_options", {}),
        )
    ],
    (
        {"messages": [{"role": "user", "content": "hi"}], "tools": [], "tool_choice": "auto", "functions": [{}]},
        "functions",
        "unsupported",
    ),
    # Tools: "auto" (the default with tools) needs a parser of the model's call syntax; a call without tools.
    (
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
        "tool_choice",
        "unsupported",
    ),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool_choice", "invalid_value"),
    # ... and accepted at their neutral values (on to the missing chat template).
    (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "text"},
            "tools": [],
            "tool_choice": "auto",
            "function_call": "none",
            "parallel_tool_calls": True,
            "modalities": ["text"],
            "audio": None,
            "prediction": {"type": "content", "content": "a predicted output"},
        },
        "messages",
        "no_chat_template",
    ),
]


@pytest.mark.parametrize(("body", "param", "code"), BAD_CHATS)
def test_bad_chat_requests(app: Any, body: dict[str, Any], param: str, code: str) -> None:
    r = run(app, lambda c: c.post("/v1/chat/completions", json=body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err


CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


def test_chat_template_of_the_server(engine: Any, tmp_path: Path) -> None:
    """``--chat-template`` (``ServerSettings.chat_template``) gives a model without one chat completions, rendered
    with it: the reply is the engine's greedy continuation of the rendered conversation."""
    from specdec.server.requests import read_chat_template

    assert not getattr(engine.tokenizer, "chat_template", None)  # the tiny tokenizer has none (see BAD_CHATS)
    path = tmp_path / "chat.jinja"
    path.write_text(CHAT_TEMPLATE)
    assert read_chat_template(str(path)) == read_chat_template(CHAT_TEMPLATE) == CHAT_TEMPLATE
    app = create_app(engine, ServerSettings(model_name="tiny", chat_template=read_chat_template(str(path))))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def fib"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0}
    r = run(app, lambda c: c.post("/v1/chat/completions", json=body))
    assert r.status_code == 200, r.text
    ids = engine.tokenizer("[system] be brief\n[user] def fib\n[assistant] ", add_special_tokens=False)["input_ids"]
    assert r.json()["choices"][0]["message"]["content"] == engine.generate(ids, max_new_tokens=12).text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("chatml", "neither a file nor a Jinja template"),
        ("templates/chat.jinja", "no such file: templates/chat.jinja"),
        ("{% for m in messages %}{{ m['content'] }}", "not a valid Jinja template (line 1"),
        ("{{ raise_exception('roles must alternate') }}", "fails on a one-message conversation"),
        ("{% if add_generation_prompt %}[assistant]{% endif %}", "renders without its message"),
    ],
)
def test_bad_chat_template_refused_at_start(engine: Any, value: str, words: str) -> None:
    from specdec.server.requests import read_chat_template

    with pytest.raises(InvalidRequestError, match=words.replace("(", r"\(")):
        create_app(engine, ServerSettings(chat_template=read_chat_template(value)))


def test_oversized_body_is_413_with_or_without_content_length(app: Any) -> None:
    big = json.dumps({"prompt": "x" * 5000}).encode()

    async def chunks() -> Any:
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    async def go(client: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response]:
        declared = await client.post("/v1/completions", content=big)
        chunked = await client.post("/v1/completions", content=chunks())
        return declared, chunked

    for r in run(app, go):
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_unknown_routes_and_methods_use_the_error_shape(app: Any) -> None:
    async def go(client: httpx.AsyncClient) -> list[httpx.Response]:
        return [
            await client.get("/v1/nothing"),
            await client.get("/v1/completions"),
            await client.post(
                "/v1/completions", content=b'{"prompt": "x", "max_tokens": 2}', headers={"content-type": "text/plain"}
            ),
        ]

    missing, wrong_method, as_text = run(app, go)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    assert as_text.status_code == 200  # curl -d sends form encoding: JSON is accepted whatever the content type


def test_api_key(engine: Any) -> None:
    app = create_app(engine, ServerSettings(model_name="tiny", api_key="sekrit"))

    async def go(client: httpx.AsyncClient) -> list[httpx.Response]:
        body = {"prompt": "x", "max_tokens": 2}
        return [
            await client.post("/v1/completions", json=body),
            await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}),
            await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekrit"}),
            await client.get("/health"),
        ]

    try:
        none, wrong, right, health = run(app, go)
    finally:
        engine.observers.clear()
    assert none.status_code == wrong.status_code == 401
    assert none.json()["error"]["code"] == "invalid_api_key" and none.headers["www-authenticate"] == "Bearer"
    assert right.status_code == 200 and health.status_code == 200
    info = health.json()  # /health needs no key, and says what is served and where its batch costs come from
    assert info["drafter"] == engine.drafter.name and info["costs"] == engine.costs_note
    head = getattr(getattr(engine.drafter, "runner", None), "head_tokens", None)
    assert info["draft_head"] == ("full" if head is None else len(head))


def test_prefill_in_step_setting() -> None:
    assert ServerSettings().prefill_tokens_in_step == 256
    assert ServerSettings(max_batch=1).prefill_tokens_in_step == 0  # one request per pass: today's behaviour
    assert ServerSettings(max_batch=1, prefill_in_step=64).prefill_tokens_in_step == 64
    with pytest.raises(InvalidRequestError, match="prefill_in_step=-1"):
        ServerSettings(prefill_in_step=-1)


def test_chain_plain_setting() -> None:
    assert ServerSettings().chain_passes == 4
    assert ServerSettings(max_batch=1).chain_passes == 1  # one request per pass: today's behaviour
    assert ServerSettings(chain_plain=1).chain_passes == 1
    with pytest.raises(InvalidRequestError, match="chain_plain=0"):
        ServerSettings(chain_plain=0)


def test_full_queue_answers_429_with_retry_after(engine: Any) -> None:
    app = create_app(engine, ServerSettings(model_name="tiny", max_active=1, max_queue=1))
    body = {"prompt": "def fibonacci(n):", "max_tokens": 60, "temperature": 0}

    async def go(client: httpx.AsyncClient) -> list[httpx.Response]:
        return list(await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(6))))

    try:
        responses = run(app, go)
    finally:
        engine.observers.clear()
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 2 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
    busy = next(r for r in responses if r.status_code == 429)
    assert int(busy.headers["retry-after"]) >= 1 and busy.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(busy.headers["retry-after-ms"]) <= 1000 * int(busy.headers["retry-after"])
    texts = {r.json()["choices"][0]["text"] for r in responses if r.status_code == 200}
    assert len(texts) == 1  # the admitted ones all ran to the same greedy output


def test_request_timeout_is_408_and_frees_the_slot(engine: Any) -> None:
    app = create_app(engine, ServerSettings(model_name="tiny", request_timeout=0.01))  # 240 tokens take ~0.15 s
    body = {"prompt": "def fibonacci(n):", "max_tokens": 240, "temperature": 0, "speculative": {"tau": 1}}

    async def go(client: httpx.AsyncClient) -> tuple[httpx.Response, dict[str, Any]]:
        r = await client.post("/v1/completions", json=body)
        return r, (await client.get("/health")).json()

    try:
        r, health = run(app, go)
    finally:
        engine.observers.clear()
    assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
    assert health["active"] == 0 and health["failed"] == 1


class _StepOrder:
    """An engine observer recording which request each step belonged to, in the order the worker ran them."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def on_step(self, record: Any) -> None:
        self.ids.append(record.request_id)

    def on_request(self, summary: Any) -> None:
        pass


def test_requests_are_interleaved_step_by_step(app: Any, engine: Any) -> None:
    """Three requests at once: the worker round-robins over them, one step each, until each finishes."""
    order = _StepOrder()
    engine.observers.append(order)
    bodies = [
        {"prompt": p, "max_tokens": 30, "temperature": 0, "speculative": {"tau": 2}, "stream": s}
        for p, s in (("class Stack:", True), ("import os", False), ("def f(", True))
    ]

    async def go(client: httpx.AsyncClient) -> list[httpx.Response]:
        return list(await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies)))

    assert all(r.status_code == 200 for r in run(app, go))
    ids = order.ids
    assert len(set(ids)) == 3
    last = {rid: max(i for i, x in enumerate(ids) if x == rid) for rid in set(ids)}
    first = {rid: ids.index(rid) for rid in set(ids)}
    both_running = max(first.values())
    # Once all three are admitted, no request takes a second step before the others took theirs.
    for i in range(both_running, min(last.values())):
        window = ids[i : i + 3]
        if len(window) == 3 and all(last[r] > i + 2 for r in set(ids)):
            assert len(set(window)) == 3, ids


def test_models_and_metrics(app: Any) -> None:
    async def go(client: httpx.AsyncClient) -> list[httpx.Response]:
        await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "temperature": 0})
        return [await client.get("/v1/models"), await client.get("/metrics"), await client.get("/openapi.json")]

    models, metrics, schema = run(app, go)
    card = models.json()["data"][0]
    assert card["id"] == "tiny" and card["max_context"] == 256 and card["drafter"] == "model"
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "specdec_verify_passes_total" in metrics.text and "specdec_server_requests_running 0.0" in metrics.text
    paths = schema.json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(paths)
    assert "specdec_server_thread_cpu_seconds_total" in metrics.text  # the threads' CPU (samples where /proc has it)
    if sys.platform.startswith("linux"):  # the worker has run: its CPU is read (the event loop's from the lifespan on)
        assert 'specdec_server_thread_cpu_seconds_total{thread="scheduler"}' in metrics.text
        assert "process_cpu_seconds_total" in metrics.text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread CPU is read from /proc")
def test_thread_cpu_counts_a_thread_from_when_it_took_its_role() -> None:
    """``ThreadCpu``: the CPU a thread spent since it took its role (the event loop's thread loaded the models before
    it served: not the loop's), as a Prometheus counter by role; a thread that ended has no sample, and no error.
    ``/proc`` gives a thread's CPU in clock ticks (10 ms): 0.5 s burnt read 0.49-0.51 s in 12 runs with two other
    processes busy on the two cores (session 65); the bounds below are 20 ticks or more from it, and without the start
    left out it reads ~1 s."""
    from specdec.server.observe import ThreadCpu

    cpu = ThreadCpu()
    measured, done = threading.Event(), threading.Event()

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def worker() -> None:
        burn(0.5)  # before the role
        cpu.watch_current("worker")
        burn(0.5)
        measured.set()
        done.wait(30)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert measured.wait(30)
        assert 0.3 <= cpu.seconds()["worker"] <= 0.75  # the 0.5 s since, not the 1 s of the thread's life
        (family,) = cpu.collect()
        (sample,) = family.samples
        assert sample.name == "specdec_server_thread_cpu_seconds_total" and sample.labels == {"thread": "worker"}
    finally:
        done.set()
        thread.join()
    # (join returns as the thread finishes in Python; the OS takes its task away a moment later)
    deadline = time.monotonic() + 10
    while cpu.seconds() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cpu.seconds() == {}


def _sse_chunks(text: str) -> list[dict[str, Any]]:
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


_STREAM_BODY = {
    "prompt": "def fibonacci(n):",
    "max_tokens": 33,
    "temperature": 0,
    "ignore_eos": True,
    "speculative": {"tau": 0},
}


def _stream_texts(
    engine: Any, settings: ServerSettings, extra: dict[str, Any]
) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """``_STREAM_BODY`` (plus ``extra``) answered whole and streamed by an app with ``settings``: the whole text, the
    stream's chunks before its closing one (their text must add up to the whole), and ``/health``."""
    app = create_app(engine, settings)

    async def go(client: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response, dict[str, Any]]:
        whole = await client.post("/v1/completions", json={**_STREAM_BODY, **extra})
        streamed = await client.post("/v1/completions", json={**_STREAM_BODY, **extra, "stream": True})
        return whole, streamed, (await client.get("/health")).json()

    try:
        whole, streamed, health = run(app, go)
    finally:
        engine.observers.clear()
    assert whole.status_code == streamed.status_code == 200
    chunks = [c for c in _sse_chunks(streamed.text) if c["choices"][0]["finish_reason"] is None]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.json()["choices"][0]["text"]
    return whole.json()["choices"][0]["text"], chunks, health


def test_stream_interval_gathers_tokens_and_keeps_the_text(engine: Any) -> None:
    """``--stream-interval 4``: after its first text a stream sends a chunk per 4 tokens at least (its last one at
    once), the same text as every step's chunk at interval 1 and as the answer in one piece; a request asking for
    logprobs still gets each step's chunk (its tokens' figures belong to the step)."""

    def texts(interval: int, extra: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
        # one token a step (no chained plain passes, which make several): what the interval gathers is counted
        settings = ServerSettings(model_name="tiny", stream_interval=interval, stream_interval_ms=0, chain_plain=1)
        text, chunks, health = _stream_texts(engine, settings, extra)
        assert health["stream_interval"] == interval
        return text, chunks

    every, each_step = texts(1, {})
    gathered, fewer = texts(4, {})
    assert gathered == every
    # Plain decoding, one token a step (the tiny model's random tokens: some steps' text is held back as partial
    # characters): at interval 1 a chunk per step with text; at 4 the first text, then 4 tokens a chunk at least, the last.
    assert len(fewer) <= 1 + -(-32 // 4) + 1 < len(each_step), (len(fewer), len(each_step))
    # With logprobs every step is its own chunk: 33 tokens' figures over as many chunks as there were steps.
    _, with_logprobs = texts(4, {"logprobs": 1})
    figures = [t for c in with_logprobs for t in (c["choices"][0]["logprobs"] or {"tokens": []})["tokens"]]
    assert len(figures) == 33 and len(with_logprobs) >= 30


def test_stream_interval_ms_sends_a_chunk_per_interval_and_keeps_the_text(engine: Any) -> None:
    """``--stream-interval-ms``: after its first text a choice's text waits that long after its last chunk (its last
    text at once). With an interval longer than the request, a stream is its first text and then the rest in its last
    chunk, the same text as every step's chunk at 0 and as the answer in one piece (the first text sent as it comes);
    a request asking for logprobs still gets each step's chunk."""

    def texts(ms: float, extra: dict[str, Any]) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
        return _stream_texts(engine, ServerSettings(model_name="tiny", stream_interval_ms=ms), extra)

    every, each_step, health = texts(0, {})
    assert health["stream_interval_ms"] == 0 and len(each_step) >= 3
    gathered, two, health = texts(10_000, {})
    assert health["stream_interval_ms"] == 10_000
    assert gathered == every
    assert len(two) == 2, [c["choices"][0]["text"] for c in two]  # the first text, then all the rest at the end
    # With logprobs every step is its own chunk whatever the interval: 33 tokens' figures.
    _, with_logprobs, _ = texts(10_000, {"logprobs": 1})
    figures = [t for c in with_logprobs for t in (c["choices"][0]["logprobs"] or {"tokens": []})["tokens"]]
    assert len(figures) == 33 and len(with_logprobs) >= 30


def test_stream_interval_setting() -> None:
    assert ServerSettings().stream_interval == 1
    assert ServerSettings().stream_interval_ms == 20.0
    with pytest.raises(InvalidRequestError, match="stream_interval=0"):
        ServerSettings(stream_interval=0)
    with pytest.raises(InvalidRequestError, match="stream_interval_ms=-1"):
        ServerSettings(stream_interval_ms=-1)


def test_an_answer_in_one_piece_gets_no_step_messages(engine: Any) -> None:
    """The scheduler posts a request that is not streamed its start and its result, not a message per step that
    its event loop would read and drop; a streamed one gets its steps."""
    from specdec.server.scheduler import Done, Job, Scheduler, Started, Step

    scheduler = Scheduler(engine, max_active=4, max_queue=0, max_batch=4)
    chain, engine.chain_plain = engine.chain_plain, 1  # a token a step: a message a step

    async def kinds(stream: bool) -> list[str]:
        job = Job(
            request_id=f"r{stream}",
            build=lambda e: [e.start("import os", max_new_tokens=12, tau=0)],
            loop=asyncio.get_running_loop(),
            deadline=float("inf"),
            stream=stream,
        )
        scheduler.submit(job)
        return [type(m).__name__ async for m in job.messages()]

    try:
        whole = asyncio.run(kinds(False))
        streamed = asyncio.run(kinds(True))
    finally:
        scheduler.stop()
        engine.chain_plain = chain
    assert whole == [Started.__name__, Done.__name__]
    assert streamed[0] == Started.__name__ and streamed[-1] == Done.__name__
    assert streamed.count(Step.__name__) >= 6


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_text_chunk_is_the_same_bytes_as_the_event_built_whole(kind: str) -> None:
    """Most streamed events carry text only: they are made from the event's bytes before and after the text, kept per
    choice. They must be the bytes of the event built as a whole, whatever the text (quotes, control characters,
    non-ASCII, the kept placeholder's own characters) and whatever the model's name."""
    from specdec.server.responses import Reply

    for model in ("specdec-default", 'a "quoted" \x00specdec-text\x00 model'):
        reply = Reply(id="cmpl-1", created=1_700_000_000, model=model, kind=kind)  # type: ignore[arg-type]
        for text in ("hello", "", 'é\n"q"\t\\ ✓ 🙂', "\x00specdec-text\x00", "\x00"):
            for index in (0, 2, 0):  # the kept parts of a choice serve its later events
                got = reply.chunk(text, index=index)
                assert got == reply._chunk_event(text, index).encode()
                event = json.loads(got.decode().removeprefix("data: "))
                choice = event["choices"][0]
                assert (choice["text"] if kind == "completion" else choice["delta"]["content"]) == text
                assert event["model"] == model and choice["index"] == index


def test_a_list_of_prompts_gets_each_prompts_choices_in_turn(engine: Any) -> None:
    """``prompt`` as a list: prompt i's n choices are indices i·n .. i·n + n − 1, each the output that prompt gets in a
    request of its own (all of them step together); usage counts each prompt once; streams and echo follow."""
    app = create_app(engine, ServerSettings(model_name="tiny"))
    prompts = ["def f(x):", "class A:", "import os"]
    base = {"max_tokens": 6, "temperature": 0}
    ids = engine.encode(prompts[1])

    async def go(client: httpx.AsyncClient) -> Any:
        alone = [(await client.post("/v1/completions", json={**base, "prompt": p})).json() for p in prompts]
        many = (await client.post("/v1/completions", json={**base, "prompt": prompts, "n": 2})).json()
        mixed = (await client.post("/v1/completions", json={**base, "prompt": [ids, [5, 6, 7]], "echo": True})).json()
        streamed = await client.post("/v1/completions", json={**base, "prompt": prompts, "stream": True})
        return alone, many, mixed, streamed

    alone, many, mixed, streamed = run(app, go)
    assert [c["index"] for c in many["choices"]] == list(range(6))
    assert [c["text"] for c in many["choices"]] == [a["choices"][0]["text"] for a in alone for _ in range(2)]
    assert many["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert many["usage"]["completion_tokens"] == 2 * sum(a["usage"]["completion_tokens"] for a in alone)
    assert len(many["speculative"]["choices"]) == 6
    assert mixed["choices"][0]["text"].startswith(engine.tokenizer.decode(ids, skip_special_tokens=True))
    assert mixed["choices"][1]["text"].startswith(engine.tokenizer.decode([5, 6, 7], skip_special_tokens=True))
    events = [json.loads(x[6:]) for x in streamed.text.splitlines() if x.startswith("data: {")]
    texts = ["", "", ""]
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == [a["choices"][0]["text"] for a in alone]
    finished = [c["index"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert sorted(finished) == [0, 1, 2]


def test_a_fault_in_the_workers_own_round_fails_its_requests_and_the_server_goes_on(engine: Any) -> None:
    """Something outside a request's own work fails in a round (here the metrics hook the worker calls after every
    step): the requests of that round end with a 500 at once, not at their timeout, and the next request is served
    by the same worker. Before, the worker thread ended and every request in flight hung."""
    app = create_app(engine, ServerSettings(model_name="tiny", request_timeout=30))
    scheduler = app.state.scheduler
    observe, calls = scheduler.on_step, [0]

    def faulty(sequences: int, rows: int) -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("metrics hook failed")
        observe(sequences, rows)

    scheduler.on_step = faulty
    body = {"prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def go(client: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response, dict[str, Any]]:
        # Bounded: without the recovery the first request never ends (its worker is gone), and this fails here.
        failed = await asyncio.wait_for(client.post("/v1/completions", json=body), 20)
        served = await asyncio.wait_for(client.post("/v1/completions", json=body), 20)
        return failed, served, (await client.get("/health")).json()

    try:
        failed, served, health = run(app, go)
    finally:
        engine.observers.clear()
    assert failed.status_code == 500, failed.text
    assert (
        failed.json()["error"]["code"] == "internal_error"
        and "metrics hook failed" in failed.json()["error"]["message"]
    )
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 8
    assert health["failed"] == 1 and health["completed"] == 1 and health["active"] == 0


def test_a_steps_text_goes_out_once_the_next_step_has_drafted(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The text of a step for a request still running is handed to its event loop once the next step's drafts are made
    (right before that step's target pass, where the loop's writing overlaps a long pass rather than the short draft
    forwards); a request that finished hears of it at once; the text, in order, is the solo output; nothing stays
    held when the worker runs out of work."""
    from specdec.server.scheduler import Done, Job, Scheduler, Started, Step

    loop = asyncio.new_event_loop()

    def job(name: str, prompt: str, tokens: int) -> Job:
        return Job(
            request_id=name,
            build=lambda e: [e.start(prompt, max_new_tokens=tokens, tau=2)],
            loop=loop,
            deadline=float("inf"),
        )

    got: list[Any] = []  # a's messages in the order its loop received them

    def drain(j: Job) -> list[Any]:
        loop.run_until_complete(asyncio.sleep(0))
        out = []
        while not j.queue.empty():
            out.append(j.queue.get_nowait())
        if j is a:
            got.extend(out)
        return out

    at_join: list[list[type]] = []  # what a's loop had received when each step's drafts were done
    step = engine.step

    def spy(generations: Any, join: Any = None) -> Any:
        def joined() -> Any:
            out = join()
            at_join.append([type(m) for m in drain(a)])
            return out

        return step(generations, joined if join is not None else None)

    monkeypatch.setattr(engine, "step", spy)
    try:
        scheduler = Scheduler(engine, max_active=4, max_queue=4, max_batch=4)
        a, b = job("a", "def fibonacci(n):", 12), job("b", "import os", 1)
        scheduler._admit(a)
        scheduler._admit(b)
        assert [type(m) for m in drain(a)] == [Started] and [type(m) for m in drain(b)] == [Started]
        scheduler._advance([a, b])
        assert at_join == [[]]
        assert drain(a) == []  # a goes on: its text waits for the next step's drafts
        assert [type(m) for m in drain(b)] == [Step, Done]  # b finished: at once
        scheduler._advance([a])
        assert at_join[1] == [Step]  # the first step's text, before the second step's pass
        while scheduler._active:
            scheduler._advance(list(scheduler._active))
            drain(a)
        assert not scheduler._held and isinstance(got[-1], Done)
        text = "".join(m.event.text for m in got if isinstance(m, Step))
        assert text == engine.generate("def fibonacci(n):", max_new_tokens=12, tau=0).text
    finally:
        monkeypatch.undo()
        loop.close()


def test_requests_left_out_of_a_rotated_round_are_set_aside_for_its_time(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More active requests than ``max_batch``: the rounds rotate, and a request's next record holds as its rest what
    its own steps cost between them, not the round it sat out (``Scheduler._round``, ``Generation.set_aside``). Here
    a's rounds take 40 ms longer (before its plan: in its own rest); b's rests stay far below that."""
    from specdec.server.scheduler import Job, Scheduler

    loop = asyncio.new_event_loop()
    step = engine.step

    def slow_for_a(generations: Any, join: Any = None) -> Any:
        if any(g.request_id.startswith("a") for g in generations):
            time.sleep(0.04)
        return step(generations, join)

    def job(name: str, prompt: str) -> Job:
        return Job(
            request_id=name,
            build=lambda e: [e.start(prompt, max_new_tokens=12, tau=2, request_id=f"{name}-0")],
            loop=loop,
            deadline=float("inf"),
        )

    monkeypatch.setattr(engine, "step", slow_for_a)
    try:
        scheduler = Scheduler(engine, max_active=4, max_queue=4, max_batch=1)
        a, b = job("a", "def fibonacci(n):"), job("b", "import os")
        scheduler._admit(a)
        scheduler._admit(b)
        for _ in range(3):
            scheduler._round([a])
            scheduler._round([b])
        (gb,) = b.gens
        assert len(gb.records) == 3
        # each of b's records after its first: its rest, the round it sat out (>= 40 ms) set aside
        assert all(0.0 <= r.other_time < 0.02 for r in gb.records[1:]), [r.other_time for r in gb.records]
        # a's own slow rounds stay in its own rest (the 40 ms come before its plan), b's fast ones are set aside
        (ga,) = a.gens
        assert all(0.04 <= r.other_time < 0.06 for r in ga.records[1:]), [r.other_time for r in ga.records]
    finally:
        monkeypatch.undo()
        scheduler.stop()
        loop.close()


def test_a_request_arriving_while_a_round_drafts_joins_that_rounds_pass(engine: Any) -> None:
    """A job waiting when a round's drafts are done (it arrived meanwhile) is admitted into that round's target pass
    (``Engine.step``'s ``join``): its Started and its first text come with that round, where it waited for the next
    round before; its whole text is its solo output. With ``max_batch`` full it waits for the next round."""
    from specdec.server.scheduler import Job, Scheduler, Started, Step

    loop = asyncio.new_event_loop()
    engine.prefill_in_step, before = 256, engine.prefill_in_step

    def job(name: str, prompt: str) -> Job:
        return Job(
            request_id=name,
            build=lambda e: [e.start(prompt, max_new_tokens=10, tau=2)],
            loop=loop,
            deadline=float("inf"),
        )

    def drained(j: Job) -> list[Any]:
        loop.run_until_complete(asyncio.sleep(0))
        out = []
        while not j.queue.empty():
            out.append(j.queue.get_nowait())
        return out

    try:
        scheduler = Scheduler(engine, max_active=4, max_queue=4, max_batch=2)
        a, b, c = job("a", "def fibonacci(n):"), job("b", "import os"), job("c", "class Node:")
        scheduler._admit(a)
        scheduler._waiting.extend([b, c])
        scheduler._advance([a])  # b joins the pass; c does not fit max_batch = 2
        got_b = drained(b)
        assert [type(m) for m in got_b] == [Started]  # its first text is held until the next round has drafted
        scheduler._post_held()
        got_b += drained(b)
        assert [type(m) for m in got_b] == [Started, Step]
        assert got_b[1].event.record.reason == "joined after the step's drafts" and got_b[1].event.record.tau == 0
        assert list(scheduler._waiting) == [c] and not drained(c)
        texts = {"b": "".join(m.event.text for m in got_b if isinstance(m, Step))}
        while scheduler._active:
            scheduler._advance(list(scheduler._active), join=False)
            texts["b"] += "".join(m.event.text for m in drained(b) if isinstance(m, Step))
        assert texts["b"] == engine.generate("import os", max_new_tokens=10, tau=0).text
        assert not scheduler._held
    finally:
        engine.prefill_in_step = before
        loop.close()

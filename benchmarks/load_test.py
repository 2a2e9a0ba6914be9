"""Load benchmark for ``specdec serve``: throughput and latency at several concurrency levels, for
batched plain decoding, batched speculation (the policy, and fixed τ) and one-request-per-pass serving,
side by side in one run.

    python benchmarks/load_test.py --spawn --concurrency 1 4 16 32 --requests 32 --json load.json
    python benchmarks/load_test.py --url http://127.0.0.1:8000 --modes plain spec   # a server you started
    python benchmarks/load_test.py --from-json load.json --plot load.png             # re-draw a report
    python benchmarks/load_test.py --spawn --prompts benchmarks/long_prompts.jsonl   # prompts of 1-729 tokens
    python benchmarks/load_test.py --spawn --other llama.cpp=http://127.0.0.1:8080    # another server beside ours

``--spawn`` starts two servers on loopback with the same models (``--serve-args``): one with the default
``--max-batch`` and one with ``--max-batch 1``, both with ``--prefix-cache off`` unless ``--prefix-cache`` says
otherwise (the load test sends each of its prompts many times: with the cache on, every prompt after its first
sending copies its whole prefill, which is a server's behaviour for repeated prompts but not what the load measures;
the report says what share of the prompt tokens each mode's server found cached); mode ``unbatched`` is the policy on the second, every
other mode runs on the first (``plain`` asks for ``"speculative": {"tau": 0}``, ``spec`` for the policy,
``tauN`` for fixed τ = N). Modes alternate within each concurrency level so machine noise hits all alike, in an
order rotated each round (``--rounds``), and the JSON keeps each round's tokens/s (``round_tokens_per_s``).
Every request streams (``stream_options.include_usage``) so time to first token is measured too, each client on a
keep-alive connection of its own read by a small HTTP/1.1 reader (``StreamConnection``: httpx took ~0.3 of a core at
16 clients, on the machine it measures), on uvloop where it is installed (``event_loop``); the report says how much
CPU the load generator itself took per request (``client_cpu_ms_per_request``), and, where the server reports its
threads' CPU on its ``/metrics`` (``specdec serve`` on Linux), its event loop's (``server_loop_cpu_ms_per_request``,
read before and after each level's rounds). ``--no-stream`` asks for whole
responses instead (no time to first token): what a server serves to clients that do not stream, where each step's
tokens are not written to every client as they come (docs/server.md: on two cores the event loop's and the load
generator's work per streamed chunk lands on the model's passes).

Reports, per mode and concurrency: output tokens/s (all clients together), requests/s, p50/p95 request
latency, p50 time to first token, and each mode's throughput relative to batched plain. Beside the tokens/s of a
level's whole rounds, the tokens/s while all its clients had a request in flight (``run_level``): a round's last
requests are served to fewer and fewer clients, which slows a batching server and not a one-request-per-pass one,
so the whole rounds' figure of a batching server depends on the number of requests (``--requests``). Every greedy output
is compared with a solo target-only run of the same prompt on the same server (by its text): speculation and
batching are lossless, so every output must match; the exit code is 1 if one does not.

``--other NAME=URL`` adds another OpenAI-compatible server as mode NAME (llama.cpp's ``llama-server``, vLLM, ...;
``benchmarks/vs_llama_cpp.py`` starts llama.cpp's): it gets the same prompts and clients, in turn with the other
modes, with plain completion bodies (no ``speculative``; ``--other-body`` adds fields, e.g. ``{"cache_prompt":
false}``). Its greedy outputs are compared with its own solo run of each prompt and with ours, and reported: they are
not ours to promise, so they do not set the exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from specdec.retry_after import retry_delay

PROMPTS = [
    "def quicksort(items):\n",
    "def binary_search(items, target):\n    lo, hi = 0, len(items)\n",
    'class Stack:\n    """A last-in first-out container."""\n\n    def __init__(self):\n',
    'import json\n\n\ndef load_config(path):\n    """Read a JSON config file."""\n',
    "def fibonacci(n):\n",
    "    def __repr__(self):\n        return ",
    "try:\n    import numpy as np\nexcept ImportError:\n",
    "def merge(left, right):\n    result = []\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "def parse_args():\n    parser = argparse.ArgumentParser(",
    "    for i, line in enumerate(lines):\n",
    "def read_json(path):\n    with open(path",
    "class Node:\n    def __init__(self, value, next=None):\n",
    "if __name__ == '__main__':\n",
]


@dataclass
class Sample:
    latency: float
    ttft: float
    tokens: int
    text: str
    prompt_tokens: int = 0  # from the usage (0 where the server sent none)
    cached_tokens: int = 0  # of those, held by the server's prefix cache (usage.prompt_tokens_details)
    arrivals: list[float] = field(default_factory=list)  # perf_counter at each streamed event that carried text
    done_at: float = 0.0  # perf_counter when the response ended

    def tokens_within(self, start: float, end: float) -> float:
        """The completion tokens that arrived within (start, end]: each text event carrying an equal share of them
        (a server streams a step's tokens in one event, and steps make about as many tokens as each other; one token
        an event where the server streams so, as llama.cpp's does)."""
        if not self.arrivals:
            return 0.0
        share = self.tokens / len(self.arrivals)
        return share * sum(1 for t in self.arrivals if start < t <= end)


@dataclass
class Result:
    mode: str
    concurrency: int
    requests: int = 0
    wall: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    refused: int = 0  # 429s the clients met (each then tried again after the wait the server asked: not errors)
    texts: dict[int, set[str]] = field(default_factory=dict)  # prompt index -> outputs seen
    rounds: list[float] = field(default_factory=list)  # output tokens/s of each round (the spread of the figure)
    # Of each round, the tokens streamed while every client had a request in flight, and for how long (``run_level``).
    steady_tokens: float = 0.0
    steady_wall: float = 0.0
    steady_rounds: list[float] = field(default_factory=list)
    client_cpu: float = 0.0  # seconds of CPU this process (the load generator) spent while the rounds ran
    # seconds of CPU the server's event loop spent over the rounds (its /metrics, where it gives them) and the requests
    # of the rounds it was read over
    server_loop_cpu: float = 0.0
    server_loop_requests: int = 0

    def summary(self) -> dict[str, Any]:
        lat = sorted(s.latency for s in self.samples)
        tokens = sum(s.tokens for s in self.samples)
        return {
            "mode": self.mode,
            "concurrency": self.concurrency,
            "requests": len(self.samples),
            "errors": len(self.errors),
            "refused": self.refused,
            "tokens_per_s": tokens / self.wall if self.wall else 0.0,
            "requests_per_s": len(self.samples) / self.wall if self.wall else 0.0,
            "p50_latency_s": _pct(lat, 50),
            "p95_latency_s": _pct(lat, 95),
            # requests that produced no text (an immediate EOS) have no first token: left out
            "p50_ttft_s": _pct(sorted(s.ttft for s in self.samples if s.ttft == s.ttft), 50),
            "mean_tokens": tokens / len(self.samples) if self.samples else 0.0,
            "prompt_tokens": sum(s.prompt_tokens for s in self.samples),
            "cached_prompt_tokens": sum(s.cached_tokens for s in self.samples),
            "round_tokens_per_s": [round(r, 1) for r in self.rounds],
            # tokens/s while all the level's clients had a request in flight (None: no such stretch, or no stream)
            "steady_tokens_per_s": self.steady_tokens / self.steady_wall if self.steady_wall else None,
            "round_steady_tokens_per_s": [round(r, 1) for r in self.steady_rounds],
            # what the load generator took from the machine it measures, per request it sent
            "client_cpu_ms_per_request": 1e3 * self.client_cpu / len(self.samples) if self.samples else 0.0,
            # what the server's event loop spent per request (None: the server does not report it)
            "server_loop_cpu_ms_per_request": (
                1e3 * self.server_loop_cpu / self.server_loop_requests if self.server_loop_requests else None
            ),
        }


def _pct(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation: with few samples it is an observed value)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, round(q / 100 * len(sorted_values) + 0.4999))
    return sorted_values[min(rank, len(sorted_values)) - 1]


class StreamConnection:
    """One keep-alive HTTP/1.1 connection that posts streaming completions and reads their SSE events with asyncio's
    own streams. The load generator runs on the machine it measures: httpx spent ~100 µs of CPU per event (its
    connection pool, h11, anyio and line iteration), ~0.3 of a core at 16 clients, taken from the server's two;
    this reads an event in a few µs of Python. Non-streamed and error responses are read too (Content-Length)."""

    def __init__(self, url: str, headers: dict[str, str], timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"{url}: only http:// URLs are supported")
        self.host, self.port, self.timeout = parts.hostname, parts.port or 80, timeout
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._head = f"Host: {parts.netloc}\r\nContent-Type: application/json\r\n{extra}"
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        """Open the connection unless it is open (before a timed run: connecting is not what is measured)."""
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)

    async def post_stream(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], AsyncIterator[bytes]]:
        """POST ``body``; the status code, the response's headers (names in lower case) and its body's pieces as they
        arrive."""
        data = json.dumps(body).encode()
        for attempt in (0, 1):  # a kept-alive connection the server closed meanwhile: reconnect once
            await self.connect()
            assert self._reader is not None and self._writer is not None
            self._writer.write(
                f"POST {path} HTTP/1.1\r\n{self._head}Content-Length: {len(data)}\r\n\r\n".encode() + data
            )
            try:
                await self._writer.drain()
                head = await asyncio.wait_for(self._reader.readuntil(b"\r\n\r\n"), self.timeout)
            except (ConnectionError, asyncio.IncompleteReadError):
                await self.close()
                if attempt:
                    raise
                continue
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            return status, fields, self._body(fields)
        raise AssertionError("unreachable")

    async def _body(self, fields: dict[str, str]) -> AsyncIterator[bytes]:
        reader = self._reader
        assert reader is not None
        if fields.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")  # no trailers from uvicorn: the empty line
                    break
                piece = await reader.readexactly(size + 2)
                yield piece[:-2]
        else:
            yield await reader.readexactly(int(fields.get("content-length", "0")))
        if fields.get("connection", "").lower() == "close":
            await self.close()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await self._writer.wait_closed()
        self._reader = self._writer = None


def _raise_reported(obj: dict[str, Any]) -> None:
    """An error the server reported in an event or a response body (OpenAI's shape), as an exception."""
    if "error" in obj:
        raise RuntimeError(obj["error"]["message"])


class _Reading:
    """What one streamed completion's SSE events say: its text, completion tokens and time to first text."""

    def __init__(self, started: float | None = None) -> None:
        self.t0 = time.perf_counter() if started is None else started
        self.ttft = float("nan")
        self.text: list[str] = []
        self.arrivals: list[float] = []
        self.tokens = 0
        self.usage = False
        self.prompt_tokens = self.cached_tokens = 0

    def event(self, data: str | bytes) -> None:
        """One event's ``data:`` payload (``[DONE]`` included)."""
        if data in ("[DONE]", b"[DONE]"):
            return
        chunk = json.loads(data)
        _raise_reported(chunk)
        if chunk.get("usage"):
            self._usage(chunk["usage"])
        for choice in chunk.get("choices", ()):
            self._text(choice.get("text"))

    def sdk_chunk(self, chunk: Any) -> None:
        """One streamed chunk as the ``openai`` package hands it over (``--client openai``)."""
        if chunk.usage is not None:
            self._usage(chunk.usage.model_dump())
        for choice in chunk.choices:
            self._text(choice.text)

    def _text(self, text: str | None) -> None:
        if text:
            now = time.perf_counter()
            if not self.text:
                self.ttft = now - self.t0
            self.text.append(text)
            self.arrivals.append(now)
            if not self.usage:  # a server that sends no usage chunk: one event per token (llama.cpp's does)
                self.tokens += 1

    def whole(self, response: dict[str, Any]) -> None:
        """A response that did not stream: its text and completion tokens (no time to first text)."""
        _raise_reported(response)
        self.text = [choice.get("text") or "" for choice in response.get("choices", ())[:1]]
        self._usage(response.get("usage") or {})

    def _usage(self, usage: dict[str, Any]) -> None:
        self.tokens, self.usage = usage.get("completion_tokens", 0), True
        self.prompt_tokens = usage.get("prompt_tokens", 0)
        self.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    def sample(self) -> Sample:
        now = time.perf_counter()
        return Sample(
            latency=now - self.t0,
            ttft=self.ttft,
            tokens=self.tokens,
            text="".join(self.text),
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            arrivals=self.arrivals,
            done_at=now,
        )


class Refused(Exception):
    """A 429: the server's waiting line is full. ``delay``: the seconds it asks the client to wait (``retry_delay``),
    None where it says nothing."""

    def __init__(self, message: str, delay: float | None) -> None:
        super().__init__(message)
        self.delay = delay


async def one_request(conn: StreamConnection, body: dict[str, Any], started: float | None = None) -> Sample:
    """One completion: its latency (from ``started``, a ``perf_counter`` reading, where a refusal came before it),
    time to first text (streamed), completion tokens (the usage chunk) and text."""
    reading = _Reading(started)
    status, fields, pieces = await conn.post_stream("/v1/completions", body)
    if status != 200:
        raw = b"".join([p async for p in pieces])
        message = f"HTTP {status}: {raw.decode(errors='replace')[:200]}"
        if status == 429:
            raise Refused(message, retry_delay(fields))
        raise RuntimeError(message)
    if not body.get("stream"):
        reading.whole(json.loads(b"".join([p async for p in pieces])))
        return reading.sample()
    pending = b""
    async for piece in pieces:
        pending += piece
        *events, pending = pending.split(b"\n\n")
        for event in events:
            if event.startswith(b"data: "):
                reading.event(event[6:])
    return reading.sample()


async def one_request_httpx(client: httpx.AsyncClient, body: dict[str, Any]) -> Sample:
    """``one_request`` through httpx (what the fast client is checked against in the tests)."""
    reading = _Reading()
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}")
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                reading.event(line[6:])
    return reading.sample()


# The fields of a request body that the openai package's ``completions.create`` takes by name; the others
# (``speculative``, another server's --other-body fields) go as its ``extra_body``.
SDK_FIELDS = ("prompt", "max_tokens", "temperature", "seed", "stream", "stream_options")


def openai_client(url: str, api_key: str | None, timeout: float) -> Any:
    """An ``openai.AsyncOpenAI`` for one simulated client (its own connection pool), no retries."""
    import openai

    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key or "none", max_retries=0, timeout=timeout)


async def one_request_openai(client: Any, body: dict[str, Any], model: str, started: float | None = None) -> Sample:
    """``one_request`` through the ``openai`` package (``--client openai``): what a Python application sends and reads,
    with that package's cost a request on the machine measured. Its errors come back as ``one_request``'s do (a 429 as
    ``Refused``: the package's own retries are off, so both clients wait alike)."""
    import openai

    reading = _Reading(started)
    fields = {k: body[k] for k in SDK_FIELDS if k in body}
    extra = {k: v for k, v in body.items() if k not in SDK_FIELDS and k != "model"} or None
    try:
        answer = await client.completions.create(model=body.get("model", model), extra_body=extra, **fields)
        if body.get("stream"):
            async for chunk in answer:
                reading.sdk_chunk(chunk)
        else:
            reading.whole(answer.model_dump())
    except openai.APIStatusError as e:
        if e.status_code == 429:
            raise Refused(f"HTTP 429: {str(e)[:200]}", retry_delay(e.response.headers)) from None
        raise RuntimeError(f"HTTP {e.status_code}: {str(e)[:200]}") from None
    except openai.APIConnectionError as e:
        raise OSError(f"openai client: {e}") from None
    except openai.APIError as e:  # an error reported inside the stream
        raise RuntimeError(f"reported in the stream: {str(e)[:200]}") from None
    return reading.sample()


def request_body(args: argparse.Namespace, mode: str, i: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": args.prompt_list[i % len(args.prompt_list)],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": i,
        "stream": not args.no_stream,
    }
    if not args.no_stream:
        body["stream_options"] = {"include_usage": True}
    if args.model:
        body["model"] = args.model
    if mode in args.other:  # another server: a plain OpenAI body and the fields given for it
        return {**body, **args.other_body}
    if mode == "plain":
        body["speculative"] = {"tau": 0}
    elif mode.startswith("tau"):
        body["speculative"] = {"tau": int(mode[3:])}
    elif args.policy:  # spec, unbatched
        body["speculative"] = {"policy": args.policy}
    return body


async def run_level(
    url: str, args: argparse.Namespace, mode: str, concurrency: int, result: Result, headers: dict[str, str]
) -> None:
    """``requests_at(args.requests, concurrency)`` requests through ``concurrency`` clients, each on its own
    keep-alive connection, sending its next request when its last one is done.

    Besides the round's tokens over its whole time, the tokens streamed while every client had a request in flight:
    from the first response's end (the clients' first requests, sent together, have met in the server by then) to
    the moment the first client found no request left (from then on fewer clients are served, and a batching server
    serves its last ones in ever smaller batches: at 16 clients and 48 requests a third of the steps ran below 16
    sequences, and the whole round's tokens/s read 0.82-0.93 of this figure in process; a one-request-per-pass server
    serves as fast with fewer). That is the throughput "at N clients" whatever the number of requests."""
    counter = iter(range(requests_at(args.requests, concurrency)))
    sdk = args.client == "openai"
    conns = [] if sdk else [StreamConnection(url, headers, args.timeout) for _ in range(concurrency)]
    clients = [openai_client(url, args.api_key, args.timeout) for _ in range(concurrency)] if sdk else []
    first_done: list[float] = []  # when the first response of the round ended
    dry: list[float] = []  # when the first client found no request left

    async def send(n: int, body: dict[str, Any]) -> Sample:
        """One request as a well-behaved client sends it: refused (429), it waits what the server asks and tries
        again, its latency counted from its first try, until ``args.timeout`` has passed since then."""
        started = time.perf_counter()
        while True:
            try:
                if sdk:
                    return await one_request_openai(clients[n], body, args.model or args.served_model, started)
                return await one_request(conns[n], body, started)
            except Refused as e:
                result.refused += 1
                delay = REFUSED_WAIT if e.delay is None else e.delay
                if time.perf_counter() + delay - started > args.timeout:
                    raise RuntimeError(f"{e} (refused until the client's --timeout)") from None
                await asyncio.sleep(delay)

    async def worker(n: int) -> None:
        for i in counter:
            try:
                sample = await send(n, request_body(args, mode, i))
                result.samples.append(sample)
                result.texts.setdefault(i % len(args.prompt_list), set()).add(sample.text)
                if not first_done:
                    first_done.append(sample.done_at)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, RuntimeError) as e:
                result.errors.append(f"{type(e).__name__}: {e}")
                if not sdk:  # the next request on a fresh connection (the openai package's pool makes its own)
                    await conns[n].close()
        if not dry:
            dry.append(time.perf_counter())

    loop0 = await server_loop_cpu(url, headers, args.timeout)
    # Connections open before the clock starts: connecting is not what is measured (the openai package's clients
    # connect at their first request).
    for conn in conns:
        await conn.connect()
    t0, cpu0 = time.perf_counter(), time.process_time()
    before = sum(s.tokens for s in result.samples)
    first = len(result.samples)
    try:
        await asyncio.gather(*(worker(n) for n in range(concurrency)))
        wall = time.perf_counter() - t0
        result.wall += wall
        result.client_cpu += time.process_time() - cpu0
        result.rounds.append((sum(s.tokens for s in result.samples) - before) / wall if wall else 0.0)
        if first_done and dry and dry[0] > first_done[0]:
            start, end = first_done[0], dry[0]
            tokens = sum(s.tokens_within(start, end) for s in result.samples[first:])
            if tokens:
                result.steady_tokens += tokens
                result.steady_wall += end - start
                result.steady_rounds.append(tokens / (end - start))
    finally:
        for conn in conns:
            await conn.close()
        for client in clients:
            await client.close()
    loop1 = await server_loop_cpu(url, headers, args.timeout)
    if loop0 is not None and loop1 is not None:
        result.server_loop_cpu += loop1 - loop0
        result.server_loop_requests += len(result.samples) - first


# The server's event-loop CPU in its Prometheus text (specdec serve's ``specdec_server_thread_cpu_seconds_total``).
_LOOP_CPU = re.compile(rb'^specdec_server_thread_cpu_seconds_total\{thread="event_loop"\} (\S+)$', re.MULTILINE)


async def server_loop_cpu(url: str, headers: dict[str, str], timeout: float) -> float | None:
    """Seconds of CPU the server's event loop has spent, from its ``/metrics``; None where it does not say (another
    server, a replica fleet, a platform without per-thread CPU)."""
    try:
        async with httpx.AsyncClient(headers=headers, timeout=timeout) as http:
            r = await http.get(url + "/metrics")
    except httpx.HTTPError:
        return None
    found = _LOOP_CPU.search(r.content) if r.status_code == 200 else None
    return float(found.group(1)) if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_servers(
    commands: list[tuple[str, Callable[[int], list[str]]]], log_dir: str | None = None
) -> Iterator[dict[str, str]]:
    """Servers on loopback, each started when the one before answers ``/health`` (a batching server measures its pass
    costs as it starts: not while another one loads), all stopped after. ``commands``: a name and its command line
    for a port. Output goes to ``log_dir/NAME.log`` where given (else this process's). A server that exits or does not
    answer within 300 s is a RuntimeError naming it (and its last line of output, where logged)."""
    procs: list[subprocess.Popen[bytes]] = []
    urls: dict[str, str] = {}
    try:
        for name, command in commands:
            port = _free_port()
            log = os.path.join(log_dir, f"{name}.log") if log_dir else None
            with open(log, "wb") if log else contextlib.nullcontext() as out:  # the child keeps its own descriptor
                procs.append(subprocess.Popen(command(port), stdout=out, stderr=subprocess.STDOUT if out else None))
            url = urls[name] = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while True:
                if procs[-1].poll() is not None:
                    last = ""
                    if log:
                        with open(log, errors="replace") as f:
                            lines = f.read().strip().splitlines()
                        last = f": {lines[-1] if lines else 'no output'}"
                    raise RuntimeError(f"the {name} server ({url}) exited with {procs[-1].returncode}{last}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the {name} server ({url}) did not start within 300 s")
                time.sleep(0.5)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def spawned_servers(args: argparse.Namespace) -> contextlib.AbstractContextManager[dict[str, str]]:
    """Two ``specdec serve`` processes on loopback: the batched one and ``--max-batch 1``."""

    def serve(extra: list[str]) -> Callable[[int], list[str]]:
        head = [sys.executable, "-m", "specdec.cli", "serve", "--log-level", "warning"]
        cache = ["--prefix-cache", args.prefix_cache]
        return lambda port: [*head, "--port", str(port), *cache, *shlex.split(args.serve_args), *extra]

    return running_servers([("batched", serve([])), ("unbatched", serve(["--max-batch", "1"]))])


ROUNDS = 6  # default --rounds
REFUSED_WAIT = 0.1  # seconds a client waits after a 429 that says nothing of when to try again
LEAST_REQUESTS = 16  # default --requests: twice the clients, at least this many


def requests_at(requests: int | None, concurrency: int) -> int:
    """Requests a mode's round sends at ``concurrency`` clients: ``--requests``, by default twice the clients and at
    least LEAST_REQUESTS. Short rounds, many of them (``ROUNDS``): these machines change speed within seconds (a
    traced server ran the same 16-row pass at 4.6 ms for a whole 96-request round of one mode and 3.1 ms in the next
    mode's round), and two long rounds put that drift on a mode's ratio: the policy read 0.89 of τ = 3 at 4 clients in
    two runs of 2 rounds of 96 requests, 0.99-1.01 in runs of 6-10 shorter rounds on the same code (session 77), where
    rounds of the same length alternating every few seconds ran its passes at the same rows in the same times as τ =
    3's. Twice the clients keeps a round past its first wave of requests (the figure with every client busy)."""
    return requests if requests is not None else max(LEAST_REQUESTS, 2 * concurrency)


def level_schedule(modes: list[str], concurrency: list[int], rounds: int, warmup: int) -> list[tuple[str, str, int]]:
    """What runs, in order: (kind, mode, clients), kind "warm" or "round". At each level, before its measured rounds,
    every mode runs one unmeasured burst of as many requests as clients (``warmup`` new tokens each; none at 0): a
    level's first batches of its size pay one-off costs (cache slots and buffers first used at that size), and on a
    fresh server at 16 clients the mode that ran first read ~5% below its round after (session 60, 90 runs: the
    policy's first round 0.876 of the best fixed τ on average, its second 0.924); the burst also gives each mode's
    server, and the policy, the level's load before its clock starts. Then the rounds (``round_order``)."""
    out: list[tuple[str, str, int]] = []
    for c in concurrency:
        if warmup > 0:
            out += [("warm", mode, c) for mode in modes]
        out += [("round", mode, c) for r in range(rounds) for mode in round_order(modes, r)]
    return out


def round_order(modes: list[str], r: int) -> list[str]:
    """The modes' order in round ``r`` at a level, rotated each round (A B C, B C A, C A B, ...): no mode always runs
    first after a change of load (where a policy is still learning it) or always after the same other mode."""
    k = r % len(modes) if modes else 0
    return modes[k:] + modes[:k]


async def main_async(args: argparse.Namespace, urls: dict[str, str]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    urls = {**urls, **args.other}
    conns = {name: StreamConnection(url, headers, args.timeout) for name, url in urls.items()}
    modes = [*args.modes, *args.other]

    def server_for(mode: str) -> str:  # where a mode runs
        return mode if mode in args.other or mode == "unbatched" else "batched"

    def reference_for(mode: str) -> str:  # whose solo outputs it is held to
        return mode if mode in args.other else "batched"

    try:
        async with httpx.AsyncClient(headers=headers, timeout=args.timeout) as http:
            health = {name: await _health(http, url) for name, url in urls.items()}
            models = (await http.get(urls["batched"] + "/v1/models")).json()
        args.served_model = models["data"][0]["id"]  # what --client openai names when --model does not
        for mode in modes:  # warm-up: first requests pay one-off costs
            await one_request(conns[server_for(mode)], {**request_body(args, mode, 0), "max_tokens": 8})
        # The reference: each prompt alone, target-only, greedy (and on each other server, its own plain decoding).
        solo: dict[str, dict[int, str]] = {}
        if args.temperature == 0:
            for name in ("batched", *args.other):
                mode = "plain" if name == "batched" else name
                solo[name] = {
                    k: (await one_request(conns[name], request_body(args, mode, k))).text
                    for k in range(len(args.prompt_list))
                }
    finally:
        for conn in conns.values():
            await conn.close()
    results = {(m, c): Result(m, c) for c in args.concurrency for m in modes}
    for kind, mode, concurrency in level_schedule(modes, args.concurrency, args.rounds, args.level_warmup):
        if kind == "warm":  # unmeasured: its Result is thrown away (its outputs are not checked either)
            warm = argparse.Namespace(**{**vars(args), "requests": concurrency, "max_tokens": args.level_warmup})
            await run_level(urls[server_for(mode)], warm, mode, concurrency, Result(mode, concurrency), headers)
            continue
        await run_level(urls[server_for(mode)], args, mode, concurrency, results[(mode, concurrency)], headers)
        print(f"  {mode:>9} x{concurrency:<3} done", file=sys.stderr, flush=True)
    rows = [r.summary() for r in results.values()]
    identity = None
    others: dict[str, dict[str, Any]] = {}
    if solo:  # greedy: every output of every mode and load must equal the solo target-only output
        checked = differ = 0
        for r in results.values():
            ref = solo[reference_for(r.mode)]
            same = sum(1 for k, texts in r.texts.items() if all(t == ref[k] for t in texts))
            next(row for row in rows if row["mode"] == r.mode and row["concurrency"] == r.concurrency)[
                "identical_prompts"
            ] = f"{same}/{len(r.texts)}"
            if r.mode in args.other:
                seen = others.setdefault(r.mode, {"prompt_levels": 0, "differing": 0})
                seen["prompt_levels"] += len(r.texts)
                seen["differing"] += len(r.texts) - same
            else:
                checked += len(r.texts)
                differ += len(r.texts) - same
        identity = {"prompt_mode_levels": checked, "differing": differ}
        for name, seen in others.items():  # its plain decoding against ours, prompt by prompt
            seen["solo_equal_to_specdec"] = sum(solo[name][k] == solo["batched"][k] for k in solo["batched"])
            seen["prompts"] = len(solo["batched"])
    return {
        "server": health,
        "model": models["data"][0],
        "settings": {k: v for k, v in vars(args).items() if k != "prompt_list"},
        "prompts": args.prompt_list,
        "rows": rows,
        "greedy_identity": identity,
        "other_identity": others or None,
        "by_level": ratios(rows, list(args.other)),
    }


async def _health(http: httpx.AsyncClient, url: str) -> Any:
    """A server's ``/health`` (its JSON, else its status code): what ran, kept with the report."""
    try:
        r = await http.get(url + "/health")
        return r.json()
    except ValueError:
        return {"status_code": r.status_code}
    except httpx.HTTPError as e:
        return {"error": str(e)}


def _seconds(value: float) -> str:
    return "–" if value != value else f"{value:.3f}"  # nan: not measured (responses not streamed)


def render(report: dict[str, Any]) -> str:
    rows = report["rows"]
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    lines = [
        "| mode | clients | requests | errors | output tok/s | vs plain | tok/s, all clients busy | req/s |"
        " p50 latency s | p95 latency s | p50 TTFT s | identical to solo |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        plain = by.get(("plain", r["concurrency"]))
        ratio = f"{r['tokens_per_s'] / plain['tokens_per_s']:.2f}×" if plain and plain["tokens_per_s"] else ""
        lines.append(
            f"| {r['mode']} | {r['concurrency']} | {r['requests']} | {r['errors']} | {r['tokens_per_s']:.1f} | "
            f"{ratio} | {_cell(r.get('steady_tokens_per_s'), digits=1)} | {r['requests_per_s']:.2f} | "
            f"{r['p50_latency_s']:.3f} | {r['p95_latency_s']:.3f} | "
            f"{_seconds(r['p50_ttft_s'])} | {r.get('identical_prompts', '')} |"
        )
    refused = [r for r in rows if r.get("refused")]
    if refused:
        lines.append(
            "\nRefused with 429 (the server's waiting line full; each client waited what the refusal asked, "
            "retry-after-ms or Retry-After, and tried again, its latency counted from its first try): "
            + ", ".join(f"{r['refused']} at {r['mode']} x{r['concurrency']}" for r in refused)
            + "."
        )
    cached = [r for r in rows if r.get("cached_prompt_tokens")]
    if cached:
        lines.append(
            "\nPrompt tokens found in the server's prefix cache: "
            + ", ".join(
                f"{r['mode']} × {r['concurrency']} {100 * r['cached_prompt_tokens'] / r['prompt_tokens']:.0f}%"
                for r in cached
            )
            + " (the load test repeats its prompts: a repeat copies its prefill)."
        )
    counted = [r for r in rows if r.get("prompt_tokens") and r["requests"]]
    if counted:
        asked = sum(r["requests"] for r in counted)
        prompt = sum(r["prompt_tokens"] for r in counted) / asked
        out = sum(r["mean_tokens"] * r["requests"] for r in counted) / asked
        line = f"\nA request brought {prompt:.0f} prompt tokens on average and got {out:.0f} tokens."
        if prompt >= 0.5 * out:  # (the load test's own prompts: 14 tokens against ~50)
            line += (
                " Every prompt token is one target row in either server, at about the same cost, so prompts this long"
                " make prefill a large share of the batched server's work, and that share does not batch away: best"
                " batched ÷ --max-batch 1 falls as the prompts grow (docs/server.md, Load figures, session 83)."
            )
        lines.append(line)
    same = report["greedy_identity"]
    if same is not None:
        lines.append(
            f"\nGreedy outputs differing from the solo target-only run: {same['differing']} of "
            f"{same['prompt_mode_levels']} (prompt, mode, level) groups."
        )
    cpu = [(r["client_cpu_ms_per_request"], r["requests"]) for r in rows if r.get("client_cpu_ms_per_request")]
    if cpu:
        loop = (report.get("load_generator") or {}).get("event_loop", "?")
        mean = sum(ms * n for ms, n in cpu) / sum(n for _, n in cpu)
        lines.append(
            f"Load generator (this process, on the machine it measures; {loop}): {mean:.2f} ms of CPU a request "
            f"({min(ms for ms, _ in cpu):.2f}-{max(ms for ms, _ in cpu):.2f} by mode and level)."
        )
    # (a level can read 0: the server's figure comes in clock ticks of 10 ms)
    served = [
        (r["server_loop_cpu_ms_per_request"], r["requests"])
        for r in rows
        if r.get("server_loop_cpu_ms_per_request") is not None
    ]
    if served:
        mean = sum(ms * n for ms, n in served) / sum(n for _, n in served)
        lines.append(
            f"Server event loop (its /metrics): {mean:.2f} ms of CPU a request "
            f"({min(ms for ms, _ in served):.2f}-{max(ms for ms, _ in served):.2f} by mode and level): HTTP work on the "
            "cores the passes use (docs/server.md, Compute threads)."
        )
    for name, seen in (report.get("other_identity") or {}).items():
        lines.append(
            f"{name}: greedy outputs differing from its own solo run: {seen['differing']} of {seen['prompt_levels']}"
            f" (prompt, level) groups; its solo outputs equal to specdec's on {seen['solo_equal_to_specdec']} of"
            f" {seen['prompts']} prompts."
        )
    others = list(report.get("other_identity") or {}) or sorted(
        {name for r in report.get("by_level") or () for name in r.get("vs_other", {})}
    )
    summary = ratios(rows, others)
    if summary:
        lines += [
            "\nBy level (the batching issue's figures; rounds: the same ratio from each round's tokens/s alone, its spread"
            " on this run; all clients busy: the same from the tokens streamed while every client had a request in"
            " flight):\n",
            "| clients | policy ÷ best of plain and fixed τ (rounds) | best batched ÷ --max-batch 1 | policy ÷ --max-batch 1"
            " | policy p95 s | policy ÷ best, all clients busy | best batched ÷ --max-batch 1, all clients busy |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in summary:
            lines.append(
                f"| {r['concurrency']} | {_cell(r['policy_vs_best'], r['policy_vs_best_rounds'])} "
                + (f"against {r['best_other']} " if r["best_other"] else "")
                + f"| {_cell(r['best_batched_vs_unbatched'], unit='×')} | {_cell(r['policy_vs_unbatched'], unit='×')} | "
                f"{_cell(r['policy_p95_s'], digits=3)} | {_cell(r.get('policy_vs_best_steady'))} | "
                f"{_cell(r.get('best_batched_vs_unbatched_steady'), unit='×')} |"
            )
        for name in others:
            lines += [
                f"\nAgainst {name} (its tokens/s through the same clients):\n",
                f"| clients | policy ÷ {name} | best batched ÷ {name} | {name} p95 s |",
                "|---|---|---|---|",
            ]
            for r in summary:
                vs = r["vs_other"].get(name)
                if vs:
                    lines.append(
                        f"| {r['concurrency']} | {vs['policy']:.2f}× | {vs['best_batched']:.2f}× | {vs['p95_s']:.3f} |"
                    )
    return "\n".join(lines)


def _cell(value: float | None, spread: list[float] | None = None, unit: str = "", digits: int = 2) -> str:
    if value is None:
        return "–"
    out = f"{value:.{digits}f}{unit}"
    if spread:
        out += f" ({min(spread):.{digits}f}-{max(spread):.{digits}f})"
    return out


BATCHED_OTHERS = ("plain", "tau")  # the modes the policy is held against: batched plain and every fixed τ


def ratios(rows: list[dict[str, Any]], servers: list[str] | None = None) -> list[dict[str, Any]]:
    """Per client count, what the batching issue's goals read: the policy ('spec') against the best of batched plain
    and the fixed-τ modes present (overall, and round by round where the rows kept each round's tokens/s), the best
    batched mode and the policy against '--max-batch 1' ('unbatched'), the policy's p95 latency, and the policy and
    the best batched mode against each other server (``servers``: ``--other`` names). Levels without a 'spec' row are
    left out; a ratio whose modes did not run is None."""
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    servers_ = set(servers or ())
    out = []
    for level in sorted({r["concurrency"] for r in rows}):
        spec = by.get(("spec", level))
        if spec is None:
            continue
        others = [
            r for (mode, c), r in by.items() if c == level and mode.startswith(BATCHED_OTHERS) and mode not in servers_
        ]
        best = max(others, key=lambda r: r["tokens_per_s"], default=None)
        unbatched = by.get(("unbatched", level))
        batched = [spec, *others]
        policy_vs_best, best_vs_unbatched = _against(spec, others, unbatched, "tokens_per_s")
        busy_vs_best, busy_best_vs_unbatched = _against(spec, others, unbatched, "steady_tokens_per_s")
        per_round = None
        rounds = spec.get("round_tokens_per_s") or []
        if others and rounds and all(len(r.get("round_tokens_per_s") or []) == len(rounds) for r in others):
            round_best = [max(column) for column in zip(*(r["round_tokens_per_s"] for r in others))]
            per_round = [mine / top for mine, top in zip(rounds, round_best) if top > 0]
        out.append(
            {
                "concurrency": level,
                "policy_vs_best": policy_vs_best,
                "best_other": best["mode"] if best else None,
                "policy_vs_best_rounds": per_round,
                "best_batched_vs_unbatched": best_vs_unbatched,
                "policy_vs_unbatched": (
                    spec["tokens_per_s"] / unbatched["tokens_per_s"]
                    if unbatched and unbatched["tokens_per_s"]
                    else None
                ),
                "policy_p95_s": spec["p95_latency_s"],
                "policy_vs_best_steady": busy_vs_best,
                "best_batched_vs_unbatched_steady": busy_best_vs_unbatched,
                "vs_other": {
                    name: {
                        "policy": spec["tokens_per_s"] / other["tokens_per_s"],
                        "best_batched": max(r["tokens_per_s"] for r in batched) / other["tokens_per_s"],
                        "p95_s": other["p95_latency_s"],
                    }
                    for name in servers or ()
                    if (other := by.get((name, level))) and other["tokens_per_s"]
                },
            }
        )
    return out


def _against(
    spec: dict[str, Any], others: list[dict[str, Any]], unbatched: dict[str, Any] | None, key: str
) -> tuple[float | None, float | None]:
    """(the policy ÷ the best other batched mode, the best batched mode ÷ '--max-batch 1') from each row's ``key``: its
    tokens/s over whole rounds, or while all clients were busy (``run_level``). A ratio is None where a figure in it is
    missing (a mode without the busy figure) or 0, or its modes did not run."""
    figures = [r.get(key) for r in (spec, *others)]
    if None in figures:
        return None, None
    best = max(figures[1:], default=None)
    alone = unbatched.get(key) if unbatched else None
    return (figures[0] / best if best else None, max(figures) / alone if alone else None)


def plot(report: dict[str, Any], path: str) -> None:
    """Output tok/s and p95 latency against clients, one line per mode (PNG; matplotlib, checked by parse_args)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, (ax_tok, ax_p95) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in modes:
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["concurrency"])
        clients = [r["concurrency"] for r in mine]
        style = {"linewidth": 2.5} if mode == "spec" else {"linewidth": 1.2}
        ax_tok.plot(clients, [r["tokens_per_s"] for r in mine], marker="o", label=mode, **style)
        ax_p95.plot(clients, [r["p95_latency_s"] for r in mine], marker="o", label=mode, **style)
    for ax, title in ((ax_tok, "output tokens/s (all clients)"), (ax_p95, "p95 request latency, s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(
            sorted({r["concurrency"] for r in rows}), [str(c) for c in sorted({r["concurrency"] for r in rows})]
        )
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax_tok.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from specdec.bench.prompts import FILE_HELP as PROMPT_FILE_HELP  # no torch: the prompt files' reader and format

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a running batched server (without --spawn)")
    p.add_argument("--unbatched-url", default=None, help="a running --max-batch 1 server, for mode 'unbatched'")
    p.add_argument("--spawn", action="store_true", help="start both servers here (loopback) and stop them after")
    p.add_argument("--serve-args", default="", help="extra 'specdec serve' arguments for --spawn (models, ...)")
    p.add_argument(
        "--prefix-cache",
        default="off",
        metavar="MIB|auto|off",
        help="the spawned servers' --prefix-cache (default: off: the load test repeats its prompts, and with the "
        "cache on every repeat copies its prefill)",
    )
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model id to send (default: none, the server's)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"requests per mode, concurrency level and round (default: twice the clients, at least {LEAST_REQUESTS})",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=ROUNDS,
        help=f"alternations of the modes at each level, the order rotated each round (default {ROUNDS}: short rounds, "
        "many of them, so that the machine's changes of speed fall on every mode alike)",
    )
    p.add_argument(
        "--level-warmup",
        type=int,
        default=16,
        metavar="TOKENS",
        help="before each level's rounds, every mode runs one unmeasured burst of as many requests as clients, this "
        "many new tokens each (default 16; 0: none): a level's first batches pay one-off costs",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--policy", default="adaptive", help="policy of modes spec and unbatched (default: adaptive)")
    p.add_argument(
        "--modes",
        nargs="+",
        default=["plain", "spec", "unbatched", "tau1", "tau2", "tau3", "tau4"],
        help="plain, spec, unbatched, tauN (fixed τ = N on the batched server)",
    )
    p.add_argument(
        "--other",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="another OpenAI-compatible server, run as mode NAME beside ours (e.g. llama.cpp=http://127.0.0.1:8080)",
    )
    p.add_argument(
        "--other-body",
        default="{}",
        metavar="JSON",
        help="fields added to every request to the --other servers (e.g. '{\"cache_prompt\": false}')",
    )
    p.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help="prompts: " + PROMPT_FILE_HELP + " (specdec bench's files too)",
    )
    p.add_argument(
        "--no-stream",
        action="store_true",
        help="ask for whole responses (no time to first token) instead of streamed ones",
    )
    p.add_argument(
        "--client",
        choices=("own", "openai"),
        default="own",
        help="what sends the measured requests: the load test's own client (raw asyncio streams: the least CPU a "
        "request, on the machine it measures) or the openai package's AsyncOpenAI, as a Python application would "
        "(several times the CPU a request; docs/server.md, Load figures, session 68)",
    )
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None, metavar="FILE", help="also write the full report as JSON")
    p.add_argument("--plot", default=None, metavar="FILE", help="also draw tok/s and p95 against clients (PNG)")
    p.add_argument(
        "--from-json", default=None, metavar="FILE", help="no run: print (and --plot) a report written by --json"
    )
    args = p.parse_args(argv)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib: pip install 'specdec[bench]'")
    if args.from_json:  # a saved report: nothing is run
        return args
    if args.level_warmup < 0:
        p.error(f"--level-warmup: expected 0 or more new tokens, got {args.level_warmup}")
    if args.requests is not None and args.requests < 1:
        p.error(f"--requests: expected 1 or more, got {args.requests}")
    if args.rounds < 1:
        p.error(f"--rounds: expected 1 or more, got {args.rounds}")
    if args.client == "openai":
        try:
            import openai  # noqa: F401
        except ImportError:
            p.error("--client openai needs the openai package: pip install openai")
    for mode in args.modes:
        if mode not in ("plain", "spec", "unbatched") and not (mode.startswith("tau") and mode[3:].isdigit()):
            p.error(f"unknown mode {mode!r}: plain, spec, unbatched or tauN")
    other: dict[str, str] = {}
    for item in args.other:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith("http://"):
            p.error(f"--other {item!r}: expected NAME=http://HOST:PORT")
        if name in ("plain", "spec", "unbatched", "batched") or name.startswith("tau") or name in other:
            p.error(f"--other {item!r}: the name {name!r} is taken")
        other[name] = url.rstrip("/")
    args.other = other
    try:
        args.other_body = json.loads(args.other_body)
    except ValueError as e:
        p.error(f"--other-body: not JSON ({e})")
    if not isinstance(args.other_body, dict):
        p.error("--other-body: expected a JSON object")
    if "unbatched" in args.modes and not (args.spawn or args.unbatched_url):
        p.error("mode 'unbatched' needs --spawn or --unbatched-url")
    args.prompt_list = prompt_texts(p, args.prompts)
    return args


def prompt_texts(p: argparse.ArgumentParser, path: str | os.PathLike[str] | None) -> list[str]:
    """``--prompts``' texts (JSONL, ``specdec.bench.prompts.load_prompts``), or the load test's own without one; a bad
    file is ``p``'s one-line error (``engine_steps.py`` reads its ``--prompts`` the same way)."""
    if not path:
        return PROMPTS
    from specdec.bench.prompts import load_prompts
    from specdec.errors import InvalidRequestError

    try:
        return [q.text for q in load_prompts(path)]
    except InvalidRequestError as e:
        p.error(str(e))


def event_loop() -> tuple[Callable[[Any], Any], str]:
    """How the load generator runs its coroutines: uvloop where it is installed (the server's extra brings it), else
    asyncio's own loop. The generator shares the machine it measures; on two cores of an Emerald Rapids, 16 clients
    streaming 192 requests took 0.55-0.73 s of its CPU on uvloop against 0.81-0.91 s on asyncio's loop (three runs
    each, session 53), CPU the server's passes then do not get."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run, "asyncio"
    return uvloop.run, "uvloop"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        try:
            with open(args.from_json) as f:
                report = json.load(f)
            text = render(report)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"load_test: error: {args.from_json}: not a report written by --json ({e})", file=sys.stderr)
            return 2
        print(text)
        if args.plot:
            plot(report, args.plot)
        return 0
    run, loop_name = event_loop()
    try:
        if args.spawn:
            with spawned_servers(args) as urls:
                report = run(main_async(args, urls))
        else:
            urls = {"batched": args.url, **({"unbatched": args.unbatched_url} if args.unbatched_url else {})}
            report = run(main_async(args, urls))
        report["load_generator"] = {"event_loop": loop_name}
    except (httpx.ConnectError, OSError) as e:
        print(f"load_test: error: cannot reach a server: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"load_test: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"load_test: error: {e}", file=sys.stderr)
        return 2
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        plot(report, args.plot)
    failed = any(r["errors"] for r in report["rows"])
    differ = report["greedy_identity"] is not None and report["greedy_identity"]["differing"] > 0
    return 1 if failed or differ else 0


if __name__ == "__main__":
    sys.exit(main())

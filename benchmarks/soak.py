"""Soak test for ``specdec serve``: many clients send random requests of every kind the API takes, some hang up
half way; then the server must be drained and healthy, and every greedy output it served must be its target-only
output, token by token.

    python benchmarks/soak.py --spawn --requests 800 --clients 32            # the shipped pair, a server started here
    python benchmarks/soak.py --spawn --models "--target T --draft D" --serve-args "--max-batch 8"
    python benchmarks/soak.py --url http://127.0.0.1:8000 --trace run.jsonl --models "--target T --draft D"
    python benchmarks/soak.py --spawn --serve-args "--ray --replicas 2"      # a Ray fleet: each replica's trace

The requests (seeded by ``--seed``): completions (text, token ids, or a list of prompts) and, where the model has a
chat template, chat completions; streamed or whole; ``n`` 1-3; greedy or sampled (seeded or not); stop strings;
logprobs; penalties, ``logit_bias``, ``min_tokens``, ``ignore_eos``; a ``response_format``; tools (chat: a named
function or "required"); a ``prediction``; ``speculative`` with a fixed τ (0 included), a policy, a verification
budget, the step records. About one streamed request in ten hangs up after a few chunks, one whole request in twenty
gives up after 50 ms.

What must hold (exit status 1 if anything does not; 2 for bad arguments or a server that cannot be reached):
- no response is a 5xx; every 4xx carries an OpenAI-style error body (``error.message``, ``error.type``), and a 4xx
  that is not the model's missing chat template is reported (the requests are valid);
- every 200 is well formed: whole responses with ``n`` choices (indices 0..n-1) and a finish reason each, usage that
  adds up (with logprobs: one log probability per completion token; a JSON format's finished output whole JSON); streams of JSON chunks ending in ``[DONE]``,
  one finish reason per choice, usage last where asked;
- after the run the server is drained (``/health``: nothing running or waiting) and ``/metrics`` parses as Prometheus
  text;
- ``specdec audit --trace`` (the server's trace: ``--spawn`` writes one, one per replica under ``--ray``; ``--trace``
  names a running server's, or a fleet's files) replays every finished greedy request, with the logits rules it was
  served with, against target-only decoding: all match. Without a trace (a running server without ``--trace``, or
  ``--replay``), each greedy request served to its end is sent again, alone and target-only (``tau`` 0), to the same
  server, and every choice's text must be that one's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from specdec.retry_after import retry_delay

STOPS: list[str | list[str]] = ["\n", ")", ":", ["\n\n", "return"]]
FORMATS: list[dict[str, Any]] = [  # response_format values (about one request in ten asks for one)
    {"type": "json_object"},
    {
        "type": "json_schema",
        "json_schema": {
            "name": "item",
            "schema": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 16}, "size": {"type": "integer"}},
                "required": ["name", "size"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "regex", "regex": "[a-z_]{1,12} = [0-9]{1,4}"},
    {"type": "choice", "choice": ["return None", "pass", "raise ValueError"]},
]
FINISH = {"stop", "length", "verify_budget", "tool_calls"}
TOOLS = [  # chat requests with tools name one of them or ask for a call (tool_choice "required")
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {"key": {"type": "string", "maxLength": 12}, "limit": {"type": "integer"}},
                "required": ["key"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]
NO_TEMPLATE = "no chat template"
RETRIES = 200  # tries of one request that meets a full queue (429)


@dataclass
class Plan:
    """One request: where it goes, what it asks, and how its client behaves."""

    path: str
    body: dict[str, Any]
    hang_up_after: int = 0  # streamed: chunks read before the client goes away (0: reads it all)
    timeout: float = 600.0

    @property
    def prompts(self) -> list[Any]:
        """A completion's prompts: one, or its list's (strings or token-id lists); a chat's one conversation."""
        p = self.body.get("prompt")
        return list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]

    @property
    def choices(self) -> int:
        """Choices the answer holds: ``n`` for each prompt."""
        return int(self.body.get("n", 1)) * len(self.prompts)


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    # Greedy requests served whole to the end (a length limit or a stop), with each choice's text: the replay check.
    greedy: list[tuple[Plan, list[str]]] = field(default_factory=list)

    def problem(self, plan: Plan, what: str) -> None:
        self.outcomes["problem"] += 1
        brief = {k: v for k, v in plan.body.items() if k not in ("prompt", "messages")}
        self.problems.append(f"{plan.path} {json.dumps(brief)}: {what}")


def plan_request(
    rng: random.Random, prompts: list[str], vocab: int, max_tokens: int, chat: bool, max_n: int = 3
) -> Plan:
    text = rng.choice(prompts)
    text = text[: rng.choice([12, 80, 400, len(text)])] or text
    body: dict[str, Any] = {"max_tokens": rng.randint(1, max_tokens)}
    path = "/v1/completions"
    if chat and rng.random() < 0.2:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if path == "/v1/completions" and rng.random() < 0.1:
        body["prompt"] = [rng.randrange(1, vocab) for _ in range(rng.randint(1, 8))]
    elif path == "/v1/completions" and rng.random() < 0.1 and max_n > 1:  # a list of prompts, n choices each
        body["prompt"] = [text] + [rng.choice(prompts)[: rng.choice([12, 80, 400])] for _ in range(rng.randint(1, 2))]
    greedy = rng.random() < 0.7
    body["temperature"] = 0.0 if greedy else rng.choice([0.5, 1.0])
    if not greedy and rng.random() < 0.5:
        body["seed"] = rng.randrange(1000)
    if not greedy and rng.random() < 0.3:
        field, value = rng.choice([("top_k", 20), ("top_p", 0.9), ("min_p", 0.05)])
        body[field] = value
    lists = len(body["prompt"]) if isinstance(body.get("prompt"), list) and isinstance(body["prompt"][0], str) else 1
    if rng.random() < 0.2 and max_n // lists > 1:
        body["n"] = rng.randint(2, max_n // lists)
    if rng.random() < 0.2:
        body["stop"] = rng.choice(STOPS)
    if rng.random() < 0.2:
        if path == "/v1/chat/completions":
            body["logprobs"], body["top_logprobs"] = True, 2
        else:
            body["logprobs"] = 2
    for name, value, chance in (
        ("presence_penalty", 0.6, 0.1),
        ("frequency_penalty", 0.4, 0.1),
        ("repetition_penalty", 1.3, 0.1),
        ("ignore_eos", True, 0.1),
    ):
        if rng.random() < chance:
            body[name] = value
    if rng.random() < 0.05:
        body["logit_bias"] = {str(rng.randrange(vocab)): rng.choice([-100, 5])}
    if rng.random() < 0.05:
        body["min_tokens"] = rng.randint(1, body["max_tokens"])
    if rng.random() < 0.1:  # an output format; it decides where the output ends (no min_tokens, no ignore_eos)
        body["response_format"] = rng.choice(FORMATS)
        body.pop("min_tokens", None)
        body.pop("ignore_eos", None)
    if path == "/v1/chat/completions" and rng.random() < 0.15:  # tool calls, held to their schemas
        for name in ("response_format", "min_tokens", "ignore_eos"):  # a call's format ends the reply
            body.pop(name, None)
        body["tools"] = TOOLS
        body["tool_choice"] = rng.choice(["required", {"type": "function", "function": {"name": "lookup"}}])
        body["parallel_tool_calls"] = False
    if rng.random() < 0.15:  # a predicted output: some prompt's text (code repeats itself), whole or cut
        predicted = rng.choice(prompts)
        body["prediction"] = {"type": "content", "content": predicted[: rng.choice([40, 400, len(predicted)])]}
    spec: dict[str, Any] = {}
    r = rng.random()
    if r < 0.4:
        spec["tau"] = rng.randint(0, 7)
    elif r < 0.6:
        spec["policy"] = rng.choice(["adaptive", "heuristic", "fixed"])
    if rng.random() < 0.1:
        spec["max_verify_passes"] = rng.randint(1, 10)
    body["stream"] = rng.random() < 0.6
    if body["stream"] and rng.random() < 0.1:
        spec["steps"] = True
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if spec:
        body["speculative"] = spec
    plan = Plan(path, body)
    if body["stream"] and rng.random() < 0.1:
        plan.hang_up_after = rng.randint(1, 4)
    elif not body["stream"] and rng.random() < 0.05:
        plan.timeout = 0.05
    return plan


def check_whole(plan: Plan, obj: dict[str, Any]) -> str | None:
    """What is wrong with a whole response, or None."""
    n = plan.choices
    choices = obj.get("choices")
    if not isinstance(choices, list) or sorted(c.get("index") for c in choices) != list(range(n)):
        return f"expected choices with indices 0..{n - 1}, got {choices!r:.200}"
    if any(c.get("finish_reason") not in FINISH for c in choices):
        return f"a finish reason outside {sorted(FINISH)}: {[c.get('finish_reason') for c in choices]}"
    usage = obj.get("usage") or {}
    done = usage.get("completion_tokens")
    if not isinstance(done, int) or not 0 <= done <= n * plan.body["max_tokens"]:
        return f"completion_tokens {done!r} outside 0..{n * plan.body['max_tokens']}"
    if usage.get("total_tokens") != usage.get("prompt_tokens", 0) + done:
        return f"usage does not add up: {usage}"
    details = usage.get("completion_tokens_details")
    tau0 = plan.body.get("speculative", {}).get("tau") == 0
    if plan.body.get("prediction") and not tau0:
        kept = (details or {}).get("accepted_prediction_tokens")
        if not isinstance(kept, int) or not 0 <= kept <= done:
            return f"a prediction's accepted tokens {kept!r} outside 0..{done}: {usage}"
    elif details is not None and not tau0:
        return f"completion_tokens_details without a prediction: {usage}"
    if plan.body.get("logprobs") and plan.path == "/v1/completions":
        counted = sum(len((c.get("logprobs") or {}).get("token_logprobs") or []) for c in choices)
        if counted != done:
            return f"{counted} token log probabilities for {done} completion tokens"
    for c in choices:
        if c.get("finish_reason") == "tool_calls":
            calls = (c.get("message") or {}).get("tool_calls") or []
            if not calls or (c.get("message") or {}).get("content") is not None:
                return f"finish_reason tool_calls without calls, or with text: {c.get('message')!r:.200}"
            for call in calls:
                if call.get("function", {}).get("name") not in ("lookup", "now"):
                    return f"a call of a function not offered: {call!r:.200}"
                try:
                    json.loads(call["function"]["arguments"])
                except (KeyError, TypeError, ValueError):
                    return f"a call whose arguments are not JSON: {call!r:.200}"
    fmt = plan.body.get("response_format") or {}
    if fmt.get("type", "").startswith("json") and "stop" not in plan.body:  # a finished output is whole JSON
        for c in choices:
            text = (c.get("message") or {}).get("content") if plan.path == "/v1/chat/completions" else c.get("text")
            if c.get("finish_reason") == "stop":
                try:
                    json.loads(text)
                except (TypeError, ValueError):
                    return f"a finished {fmt['type']} output that is not JSON: {text!r:.100}"
    return None


def check_stream(plan: Plan, events: list[str]) -> str | None:
    """What is wrong with a whole stream (its ``data:`` payloads), or None."""
    if not events or events[-1] != "[DONE]":
        return f"the stream does not end with [DONE] (last: {events[-1] if events else None!r:.100})"
    finished: Counter[int] = Counter()
    chunks = []
    for raw in events[:-1]:
        try:
            chunk = json.loads(raw)
        except ValueError:
            return f"a chunk that is not JSON: {raw!r:.100}"
        if "error" in chunk:
            return f"an error in the stream: {chunk['error']}"
        chunks.append(chunk)
        for c in chunk.get("choices") or []:
            if c.get("finish_reason") is not None:
                if c["finish_reason"] not in FINISH:
                    return f"finish reason {c['finish_reason']!r}"
                finished[c.get("index")] += 1
    n = plan.choices
    if finished != Counter(range(n)):
        return f"finish reasons per choice {dict(finished)}, expected one for each of 0..{n - 1}"
    if (plan.body.get("stream_options") or {}).get("include_usage") and not (chunks and chunks[-1].get("usage")):
        return "include_usage asked, no usage in the last chunk"
    return None


async def send(client: httpx.AsyncClient, url: str, plan: Plan, tally: Tally) -> None:
    """One request as a well-behaved client sends it: a 429 (the server's queue is full) is tried again after the
    ``Retry-After`` it names (at most 1 s), up to ``RETRIES`` times."""
    for _ in range(RETRIES):
        wait = await attempt(client, url, plan, tally)
        if wait is None:
            return
        await asyncio.sleep(wait)
    tally.outcomes["429 until the client stopped trying"] += 1


async def attempt(client: httpx.AsyncClient, url: str, plan: Plan, tally: Tally) -> float | None:
    """Send ``plan`` once and tally the outcome; the seconds to wait before trying again after a 429, else None."""
    try:
        if plan.body["stream"]:
            async with client.stream("POST", url + plan.path, json=plan.body, timeout=plan.timeout) as r:
                if r.status_code != 200:
                    await r.aread()
                    return refused(plan, r, tally)
                events = []
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if plan.hang_up_after and len(events) >= plan.hang_up_after:
                            tally.outcomes["hung up mid-stream"] += 1
                            return None
                wrong = check_stream(plan, events)
                if wrong is None:
                    keep(plan, [json.loads(e) for e in events[:-1]], tally)
        else:
            r = await client.post(url + plan.path, json=plan.body, timeout=plan.timeout)
            if r.status_code != 200:
                return refused(plan, r, tally)
            wrong = check_whole(plan, r.json())
            if wrong is None:
                keep(plan, [r.json()], tally)
    except httpx.TimeoutException:
        if plan.timeout < 1:
            tally.outcomes["gave up after 50 ms"] += 1
        else:
            tally.problem(plan, "no answer within the timeout")
        return None
    except (httpx.HTTPError, ValueError) as e:
        tally.problem(plan, f"{type(e).__name__}: {e}")
        return None
    if wrong:
        tally.problem(plan, wrong)
    else:
        tally.outcomes["streamed" if plan.body["stream"] else "whole"] += 1
    return None


def keep(plan: Plan, chunks: list[dict[str, Any]], tally: Tally) -> None:
    """A greedy request's texts, one per choice, where it ran to a length limit or a stop (not its budget)."""
    if plan.body["temperature"] != 0:
        return
    texts = [""] * plan.choices
    for chunk in chunks:
        for c in chunk.get("choices") or []:
            if c.get("finish_reason") not in (None, "stop", "length"):
                return
            part = c.get("text")
            if part is None:
                part = (c.get("message") or c.get("delta") or {}).get("content")
            texts[c["index"]] += part or ""
    tally.greedy.append((plan, texts))


async def replay(client: httpx.AsyncClient, url: str, tally: Tally) -> dict[str, Any]:
    """Without a trace to audit: each greedy request served to its end, sent again alone and target-only (``tau``
    0, whole, ``n`` 1) to the same server; every choice's text must be that one's."""
    differ: list[str] = []
    for plan, texts in tally.greedy:
        body = {k: v for k, v in plan.body.items() if k not in ("stream", "stream_options", "n", "speculative")}
        n = int(plan.body.get("n", 1))
        for i, prompt in enumerate(plan.prompts):  # each prompt of a list alone too
            one = {**body, "prompt": prompt} if "prompt" in body else body
            r = await client.post(url + plan.path, json={**one, "speculative": {"tau": 0}})
            c = r.json()["choices"][0]
            alone = c["text"] if "text" in c else c["message"]["content"]
            differ += [
                f"{plan.path} {json.dumps(one)[:300]}: served {t!r:.80}, alone {alone!r:.80}"
                for t in texts[i * n : (i + 1) * n]
                if t != alone
            ]
    return {
        "ok": not differ,
        "mode": "replay",
        "prompts": len(tally.greedy),
        "choices": sum(len(t) for _, t in tally.greedy),
        "first_failure": differ[0] if differ else None,
        "differing": len(differ),
    }


def refused(plan: Plan, r: httpx.Response, tally: Tally) -> float | None:
    """Tally a refusal; for a 429, the seconds it asks (``retry-after-ms``, else ``Retry-After``; at most 1 s)."""
    try:
        error = r.json()["error"]
        message, kind = str(error["message"]), error["type"]
    except (ValueError, KeyError, TypeError):
        tally.problem(plan, f"HTTP {r.status_code} without an OpenAI-style error body: {r.text[:200]!r}")
        return None
    if r.status_code >= 500:
        tally.problem(plan, f"HTTP {r.status_code} ({kind}): {message}")
    elif r.status_code == 429:
        tally.outcomes["429 (queue full), tried again"] += 1
        delay = retry_delay(r.headers) if {"retry-after", "retry-after-ms"} & set(r.headers.keys()) else 0.1
        if delay is None:
            tally.problem(plan, f"429 with a Retry-After that is not a number: {r.headers.get('retry-after')!r}")
        else:
            return min(1.0, max(0.01, delay))
    elif NO_TEMPLATE in message:
        tally.outcomes["400 no chat template"] += 1
    else:
        tally.problem(plan, f"a valid request refused, HTTP {r.status_code} ({kind}): {message}")
    return None


async def has_chat_template(client: httpx.AsyncClient, url: str) -> bool:
    r = await client.post(
        url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    )
    return r.status_code == 200 or NO_TEMPLATE not in r.text


async def drained(client: httpx.AsyncClient, url: str, within: float = 30.0) -> dict[str, Any]:
    """``/health`` once nothing runs or waits (or as it is after ``within`` seconds)."""
    deadline = time.monotonic() + within
    while True:
        health: dict[str, Any] = (await client.get(url + "/health")).json()
        if (health.get("active"), health.get("queued")) == (0, 0) or time.monotonic() > deadline:
            return health
        await asyncio.sleep(0.2)


async def run(args: argparse.Namespace, url: str, replay_greedy: bool) -> dict[str, Any]:
    """The soak against ``url``; ``replay_greedy``: no trace to audit after, so the greedy requests are sent again."""
    from prometheus_client.parser import text_string_to_metric_families

    tally = Tally()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=600, headers=headers) as client:
        health = (await client.get(url + "/health")).json()
        chat = await has_chat_template(client, url)
        vocab = 256  # token-id prompts stay in every vocabulary
        rng = random.Random(args.seed)
        # n samples run together: at most the server's --max-batch and --max-active (a larger n is refused, 400).
        max_n = min(3, int(health.get("max_batch") or 3), int(health.get("max_active") or 3))
        plans = [plan_request(rng, args.prompt_list, vocab, args.max_tokens, chat, max_n) for _ in range(args.requests)]
        queue = list(reversed(plans))
        t0 = time.monotonic()

        async def client_loop() -> None:
            while queue:
                await send(client, url, queue.pop(), tally)

        await asyncio.gather(*(client_loop() for _ in range(args.clients)))
        seconds = time.monotonic() - t0
        after = await drained(client, url)
        if (after.get("active"), after.get("queued")) != (0, 0):
            tally.problems.append(f"not drained 30 s after the run: /health says {after}")
        metrics = (await client.get(url + "/metrics")).text
        try:
            families = {f.name for f in text_string_to_metric_families(metrics)}
        except ValueError as e:
            families = set()
            tally.problems.append(f"/metrics does not parse as Prometheus text: {e}")
        replayed = await replay(client, url, tally) if replay_greedy else None
    return {
        "url": url,
        "requests": args.requests,
        "clients": args.clients,
        "seed": args.seed,
        "seconds": round(seconds, 1),
        "chat": chat,
        "server": {k: health.get(k) for k in ("model", "runtime", "max_batch", "batched_passes")},
        "outcomes": dict(tally.outcomes),
        "after": {k: after.get(k) for k in ("active", "queued", "completed", "failed", "cancelled", "rejected")},
        "metric_families": len(families),
        "problems": tally.problems,
        "audit": replayed,
    }


def model_options(argv: list[str]) -> list[str]:
    """The model options (those every command takes: ``--dtype``, ``--kv-dtype``, ...) among ``argv``, with their
    values, in order: what of ``--serve-args`` the audit must be given too, to compute as the server did."""
    from specdec.commands.common import add_model_args

    parser = argparse.ArgumentParser(add_help=False)
    add_model_args(parser)
    known = parser._option_string_actions
    out: list[str] = []
    i = 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        action = known.get(name)
        takes = 0 if action is None or "=" in argv[i] or action.nargs == 0 else 1
        if action is not None:
            out += argv[i : i + 1 + takes]
        i += 1 + takes
    return out


def audit(args: argparse.Namespace, trace: list[str]) -> dict[str, Any]:
    """``specdec audit --trace``: every finished greedy request the trace holds (one file, or a fleet's, one per
    replica) against target-only decoding, on a target loaded with the server's model options (``--models`` and those
    among ``--serve-args``)."""
    if not trace:
        return {"ok": False, "first_failure": "no trace file to audit"}
    models = [*shlex.split(args.models), *model_options(shlex.split(args.serve_args))]
    command = [sys.executable, "-m", "specdec.cli", "audit", *models, "--trace", *trace]
    done = subprocess.run([*command, "--samples", "1000000000", "--json"], capture_output=True, text=True)
    try:
        result: dict[str, Any] = json.loads(done.stdout)
    except ValueError:
        lines = done.stderr.strip().splitlines()
        return {"ok": False, "first_failure": f"audit exited {done.returncode}: {lines[-1] if lines else ''}"}
    result["traces"] = trace
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="specdec-soak-") as folder:
            trace: list[str] = list(args.trace or [])
            if args.spawn:
                from load_test import running_servers  # type: ignore[import-not-found]

                head = [sys.executable, "-m", "specdec.cli", "serve", "--log-level", "warning"]
                if not args.replay:
                    head += ["--trace", os.path.join(folder, "trace.jsonl")]
                extra = [*shlex.split(args.models), *shlex.split(args.serve_args)]
                serve = [("soak", lambda port: [*head, "--port", str(port), *extra])]
                with running_servers(serve, log_dir=folder) as urls:
                    report = asyncio.run(run(args, urls["soak"], replay_greedy=args.replay))
                # stopped: its trace is whole (under --ray, one file per replica: trace.<replica>.jsonl)
                if not args.replay:
                    trace = sorted(str(f) for f in Path(folder).glob("trace*.jsonl"))
            else:
                report = asyncio.run(run(args, args.url.rstrip("/"), replay_greedy=not trace))
            if report["audit"] is None:
                report["audit"] = audit(args, trace)
    except (httpx.HTTPError, OSError, RuntimeError) as e:
        print(f"soak: error: {e}", file=sys.stderr)
        return 2
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if ok(report) else 1


def ok(report: dict[str, Any]) -> bool:
    return not report["problems"] and bool(report["audit"].get("ok"))


def render(report: dict[str, Any]) -> str:
    server = report["server"]
    lines = [
        f"soak: {report['requests']} requests from {report['clients']} clients in {report['seconds']} s against "
        f"{report['url']} ({server['model']}, {server['runtime']}, --max-batch {server['max_batch']}); chat: "
        f"{'yes' if report['chat'] else 'no template'}",
        "  " + ", ".join(f"{k} {v}" for k, v in sorted(report["outcomes"].items())),
        f"  after the run: {report['after']}; /metrics: {report['metric_families']} metric families",
    ]
    lines += [f"  PROBLEM {p}" for p in report["problems"][:20]]
    if len(report["problems"]) > 20:
        lines.append(f"  ... {len(report['problems']) - 20} more")
    a = report["audit"]
    if a.get("mode") == "replay":
        lines.append(
            f"  replay (no trace to audit): {a['prompts']} greedy requests ({a['choices']} choices) sent again alone, "
            "target-only: " + ("all identical" if a["ok"] else f"{a['differing']} differ; first: {a['first_failure']}")
        )
    elif a.get("ok"):
        files = len(a.get("traces", []))
        lines.append(
            f"  audit{f' of {files} trace files (one per replica)' if files > 1 else ''}: {a.get('prompts')} greedy "
            f"requests, {a.get('tokens_compared')} tokens, all identical to target-only decoding"
        )
    else:
        lines.append(f"  audit: FAILED: {a.get('first_failure')}")
    lines.append("PASS" if ok(report) else "FAIL")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from specdec.bench.prompts import FILE_HELP as PROMPT_FILE_HELP

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a running server (without --spawn)")
    p.add_argument("--spawn", action="store_true", help="start a server here (loopback, with a trace), stop it after")
    p.add_argument(
        "--models",
        default="",
        help="model options of the server and of the audit, e.g. '--target T --draft D' (one option alone: "
        "--models=--prompt-lookup)",
    )
    p.add_argument(
        "--serve-args",
        default="",
        help="more 'specdec serve' options for --spawn (--max-batch, ...); model options among them (--kv-dtype, ...) "
        "go to the audit too",
    )
    p.add_argument(
        "--trace",
        nargs="+",
        default=None,
        metavar="FILE",
        help="without --spawn: the trace the running server writes, to audit (a Ray fleet's: every replica's file)",
    )
    p.add_argument(
        "--replay",
        action="store_true",
        help="with --spawn: no trace; each greedy request is sent again alone and target-only instead",
    )
    p.add_argument("--api-key", default=None, help="the running server's --api-key (sent as a bearer token)")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--clients", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=80, help="each request asks 1..this many tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the requests and of the clients' behaviour")
    p.add_argument("--prompts", default=None, metavar="FILE", help="prompts: " + PROMPT_FILE_HELP)
    p.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")
    args = p.parse_args(argv)
    for name in ("requests", "clients", "max_tokens"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be a positive integer")
    if args.spawn and args.trace:
        p.error("--trace names a running server's trace; --spawn writes its own")
    if args.replay and not args.spawn:
        p.error("--replay is for --spawn (a running server without --trace is checked that way anyway)")
    from specdec.bench.prompts import DEFAULT_PROMPTS, load_prompts
    from specdec.errors import InvalidRequestError

    try:
        args.prompt_list = [q.text for q in load_prompts(args.prompts or DEFAULT_PROMPTS)]
    except InvalidRequestError as e:
        p.error(str(e))
    return args


if __name__ == "__main__":
    sys.exit(main())

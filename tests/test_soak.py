"""benchmarks/soak.py: random requests of every kind from many clients against a real server, some hanging up; the
server drained and healthy after, and every greedy output it served audited against target-only decoding."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from specdec.testing import import_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "soak.py"


def _soak() -> Any:
    return import_script(SCRIPT, "soak_under_test")


def _whole(n: int, finish: str = "length", completion: int = 4, logprobs: int | None = None) -> dict[str, Any]:
    choices = []
    for i in range(n):
        c: dict[str, Any] = {"index": i, "text": "x", "finish_reason": finish}
        if logprobs is not None:
            c["logprobs"] = {"token_logprobs": [-1.0] * logprobs}
        choices.append(c)
    return {
        "choices": choices,
        "usage": {"prompt_tokens": 3, "completion_tokens": completion, "total_tokens": 3 + completion},
    }


def test_the_checks_catch_malformed_responses() -> None:
    soak = _soak()
    plan = soak.Plan("/v1/completions", {"max_tokens": 4, "n": 2, "logprobs": 1, "stream": False})
    assert soak.check_whole(plan, _whole(2, completion=4, logprobs=2)) is None
    assert "indices 0..1" in soak.check_whole(plan, _whole(1, completion=4, logprobs=4))
    assert "finish reason" in soak.check_whole(plan, _whole(2, finish="eos", logprobs=2))
    assert "outside 0..8" in soak.check_whole(plan, _whole(2, completion=9, logprobs=5))
    assert "3 token log probabilities for 4" in soak.check_whole(
        plan,
        {
            **_whole(2, logprobs=2),
            "choices": [
                {"index": 0, "finish_reason": "stop", "logprobs": {"token_logprobs": [-1.0]}},
                {"index": 1, "finish_reason": "stop", "logprobs": {"token_logprobs": [-1.0, -2.0]}},
            ],
        },
    )
    bad_usage = _whole(2, logprobs=2)
    bad_usage["usage"]["total_tokens"] += 1
    assert "does not add up" in soak.check_whole(plan, bad_usage)

    stream = soak.Plan(
        "/v1/completions", {"max_tokens": 4, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    )

    def chunk(index: int, finish: str | None = None) -> str:
        return json.dumps({"choices": [{"index": index, "text": "a", "finish_reason": finish}]})

    usage = json.dumps({"choices": [], "usage": {"completion_tokens": 2}})
    good = [chunk(0), chunk(1), chunk(1, "length"), chunk(0, "stop"), usage, "[DONE]"]
    assert soak.check_stream(stream, good) is None
    assert "does not end with [DONE]" in soak.check_stream(stream, good[:-1])
    assert "one for each of 0..1" in soak.check_stream(stream, [chunk(0, "stop"), usage, "[DONE]"])
    assert "one for each of 0..1" in soak.check_stream(stream, [*good[:4], chunk(0, "stop"), usage, "[DONE]"])
    assert "no usage" in soak.check_stream(stream, [*good[:4], "[DONE]"])
    assert "not JSON" in soak.check_stream(stream, ["{", "[DONE]"])
    assert "an error in the stream" in soak.check_stream(stream, [json.dumps({"error": {"message": "x"}}), "[DONE]"])


def test_requests_are_valid_and_cover_the_api() -> None:
    """The random requests stay within what the server accepts (so a refusal is a finding) and use every field."""
    soak = _soak()
    rng = random.Random(0)
    plans = [soak.plan_request(rng, ["def f(x):\n    return x\n"], 320, 12, True) for _ in range(2000)]
    seen = {k for p in plans for k in p.body} | {k for p in plans for k in p.body.get("speculative", {})}
    lists = [p for p in plans if len(p.prompts) > 1]  # lists of prompts, n choices each, within the server's batch
    assert lists and all(p.choices <= 3 for p in lists)
    wide = [soak.plan_request(rng, ["x = 1"], 320, 12, False, 8) for _ in range(2000)]
    assert any(len(p.prompts) > 1 and p.body.get("n", 1) > 1 for p in wide) and max(p.choices for p in wide) <= 8
    for field in (
        "prompt",
        "messages",
        "n",
        "stop",
        "logprobs",
        "top_logprobs",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "min_tokens",
        "ignore_eos",
        "prediction",
        "tau",
        "policy",
        "max_verify_passes",
        "steps",
        "stream_options",
        "top_k",
        "top_p",
        "min_p",
    ):
        assert field in seen, field
    for p in plans:
        b = p.body
        assert 1 <= b["max_tokens"] <= 12 and b.get("min_tokens", 0) <= b["max_tokens"] and b.get("n", 1) <= 3
    assert sum(p.hang_up_after > 0 for p in plans) > 50 and sum(p.timeout < 1 for p in plans) > 20


def test_the_audit_is_given_the_servers_model_options() -> None:
    soak = _soak()
    serve = ["--max-batch", "4", "--kv-dtype", "fp32", "--prompt-lookup", "--port", "9", "--draft-vocab=full"]
    assert soak.model_options(serve) == ["--kv-dtype", "fp32", "--prompt-lookup", "--draft-vocab=full"]
    assert soak.model_options(["--max-batch", "1", "--stream-interval", "3"]) == []


def test_n_stays_within_what_the_server_runs_together() -> None:
    soak = _soak()
    for max_n, allowed in ((1, {1}), (2, {1, 2}), (3, {1, 2, 3})):
        rng = random.Random(1)
        ns = {soak.plan_request(rng, ["x"], 320, 8, False, max_n).body.get("n", 1) for _ in range(300)}
        assert ns == allowed


@pytest.mark.slow
@pytest.mark.server
def test_soak_against_a_spawned_server(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in ["def f(x):", "import os\n", "class A:\n    pass\n"]))
    target = tmp_path / "target"  # the tiny target with a chat template: chat completions join the mix
    shutil.copytree(tiny_models["llama"], target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    models = f"--target {target} --draft {tiny_models['draft']}"
    out = tmp_path / "soak.json"
    args = ["--spawn", "--models", models, "--serve-args", "--max-batch 6", "--requests", "60", "--clients", "6"]
    args += ["--max-tokens", "10", "--prompts", str(prompts), "--seed", "3", "--json", str(out)]
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["server"]["max_batch"] == 6 and report["problems"] == [] and report["chat"]
    assert report["outcomes"].get("streamed", 0) > 0 and report["outcomes"].get("whole", 0) > 0
    assert report["outcomes"].get("hung up mid-stream", 0) > 0
    assert report["after"]["active"] == 0 and report["after"]["failed"] == 0 and report["metric_families"] > 10
    assert report["audit"]["ok"] and report["audit"]["prompts"] > 20
    assert done.stdout.strip().endswith("PASS")


def test_bad_arguments_are_one_line(tmp_path: Path) -> None:
    for args, message in (
        (["--requests", "0"], "--requests must be a positive integer"),
        (["--spawn", "--trace", "t.jsonl"], "--trace names a running server's trace"),
        (["--replay"], "--replay is for --spawn"),
        (["--prompts", str(tmp_path / "none.jsonl")], "prompt file not found"),
    ):
        done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--url", "http://127.0.0.1:9", "--requests", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stderr.startswith("soak: error:") and done.stderr.count("\n") == 1


def test_the_replay_check_compares_each_choice_with_a_solo_target_only_run() -> None:
    """Without a trace: the greedy requests served to their end go again, alone, ``tau`` 0, whole, ``n`` 1; a choice
    whose text differs fails the run (a server here that answers from a table)."""
    import asyncio

    import httpx

    soak = _soak()
    alone = {"a": "one", "b": "two"}
    sent: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append(body)
        return httpx.Response(
            200, json={"choices": [{"index": 0, "text": alone[body["prompt"]], "finish_reason": "length"}]}
        )

    tally = soak.Tally()
    greedy = {"temperature": 0.0, "max_tokens": 4, "stream": True, "n": 2, "speculative": {"tau": 3}}
    stream = [
        {"choices": [{"index": i, "text": t, "finish_reason": None}]} for i, t in ((0, "o"), (1, "on"), (0, "ne"))
    ]
    stream += [
        {
            "choices": [
                {"index": 0, "text": "", "finish_reason": "length"},
                {"index": 1, "text": "e", "finish_reason": "stop"},
            ]
        }
    ]
    soak.keep(soak.Plan("/v1/completions", {**greedy, "prompt": "a"}), stream, tally)
    whole = {"choices": [{"index": 0, "text": "twx", "finish_reason": "length"}]}
    soak.keep(soak.Plan("/v1/completions", {**greedy, "stream": False, "n": 1, "prompt": "b"}), [whole], tally)
    budget = {"choices": [{"index": 0, "text": "t", "finish_reason": "verify_budget"}]}
    soak.keep(soak.Plan("/v1/completions", {**greedy, "n": 1, "prompt": "b"}), [budget], tally)  # not replayed
    soak.keep(soak.Plan("/v1/completions", {**greedy, "temperature": 1.0, "prompt": "b"}), [whole], tally)  # sampled
    assert [texts for _, texts in tally.greedy] == [["one", "one"], ["twx"]]

    async def go() -> dict[str, Any]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await soak.replay(client, "http://soak.test", tally)

    result = asyncio.run(go())
    assert not result["ok"] and result["differing"] == 1 and "served 'twx', alone 'two'" in result["first_failure"]
    assert result["prompts"] == 2 and result["choices"] == 3
    assert all(b["speculative"] == {"tau": 0} and "n" not in b and "stream" not in b for b in sent)


def test_a_full_queue_is_tried_again_after_its_retry_after() -> None:
    """429 twice (Retry-After 0), then the answer: the client tries again as told; a 5xx is a problem."""
    import asyncio

    import httpx

    soak = _soak()
    replies = iter(
        [
            httpx.Response(
                429, json={"error": {"message": "queue full", "type": "queue_full"}}, headers={"Retry-After": "0"}
            ),
            httpx.Response(
                429, json={"error": {"message": "queue full", "type": "queue_full"}}, headers={"Retry-After": "0"}
            ),
            httpx.Response(200, json=_whole(1, completion=2)),
            httpx.Response(500, json={"error": {"message": "boom", "type": "internal_error"}}),
        ]
    )
    plan = soak.Plan("/v1/completions", {"prompt": "a", "max_tokens": 4, "temperature": 1.0, "stream": False})
    tally = soak.Tally()

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(lambda request: next(replies))) as client:
            await soak.send(client, "http://soak.test", plan, tally)
            await soak.send(client, "http://soak.test", plan, tally)

    asyncio.run(go())
    assert tally.outcomes["429 (queue full), tried again"] == 2 and tally.outcomes["whole"] == 1
    assert len(tally.problems) == 1 and "HTTP 500 (internal_error): boom" in tally.problems[0]

"""Structured output (``response_format``): the output follows its format, and speculation leaves it exactly what
target-only decoding under the same format gives (greedy: the same tokens, solo or in a batch, on every runtime;
sampled: the same law, in test_distribution.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

import specdec
from specdec.engine import Engine
from specdec.errors import InvalidRequestError
from specdec.logits_rules import LogitsRules, rules_from_settings
from specdec.output_format import OutputFormat

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "size"],
    "additionalProperties": False,
}
FORMATS: dict[str, dict[str, Any]] = {
    "json_object": {"type": "json_object"},
    "json_schema": {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}},
    "regex": {"type": "regex", "regex": r"[a-z_]{1,6}\([a-z]{0,3}\)"},
    "choice": {"type": "choice", "choice": ["return None", "return self", "pass", 'raise ValueError("x")']},
    "grammar": {
        "type": "grammar",
        "grammar": 'start: line | line "\\n" line\nline: "x = " NUMBER\nNUMBER: /[0-9]{1,3}/',
    },
}
PROMPTS = ["def fibonacci(n):", "class Node:\n    def __init__(self, value, next=None):\n", "import os\n"]


def follows(kind: str, text: str) -> bool:
    """Whether a complete output (finish_reason "stop") is in its format, checked without the matcher."""
    if kind in ("json_object", "json_schema"):
        value = json.loads(text)
        if kind == "json_schema":
            name, size = value["name"], value["size"]
            return set(value) == {"name", "size"} and isinstance(name, str) and len(name) <= 6 and size in range(100)
        return isinstance(value, dict)
    if kind == "regex":
        return re.fullmatch(FORMATS["regex"]["regex"], text) is not None
    if kind == "choice":
        return text in FORMATS["choice"]["choice"]
    return re.fullmatch(r"x = [0-9]{1,3}(\nx = [0-9]{1,3})?", text) is not None


# -- the format as data -------------------------------------------------------------------------


def test_openai_shapes_parse_and_round_trip_through_the_records() -> None:
    assert OutputFormat.parse(None) is None and OutputFormat.parse({"type": "text"}) is None
    for kind, spec in FORMATS.items():
        fmt = OutputFormat.parse(spec)
        assert fmt is not None and fmt.kind == kind
        assert OutputFormat.parse(fmt.settings()) == fmt
        rules = LogitsRules.checked(response_format=spec, vocab_size=100, max_new_tokens=10)
        assert rules.active
        # a trace's settings give back the request's format (audit replays it)
        assert (
            OutputFormat.parse(rules_from_settings(json.loads(json.dumps(rules.settings())))["response_format"]) == fmt
        )
    assert OutputFormat.parse(FORMATS["json_schema"]).name == "thing"
    # a schema sent as JSON text is the same schema
    as_text = {"type": "json_schema", "json_schema": {"name": "thing", "schema": json.dumps(SCHEMA)}}
    assert OutputFormat.parse(as_text) == OutputFormat.parse(FORMATS["json_schema"])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("json", "must be an object with a type"),
        ({"type": "yaml"}, 'unknown type "yaml"'),
        ({"type": "json_schema"}, "needs a json_schema object"),
        ({"type": "json_schema", "json_schema": {"schema": "{nope"}}, "json_schema.schema is not JSON"),
        ({"type": "json_schema", "json_schema": {"schema": [1]}}, "must be a JSON schema object"),
        ({"type": "regex", "regex": ""}, "needs a non-empty string regex"),
        ({"type": "choice", "choice": "yes"}, "needs a list of non-empty strings"),
        ({"type": "choice", "choice": ["a", ""]}, "needs a list of non-empty strings"),
    ],
)
def test_malformed_formats_are_refused_naming_the_field(spec: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as e:
        OutputFormat.parse(spec)
    assert e.value.param == "response_format"


# -- on models ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_models: dict[str, Path]) -> Engine:
    return specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"type": "regex", "regex": "[a-z"}, "the regex does not compile"),
        ({"type": "grammar", "grammar": "start: undefined_rule"}, "the grammar does not compile"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "colour"}}}, "does not compile"),
    ],
)
def test_formats_that_do_not_compile_are_the_requests_error(engine: Engine, spec: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as e:
        engine.start("x = ", max_new_tokens=4, response_format=spec)
    assert e.value.param == "response_format"


@pytest.mark.parametrize("name", ["min_tokens", "ignore_eos"])
def test_a_format_decides_where_the_output_ends(engine: Engine, name: str) -> None:
    value: Any = 3 if name == "min_tokens" else True
    with pytest.raises(InvalidRequestError, match=f"{name} cannot be combined with response_format") as e:
        engine.start("x = ", max_new_tokens=4, response_format=FORMATS["json_object"], **{name: value})
    assert e.value.param == name


def test_the_rows_of_a_block_are_masked_with_their_own_context(engine: Engine) -> None:
    """``FormatMatcher.allowed`` over a drafted block equals a fresh matcher fed each row's prefix; rows after a
    forbidden token repeat its row; the matcher is where it was after the call."""
    import torch
    from llguidance import LLMatcher

    fmt = OutputFormat.parse(FORMATS["regex"])
    assert fmt is not None
    text = "print(ab)"
    ids = engine.encode(text)
    assert len(ids) >= 3
    width = engine.side.vocab_size
    matcher = engine.formats.matcher(fmt)
    llg = engine.formats._llg_tokenizer()

    def expected(prefix: list[int]) -> torch.Tensor:
        m = LLMatcher(llg, fmt.grammar(), log_level=0)
        assert m.consume_tokens(prefix)
        bits = torch.tensor(list(m.compute_bitmask()), dtype=torch.uint8)
        return ((bits[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).bool().flatten()[:width]

    before = matcher.allowed([], 0, 1, width, torch.device("cpu"))
    block = matcher.allowed(ids, 0, len(ids) + 1, width, torch.device("cpu"))
    for i in range(len(ids) + 1):
        assert torch.equal(block[i], expected(ids[:i])), f"row {i}"
    # one drafting position after two drafted tokens
    assert torch.equal(matcher.allowed(ids[:2], 2, 1, width, torch.device("cpu"))[0], expected(ids[:2]))
    # a forbidden token at position 1: rows 2.. repeat row 1 (the state before it)
    bad = next(t for t in range(width) if not block[1][t])
    rows = matcher.allowed([ids[0], bad, ids[1]], 0, 4, width, torch.device("cpu"))
    assert torch.equal(rows[1], expected(ids[:1])) and all(torch.equal(rows[j], rows[1]) for j in (2, 3))
    assert torch.equal(matcher.allowed([], 0, 1, width, torch.device("cpu")), before)
    matcher.commit(ids[:2])
    assert torch.equal(matcher.allowed([], 0, 1, width, torch.device("cpu"))[0], expected(ids[:2]))


def test_greedy_output_is_target_only_decoding_under_the_format(
    tiny_models: dict[str, Path], runtime_name: str
) -> None:
    """Every format, every prompt: speculative (τ = 3 and the default policy) and batched with unformatted requests
    give the tokens target-only decoding gives under the format, and a finished output is in its format."""
    engine = specdec.load(
        tiny_models["llama"], tiny_models["draft"], dtype="float32", runtime=runtime_name.split("-")[0]
    )
    finished = 0
    for kind, spec in FORMATS.items():
        for prompt in PROMPTS:
            solo = engine.generate(prompt, max_new_tokens=24, tau=0, response_format=spec)
            for tau in (3, None):
                spec_run = engine.generate(prompt, max_new_tokens=24, tau=tau, response_format=spec)
                assert spec_run.token_ids == solo.token_ids, (kind, prompt, tau)
            if solo.finish_reason == "stop":
                finished += 1
                assert follows(kind, solo.text), (kind, solo.text)
    assert finished >= 9, "too few outputs completed their format for the check to mean anything"
    # All of them in one batch, with unformatted requests between them, joining one per step.
    arrivals, wanted = [], []
    for i, spec in enumerate(FORMATS.values()):
        for j, prompt in enumerate(PROMPTS):
            arrivals.append(dict(prompt=prompt, max_new_tokens=24, tau=1 + (i + j) % 4, response_format=spec))
            wanted.append(engine.generate(prompt, max_new_tokens=24, tau=0, response_format=spec).token_ids)
            arrivals.append(dict(prompt=prompt, max_new_tokens=24, tau=2))
            wanted.append(engine.generate(prompt, max_new_tokens=24, tau=0).token_ids)
    gens = []
    while len(gens) < len(arrivals) or any(not g.done for g in gens):
        if len(gens) < len(arrivals):
            gens.append(engine.start(**arrivals[len(gens)]))
        engine.step([g for g in gens if not g.done])
    assert [g.result().token_ids for g in gens] == wanted


def test_the_default_pair_fills_a_schema(default_pair: tuple[Path, Path]) -> None:
    """The shipped pair answers with JSON of the schema, speculating (its draft's head is cut to its likeliest tokens:
    where it has no logit for any token the format allows, it draws among them uniformly), identical to target-only."""
    engine = specdec.load(*default_pair)
    prompt = "def load_settings(path):\n    # returns the name and size as JSON\n"
    solo = engine.generate(prompt, max_new_tokens=40, tau=0, response_format=FORMATS["json_schema"])
    fast = engine.generate(prompt, max_new_tokens=40, response_format=FORMATS["json_schema"])
    assert fast.token_ids == solo.token_ids
    assert solo.finish_reason == "stop" and follows("json_schema", solo.text), solo.text
    assert fast.stats.accepted > 0
    sampled = engine.generate(prompt, max_new_tokens=40, temperature=1.0, seed=3, response_format=FORMATS["choice"])
    assert sampled.finish_reason == "stop" and sampled.text in FORMATS["choice"]["choice"]


# -- the server ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def app_engine(tiny_models: dict[str, Path]) -> Engine:
    return specdec.load(tiny_models["llama"], tiny_models["draft"])


def test_the_server_answers_in_the_format(app_engine: Engine) -> None:
    """``response_format`` on chat (rendered with the server's template) and on completions, and vLLM's
    ``structured_outputs``, streamed or not: each answer is the engine's greedy output under that format."""
    from specdec.server.app import create_app
    from specdec.server.settings import ServerSettings
    from test_server_app import CHAT_TEMPLATE, run

    engine = app_engine
    app = create_app(engine, ServerSettings(model_name="tiny", chat_template=CHAT_TEMPLATE))
    chat = {
        "messages": [{"role": "user", "content": "a thing, as JSON"}],
        "max_tokens": 40,
        "temperature": 0,
        "response_format": FORMATS["json_schema"],
    }
    plain = {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0}
    bodies = {
        "chat": ("/v1/chat/completions", chat),
        "completion, regex": ("/v1/completions", {**plain, "response_format": FORMATS["regex"]}),
        "completion, structured_outputs choice": (
            "/v1/completions",
            {**plain, "structured_outputs": {"choice": FORMATS["choice"]["choice"]}},
        ),
        "completion, structured_outputs json": (
            "/v1/completions",
            {**plain, "max_tokens": 40, "structured_outputs": {"json": SCHEMA}},
        ),
        "completion, streamed grammar": (
            "/v1/completions",
            {**plain, "response_format": FORMATS["grammar"], "stream": True},
        ),
    }

    async def ask(client: Any) -> dict[str, Any]:
        return {name: await client.post(path, json=body) for name, (path, body) in bodies.items()}

    answers = run(app, ask)
    chat_ids = engine.tokenizer("[user] a thing, as JSON\n[assistant] ", add_special_tokens=False)["input_ids"]
    expected = {
        "chat": engine.generate(chat_ids, max_new_tokens=40, response_format=FORMATS["json_schema"]),
        "completion, regex": engine.generate(PROMPTS[0], max_new_tokens=24, response_format=FORMATS["regex"]),
        "completion, structured_outputs choice": engine.generate(
            PROMPTS[0], max_new_tokens=24, response_format=FORMATS["choice"]
        ),
        "completion, structured_outputs json": engine.generate(
            PROMPTS[0], max_new_tokens=40, response_format=FORMATS["json_schema"]
        ),
        "completion, streamed grammar": engine.generate(
            PROMPTS[0], max_new_tokens=24, response_format=FORMATS["grammar"]
        ),
    }
    for name, r in answers.items():
        assert r.status_code == 200, (name, r.text)
        want = expected[name]
        if name == "chat":
            got, finish = r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["finish_reason"]
        elif "streamed" in name:
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            got = "".join(e["choices"][0]["text"] for e in events)
            finish = next(e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"])
        else:
            got, finish = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        assert (got, finish) == (want.text, want.finish_reason), name
    assert expected["chat"].finish_reason == "stop" and follows("json_schema", expected["chat"].text)


def test_the_server_prepares_the_vocabulary_before_it_serves(tiny_models: dict[str, Path]) -> None:
    """Not in the first formatted request's step, which every request in flight waits on."""
    from specdec.server.app import create_app
    from specdec.server.settings import ServerSettings

    engine = specdec.load(tiny_models["llama"], tiny_models["draft"])
    assert engine.formats._tokenizer is None
    app = create_app(engine, ServerSettings(model_name="tiny"))
    assert engine.formats._tokenizer is not None
    app.state.scheduler.stop()


BAD_FORMATS: list[tuple[dict[str, Any], str, str]] = [
    ({"response_format": {"type": "yaml"}}, "response_format", 'unknown type "yaml"'),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema object"),
    ({"response_format": "json"}, "response_format", "valid dictionary"),
    ({"response_format": {"type": "regex", "regex": "[a-z"}}, "response_format", "the regex does not compile"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"yaml": "a"}}, "structured_outputs.yaml", "Extra inputs"),
    (
        {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
        "structured_outputs",
        "both ask for a format",
    ),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens", "cannot be combined"),
]


@pytest.mark.parametrize(("extra", "param", "words"), BAD_FORMATS)
def test_bad_formats_are_400_naming_the_field(
    app_engine: Engine, extra: dict[str, Any], param: str, words: str
) -> None:
    from specdec.server.app import create_app
    from specdec.server.settings import ServerSettings
    from test_server_app import run

    app = create_app(app_engine, ServerSettings(model_name="tiny"))
    body = {"prompt": "x = ", "max_tokens": 4, **extra}
    r = run(app, lambda c: c.post("/v1/completions", json=body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_openai_client_against_a_served_model(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """A real server process and the OpenAI client: ``response_format`` with a JSON schema on chat, and
    ``structured_outputs`` through ``extra_body`` on completions, answer what the engine gives in-process."""
    openai = pytest.importorskip("openai")
    from test_server import API_KEY, long_context, served, with_chat_template

    target = long_context(with_chat_template(tiny_models["llama"], tmp_path / "llama"))
    engine = specdec.load(target, tiny_models["draft"])
    with served(target, tiny_models["draft"], tmp_path / "server.log", "--api-key", API_KEY) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "name and size"}]
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=40,
            temperature=0,
            response_format=FORMATS["json_schema"],  # type: ignore[arg-type]
        )
        done = client.completions.create(
            model=client.models.list().data[0].id,
            prompt=PROMPTS[1],
            max_tokens=24,
            temperature=0,
            extra_body={"structured_outputs": {"regex": FORMATS["regex"]["regex"]}},
        )
    ids = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = engine.generate(
        engine.tokenizer(ids, add_special_tokens=False)["input_ids"],
        max_new_tokens=40,
        response_format=FORMATS["json_schema"],
    )
    assert reply.choices[0].message.content == want.text and reply.choices[0].finish_reason == want.finish_reason
    assert want.finish_reason == "stop" and follows("json_schema", want.text)
    assert done.choices[0].text == engine.generate(PROMPTS[1], max_new_tokens=24, response_format=FORMATS["regex"]).text


def test_generate_on_the_command_line(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """``specdec generate --json-schema FILE`` (and ``--choice``, ``--grammar FILE``): the engine's output under the
    format, and the trace records the format so the request can be replayed."""
    import subprocess
    import sys

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    grammar = tmp_path / "lines.lark"
    grammar.write_text(FORMATS["grammar"]["grammar"])
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], dtype="float32")
    models = ["--target", str(tiny_models["llama"]), "--draft", str(tiny_models["draft"]), "--dtype", "float32"]
    cases = {
        "json_schema": ["--json-schema", str(schema)],
        "choice": [arg for c in FORMATS["choice"]["choice"] for arg in ("--choice", c)],
        "grammar": ["--grammar", str(grammar)],
    }
    for kind, flags in cases.items():
        trace = tmp_path / f"{kind}.jsonl"
        r = subprocess.run(
            [sys.executable, "-m", "specdec.cli", "generate", PROMPTS[0], *models, "--max-new-tokens", "40", "--json"]
            + ["--trace", str(trace), *flags],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        want = engine.generate(PROMPTS[0], max_new_tokens=40, response_format=FORMATS[kind])
        assert json.loads(r.stdout)["token_ids"] == want.token_ids, kind
        records = [json.loads(line) for line in trace.read_text().splitlines()]
        (summary,) = [rec for rec in records if rec["type"] == "request"]
        recorded, asked = OutputFormat.parse(summary["settings"]["response_format"]), OutputFormat.parse(FORMATS[kind])
        assert (
            recorded is not None and asked is not None and (recorded.kind, recorded.value) == (asked.kind, asked.value)
        )


def test_audit_checks_outputs_under_a_format(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """``specdec audit --regex``: greedy outputs against target-only under the format, and the law of sampled ones
    against the target's masked distribution (chi-square at the audit's 1e-3: false-failure rate ≤ 1e-3)."""
    import subprocess
    import sys

    models = ["--target", str(tiny_models["llama"]), "--draft", str(tiny_models["draft"]), "--dtype", "float32"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    fmt = ["--regex", FORMATS["regex"]["regex"], "--prompts", str(prompts), "--max-new-tokens", "24"]
    for extra in (["--samples", "3"], ["--temperature", "1", "--samples", "2", "--runs", "200"]):
        r = subprocess.run(
            [sys.executable, "-m", "specdec.cli", "audit", *models, *fmt, *extra],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0 and r.stdout.startswith("PASS"), r.stdout + r.stderr

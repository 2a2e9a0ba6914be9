"""Tool calls (``tools`` with ``tool_choice`` "required" or a named function): the reply is OpenAI's ``tool_calls``,
its arguments the engine's output under the call's schema (structured output, exact under speculation), streamed
whole at the end; "none" is text; "auto" and malformed choices are 400s naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import specdec
from specdec.engine import Engine
from specdec.server.app import create_app
from specdec.server.settings import ServerSettings
from test_server_app import run

pytest.importorskip("llguidance")

# A template that shows the tools offered and an assistant's earlier calls (as chat templates of tool models do).
TEMPLATE = (  # newlines as expressions: chat templates render with trim_blocks (a newline after a tag is dropped)
    "{% if tools %}[tools]{% for t in tools %} {{ t['function']['name'] }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}[{{ m['role'] }}] "
    "{% if m.tool_calls %}{% for c in m.tool_calls %}call {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}{% endfor %}{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}"
    "{% endfor %}[assistant] "
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "a forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},  # no parameters: no arguments
]
MESSAGES = [{"role": "user", "content": "weather in Oslo?"}]


@pytest.fixture(scope="module")
def engine(tiny_models: dict[str, Path]) -> Engine:
    return specdec.load(tiny_models["llama"], tiny_models["draft"])


def ask(engine: Engine, body: dict[str, Any]) -> Any:
    app = create_app(engine, ServerSettings(model_name="tiny", chat_template=TEMPLATE))
    full = {"messages": MESSAGES, "max_tokens": 60, "temperature": 0, "tools": TOOLS, **body}
    return run(app, lambda c: c.post("/v1/chat/completions", json=full))


def rendered(engine: Engine, text: str) -> list[int]:
    return list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


PROMPT = "[tools] get_weather get_time\n[user] weather in Oslo?\n[assistant] "


def test_a_named_function_is_called_with_arguments_under_its_schema(engine: Engine) -> None:
    r = ask(engine, {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    want = engine.generate(
        rendered(engine, PROMPT),
        max_new_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"schema": WEATHER}},
    )
    assert want.finish_reason == "stop"
    args = json.loads(call["function"]["arguments"])
    assert args == json.loads(want.text)
    assert set(args) == {"city", "days"} and len(args["city"]) <= 8 and 1 <= args["days"] <= 9
    assert r.json()["usage"]["prompt_tokens"] == len(rendered(engine, PROMPT))


def test_required_makes_calls_of_the_offered_functions(engine: Engine) -> None:
    """One call (``parallel_tool_calls: false``): finished, a call of an offered function under its schema."""
    r = ask(engine, {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 150})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_weather":
        assert set(args) == {"city", "days"}
    else:
        assert call["function"]["name"] == "get_time" and args == {}


def test_required_without_a_limit_is_the_engines_array_of_calls(engine: Engine) -> None:
    """Calls of the offered functions, one or more, in vLLM's array shape: the engine's output under that schema (the
    tiny model repeats its call until max_tokens cuts it: then the reply is that text, finish_reason "length")."""
    from specdec.server.schemas import ChatCompletionRequest
    from specdec.server.tools import tool_plan

    r = ask(engine, {"tool_choice": "required", "max_tokens": 150})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    plan = tool_plan(ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, tool_choice="required"))
    assert plan is not None and plan.schema["minItems"] == 1 and "maxItems" not in plan.schema
    want = engine.generate(rendered(engine, PROMPT), max_new_tokens=150, response_format=plan.response_format())
    assert want.text.startswith('[{"name": "get_')
    if want.finish_reason == "stop":
        calls = choice["message"]["tool_calls"]
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [
            c["parameters"] for c in json.loads(want.text)
        ]
    else:
        assert (choice["message"]["content"], choice["finish_reason"]) == (want.text, want.finish_reason)


def test_none_answers_text_with_the_tools_in_the_prompt(engine: Engine) -> None:
    r = ask(engine, {"tool_choice": "none", "max_tokens": 12})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] == engine.generate(rendered(engine, PROMPT), max_new_tokens=12).text
    assert message.get("tool_calls") is None


def test_a_call_cut_short_is_text(engine: Engine) -> None:
    r = ask(engine, {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 3})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"].get("tool_calls") is None
    assert choice["message"]["content"].startswith("{")


def test_streamed_calls_come_whole_at_the_end(engine: Engine) -> None:
    named = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole = ask(engine, named).json()["choices"][0]["message"]["tool_calls"][0]
    r = ask(engine, {**named, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert not any(d.get("content") for d in deltas[1:])  # no text: the call is held back until it is whole
    (last,) = [e["choices"][0] for e in events if e["choices"][0]["finish_reason"]]
    assert last["finish_reason"] == "tool_calls"
    (call,) = last["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == whole["function"]


def test_an_earlier_call_and_its_result_reach_the_template(engine: Engine) -> None:
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]
    r = ask(engine, {"messages": history, "tool_choice": "none", "max_tokens": 4})
    assert r.status_code == 200, r.text
    text = PROMPT.removesuffix("[assistant] ")
    text += '[assistant] call get_weather {"city": "Oslo", "days": 2}\n[tool] rain\n[assistant] '
    assert r.json()["usage"]["prompt_tokens"] == len(rendered(engine, text))


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({}, "tool_choice", 'tool_choice "auto" (the default with tools) needs a parser'),
        ({"tool_choice": "auto"}, "tool_choice", "needs a parser"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "no tools are given"),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools.1.function.name", "two tools"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "cannot be combined",
        ),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", "pattern"),
        ({"tool_choice": "sometimes"}, "tool_choice", ""),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(engine: Engine, body: dict[str, Any], param: str, words: str):
    r = ask(engine, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_openai_client_reads_the_calls(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """A real server and the OpenAI client: the call parses into its types, arguments as the engine gives them."""
    openai = pytest.importorskip("openai")
    from test_server import API_KEY, long_context, served

    target = tmp_path / "llama"
    import shutil

    shutil.copytree(tiny_models["llama"], target)
    long_context(target)
    engine = specdec.load(target, tiny_models["draft"])
    with served(
        target, tiny_models["draft"], tmp_path / "server.log", "--api-key", API_KEY, "--chat-template", TEMPLATE
    ) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=60,
            temperature=0,
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
    (call,) = reply.choices[0].message.tool_calls or []
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    want = engine.generate(
        rendered(engine, PROMPT),
        max_new_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"schema": WEATHER}},
    )
    assert json.loads(call.function.arguments) == json.loads(want.text)

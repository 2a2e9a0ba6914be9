"""From a validated request body to what the engine is asked to do (run on the scheduler's worker)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from specdec.engine import Engine, Generation
from specdec.errors import ContextLengthError, InvalidRequestError
from specdec.output_format import OutputFormat
from specdec.server.errors import APIError
from specdec.server.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, _Common
from specdec.server.tools import ToolPlan, template_tools, tool_plan

# Engine argument names -> the request fields a client sent.
_PARAMS = {
    "max_new_tokens": "max_tokens",
    "tau": "speculative.tau",
    "policy": "speculative.policy",
    "max_verify_passes": "speculative.max_verify_passes",
}


def check_supported(body: _Common) -> None:
    """Refuse OpenAI options specdec does not implement instead of silently ignoring them."""
    if isinstance(body, CompletionRequest):
        if body.max_tokens == 0 and (not body.echo or body.logprobs is None):
            raise APIError(
                400,
                "max_tokens=0 generates nothing: it is for scoring a prompt, with echo: true and logprobs",
                "max_tokens",
                "invalid_value",
            )
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(
                400,
                f"best_of={body.best_of} is not supported: only best_of equal to n ({body.n}), i.e. every "
                "sample returned, is",
                "best_of",
                "unsupported",
            )
        if body.suffix is not None:
            raise APIError(400, "suffix is not supported", "suffix", "unsupported")
    spec = body.speculative
    if spec is not None and spec.policy is not None and ":" in spec.policy:
        # Each policy the engine is asked for lives as long as the server (it learns across requests):
        # clients pick among named ones; settings are the operator's (specdec serve --policy NAME:KEY=VALUE).
        raise APIError(
            400,
            f"policy {spec.policy!r}: requests name a policy (e.g. adaptive); its settings are the server's",
            "speculative.policy",
            "invalid_value",
        )
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
        _check_neutral(body)
        tool_plan(body)
    output_format(body)  # a malformed format is refused before the request queues


def output_format(body: _Common) -> OutputFormat | None:
    """The request's output format: ``response_format`` (OpenAI's shape, and specdec's regex/choice/grammar types) or
    vLLM's ``structured_outputs``; not both."""
    if body.structured_outputs is not None:
        if body.response_format not in (None, {"type": "text"}):
            raise APIError(
                400,
                "response_format and structured_outputs both ask for a format: send one",
                "structured_outputs",
                "invalid_value",
            )
        so = body.structured_outputs
        given = [name for name in ("json_", "regex", "choice", "grammar", "json_object") if getattr(so, name)]
        if len(given) != 1:
            raise APIError(
                400,
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object",
                "structured_outputs",
                "invalid_value",
            )
        kind = given[0]
        if kind == "json_":
            spec: dict[str, Any] = {"type": "json_schema", "json_schema": {"schema": so.json_}}
        elif kind == "json_object":
            spec = {"type": "json_object"}
        else:
            spec = {"type": kind, kind: getattr(so, kind)}
        return OutputFormat.parse(spec, "structured_outputs")
    return OutputFormat.parse(body.response_format)


def _check_neutral(body: ChatCompletionRequest) -> None:
    """OpenAI chat fields that change what is generated (legacy functions, audio, web search): specdec generates text
    from the messages, so each is accepted only at a value that asks nothing else, and refused otherwise, naming the
    field. (``tools`` and ``tool_choice``: ``specdec.server.tools``.)"""
    no_tools = not body.tools and not body.functions
    neutral = {
        "functions": (body.functions in (None, []), "function calling (use tools)"),
        "function_call": (
            body.function_call in (None, "none") or (body.function_call == "auto" and no_tools),
            "function calling",
        ),
        "modalities": (body.modalities in (None, ["text"]), "output other than text"),
        "audio": (body.audio is None, "audio output"),
        "web_search_options": (body.web_search_options is None, "web search"),
    }
    for name, (ok, what) in neutral.items():
        if not ok:
            shown = json.dumps(getattr(body, name))
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise APIError(
                400,
                f"{name}={shown} is not supported: specdec does not implement {what} (it generates free text)",
                name,
                "unsupported",
            )


def logprobs_wanted(body: _Common) -> int | None:
    """How many alternatives per token the request asks for; None when it asks for no log probabilities."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    if isinstance(body, ChatCompletionRequest) and body.logprobs:
        return body.top_logprobs or 0
    return None


def engine_kwargs(body: _Common, request_id: str, fmt: OutputFormat | dict[str, Any] | None) -> dict[str, Any]:
    """Sampling, stop and speculation settings for ``Engine.start`` (max_new_tokens is added later); ``fmt``: the
    output's format (the request's own, or its tool calls')."""
    spec = body.speculative
    return {
        "temperature": float(body.temperature),
        "top_k": body.top_k,
        "top_p": float(body.top_p),
        "min_p": float(body.min_p),
        "seed": body.seed,
        "stop": body.stop,
        "tau": spec.tau if spec else None,
        "policy": spec.policy if spec else None,
        "max_verify_passes": spec.max_verify_passes if spec else None,
        "request_id": request_id,
        "presence_penalty": float(body.presence_penalty),
        "frequency_penalty": float(body.frequency_penalty),
        "repetition_penalty": float(body.repetition_penalty),
        "logit_bias": {int(k): float(v) for k, v in (body.logit_bias or {}).items()},
        "min_tokens": body.min_tokens,
        "ignore_eos": body.ignore_eos,
        "response_format": fmt,
        "logprobs": logprobs_wanted(body),
        "prediction": body.prediction.text() if body.prediction is not None else None,
        # echo with logprobs: the prompt's tokens scored too
        "prompt_logprobs": body.logprobs if isinstance(body, CompletionRequest) and body.echo else None,
    }


def choices(body: _Common) -> int:
    """The sequences a request runs: ``n`` for each of its prompts (a completion may send a list of them)."""
    return body.n * (len(body.prompts()) if isinstance(body, CompletionRequest) else 1)


def completion_builder(body: CompletionRequest, request_id: str) -> Callable[[Engine], list[Generation]]:
    prompts = body.prompts()
    kwargs = engine_kwargs(body, request_id, output_format(body))
    max_tokens = body.max_tokens if body.max_tokens is not None else 16

    def build(engine: Engine) -> list[Generation]:
        if len(prompts) == 1:
            return _start(engine, prompts[0], body.n, max_tokens, kwargs, "prompt")
        # Several prompts: each one's n samples (prefilled once), then the next's; all step together.
        gens: list[Generation] = []
        try:
            for i, prompt in enumerate(prompts):
                own = {**kwargs, "request_id": f"{request_id}-p{i}"}
                gens += _start(engine, prompt, body.n, max_tokens, own, f"prompt.{i}")
        except BaseException:
            for g in gens:
                g.cancel()
            raise
        return gens

    return build


def chat_builder(
    body: ChatCompletionRequest, request_id: str, template: str | None = None, plan: ToolPlan | None = None
) -> Callable[[Engine], list[Generation]]:
    """``template``: the server's chat template (``--chat-template``), else the tokenizer's; ``plan``: the request's
    ``tool_plan`` (its reply is tool calls), whose schema is then the output's format."""
    messages = [_message_dict(m) for m in body.messages]
    tools = template_tools(body)
    kwargs = engine_kwargs(body, request_id, plan.response_format() if plan is not None else output_format(body))
    max_tokens = body.max_completion_tokens or body.max_tokens

    def build(engine: Engine) -> list[Generation]:
        ids = render_chat(engine.tokenizer, messages, template, tools)
        room = engine.max_context - len(ids)
        if room <= 0:
            raise ContextLengthError(
                f"the conversation ({len(ids)} tokens) fills the context window of {engine.max_context} tokens",
                "messages",
            )
        return _start(engine, ids, body.n, max_tokens if max_tokens is not None else room, kwargs, "messages")

    return build


def has_chat_template(tokenizer: Any, template: str | None = None) -> bool:
    return bool(template or getattr(tokenizer, "chat_template", None))


def chat_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> Any:
    """The conversation (and the tools offered, for templates that show them) as ``template`` (None: the tokenizer's)
    renders it for the assistant's reply: what every chat request is rendered with, and what the start-up check
    renders (``check_chat_template``)."""
    return tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True
    )


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of the conversation in ``template`` (Jinja text; None: the tokenizer's chat template), ready for
    the assistant's reply."""
    from jinja2 import TemplateError

    try:
        text = chat_text(tokenizer, messages, template, tools)
    except TemplateError as e:  # templates raise for conversations they do not accept
        raise APIError(
            400, f"the model's chat template rejected the messages: {e}", "messages", "invalid_messages"
        ) from e
    if not isinstance(text, str):
        raise APIError(400, "the model's chat template did not produce text", "messages", "invalid_messages")
    # The template already wrote any BOS/special tokens it wants: do not let the tokenizer add them twice.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        msg["name"] = m.name
    if m.tool_calls:  # an assistant's earlier calls, their arguments as templates read them (objects, not text)
        msg["tool_calls"] = [_template_call(c) for c in m.tool_calls]
    if m.tool_call_id:
        msg["tool_call_id"] = m.tool_call_id
    return msg


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments", "{}"), (str, dict)):
        return call
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return call  # not JSON: the template gets it as it came
    return {**call, "function": {**function, "arguments": arguments}}


def _start(
    engine: Engine, prompt: str | list[int], n: int, max_tokens: int, kwargs: dict[str, Any], prompt_field: str
) -> list[Generation]:
    """The request's n samples, prefilled once (``Engine.start_many``)."""
    try:
        return engine.start_many(prompt, n, max_new_tokens=max_tokens, **kwargs)
    except InvalidRequestError as e:
        param = _PARAMS.get(e.param or "", e.param)
        if param == "prompt":
            param = prompt_field
        message = str(e).replace("max_new_tokens", "max_tokens")
        raise type(e)(message, param) from e


def read_chat_template(value: str) -> str:
    """``--chat-template``'s value as template text: a file's contents, or the value itself where it is Jinja (holds
    ``{{`` or ``{%``). Its syntax checked here, so a mistake stops the server before it loads anything."""
    from pathlib import Path

    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # not a possible file name (an inline template longer than a file name may be)
        is_file = False
    if is_file:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidRequestError(f"--chat-template: cannot read {value}: {e}", "chat_template") from e
    elif "{{" in value or "{%" in value:
        text = value
    elif "/" in value or path.suffix in (".jinja", ".j2", ".txt"):
        raise InvalidRequestError(f"--chat-template: no such file: {value}", "chat_template")
    else:
        raise InvalidRequestError(f"--chat-template: {value!r} is neither a file nor a Jinja template", "chat_template")
    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as e:
        raise InvalidRequestError(
            f"--chat-template: not a valid Jinja template (line {e.lineno}: {e.message})", "chat_template"
        ) from e
    return text


def check_chat_template(tokenizer: Any, template: str) -> None:
    """A one-message conversation rendered with ``template`` on ``tokenizer``: a template that cannot render the
    simplest conversation is refused as the server starts, not on its first chat request."""
    try:
        text = chat_text(tokenizer, [{"role": "user", "content": "Hello"}], template)
    except Exception as e:  # a template's own errors are of any kind (raise_exception, undefined names, ...)
        raise InvalidRequestError(
            f"--chat-template: fails on a one-message conversation: {type(e).__name__}: {e}", "chat_template"
        ) from e
    if not isinstance(text, str) or "Hello" not in text:
        raise InvalidRequestError(
            "--chat-template: a one-message conversation renders without its message", "chat_template"
        )

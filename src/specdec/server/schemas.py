"""Request and response bodies of the OpenAI-compatible API (pydantic, so the OpenAPI schema is exact).

Fields OpenAI defines but specdec does not implement are accepted only at their neutral value
(``suffix: null``, ``tools: []``, ...) so a request never silently means something else.
Unknown fields are ignored, as OpenAI clients send new ones over time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_STOP = 16
MAX_N = 16  # samples per request at most (a server also caps n at its --max-batch and --max-active)


def _valid_unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON escapes can smuggle in lone surrogates no tokenizer accepts
        raise ValueError(f"string is not valid Unicode (lone surrogate at index {e.start})") from None
    return s


Text = Annotated[StrictStr, AfterValidator(_valid_unicode)]
Float = Annotated[float, Field(allow_inf_nan=False)]
TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
Stop = Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None


class SpeculativeOptions(BaseModel):
    """specdec extension: how this request is drafted and verified."""

    model_config = ConfigDict(extra="forbid")

    policy: StrictStr | None = Field(None, description="policy choosing τ each step (default: the server's)")
    tau: StrictInt | None = Field(None, ge=0, description="fixed draft length; 0 = plain target decoding")
    max_verify_passes: StrictInt | None = Field(None, gt=0, description="hard cap on target passes")
    steps: StrictBool = Field(False, description="stream every step's record (see docs/server.md)")


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class ContentPart(BaseModel):
    type: Literal["text"]
    text: Text


class PredictionContent(BaseModel):
    """OpenAI's predicted outputs: text the output is expected to repeat much of (e.g. the file being edited)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["content"]
    content: Text | list[ContentPart]

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of its fields (``response_format`` asks the same in OpenAI's
    shape)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json", description="a JSON schema")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = Field(None, description="a Lark grammar")
    json_object: StrictBool | None = Field(None, description="true: any JSON object")


class _Common(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(None, description="served model name (GET /v1/models); default: the one served")
    temperature: Float = Field(1.0, ge=0, le=2, description="0 = greedy")
    top_p: Float = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(0, ge=0, description="extension: keep the k most likely tokens (0 = off)")
    min_p: Float = Field(
        0.0,
        ge=0,
        le=1,
        description="extension: keep the tokens at least min_p times as likely as the likeliest (0 = off)",
    )
    stop: Stop = None
    seed: StrictInt | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(
        1,
        ge=1,
        le=MAX_N,
        description=f"independent samples of the prompt, sharing its prefill (at most {MAX_N}, and at most the "
        "server's --max-batch and --max-active)",
    )
    user: StrictStr | None = None
    presence_penalty: Float = Field(
        0.0, ge=-2, le=2, description="subtracted once from the logit of every token generated so far"
    )
    frequency_penalty: Float = Field(
        0.0, ge=-2, le=2, description="subtracted from a token's logit once per time it was generated so far"
    )
    logit_bias: dict[str, Annotated[Float, Field(ge=-100, le=100)]] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit"
    )
    repetition_penalty: Float = Field(
        1.0,
        gt=0,
        description="extension: a token in the prompt or generated so far has a positive logit divided by it, "
        "a negative one multiplied (1 = off)",
    )
    min_tokens: StrictInt = Field(0, ge=0, description="extension: EOS is not generated before this many tokens")
    ignore_eos: StrictBool = Field(
        False, description="extension: EOS does not end the request (generate to max_tokens or a stop string)"
    )
    speculative: SpeculativeOptions | None = None
    response_format: dict[str, Any] | None = Field(
        None,
        description='structured output: {"type": "text"} (free text), {"type": "json_object"}, {"type": '
        '"json_schema", "json_schema": {"name": ..., "schema": {...}}}; extensions: {"type": "regex", "regex": ...}, '
        '{"type": "choice", "choice": [...]}, {"type": "grammar", "grammar": LARK}',
    )
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's extension, one of json, regex, choice, grammar, json_object (or response_format)"
    )
    prediction: PredictionContent | None = Field(
        None,
        description="predicted output: steps draft from it where the output repeats it (verified like every draft: "
        "the output is the same with or without it, only faster)",
    )

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
        return v

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v


class CompletionRequest(_Common):
    prompt: (
        Text
        | TokenIds
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_N)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_N)]
    ) = Field(
        ...,
        description="a string or token ids, or a list of them: each prompt's n choices in turn (prompts × n at most "
        f"{MAX_N}, and at most the server's --max-batch and --max-active)",
    )
    max_tokens: StrictInt | None = Field(
        16,
        ge=0,
        description="tokens to generate at most (default 16; 0 only with echo and logprobs: the prompt scored)",
    )
    echo: StrictBool = Field(
        False, description="the prompt before the completion in each choice's text (with logprobs: its tokens scored)"
    )
    logprobs: StrictInt | None = Field(
        None, ge=0, le=5, description="log probabilities of each token and of the N most likely alternatives"
    )
    best_of: StrictInt | None = Field(None, description="only null or equal to n (every sample returned)")
    suffix: StrictStr | None = Field(None, description="not supported (null only)")

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or the list's (a string or token ids each)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)  # type: ignore[arg-type]
        return [p]  # type: ignore[list-item]


class FunctionSpec(BaseModel):
    name: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments (absent: none)")
    strict: StrictBool | None = Field(None, description="accepted; the arguments always follow the schema")


class ToolSpec(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, description="an assistant's earlier calls (for the template)")
    tool_call_id: StrictStr | None = Field(None, description="a tool message's call (for the template)")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = Field(None, gt=0, description="default: up to the context window")
    max_completion_tokens: StrictInt | None = Field(None, gt=0, description="alias of max_tokens")
    logprobs: StrictBool | None = Field(None, description="return each output token's log probability")
    top_logprobs: StrictInt | None = Field(
        None, ge=0, le=20, description="with logprobs: the N most likely alternatives at each position"
    )
    tools: list[ToolSpec] | None = Field(None, description="functions the model may call (rendered by the template)")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description='"required" or a named function: the reply is tool calls, their arguments held to the schemas by '
        'structured output; "none": text; "auto" (the default with tools) is refused: it needs a parser of the '
        "model's own tool-call syntax",
    )
    # OpenAI fields that would change what is generated, which specdec does not implement: accepted only at their
    # neutral values (``requests.check_supported``), never silently ignored.
    functions: Any = Field(None, description="not supported: only null or []")
    function_call: Any = Field(None, description='not supported: only null or "none" (or "auto" without functions)')
    parallel_tool_calls: StrictBool | None = Field(
        None, description='false: "required" makes exactly one call (default: one or more)'
    )
    modalities: Any = Field(None, description='not supported: only null or ["text"]')
    audio: Any = Field(None, description="not supported: only null")
    web_search_options: Any = Field(None, description="not supported: only null")


# -- responses --------------------------------------------------------------------------------


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int = Field(description="tokens drafted from the prediction that the output kept")
    rejected_prediction_tokens: int = Field(description="tokens drafted from the prediction and rejected")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose keys and values came from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = Field(None, description="with a prediction only")


class SpeculativeSummary(BaseModel):
    acceptance_rate: float = Field(description="accepted draft tokens / drafted tokens")
    mean_accepted_length: float = Field(description="tokens emitted per target pass, the correction token included")
    target_passes: int
    drafted: int
    accepted: int
    policy: str | None
    steps: list[dict[str, Any]] | None = Field(None, description="every step's record, when speculative.steps")
    choices: list[SpeculativeSummary] | None = Field(
        None, description="n > 1: each choice's own figures (the ones above are summed over the choices)"
    )


FinishReason = Literal["stop", "length", "verify_budget", "tool_calls"]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (nothing before it to score it by)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="null when the reply is tool calls")
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class _Response(BaseModel):
    """Fields shared by completion and chat completion responses; subclasses narrow ``object`` and ``choices``."""

    id: str
    object: str
    created: int
    model: str
    choices: Sequence[CompletionChoice | ChatChoice]
    usage: Usage
    speculative: SpeculativeSummary


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: Sequence[CompletionChoice]


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: Sequence[ChatChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specdec"
    max_context: int
    drafter: str | None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail

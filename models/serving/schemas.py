"""The OpenAI request bodies the server takes, checked by pydantic, and its error bodies.

Every model forbids unknown fields and is strict about types (``"5"`` is not a number), so a typo or
an option we do not implement is a 400 naming it, never silently ignored. Options of the OpenAI API
that we cannot honour (``best_of``, ``echo``, ``suffix``) are accepted only at their neutral value;
any other value is a 400 naming the option. ``top_k``, ``min_p`` and ``repetition_penalty``
(multiplicative, as transformers' and vLLM's) are accepted as extensions (mlx-lm's server takes them
too), as is ``chat_template_kwargs.enable_thinking`` (vLLM's spelling); ``canvas_events`` asks a
DiffusionGemma server for its denoising steps; ``speculative`` asks for prompt-lookup drafts, in the
keys of vLLM's ``--speculative-config`` (``method: "ngram"``, ``num_speculative_tokens``), which
vLLM sets for a whole server and we take per request.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from models.processing.audio import AUDIO_FORMATS

MAX_STOPS = 4  # the API's limit
MAX_STOP_CHARS = 1000  # characters in one stop string
MAX_TOP_LOGPROBS = 20  # the API's limit for chat's top_logprobs (and ours for completions' logprobs)
MAX_CHOICES = 128  # the API's limit for n (the server's --max-batch bounds it further)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ------------------------------------------------------------------------------ message parts
class URL(Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: URL


class AudioData(Strict):
    data: str  # base64
    format: Literal[tuple(AUDIO_FORMATS)]  # "wav", "mp3", ...: the one demuxer the bytes are read with


class AudioPart(Strict):
    type: Literal["input_audio"]
    input_audio: AudioData


class VideoPart(Strict):
    type: Literal["video_url"]  # vLLM's spelling; OpenAI has no video part
    video_url: URL


Part = Annotated[Union[TextPart, ImagePart, AudioPart, VideoPart], Field(discriminator="type")]


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON, as the API sends it


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _parts_by_role(self) -> "Message":
        if self.role != "user" and isinstance(self.content, list):
            media = [p.type for p in self.content if p.type != "text"]
            if media:
                raise ValueError(f"{media[0]} parts are accepted in user messages only, not in {self.role} messages")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        if self.content is None and not self.tool_calls:
            raise ValueError(f"a {self.role} message needs content")
        return self


class Function(Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: Function


class StreamOptions(Strict):
    include_usage: bool = False


class JSONSchemaFormat(Strict):
    name: str = Field(max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema goes with type 'json_schema', and that type needs it")
        return self


class Speculative(Strict):
    method: Literal["ngram"]  # vLLM's name for prompt-lookup drafts
    num_speculative_tokens: int = Field(4, ge=1)


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class TemplateOptions(Strict):
    enable_thinking: bool = False


# ----------------------------------------------------------------------------------- requests
class Sampling(Strict):
    """The sampling and length options both endpoints share."""

    GUIDES: ClassVar[tuple[str, ...]] = ("guided_json", "guided_regex", "guided_grammar", "tool_choice")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    guided_json: dict[str, Any] | str | None = None  # vLLM's extensions: at most one guide per request
    guided_regex: str | None = None
    guided_grammar: str | None = None  # Lark (llguidance's dialect), or GBNF when it holds "::="
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    speculative: Speculative | None = None

    @field_validator("stop")
    @classmethod
    def _stop_bounds(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"takes at most {MAX_STOPS} sequences, got {len(stops)}")
        longest = max(map(len, stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"a stop string may hold at most {MAX_STOP_CHARS} characters, got one of {longest}")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys are token ids written as strings, got {_shortened(repr(key))}")
        return bias

    @model_validator(mode="after")
    def _checks(self) -> "Sampling":
        guides = [name for name in self.GUIDES if getattr(self, name, None) not in (None, "auto", "none")]
        if getattr(self, "response_format", None) is not None and self.response_format.type != "text":
            guides.append("response_format")
        if len(guides) > 1:
            raise ValueError(f"{' and '.join(guides)} each constrain the answer; send one")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def bias(self) -> dict[int, float] | None:
        """``logit_bias`` keyed by token id (None when empty)."""
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: TemplateOptions | None = None
    canvas_events: bool = False
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _lengths(self) -> "ChatRequest":
        if self.max_tokens is not None and self.max_completion_tokens is not None and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @field_validator("tool_choice")
    @classmethod
    def _forced_tool(cls, choice, info):
        tools = info.data.get("tools")
        if choice not in (None, "auto", "none") and not tools:
            raise ValueError("'required' or a named function needs tools")
        names = [tool.function.name for tool in tools or []]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"names {choice.function.name!r}, which is not among the tools {names}")
        return choice

    @property
    def top_count(self) -> int | None:
        """How many most likely tokens to report per token (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def enable_thinking(self) -> bool:
        """Thinking is off unless the request asks for it (a template option or a reasoning effort)."""
        if self.chat_template_kwargs is not None and self.chat_template_kwargs.enable_thinking:
            return True
        return self.reasoning_effort not in (None, "none")


class CompletionRequest(Sampling):
    prompt: str | list[int] = Field(min_length=1)
    echo: Literal[False] = False
    suffix: None = None
    best_of: Literal[1] | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def top_count(self) -> int | None:
        return self.logprobs

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


# ------------------------------------------------------------------------------------- errors
class APIError(Exception):
    """An OpenAI-style error: ``status``, a message naming the fault, and the parameter at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


PART_TAGS = ("text", "image_url", "input_audio", "video_url")


def location(loc: tuple) -> str:
    """``('messages', 0, 'content')`` as ``messages[0].content``; pydantic's union-branch labels
    (``str``, ``list[...]``) and the part tag it puts after a part's index are dropped."""
    out, after_index = "", False
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            after_index = True
            continue
        skip = part in ("str", "int") or part.startswith(("list[", "function-", "literal[", "tagged-union["))
        if not skip and not (after_index and part in PART_TAGS):
            out += f".{part}" if out else str(part)
        after_index = False if not skip else after_index
    return out


def validation_error(err: ValidationError) -> APIError:
    """One 400 naming every fault pydantic found (unknown fields, wrong types, out-of-range values)."""
    items = [(location(item["loc"]), item) for item in err.errors(include_url=False)]
    wheres = [where for where, _ in items]
    # A union reports every branch; keep the faults of the branch that went deepest.
    items = [(w, i) for w, i in items if not any(o != w and o.startswith(w) and o[len(w)] in ".[" for o in wheres)]
    faults, params = [], []
    for where, item in items:
        if item["type"] == "extra_forbidden":
            faults.append(f"unknown field {where!r}")
        elif item["type"] == "missing":
            faults.append(f"missing field {where!r}")
        else:
            value = item.get("input")
            shown = "" if isinstance(value, (dict, list)) else f" (got {_shortened(repr(value))})"
            faults.append(f"{where or 'body'}: {item['msg'].removeprefix('Value error, ')}{shown}")
        params.append(where)
    unique = list(dict.fromkeys(faults))
    return APIError(400, "; ".join(unique), params[0] if params else None)


def _shortened(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was: an error never echoes a megabyte back."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def parse(model: type[Strict], body: Any) -> Strict:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise validation_error(err) from None

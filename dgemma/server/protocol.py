"""The HTTP API's request bodies (OpenAI-compatible, plus diffusion settings) and its error bodies.

Every field has a type and a finite range; anything that sizes work (messages, prompts, stop strings,
tools, `n`, every diffusion setting) is bounded here, before a request reaches the tokenizer or the
engine. Strings must be valid Unicode (a JSON `"\\ud800"` is a lone surrogate that no tokenizer can
encode). OpenAI fields that this model has no counterpart for are accepted only at their no-op value
(`top_p: 1`, `logprobs: false`, ...) and are a 400 naming the field otherwise; unknown fields are a 400
too, so that no parameter is ever silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..generation.choose import MAX_OPTIONS  # `choices`: the options of one request
from ..generation.loop import MAX_LOGPROBS
from ..generation.programs import MAX_RETRIES  # of a JSON answer
from ..generation.sampling import SETTINGS, SamplingParams
from ..images import SOFT_TOKEN_BUDGETS
from ..structured.tokens import MAX_VALUE_DEPTH, JsonRefused, first_problem, loads
from ..tool_calls import FUNCTION_NAME

MAX_N = 8  # choices per request (each one is a row of the engine's batch)
MAX_MESSAGES = 2048
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_TOOLS = 128
MAX_IMAGES = 16  # image parts in one request (each is decoded, resized and run through the vision tower)
MAX_OPTION_CHARS = 1024
MAX_SCHEMA_CHARS = 32768  # a response_format's JSON schema, or a tool's parameters, as JSON text
MAX_SCHEMA_DEPTH = MAX_VALUE_DEPTH  # nesting of a schema, a tool's parameters or a call's arguments
MAX_DESCRIPTION_CHARS = 8192  # a tool's description
MAX_ARGUMENTS_CHARS = 32768  # a replayed tool call's arguments, as JSON text
MAX_PREDICTION_PARTS = 256  # text parts of a prediction (its characters are bounded by the context, as a prompt's)
IMAGE_BUDGETS = Literal[SOFT_TOKEN_BUDGETS]  # the five budgets, as a request field's type


class ApiError(Exception):
    """A client error with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self, path: str = "") -> dict:
        """The error body in the dialect of the route at `path` (OpenAI's unless `dialect_of` says else)."""
        dialect = dialect_of(path)
        if dialect == "openai":
            return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        bare = self.param and not self.message.startswith(self.param)
        named = f"{self.param}: {self.message}" if bare else self.message
        if dialect == "anthropic":
            kind = _ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
            return {"type": "error", "error": {"type": kind, "message": named}}
        if dialect == "ollama":
            return {"error": named}
        return {"error": {"code": self.status, "message": named, "type": self.kind}}  # llama.cpp's server

    def renamed(self, rename) -> ApiError:
        """The same error with its field in a dialect's names (`rename`: a chat or completions field's
        dotted path -> the dialect's, or None to keep it)."""
        param = rename(self.param) if self.param else None
        if not param or param == self.param:
            return self
        message = param + self.message[len(self.param) :] if self.message.startswith(self.param) else self.message
        return ApiError(self.status, message, param, self.kind, self.code, self.headers)


# Anthropic's error types by status (docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
_ANTHROPIC_TYPES |= {413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
_DIALECTS = (("/v1/messages", "anthropic"), ("/api/", "ollama"), ("/infill", "llama.cpp"), ("/completion", "llama.cpp"))


def dialect_of(path: str) -> str:
    """Which client dialect a route speaks, by its path: "openai", "anthropic", "ollama" or "llama.cpp"."""
    for prefix, dialect in _DIALECTS:
        if path == prefix or path.startswith(prefix + "/") or (prefix.endswith("/") and path.startswith(prefix)):
            return dialect
    return "openai"


def validation_error(errors: list) -> ApiError:
    """A request model's first validation error (pydantic's `errors()`) as a 400 naming its field."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return ApiError(400, "the request body is not valid JSON")
    # field names and list indices; not "body", nor pydantic's names of union members ("function-after[...]")
    loc = [str(x) for x in first.get("loc", []) if x != "body" and (isinstance(x, int) or str(x).isidentifier())]
    param = ".".join(loc) or (first.get("ctx") or {}).get("name")  # a whole-request check names its field
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        message = "this server does not know this field (see docs/server.md for the fields it takes)"
    if first.get("type") == "model_attributes_type":
        message = "the request body must be a JSON object"
    if param and message.startswith(f"{param}: "):
        return ApiError(400, message, param)
    return ApiError(400, f"{param}: {message}" if param else message, param)


# ------------------------------------------------------------------------------------------------
# Field types


def first_bad_unicode(value: Any, path: str = "") -> str | None:
    """Where the first string in `value` (nested lists and dicts too) holds a lone surrogate, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"{path} (character {e.start})" if path else f"character {e.start}"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and first_bad_unicode(key) is not None:
            return f"{path}.{key}" if path else "a key"
        where = first_bad_unicode(item, f"{path}.{key}" if path else str(key))
        if where is not None:
            return where
    return None


def _valid_unicode(value: Any) -> Any:
    where = first_bad_unicode(value)
    if where is not None:
        raise ValueError(f"holds a lone surrogate at {where}; text must be valid Unicode")
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]


def setting_field(name: str) -> Any:
    """A request field for a SamplingParams setting: its range and help, from dgemma.generation.sampling."""
    meta = SETTINGS[name]
    bounds = {"gt": meta["low"]} if meta["open_low"] else {"ge": meta["low"]}
    return Field(default=None, le=meta["high"], description=meta["help"], **bounds)


# OpenAI fields with no counterpart in a diffusion model: the values that mean "off" are accepted
_NO_OP_VALUES: dict[str, tuple] = {
    "top_p": (1,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "reasoning_effort": (),
    "functions": ([],),
    "function_call": ("none",),
    "store": (False,),  # nothing is stored
    "metadata": ({},),  # (what OpenAI keeps with stored answers)
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
}


class Body(BaseModel):
    """A part of a request: unknown fields are refused, and `null` for a field means "not sent" (OpenAI's
    spec makes most fields nullable: `"n": null` is n's default)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)  # "yes" is not a bool

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        return {k: v for k, v in data.items() if v is not None or k not in known}


def _bounded_json(value: dict) -> dict:
    """A free-form JSON value (a schema, a tool's parameters): finite numbers, bounded nesting and size."""
    problem = first_problem(value, MAX_SCHEMA_DEPTH)
    if problem is not None:
        where, what = problem
        raise ValueError(f"{where}: {what}" if where else what)
    if len(json.dumps(value)) > MAX_SCHEMA_CHARS:
        raise ValueError(f"is longer than {MAX_SCHEMA_CHARS} characters of JSON")
    return value


Schema = Annotated[dict[str, Any], AfterValidator(_valid_unicode), AfterValidator(_bounded_json)]
FunctionName = Annotated[str, Field(min_length=1, max_length=128, pattern=f"^{FUNCTION_NAME}$")]


# ------------------------------------------------------------------------------------------------
# Tools


class FunctionDefinition(Body):
    """tools[].function: a function the model may call, its arguments described by a JSON schema."""

    name: FunctionName
    description: Text | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: Schema | None = None
    strict: bool | None = None  # calls follow `parameters` by construction when they are forced


class Tool(Body):
    """One entry of `tools`: {"type": "function", "function": {...}}."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionCall(Body):
    """A replayed call's function: its name and arguments (OpenAI sends JSON text; an object is taken too).
    Arguments that are a JSON object become that object, so the chat template writes them in the model's
    call syntax; other text stays as it is."""

    name: FunctionName
    arguments: Annotated[str, Field(max_length=MAX_ARGUMENTS_CHARS)] | Schema = "{}"

    @field_validator("arguments")
    @classmethod
    def _as_object(cls, value: str | dict) -> str | dict:
        if isinstance(value, dict):
            return value
        _valid_unicode(value)
        try:
            parsed = loads(value, MAX_SCHEMA_DEPTH)
        except JsonRefused as e:
            raise ValueError(f"the JSON text {e.reason}" + (f" (at {e.path})" if e.path else "")) from None
        except ValueError:  # not JSON: the template writes it as it is
            return value
        return parsed if isinstance(parsed, dict) else value


class ToolCall(Body):
    """An assistant message's tool_calls[] entry, as an OpenAI response carries it back."""

    id: Text | None = Field(default=None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


# ------------------------------------------------------------------------------------------------
# Requests


def _image_part(i: int, part: dict) -> None:
    """An OpenAI image part: {"type": "image_url", "image_url": {"url": "data:image/...;base64,...", "detail":
    "auto"}}. Remote URLs are refused: the server fetches nothing a client names."""
    image = part.get("image_url")
    if set(part) - {"type", "image_url"} or not isinstance(image, dict) or set(image) - {"url", "detail"}:
        raise ValueError(f"part {i} must be {{'type': 'image_url', 'image_url': {{'url': 'data:image/...'}}}}")
    url = image.get("url")
    if not isinstance(url, str):
        raise ValueError(f"part {i}: image_url.url must be a string")
    if url.startswith(("http://", "https://")):
        raise ValueError(
            f"part {i}: this server does not fetch remote images; send the image as a data: URL "
            "(data:image/png;base64,...)"
        )
    if not url.startswith("data:image/") or ";base64," not in url[:64]:
        raise ValueError(f"part {i}: image_url.url must be a data:image/...;base64,... URL")
    if image.get("detail", "auto") != "auto":
        raise ValueError(f"part {i}: detail must be 'auto' (set the image's soft tokens with max_soft_tokens)")


class Message(Body):
    """One chat message; `content` is a string or a list of parts: text (any role), and images as data:
    URLs (user messages). Parts of the other roles reach the template as their text (dgemma.checkpoints.tokenizer)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: Text | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_call_id: Text | None = Field(default=None, max_length=256)
    reasoning_content: Text | None = None
    # what an OpenAI response message carries back when a client replays it; only their empty values
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: list[None] | None = Field(default=None, max_length=0)

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any, info) -> Any:
        if value is None or isinstance(value, str):
            return _valid_unicode(value)
        if not isinstance(value, list):
            raise ValueError("must be a string, a list of content parts, or null")
        role = info.data.get("role")
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url" and role != "user":
                raise ValueError(f"part {i} is an image; only user messages hold images (a {role} message: text)")
            if kind == "image_url":
                _image_part(i, part)
                continue
            if kind != "text":
                what = f"{kind} content" if isinstance(kind, str) else "a part that is not {'type': 'text', ...}"
                raise ValueError(f"part {i} is {what}; this server takes text and image_url parts")
            if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise ValueError(f"part {i} must be {{'type': 'text', 'text': '...'}} and nothing else")
        return _valid_unicode(value)

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if isinstance(self.content, list):
            return "".join(part.get("text", "") for part in self.content)
        return self.content or ""

    def image_urls(self) -> list[tuple[int, str]]:
        """(part index, data: URL) of each image part."""
        parts = self.content if isinstance(self.content, list) else []
        return [(j, p["image_url"]["url"]) for j, p in enumerate(parts) if p.get("type") == "image_url"]


class JsonSchemaFormat(Body):
    """response_format.json_schema: OpenAI's {name, description, schema, strict}."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Text | None = Field(default=None, max_length=4096)
    schema_: Schema = Field(alias="schema")
    strict: bool | None = None  # answers follow the schema by construction either way


class ResponseFormat(Body):
    """`{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {...}}`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema goes with type 'json_schema', and only with it")
        return self


class NamedFunction(Body):
    name: Text = Field(min_length=1, max_length=256)


class NamedToolChoice(Body):
    """tool_choice naming one function: {"type": "function", "function": {"name": ...}}."""

    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Body):
    include_usage: bool = False


class PredictionPart(Body):
    type: Literal["text"]
    text: Text


class Prediction(Body):
    """`prediction` (OpenAI's Predicted Outputs): the answer as expected, text or text parts; its tokens seed
    the canvas (dgemma/generation/prediction.py), as many as the answer's length takes."""

    type: Literal["content"]
    content: Text | Annotated[list[PredictionPart], Field(max_length=MAX_PREDICTION_PARTS)]


class DiffusionSettings(Body):
    """Fields shared by both endpoints; the diffusion ones carry generation_config.json's names."""

    model: Text | None = Field(default=None, max_length=256)
    max_tokens: int | None = setting_field("max_new_tokens")  # OpenAI's name for it
    stop: Any = None  # a string or a list of them
    seed: int | None = setting_field("seed")
    greedy: bool | None = Field(default=None, description=SETTINGS["greedy"]["help"])
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=4)
    user: Text | None = Field(default=None, max_length=256)  # an end-user id for the operator's logs
    max_denoising_steps: int | None = setting_field("max_denoising_steps")
    entropy_bound: float | None = setting_field("entropy_bound")
    t_min: float | None = setting_field("t_min")
    t_max: float | None = setting_field("t_max")
    stability_threshold: int | None = setting_field("stability_threshold")
    confidence_threshold: float | None = setting_field("confidence_threshold")
    sampler: Literal["entropy-bound", "confidence", "fixed"] | None = None
    confidence: float | None = setting_field("confidence")  # the "confidence" sampler's threshold
    tokens_per_step: int | None = setting_field("tokens_per_step")  # the "fixed" sampler's count
    mode: Literal["fast", "exact"] | None = None
    early_commit: bool | None = None  # default: on when streaming
    early_commit_steps: int | None = setting_field("early_commit_steps")
    early_commit_entropy: float | None = setting_field("early_commit_entropy")
    include_drafts: bool = False  # extension: stream each step's draft canvas in `dgemma_draft`
    cache_prompt: bool = True  # extension (llama.cpp's name): false keeps the prompt out of the prefix cache
    response_format: ResponseFormat | None = None  # JSON answers: dgemma/structured/
    # extension: the answer is exactly one of these, the one the model scores best (dgemma.choose)
    choices: list[Annotated[Text, Field(min_length=1, max_length=MAX_OPTION_CHARS)]] | None = Field(
        default=None, min_length=1, max_length=MAX_OPTIONS
    )
    ignore_eos: bool = False  # extension (as in vLLM): generate max_tokens even past end-of-text tokens
    # extension: a JSON answer or a required tool call that does not validate is drawn again this many times
    # (default 2, as dgemma.generate_json's `retries`)
    retries: int | None = Field(default=None, ge=0, le=MAX_RETRIES)
    prediction: Prediction | None = None  # the answer as expected: its tokens seed the canvas (fast mode)
    # OpenAI fields accepted only at their no-op value (see _NO_OP_VALUES)
    top_p: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else value
        if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
            raise ValueError("must be a string or a list of strings")
        if stops is not None and (len(stops) > MAX_STOP or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
            raise ValueError(f"stop takes at most {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters")
        return _valid_unicode(stops) or None

    @field_validator(*_NO_OP_VALUES, check_fields=False)
    @classmethod
    def _no_op_only(cls, value, info):
        allowed = _NO_OP_VALUES[info.field_name]
        if value is None or any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed):
            return value
        shown = " or ".join(json.dumps(a) for a in allowed) if allowed else "null"
        raise ValueError(f"is not supported by this server (a diffusion model): send {shown}, or leave it out")

    def conflict(self) -> tuple[str, str] | None:
        """The first field that does not go with the others and why, as (param, message): a route answers
        it as a 400 before any work, streamed or not (the validators above check types and ranges)."""
        json_format = self.response_format is not None and self.response_format.type != "text"
        if self.choices is not None:
            bad = ["n"] * (self.n != 1) + sorted(self.model_fields_set - _WITH_CHOICES - set(_NO_OP_VALUES))
            if bad:
                return bad[0], f"{bad[0]}: does not apply with choices (the answer is the best-scored option)"
        if self.retries is not None and not (json_format or getattr(self, "forced_call", False)):
            why = "retries: apply to answers that are validated (a JSON response_format, a required tool call)"
            return "retries", why
        if json_format and self.stop:
            return "stop", "stop: does not apply with a JSON response_format (the JSON ends itself)"
        whole = {"suffix": getattr(self, "suffix", None) is not None, "response_format": json_format}
        unseeded = next((n for n, given in (*whole.items(), ("mode 'exact'", self.mode == "exact")) if given), None)
        if self.prediction is not None and unseeded is not None:  # what a prediction cannot seed: no free text
            return "prediction", f"prediction: seeds a text answer's canvas in mode 'fast', not with {unseeded}"
        other = next((n for n, given in (*whole.items(), ("stream", self.stream)) if given), None)
        logprobs = getattr(self, "logprobs", None)  # chat's a bool, completions' a count (0 is one)
        if logprobs is not None and logprobs is not False and other is not None:  # with whole answers, as written
            return other, f"logprobs: not with {other} (they are the denoiser's, for tokens it wrote as they are)"
        for name in ("stream_options", "include_drafts"):
            if getattr(self, name) and not self.stream:
                return name, f"{name}: only applies with stream: true"
        return None

    def sampling(self, max_tokens: int) -> SamplingParams:
        """The SamplingParams this request asks for (validated later, with the model's defaults)."""
        passed = (f.name for f in dataclasses.fields(SamplingParams) if f.name in _PASSED_THROUGH)
        fields = {name: getattr(self, name) for name in passed if getattr(self, name) is not None}
        seed = self.seed
        if self.temperature == 0:
            # Greedy, as clients expect of 0: the argmax at each accepted position, the checkpoint's own
            # schedule for which positions a step accepts, and seed 0 unless one is given (a canvas starts
            # from random tokens), so that the same request gives the same answer.
            fields["greedy"] = True
            seed = 0 if seed is None else seed
        elif self.temperature is not None and self.t_min is None and self.t_max is None:
            # One OpenAI temperature becomes the schedule's start, ending at half of it (the defaults' ratio).
            fields["t_max"], fields["t_min"] = self.temperature, self.temperature / 2
        early = self.stream if self.early_commit is None else self.early_commit
        fields["early_commit"] = early and fields.get("mode") != "exact"
        if self.ignore_eos:
            fields["stop_token_ids"] = []
        return SamplingParams(max_new_tokens=max_tokens, seed=seed, **fields)


# the fields that apply with `choices`
_WITH_CHOICES = frozenset(
    {"model", "choices", "messages", "prompt", "user", "stream", "stream_options", "echo", "max_tokens"}
    | {"max_completion_tokens"}
)

# the SamplingParams fields a request sets under their own names (seed, length and early commit are derived)
_PASSED_THROUGH = frozenset(DiffusionSettings.model_fields) - {"seed", "max_new_tokens", "early_commit"}


class ChatCompletionRequest(DiffusionSettings):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = setting_field("max_new_tokens")
    reasoning: bool = False  # turn on thinking (the chat template's enable_thinking)
    logprobs: bool | None = None  # each answer token's log-probability (the denoiser's, at its last step)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # ... and this many alternatives
    max_soft_tokens: IMAGE_BUDGETS | None = None  # extension: soft tokens an image may take (default 280)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    # "required" or a named function: the answer is a call, made by construction (server/structured.py)
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Any = None
    functions: Any = None
    function_call: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    modalities: Any = None

    @model_validator(mode="after")
    def _images(self) -> ChatCompletionRequest:
        count = sum(len(m.image_urls()) for m in self.messages)
        if count > MAX_IMAGES:
            raise PydanticCustomError(
                "messages", f"messages: at most {MAX_IMAGES} images in one request (got {count})", {"name": "messages"}
            )
        return self

    def conflict(self) -> tuple[str, str] | None:
        found = super().conflict()
        json_format = self.response_format is not None and self.response_format.type != "text"
        call = "does not go with a required tool call (the answer is the call)"
        json = "does not go with a JSON response_format (the answer is the JSON)"
        images, tools = any(m.image_urls() for m in self.messages), self.tools and self.tool_choice != "none"
        rules = [(n, call, self.forced_call and getattr(self, n)) for n in ("reasoning", "logprobs", "stop")] + [
            ("response_format", "a required tool call is the answer's format", self.forced_call and json_format),
            ("tools", "a JSON response_format does not go with tools (use tool_choice 'none')", json_format and tools),
            ("reasoning", json, json_format and self.reasoning),
            ("max_soft_tokens", "applies to image parts; there are none", bool(self.max_soft_tokens) and not images),
            ("tool_choice", "needs tools to call", self.forced_call and not self.tools),
            ("top_logprobs", "needs logprobs: true", self.top_logprobs and not self.logprobs),
            ("prediction", "does not go with tools (use tool_choice 'none')", self.prediction and tools),
        ]  # fmt: skip
        return found or next(((n, f"{n}: {why}") for n, why, broken in rules if broken), None)

    @property
    def forced_call(self) -> bool:
        """The answer must be a tool call (tool_choice "required" or a named function)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def requested_tokens(self) -> tuple[int | None, str]:
        """The length asked for and the field that asked for it."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(DiffusionSettings):
    prompt: Any  # a string, a list of token ids, or a list of either (one choice set per prompt)
    suffix: Text | None = None  # infilling: generate between prompt and suffix
    echo: bool = False  # return the prompt before the completion
    # each token's log-probability and this many alternatives: the prompt's (with echo) from the causal
    # encoder, the completion's from the denoiser at its canvas's last step
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> list[str | list[int]]:
        """Always a list of prompts, each a string or a non-empty list of token ids."""
        if isinstance(value, str) or (isinstance(value, list) and value and all(_is_id(t) for t in value)):
            value = [value]
        if not isinstance(value, list) or not value:
            raise ValueError("must be a string, a list of token ids, or a non-empty list of those")
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"takes at most {MAX_PROMPTS} prompts (got {len(value)})")
        for i, p in enumerate(value):
            if not (isinstance(p, str) or (isinstance(p, list) and p and all(_is_id(t) for t in p))):
                raise ValueError(f"prompt {i} must be a string or a non-empty list of token ids")
        return _valid_unicode(value)

    def conflict(self) -> tuple[str, str] | None:
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of: only best_of equal to n (or leaving it out) is supported"
        if self.suffix is not None and len(self.prompt) > 1:
            return "suffix", "suffix: infilling takes one prompt"
        if self.suffix is not None and self.response_format is not None and self.response_format.type != "text":
            return "suffix", "suffix: does not go with a JSON response_format (the answer is the JSON)"
        return super().conflict()


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CanvasScoreRequest(Body):
    """POST /v1/canvas/score: a read-only denoising pass over a given canvas (the Score task)."""

    model: Text | None = Field(default=None, max_length=256)
    prompt: Text | list[int] = Field(min_length=1)
    canvas: Text | list[int] = Field(min_length=1)
    top_logprobs: int = Field(default=0, ge=0, le=MAX_LOGPROBS)

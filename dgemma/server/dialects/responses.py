"""OpenAI's Responses API: POST /v1/responses, as the `openai` SDK (`client.responses.create / stream /
parse`) and the `openai-agents` SDK (OpenAIResponsesModel) send it.

A body maps onto a chat body (routes.start_mapped): `instructions` a system message first; `input` a user
message (a string) or items: messages (user, system, developer, assistant; input_text, input_image as a
data: URL, output_text parts), function_call items an assistant's tool_calls (consecutive ones one message),
function_call_output items tool messages; flat function `tools`; `tool_choice` auto, none, required or
{type: function, name}; `parallel_tool_calls`; `text.format` (text, json_object, json_schema: valid by
construction) response_format; `max_output_tokens` max_tokens; `temperature`, `top_p` (1 only), `metadata`
({} only), `user`, `stream`; dgemma's settings under `dgemma`. One answer (n = 1): a message item and/or
function_call items, "incomplete" (max_output_tokens) when the length ran out; streamed as Responses events.

Nothing is stored, so `store: true`, `previous_response_id`, `conversation` and item references are refused
by name (send the whole conversation in `input`, as openai-agents does). Accepted at no-op values only:
`include` ([]), `truncation` ("disabled"), `background` (false), `service_tier`, `top_logprobs` (0),
`stream_options` (no obfuscation), `text.verbosity` ("medium"); `prompt_cache_key` and `safety_identifier`
are hints with no effect. Refused by name: hosted tools and tool choices, `reasoning`, `prompt`,
`max_tool_calls`, file ids, input_file parts, and any field this module does not list.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import AfterValidator, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..protocol import (
    MAX_DESCRIPTION_CHARS,
    MAX_MESSAGES,
    MAX_TOOLS,
    ApiError,
    ChatCompletionRequest,
    FunctionCall,
    FunctionName,
    Schema,
    Text,
    _Body,
    extensions,
    first_bad_unicode,
    validation_error,
)
from ..routes import Renames, Started, start_mapped
from ..runs import Served

Id = Annotated[Text, Field(max_length=256)]
Status = Literal["in_progress", "completed", "incomplete"] | None
Parts = Text | Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)]  # parts are checked one by one


def _function_only(kind: str) -> str:
    if kind != "function":
        raise ValueError(f"{kind!r} tools are OpenAI's hosted tools; this server calls function tools only")
    return kind


class FunctionTool(_Body):
    """tools[]: chat's function, flat."""

    type: Annotated[str, AfterValidator(_function_only)]  # first: a hosted tool is refused by its type
    name: FunctionName
    description: Text | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: Schema | None = None
    strict: bool | None = None


class TextPart(_Body):
    """input_text, or output_text as a replayed answer carries it."""

    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[None] | None = Field(default=None, max_length=0)
    logprobs: list[None] | None = Field(default=None, max_length=0)


class ImagePart(_Body):
    type: Literal["input_image"]
    file_id: Any = None  # refused: this server keeps no files
    image_url: Text  # a data: URL (chat's image part checks it)
    detail: Text | None = None

    @field_validator("file_id")
    @classmethod
    def _no_files(cls, value: Any) -> None:
        raise ValueError("this server keeps no files; send the image as a data: URL in image_url")


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Parts
    id: Id | None = None
    status: Status = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(FunctionCall):
    """A call the model made, replayed: name and arguments as chat's."""

    type: Literal["function_call"]
    call_id: Id = Field(min_length=1)
    id: Id | None = None
    status: Status = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: Id = Field(min_length=1)
    output: Parts
    name: Id | None = None
    id: Id | None = None
    status: Status = None


_ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem}
_PARTS = {"input_text": TextPart, "output_text": TextPart, "input_image": ImagePart}


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    schema_: Schema | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: Text | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the default; a diffusion model has no verbosity setting


# fields with no counterpart: the values that mean "off" (none: only null), and why others are refused
_NO_OP: dict[str, tuple[tuple, str]] = {
    "store": ((False,), "this server keeps no responses; send the whole conversation in input"),
    "previous_response_id": ((), "this server keeps no responses; send the whole conversation in input"),
    "conversation": ((), "this server keeps no conversations; send the whole conversation in input"),
    "include": (([],), "there is nothing more to include (no hosted tools, no stored reasoning)"),
    "truncation": (("disabled",), "input is never cut to fit: a prompt over the context is a 400"),
    "background": ((False,), "a response runs while its request waits"),
    "service_tier": (("auto", "default"), "this server has one tier"),
    "top_logprobs": ((0,), "log-probabilities are a Chat Completions feature here"),
    "stream_options": (({}, {"include_obfuscation": False}), "stream events carry no obfuscation"),
    "reasoning": ((), "thinking is a Chat Completions feature here (reasoning: true)"),
    "prompt": ((), "this server keeps no prompt templates"),
    "max_tool_calls": ((), "the calls of an answer are bounded by parallel_tool_calls"),
}


class ResponsesRequest(_Body):
    model_config = ConfigDict(allow_inf_nan=False)

    model: Text | None = Field(default=None, max_length=256)
    input: Any  # a string, or a list of items (each checked as its type says: _typed)
    instructions: Text | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Any = None  # "auto" | "none" | "required" | {"type": "function", "name": ...}
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None  # chat's max_tokens, bounded there
    temperature: float | None = None  # bounded by chat
    top_p: Any = None  # chat's: 1 only
    stream: bool = False
    metadata: Any = None  # chat's: {} only (nothing is kept to hold it)
    user: Id | None = None
    prompt_cache_key: Id | None = None
    safety_identifier: Id | None = None
    dgemma: dict[str, Any] | None = None  # dgemma's settings (protocol.EXTENSIONS)

    @field_validator("input")
    @classmethod
    def _input(cls, value: Any) -> Any:
        if (isinstance(value, str) and first_bad_unicode(value) is None) or (
            isinstance(value, list) and len(value) <= MAX_MESSAGES
        ):
            return value
        raise ValueError(f"must be valid Unicode text or a list of at most {MAX_MESSAGES} items")

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if value in ("auto", "none", "required") or (
            kind == "function" and set(value) == {"type", "name"} and isinstance(value["name"], str)
        ):
            return value
        refused = f"{kind!r} choices are not supported; " if isinstance(kind, str) and kind != "function" else ""
        raise ValueError(f"{refused}send 'auto', 'none', 'required' or {{'type': 'function', 'name': ...}}")

    @model_validator(mode="before")
    @classmethod
    def _no_op_only(cls, data: Any) -> Any:
        """The fields of _NO_OP: refused by name unless null or a no-op value, then dropped."""
        for name in _NO_OP.keys() & (data.keys() if isinstance(data, dict) else set()):
            (allowed, why), value = _NO_OP[name], data[name]
            if value is not None and not any(value == a and type(value) is type(a) for a in allowed):
                shown = " or ".join(json.dumps(a) for a in allowed) if allowed else "null"
                message = f"{name}: not supported: {why} (send {shown}, or leave it out)"
                raise PydanticCustomError(name, message, {"name": name})
        return {k: v for k, v in data.items() if k not in _NO_OP} if isinstance(data, dict) else data


# ------------------------------------------------------------------------------------------------
# The body as a chat body


def _typed(kinds: dict[str, type[_Body]], raw: Any, where: str, default: str | None = None) -> Any:
    """An item or part as the model of its `type`; its errors are named from `where` on."""
    kind = raw.get("type", default) if isinstance(raw, dict) else None
    if kind not in kinds:
        named = f"{where}.type" if isinstance(kind, str) else where
        what = f"{kind!r} is not supported" if isinstance(kind, str) else "must be an object with a type"
        raise ApiError(400, f"{named}: {what}; this server takes {', '.join(kinds)}", named)
    try:
        return kinds[kind].model_validate(raw)
    except ValidationError as e:
        first, loc = e.errors()[0], [int(x) if x.isdigit() else x for x in where.split(".")]
        raise validation_error([{**first, "loc": (*loc, *first["loc"])}]) from None


def _content(value: str | list[dict], where: str) -> str | list[dict]:
    """Chat content: the text, or the parts one for one (text parts, and image_url parts)."""
    if isinstance(value, str):
        return value
    parts = [_typed(_PARTS, raw, f"{where}.{j}") for j, raw in enumerate(value)]
    return [
        {"type": "image_url", "image_url": {"url": p.image_url, **({"detail": p.detail} if p.detail else {})}}
        if isinstance(p, ImagePart)
        else {"type": "text", "text": p.text}
        for p in parts
    ]


def _messages(body: ResponsesRequest) -> tuple[list[dict], list[str]]:
    """The chat messages of `instructions` and `input`, and the field each came from."""
    messages, origins = [], []
    if body.instructions is not None:
        messages, origins = [{"role": "system", "content": body.instructions}], ["instructions"]
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}], [*origins, "input"]
    for k, raw in enumerate(body.input):
        item, where = _typed(_ITEMS, raw, f"input.{k}", default="message"), f"input.{k}"
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": item.model_dump(include={"name", "arguments"})}
            if messages and messages[-1]["role"] == "assistant":  # the calls of one answer: one message
                messages[-1].setdefault("tool_calls", []).append(call)
                continue
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        elif isinstance(item, FunctionCallOutputItem):
            message = {
                "role": "tool",
                "tool_call_id": item.call_id,
                "content": _content(item.output, f"{where}.output"),
            }
            message |= {"name": item.name} if item.name else {}
        else:
            message = {"role": item.role, "content": _content(item.content, f"{where}.content")}
        messages.append(message)
        origins.append(where)
    return messages, origins


# chat's names of fields (routes.Renames) -> the Responses names
_NAMES = {
    "max_tokens": "max_output_tokens", "response_format.json_schema": "text.format", "response_format": "text.format",
    "tools.*.function": "tools.*", "tool_choice.function": "tool_choice", "messages": "input",
}  # fmt: skip


def chat_fields(body: ResponsesRequest) -> tuple[dict, Renames]:
    """The chat body a Responses body maps onto, and the Responses names of its fields."""
    messages, origins = _messages(body)
    choice = body.tool_choice
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice["name"]}}
    tools = [
        {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in body.tools or []
    ]
    fmt = body.text.format if body.text is not None else None
    response_format = None if fmt is None else {"type": fmt.type}
    if fmt is not None and fmt.type == "json_schema":
        response_format["json_schema"] = fmt.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)
    elif fmt is not None and fmt.model_fields_set - {"type"}:
        raise ApiError(400, "text.format: name, schema, strict and description go with type json_schema", "text.format")
    given = {
        "model": body.model, "messages": messages, "tools": tools or None, "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls, "response_format": response_format,
        "max_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "metadata": body.metadata, "user": body.user, "stream": body.stream,
    }  # fmt: skip
    fields = {k: v for k, v in given.items() if v is not None} | extensions(body.dgemma)
    return fields, Renames(_NAMES, origins)


# ------------------------------------------------------------------------------------------------
# The answer and its events

_PART = {"type": "output_text", "text": "", "annotations": []}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Response:
    """One response as it is written: its output items as the pieces come, and the events that say so
    (numbered), sent as a stream or, drained, giving one answer."""

    def __init__(self, served: Served, body: ResponsesRequest, started: Started, rename: Renames):
        self.started, self.rename, self.output, self.message = started, rename, [], None
        self.status, self.error, self.sequence, self.reason = "in_progress", None, 0, None
        fmt = body.text.format if body.text is not None else None
        self.head = {
            "id": _id("resp"), "object": "response", "created_at": int(time.time()), "model": served.name,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
            "store": False, "temperature": body.temperature, "top_p": body.top_p, "truncation": "disabled",
            "tool_choice": body.tool_choice or "auto", "user": body.user, "metadata": body.metadata or {},
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "text": {"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt else {"type": "text"}},
        }  # fmt: skip

    def event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence, **fields}

    def snapshot(self) -> dict:
        out = {**self.head, "status": self.status, "output": self.output, "error": None, "incomplete_details": None}
        if self.error is not None:
            out["error"] = {"code": "server_error", "message": self.error.message}
        if self.reason == "length":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.status in ("completed", "incomplete"):
            choices = self.started.choices
            used, made = self.started.prompt_tokens, sum(c.returned_tokens for c in choices)
            out["usage"] = {
                "input_tokens": used, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": made, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": used + made,
            }  # fmt: skip
            details = {"choices": [c.details for c in choices]} if any(c.details for c in choices) else {}
            out["dgemma"] = {"steps_per_canvas": [c.steps_per_canvas for c in choices], **details}
        return out

    def text(self, text: str) -> list[dict]:
        """The events of `text` added to the answer's message (opened by its first text)."""
        events = self._open() if self.message is None else []
        self.message["content"][0]["text"] += text
        if text:
            events.append(self.event("response.output_text.delta", **self._at(), delta=text, logprobs=[]))
        return events

    def _open(self) -> list[dict]:
        self.message = {
            "type": "message",
            "id": _id("msg"),
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        self.output.append(self.message)
        item = {**self.message, "content": []}  # as it is now: the message grows after the event is made
        added = self.event("response.output_item.added", output_index=len(self.output) - 1, item=item)
        self.message["content"].append(dict(_PART))
        return [added, self.event("response.content_part.added", **self._at(), part=dict(_PART))]

    def _at(self) -> dict:
        """Where the open message's text is (the last item while it is open)."""
        return {"item_id": self.message["id"], "output_index": len(self.output) - 1, "content_index": 0}

    def close_message(self, status: str = "completed") -> list[dict]:
        if self.message is None:
            return []
        item, at = self.message, self._at()
        item["status"], self.message = status, None
        return [
            self.event("response.output_text.done", **at, text=item["content"][0]["text"], logprobs=[]),
            self.event("response.content_part.done", **at, part=item["content"][0]),
            self.event("response.output_item.done", output_index=at["output_index"], item=item),
        ]

    def calls(self, calls: list[tuple[str, dict]]) -> list[dict]:
        events = self.close_message()
        for name, arguments in calls:
            text, at = json.dumps(arguments), {"output_index": len(self.output)}
            item = {"type": "function_call", "id": _id("fc"), "call_id": _id("call"), "name": name, "arguments": text}
            self.output.append({**item, "status": "completed"})
            of_item = {**at, "item_id": item["id"]}
            events += [
                self.event("response.output_item.added", **at, item={**item, "arguments": "", "status": "in_progress"}),
                self.event("response.function_call_arguments.delta", **of_item, delta=text),
                self.event("response.function_call_arguments.done", **of_item, name=name, arguments=text),
                self.event("response.output_item.done", **at, item=self.output[-1]),
            ]
        return events

    def finish(self, reason: str) -> list[dict]:
        self.reason, cut = reason, reason == "length"
        events = (self.text("") if not self.output else []) + self.close_message("incomplete" if cut else "completed")
        self.status = "incomplete" if cut else "completed"  # no text and no call: an empty message
        return [*events, self.event(f"response.{self.status}", response=self.snapshot())]

    def fail(self, error: ApiError) -> list[dict]:
        self.status, self.error = "failed", error.renamed(self.rename)
        failed = self.event("error", code=self.error.code, message=self.error.message, param=self.error.param)
        return [failed, self.event("response.failed", response=self.snapshot())]


async def _events(response: _Response, pieces):
    """The events of a response from its pieces: created, in progress, its items, its end."""
    yield response.event("response.created", response=response.snapshot())
    yield response.event("response.in_progress", response=response.snapshot())
    async for piece in pieces:
        if piece.kind == "content":
            events = response.text(piece.text)
        elif piece.kind == "calls":
            events = response.calls(piece.calls)
        elif piece.kind == "end":
            events = response.fail(piece.error) if piece.error else response.finish(piece.finish_reason)
        else:
            continue  # drafts and reasoning: never asked for here
        for event in events:
            yield event


def add_routes(app: FastAPI, served: Served) -> None:
    @app.post("/v1/responses", summary="OpenAI Responses: message and function_call items, whole or streamed")
    async def responses(body: ResponsesRequest, http: Request):
        fields, rename = chat_fields(body)
        started = await start_mapped(served, ChatCompletionRequest, fields, http, rename)
        response = _Response(served, body, started, rename)
        events = _events(response, started.pieces)
        if body.stream:
            sse = (f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" async for e in events)
            return StreamingResponse(sse, media_type="text/event-stream")
        async for _ in events:
            pass
        if response.error is not None:
            raise response.error
        if response.status == "in_progress":
            raise ApiError(499, "the client closed the request")
        return response.snapshot()

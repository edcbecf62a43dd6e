"""OpenAI's Responses API (POST /v1/responses, as the `openai` and `openai-agents` SDKs send it) mapped onto the chat
body (dialects.start_mapped): chat's rules and limits apply, and its errors name Responses' fields. Supported:
`instructions`; `input`, a string or items (messages with input_text, output_text and input_image parts, images as data:
URLs; function_call and function_call_output items); flat function `tools`, `tool_choice`, `parallel_tool_calls`;
`text.format` (json_schema: valid by construction); `max_output_tokens`, `temperature`, `stream`; dgemma's settings
under `dgemma`. One answer, whole or as Responses events: a message and/or function_call items. Nothing is stored, so
`store: true`, `previous_response_id`, `conversation`, item references and file ids are refused by name (send the whole
conversation in `input`, as openai-agents does); so are hosted tools, `reasoning`, `prompt`, `max_tool_calls` and
unknown fields. `include`, `truncation`, `background`, `stream_options`, `text.verbosity`, `top_p`, `metadata`,
`service_tier` and `top_logprobs` are taken at their no-op values only (chat checks the last four).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import AfterValidator, Field, ValidationError

from .. import protocol
from ..protocol import ApiError, Body, Text
from ..runs import Piece, Served
from . import Renames, Started, extensions, start_mapped

Id = Annotated[Text, Field(max_length=256)]
Parts = Text | Annotated[list[dict[str, Any]], Field(max_length=protocol.MAX_MESSAGES)]  # each part: _typed


def _no_op(why: str, *off: Any) -> AfterValidator:
    """A field with no counterpart here: refused by name, saying why, unless null or a value in `off` (no effect)."""

    def check(value: Any) -> Any:
        if any(value == a and type(value) is type(a) for a in off):
            return value
        raise ValueError(f"not supported: {why} (send {' or '.join(map(json.dumps, off)) or 'null'}, or leave it out)")

    return AfterValidator(check)


class TextPart(Body):  # input_text, or output_text as a replayed answer carries it
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[None] | None = Field(default=None, max_length=0)
    logprobs: list[None] | None = Field(default=None, max_length=0)


class ImagePart(Body):
    type: Literal["input_image"]
    image_url: Text  # a data: URL (chat's image part checks it, and detail)
    detail: Text = "auto"
    file_id: Annotated[Any, _no_op("this server keeps no files; send the image as a data: URL in image_url")] = None

    @property
    def chat(self) -> dict:  # chat's image part
        return {"type": "image_url", "image_url": {"url": self.image_url, "detail": self.detail}}


class _Item(Body):  # what a replayed item may carry besides its own fields
    id: Id | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Parts
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(protocol.FunctionCall, _Item):  # a call the model made, replayed: name and arguments as chat's
    type: Literal["function_call"]
    call_id: Id = Field(min_length=1)


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: Id = Field(min_length=1)
    output: Parts
    name: Id | None = None


class TextConfig(Body):
    format: dict[str, Any] | None = None  # chat's response_format, flat (checked there)
    verbosity: Literal["medium"] | None = None  # the default; a diffusion model has no verbosity setting


class ResponsesRequest(Body):
    model: Text | None = Field(default=None, max_length=256)
    input: Text | Annotated[list[Any], Field(max_length=protocol.MAX_MESSAGES)]  # items: each checked by _typed
    instructions: Text | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=protocol.MAX_TOOLS)  # chat's, flat
    tool_choice: Any = None  # chat's, a named one flat: {"type": "function", "name": ...}
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None  # chat's max_tokens, bounded there
    temperature: float | None = None  # bounded by chat
    stream: bool = False
    user: Id | None = None
    prompt_cache_key: Id | None = None  # a hint, without effect
    safety_identifier: Id | None = None  # a hint, without effect
    top_p: Any = None  # these five: chat's, at chat's no-op values only
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    top_logprobs: Any = None
    previous_response_id: Annotated[Any, _no_op("this server keeps no responses; send the whole conversation")] = None
    conversation: Annotated[Any, _no_op("this server keeps no conversations; send the whole conversation")] = None
    include: Annotated[Any, _no_op("nothing more to include (no hosted tools, no stored reasoning)", [])] = None
    truncation: Annotated[Any, _no_op("input is never cut: a prompt over the context is a 400", "disabled")] = None
    background: Annotated[Any, _no_op("a response runs while its request waits", False)] = None
    stream_options: Annotated[Any, _no_op("events carry no obfuscation", {}, {"include_obfuscation": False})] = None
    reasoning: Annotated[Any, _no_op("thinking is a Chat Completions feature here (reasoning: true)")] = None
    prompt: Annotated[Any, _no_op("this server keeps no prompt templates")] = None
    max_tool_calls: Annotated[Any, _no_op("the calls of an answer are bounded by parallel_tool_calls")] = None
    dgemma: dict[str, Any] | None = None  # dgemma's settings (dialects.EXTENSIONS)


_ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem}
_PARTS = {"input_text": TextPart, "output_text": TextPart, "input_image": ImagePart}
# chat's names of fields -> the Responses names (dialects.Renames), and chat's fields of the same name and meaning
_NAMES = {"max_tokens": "max_output_tokens", "response_format.json_schema": "text.format", "messages": "input"}
_NAMES |= {"response_format": "text.format", "tools.*.function": "tools.*", "tool_choice.function": "tool_choice"}
_SAME = {"model", "parallel_tool_calls", "temperature", "top_p", "metadata", "user", "stream", "store", "service_tier"}
_SAME |= {"top_logprobs"}
_USAGE = {"output_tokens_details": {"reasoning_tokens": 0}}  # reasoning is not counted apart


def _typed(kinds: dict[str, type[Body]], raw: Any, *where: str | int, default: str | None = None) -> Any:
    """An item or part as the model of its `type`; its errors are named from `where` on."""
    kind = raw.get("type", default) if isinstance(raw, dict) else None
    if not isinstance(kind, str) or kind not in kinds:
        named = ".".join(map(str, (*where, "type") if isinstance(kind, str) else where))
        what = f"{kind!r} is not supported" if isinstance(kind, str) else "must be an object with a type"
        raise ApiError(400, f"{named}: {what}; this server takes {', '.join(kinds)}", named)
    try:
        return kinds[kind].model_validate(raw)
    except ValidationError as e:
        raise protocol.validation_error([{**x, "loc": (*where, *x["loc"])} for x in e.errors()]) from None


def _content(value: str | list[dict], *where: str | int) -> str | list[dict]:
    """Chat content: the text, or the parts one for one (text parts, and image_url parts)."""
    if isinstance(value, str):
        return value
    parts = [_typed(_PARTS, raw, *where, j) for j, raw in enumerate(value)]
    return [p.chat if isinstance(p, ImagePart) else {"type": "text", "text": p.text} for p in parts]


def _messages(body: ResponsesRequest) -> tuple[list[dict], list[str]]:
    """The chat messages of `instructions` and `input`, and the field each came from."""
    messages = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    origins = ["instructions"] * len(messages)
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}], [*origins, "input"]
    for k, raw in enumerate(body.input):
        item = _typed(_ITEMS, raw, "input", k, default="message")
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "function": item.model_dump(include={"name", "arguments"})}
            if messages and messages[-1]["role"] == "assistant":  # the calls of one answer: one message
                messages[-1].setdefault("tool_calls", []).append(call)
                continue
            message = {"role": "assistant", "tool_calls": [call]}
        elif isinstance(item, FunctionCallOutputItem):
            content = _content(item.output, "input", k, "output")
            message = {"role": "tool", "tool_call_id": item.call_id, "content": content, "name": item.name}
        else:
            message = {"role": item.role, "content": _content(item.content, "input", k, "content")}
        messages.append(message)
        origins.append(f"input.{k}")
    return messages, origins


def _nested(value: dict, under: str, kind: Any = None) -> dict:
    """Responses' flat {"type": ..., fields} as chat's {"type": ..., under: {fields}}."""
    return {"type": value.get("type", kind), under: {k: v for k, v in value.items() if k != "type"}}


def chat_fields(body: ResponsesRequest) -> tuple[dict, Renames]:
    """The chat body a Responses body maps onto, and the Responses names of its fields."""
    messages, origins = _messages(body)
    fields = body.model_dump(include=_SAME) | {"messages": messages, "max_tokens": body.max_output_tokens}
    fields["tools"] = [_nested(t, "function", "") for t in body.tools or []] or None  # a tool of no type: refused
    fields["tool_choice"] = _nested(c, "function") if isinstance(c := body.tool_choice, dict) else c
    if (fmt := body.text and body.text.format) is not None:  # chat's response_format: only json_schema takes more
        fmt, given = _nested(fmt, "json_schema"), any(v is not None for k, v in fmt.items() if k != "type")
        if given and fmt["type"] in ("text", "json_object"):
            raise ApiError(400, "text.format: name, schema, strict and description go with json_schema", "text.format")
        fields["response_format"] = fmt if given or fmt["type"] == "json_schema" else fmt | {"json_schema": None}
    fields |= extensions(body.dgemma)
    return {k: v for k, v in fields.items() if v is not None}, Renames(_NAMES, origins)


def _id(prefix: str) -> str:
    """A new id of the kind `prefix` names (resp, msg, fc, call), as OpenAI writes them."""
    return f"{prefix}_{uuid.uuid4().hex}"


class _Response:
    """A response as it is written: its items as pieces come, and numbered events (streamed, or drained: one answer)."""

    def __init__(self, served: Served, body: ResponsesRequest, started: Started, rename: Renames):
        self.started, self.rename, self.output, self.message, self.at = started, rename, [], None, {}
        self.status, self.error, self.sequence = "in_progress", None, 0
        self.head = {
            "id": _id("resp"), "object": "response", "created_at": int(time.time()), "model": served.name,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
            "store": False, "temperature": body.temperature, "top_p": body.top_p, "truncation": "disabled",
            "tool_choice": body.tool_choice or "auto", "user": body.user, "metadata": body.metadata or {},
            "tools": body.tools or [], "text": {"format": (body.text and body.text.format) or {"type": "text"}},
        }  # fmt: skip

    def event(self, kind: str, **fields: Any) -> dict:
        """The next event, numbered, as things are now (a copy, as JSON: the items grow after it is made)."""
        self.sequence += 1
        return json.loads(json.dumps({"type": kind, "sequence_number": self.sequence, **fields}))

    def snapshot(self) -> dict:
        """The response as it stands; once it has ended, with its usage and dgemma's counts."""
        error = self.error and {"code": "server_error", "message": self.error.message}
        cut = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        out = {**self.head, "status": self.status, "output": self.output, "error": error, "incomplete_details": cut}
        if self.status in ("completed", "incomplete"):
            choices, used = self.started.choices, self.started.prompt_tokens
            made = sum(c.returned_tokens for c in choices)
            cached = {"cached_tokens": choices[0].request.cached_tokens, "cache_write_tokens": 0}
            out["usage"] = {"input_tokens": used, "input_tokens_details": cached, "output_tokens": made} | _USAGE
            out["usage"]["total_tokens"] = used + made
            details = {"choices": [c.details for c in choices]} if any(c.details for c in choices) else {}
            out["dgemma"] = {"steps_per_canvas": [c.steps_per_canvas for c in choices], **details}
        return out

    def _item(self, item: dict, status: str) -> dict:
        """`item` in progress (added to the output) or done, and the event that says so."""
        self.output += [item] if status == "in_progress" else []
        item["status"], kind = status, "added" if status == "in_progress" else "done"
        return self.event(f"response.output_item.{kind}", output_index=self.output.index(item), item=item)

    def on(self, piece: Piece) -> Iterator[dict]:
        """A piece's events: text into the message (opened by the first), calls as function_call items after it, or the
        end: failed, or the message closed (empty if nothing came) and completed or incomplete (the length ran out)."""
        if piece.kind == "end" and piece.error is not None:
            self.status, self.error = "failed", piece.error.renamed(self.rename)
            yield self.event("error", code=self.error.code, message=self.error.message, param=self.error.param)
            yield self.event("response.failed", response=self.snapshot())
            return
        if self.message is None and (piece.kind == "content" or (piece.kind == "end" and not self.output)):
            self.message = {"type": "message", "id": _id("msg"), "role": "assistant", "content": []}
            yield self._item(self.message, "in_progress")
            self.at = {"item_id": self.message["id"], "output_index": len(self.output) - 1, "content_index": 0}
            self.message["content"].append({"type": "output_text", "text": "", "annotations": []})
            yield self.event("response.content_part.added", **self.at, part=self.message["content"][0])
        if piece.kind == "content" and piece.text:
            self.message["content"][0]["text"] += piece.text
            yield self.event("response.output_text.delta", **self.at, delta=piece.text, logprobs=[])
        if piece.kind in ("calls", "end") and self.message is not None:  # the message ends
            part = self.message["content"][0]
            yield self.event("response.output_text.done", **self.at, text=part["text"], logprobs=[])
            yield self.event("response.content_part.done", **self.at, part=part)
            yield self._item(self.message, "incomplete" if piece.finish_reason == "length" else "completed")
            self.message = None
        for name, arguments in piece.calls or []:
            item = {"type": "function_call", "id": _id("fc"), "call_id": _id("call"), "name": name, "arguments": ""}
            yield self._item(item, "in_progress")
            at, item["arguments"] = {"output_index": len(self.output) - 1, "item_id": item["id"]}, json.dumps(arguments)
            yield self.event("response.function_call_arguments.delta", **at, delta=item["arguments"])
            yield self.event("response.function_call_arguments.done", **at, name=name, arguments=item["arguments"])
            yield self._item(item, "completed")
        if piece.kind == "end":
            self.status = "incomplete" if piece.finish_reason == "length" else "completed"
            yield self.event(f"response.{self.status}", response=self.snapshot())


async def _events(response: _Response, pieces: AsyncIterator[Piece]) -> AsyncIterator[dict]:
    """The events of a response from its pieces: created, in progress, then each piece's."""
    yield response.event("response.created", response=response.snapshot())
    yield response.event("response.in_progress", response=response.snapshot())
    async for piece in pieces:
        for event in response.on(piece):
            yield event


def add_routes(app: FastAPI, served: Served) -> None:
    @app.post("/v1/responses", summary="OpenAI Responses: message and function_call items, whole or streamed")
    async def responses(body: ResponsesRequest, http: Request):
        fields, rename = chat_fields(body)
        started = await start_mapped(served, protocol.ChatCompletionRequest, fields, http, rename)
        events = _events(response := _Response(served, body, started, rename), started.pieces)
        if body.stream:
            sse = (f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" async for e in events)
            return StreamingResponse(sse, media_type="text/event-stream")
        _ = [event async for event in events]  # the events build the answer
        if response.status in ("in_progress", "failed"):  # the client left, or the answer ended in an error
            raise response.error or ApiError(499, "the client closed the request")
        return response.snapshot()

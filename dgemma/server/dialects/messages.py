"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, as the `anthropic` SDK,
langchain-anthropic and agents built on them send it, mapped onto a chat body (dialects.start_mapped; the
table in docs/server.md). `system` is a system message; text, image (base64), tool_use and tool_result blocks
chat messages (tool results tool messages, tool uses an assistant's tool_calls, a thinking block its
reasoning); `tools` chat's function tools; `tool_choice` auto / any (a required call) / tool (a named one) /
none; `output_config.format` a json_schema response_format; `thinking` reasoning; `max_tokens` (required),
`stop_sequences`, `temperature`, `top_p` (1 only, as in chat), `stream`; dgemma's settings under `dgemma`.

Accepted without effect: `metadata`, `service_tier`, `cache_control` (the server's prefix cache keeps every
prompt without breakpoints: usage's `cache_read_input_tokens` counts what it loaded, `input_tokens` the rest,
and `cache_creation_input_tokens` is 0, nothing being written on request). Refused by name: `top_k`, image
URLs (the server fetches nothing), document and server-tool blocks, server tools, `output_config.effort`, and
every field this module does not list.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from ...generation.sampling import SETTINGS
from .. import protocol
from ..answers import gather
from ..output import new_id
from ..protocol import ApiError, Body, ChatCompletionRequest, Schema, Text
from ..routes import conversation
from ..runs import Served
from . import Renames, extensions, mapped, start_mapped

Id = Annotated[str, Field(max_length=256)]


class Cache(Body):
    """A cache breakpoint: accepted, without effect (the prefix cache keeps every prompt on its own)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class _Block(Body):
    cache_control: Cache | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: Text
    citations: list[None] | None = Field(default=None, max_length=0)


class ImageSource(Body):
    type: Literal["base64"]  # a URL source is refused: the server fetches nothing
    media_type: Literal["image/png", "image/jpeg", "image/gif", "image/webp"]
    data: Annotated[str, Field(min_length=1)]


class ImageBlock(_Block):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: Id
    name: protocol.FunctionName
    input: Schema


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: Id
    content: Text | list[TextBlock] = ""
    is_error: bool = False


class ThinkingBlock(Body):
    type: Literal["thinking"]
    thinking: Text
    signature: Text = ""


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class MessageParam(Body):
    role: Literal["user", "assistant"]
    content: Text | Annotated[list[Block], Field(max_length=protocol.MAX_MESSAGES)]


class ToolParam(_Block):
    name: protocol.FunctionName
    description: Text | None = Field(default=None, max_length=protocol.MAX_DESCRIPTION_CHARS)
    input_schema: Schema
    type: Literal["custom"] | None = None
    strict: bool | None = None  # a required call follows input_schema by construction either way


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: protocol.FunctionName | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(Body):
    type: Literal["json_schema"]
    schema_: Schema = Field(alias="schema")


class OutputConfig(Body):
    format: OutputFormat | None = None


class Thinking(Body):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=0, le=1 << 20)  # the answer's max_tokens bounds it
    display: Literal["summarized", "omitted"] | None = None


class CountTokensRequest(Body):
    """POST /v1/messages/count_tokens: the prompt a Messages body would have, counted."""

    model: Text | None = Field(default=None, max_length=256)
    messages: list[MessageParam] = Field(min_length=1, max_length=protocol.MAX_MESSAGES)
    system: Text | Annotated[list[TextBlock], Field(max_length=protocol.MAX_MESSAGES)] | None = None
    tools: list[ToolParam] | None = Field(default=None, max_length=protocol.MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: Cache | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=SETTINGS["max_new_tokens"]["high"])  # required, as Anthropic's API has it
    stop_sequences: list[Annotated[Text, Field(min_length=1)]] | None = Field(
        default=None, max_length=protocol.MAX_STOP
    )
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = None  # chat's top_p: 1 only
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    dgemma: dict[str, Any] | None = None  # dgemma's settings (docs/server.md)


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


def _message(role: str, blocks: list) -> list[dict]:
    """One Messages message as chat messages: an assistant's text, calls and thought as one; a user's tool
    results first, as tool messages, then its text and images as one message."""
    if role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": "".join(b.text for b in blocks if b.type == "text")}
        calls = [
            {"id": b.id, "function": {"name": b.name, "arguments": b.input}} for b in blocks if b.type == "tool_use"
        ]
        thought = "".join(b.thinking for b in blocks if b.type == "thinking")
        return [out | ({"tool_calls": calls} if calls else {}) | ({"reasoning_content": thought} if thought else {})]
    results = [
        {"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)}
        for b in blocks
        if b.type == "tool_result"
    ]
    parts = []
    for b in blocks:
        if b.type == "text":
            parts.append({"type": "text", "text": b.text})
        elif b.type == "image":
            url = f"data:{b.source.media_type};base64,{b.source.data}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
    return results + ([{"role": "user", "content": parts}] if parts or not results else [])


def chat_fields(body: CountTokensRequest) -> tuple[dict, Renames]:
    """The chat body a Messages body means, and the Messages names of its fields."""
    messages, origins = [], []
    if body.system is not None:
        messages.append({"role": "system", "content": _text(body.system)})
        origins.append("system")
    for i, m in enumerate(body.messages):
        plain = isinstance(m.content, str)
        converted = [{"role": m.role, "content": m.content}] if plain else _message(m.role, m.content)
        messages += converted
        origins += [f"messages.{i}"] * len(converted)
    fields: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        functions = [{"name": t.name, "description": t.description, "parameters": t.input_schema} for t in body.tools]
        fields["tools"] = [{"type": "function", "function": f} for f in functions]
    choice = body.tool_choice
    if choice is not None:
        named = {"type": "function", "function": {"name": choice.name}} if choice.type == "tool" else None
        fields["tool_choice"] = named or {"any": "required"}.get(choice.type, choice.type)
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if body.thinking is not None and body.thinking.type != "disabled":
        fields["reasoning"] = True
    if body.output_config is not None and body.output_config.format is not None:
        schema = body.output_config.format.schema_
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    names = {"tools.*.function.parameters": "tools.*.input_schema", "tools.*.function.name": "tools.*.name"}
    names |= {"parallel_tool_calls": "tool_choice.disable_parallel_tool_use", "response_format": "output_config.format"}
    names |= {"reasoning": "thinking", "max_completion_tokens": "max_tokens", "stop": "stop_sequences"}
    return fields, Renames(names, origins)


def add_routes(app: FastAPI, served: Served) -> None:
    @app.post("/v1/messages", summary="Anthropic Messages: a chat answer, whole or streamed")
    async def messages(body: MessagesRequest, http: Request):
        fields, rename = chat_fields(body)
        settings = {"max_tokens": body.max_tokens, "stop": body.stop_sequences, "stream": body.stream}
        settings |= {"temperature": body.temperature, "top_p": body.top_p}
        fields |= extensions(body.dgemma) | {k: v for k, v in settings.items() if v is not None}
        started = await start_mapped(served, ChatCompletionRequest, fields, http, rename)
        reply = _Reply(served, body, started)
        if body.stream:
            return StreamingResponse(reply.events(), media_type="text/event-stream")
        return await reply.whole()

    @app.post("/v1/messages/count_tokens", summary="Anthropic Messages: the prompt's tokens, counted")
    async def count_tokens(body: CountTokensRequest):
        fields, rename = chat_fields(body)
        try:
            prompt, _, _ = await conversation(served, mapped(ChatCompletionRequest, fields, rename))
        except ApiError as e:
            raise e.renamed(rename) from None
        return {"input_tokens": len(prompt)}


class _Reply:
    """A Messages answer from a started chat: whole, or as Anthropic's stream of events."""

    def __init__(self, served: Served, body: MessagesRequest, started):
        self.served, self.body, self.started = served, body, started
        self.choice = started.choices[0]
        self.head = {"id": new_id("msg"), "type": "message", "role": "assistant", "model": served.name}

    def stop(self, reason: str) -> dict:
        """stop_reason and stop_sequence for a chat finish reason."""
        hit = self.choice.stop_string(self.served.decode) if reason == "stop" else None
        stopped = "stop_sequence" if hit else "end_turn"
        return {
            "stop_reason": {"tool_calls": "tool_use", "length": "max_tokens"}.get(reason, stopped),
            "stop_sequence": hit,
        }

    def usage(self) -> dict:
        """Anthropic's usage: input_tokens are the prompt's tokens not read from the cache."""
        cached = self.choice.request.cached_tokens
        counts = {"input_tokens": self.started.prompt_tokens - cached, "output_tokens": self.choice.returned_tokens}
        return counts | {"cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}

    async def whole(self) -> dict:
        texts, reasons, calls = await gather(self.started.pieces)
        parts = texts.get(0, {})
        content = [{**_THINKING, "thinking": parts["reasoning"]}] if "reasoning" in parts else []
        content += [{"type": "text", "text": parts["content"]}] if parts.get("content") else []
        content += [_tool_use(name, arguments) for name, arguments in calls.get(0, [])]
        return {**self.head, "content": content, **self.stop(reasons[0]), "usage": self.usage()}

    async def events(self):
        start = {**self.head, "content": [], "stop_reason": None, "stop_sequence": None}
        yield _event("message_start", message={**start, "usage": {**self.usage(), "output_tokens": 0}})
        index, kind = -1, None  # the open block's index and kind
        async for piece in self.started.pieces:
            if kind is not None and piece.kind not in (kind, "draft"):
                yield _event("content_block_stop", index=index)
                kind = None
            if piece.kind in _BLOCKS and piece.text:
                block, delta, field = _BLOCKS[piece.kind]
                if kind is None:
                    index, kind = index + 1, piece.kind
                    yield _event("content_block_start", index=index, content_block=block)
                yield _event("content_block_delta", index=index, delta={"type": delta, field: piece.text})
            for name, arguments in piece.calls or []:
                index += 1
                yield _event("content_block_start", index=index, content_block=_tool_use(name, {}))
                delta = {"type": "input_json_delta", "partial_json": json.dumps(arguments)}
                yield _event("content_block_delta", index=index, delta=delta)
                yield _event("content_block_stop", index=index)
            if piece.kind == "end" and piece.error is not None:
                yield _event("error", **piece.error.body("/v1/messages"))
            elif piece.kind == "end":
                yield _event("message_delta", delta=self.stop(piece.finish_reason), usage=self.usage())
                yield _event("message_stop")


_THINKING = {"type": "thinking", "thinking": "", "signature": ""}
_BLOCKS = {
    "content": ({"type": "text", "text": ""}, "text_delta", "text"),
    "reasoning": (_THINKING, "thinking_delta", "thinking"),
}


def _tool_use(name: str, arguments: dict) -> dict:
    return {"type": "tool_use", "id": new_id("toolu").replace("-", "_"), "name": name, "input": arguments}


def _event(kind: str, **data) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

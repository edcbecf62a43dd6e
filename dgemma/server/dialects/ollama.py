"""The Ollama API (what Open WebUI, Continue, Twinny, langchain-ollama and the `ollama` package speak), each
body mapped onto a chat or completions body (routes.start_mapped): every rule, limit and default is the task's.

- /api/chat -> a chat body: base64 `images` (user messages) -> image parts, replayed `tool_calls` (object
  arguments), `tool_name` / `tool_call_id`, `thinking`; `tools` (chat's "auto": Ollama has no tool_choice);
  `format` "json" or a schema (valid by construction); `think` true -> reasoning, answered as `thinking`.
- /api/generate -> with `suffix` (fill-in-the-middle: Infill, its length chosen by score unless num_predict)
  or `raw`, a completions body; else a chat body of `system` and a user message (`prompt`, `images`).
  No messages / an empty prompt without a suffix: Ollama's "load" ping, answered done at once.
- options: temperature, num_predict (-1, -2: not given; Open WebUI's top-level one too), seed (-1: a fresh
  one), stop, top_p (1 only) map; num_ctx takes any positive value (--max-context bounds a request); machine
  hints (num_gpu, num_thread, ...) have no effect; sampling options with no counterpart (top_k, min_p,
  repeat_penalty, ...) only at their off value. keep_alive is accepted (the model stays loaded). dgemma's
  diffusion settings (protocol.EXTENSIONS) go under `dgemma` or in `options` (Ollama's clients pass it on).
- Refused by name: `template` (the checkpoint's applies), `context` (no context tokens are kept), think
  levels, `system` / `images` / `think` with raw or suffix, and unknown fields (logprobs among them).
- `stream` defaults to true: NDJSON lines, the last done with done_reason ("stop", "length"; a call ends with
  "stop"), counts and durations (ns): the prompt is encoded with the first canvas, so prompt_eval_duration
  is the time before the engine took the request and eval_duration its run. Errors: {"error": ...}, a line
  mid-stream or a 4xx before.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, field_validator

from ... import __version__
from ...images import image_token_strings
from ...model.sizes import count_parameters
from ...quant.modules import QuantExperts, QuantLinear
from .. import protocol
from ..answers import gather
from ..output import new_id
from ..protocol import ApiError, Text, _Body
from ..routes import SCHEMA, Renames, Started, check_model, start_mapped
from ..runs import Served

_REFUSED = {
    "template": "the checkpoint's own chat template applies (raw: true sends a prompt as it is)",
    "context": "dgemma keeps no context tokens: send the conversation to /api/chat",
}
_MAPPED = {"temperature": "temperature", "num_predict": "max_tokens", "seed": "seed", "stop": "stop", "top_p": "top_p"}
_UNSET = {"num_predict": (-1, -2), "seed": (-1,)}  # Ollama's values for "not given"
# options with no counterpart in a diffusion model: accepted only at the value that turns them off
_OFF = {"top_k": 0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0}
_OFF |= {"frequency_penalty": 0.0, "mirostat": 0, "tfs_z": 1.0}
# options with no effect here, their types: the tuning of the ones above, and hints for the machine
_NO_EFFECT = {"mirostat_tau": float, "mirostat_eta": float, "penalize_newline": bool, "num_ctx": int}
_NO_EFFECT |= dict.fromkeys(("repeat_last_n", "num_keep", "num_batch", "num_gpu", "main_gpu", "num_thread"), int)
_NO_EFFECT |= dict.fromkeys(("numa", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mmap", "use_mlock"), bool)
_NO_EFFECT |= {"embedding_only": bool, "draft_num_predict": int}
# the chat / completions fields in Ollama's names (routes.Renames)
_NAMES = {v: f"options.{k}" for k, v in _MAPPED.items()} | {"response_format": "format", SCHEMA: "format"}
_NAMES |= {"reasoning": "think", "messages.*.name": "messages.*.tool_name", "messages.*.content": "messages.*.images"}
_NAMES |= {"messages.*.reasoning_content": "messages.*.thinking", "messages.*.content.*": "messages.*.images.*"}
_IMAGE_TYPES = {b"\x89PNG": "png", b"\xff\xd8\xff": "jpeg", b"GIF8": "gif", b"RIFF": "webp"}
_Duration = Annotated[str, Field(max_length=32, pattern=r"^-?([0-9.]+(ns|us|µs|ms|s|m|h)?)+$")]  # "5m", "-1"
# Continue reads `.Suffix` in a model's template as its sign of fill-in-the-middle (the Infill task here)
_TEMPLATE = "{{ .Prompt }}{{ .Suffix }}"
_DTYPES = {"torch.bfloat16": "BF16", "torch.float16": "F16", "torch.float32": "F32"}


class _Function(_Body):
    index: int | None = Field(default=None, ge=0, le=protocol.MAX_TOOLS)  # the call's place in its answer
    name: protocol.FunctionName
    arguments: protocol.Schema = Field(default_factory=dict)


class _ToolCall(_Body):
    id: Text | None = Field(default=None, max_length=256)  # (langchain-ollama and Open WebUI send id, type, index)
    type: Literal["function"] = "function"
    index: int | None = Field(default=None, ge=0, le=protocol.MAX_TOOLS)
    function: _Function


class _Message(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text = ""
    images: list[str] | None = Field(default=None, max_length=protocol.MAX_IMAGES)  # base64
    tool_calls: list[_ToolCall] | None = Field(default=None, max_length=protocol.MAX_TOOLS)
    tool_name: Text | None = Field(default=None, max_length=256)
    tool_call_id: Text | None = Field(default=None, max_length=256)
    thinking: Text | None = None


class _Request(_Body):
    """What /api/chat and /api/generate share."""

    model: Text = Field(min_length=1, max_length=256)
    format: Literal["", "json"] | protocol.Schema | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: _Duration | float | None = None  # accepted: the model stays loaded
    think: bool | None = None
    num_predict: int | None = None  # options.num_predict where Open WebUI puts it for its own tasks (titles)
    dgemma: dict[str, Any] | None = None  # dgemma's diffusion settings (protocol.EXTENSIONS)

    @field_validator(*_REFUSED, check_fields=False)
    @classmethod
    def _refused(cls, value: Any, info) -> Any:
        if value:  # "" and [] are Ollama's "not given"
            raise ValueError(_REFUSED[info.field_name])
        return value


class OllamaChatRequest(_Request):
    messages: list[_Message] = Field(default_factory=list, max_length=protocol.MAX_MESSAGES)
    tools: list[protocol.Tool] | None = Field(default=None, max_length=protocol.MAX_TOOLS)


class OllamaGenerateRequest(_Request):
    prompt: Text = ""
    suffix: Text = ""
    system: Text = ""
    raw: bool = False
    images: list[str] | None = Field(default=None, max_length=protocol.MAX_IMAGES)
    template: Any = None
    context: Any = None


class OllamaShowRequest(_Body):
    model: Text | None = Field(default=None, max_length=256)
    name: Text | None = Field(default=None, max_length=256)  # Ollama's older name for `model` (Continue's)
    verbose: bool = False


# ------------------------------------------------------------------------------------------------
# Bodies -> chat / completions fields


def _option_problem(key: str, value: Any) -> str | None:
    """What is wrong with an option that is not a chat / completions field, or None."""
    if key not in _NO_EFFECT and key not in _OFF:
        return "not an option this server knows (see docs/server.md)"
    kind = _NO_EFFECT.get(key) or type(_OFF[key])
    if not (type(value) is kind or (kind is float and type(value) is int)):
        return f"must be of type {kind.__name__}"
    if key == "num_ctx" and value < 1:
        return "must be positive (any positive value: the server's --max-context bounds a request)"
    if key in _OFF and value != _OFF[key]:
        return f"has no counterpart in a diffusion model; send {_OFF[key]}, or leave it out"
    return None


def _common(body: _Request, model: str) -> dict:
    """The fields every mapped body takes: model, stream, options, format, think and the dgemma settings."""
    fields = {"model": model, "stream": body.stream}
    for key, value in ({"num_predict": body.num_predict} | (body.options or {})).items():
        if value is None or value in _UNSET.get(key, ()):  # null: not given, as Ollama reads it
            continue
        if key in _MAPPED or key in protocol.EXTENSIONS:  # (Ollama's clients pass options on as they are)
            fields[_MAPPED.get(key, key)] = value
        elif (problem := _option_problem(key, value)) is not None:
            raise ApiError(400, f"options.{key}: {problem}", f"options.{key}")
    if body.format == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": body.format}}
    return fields | ({"reasoning": True} if body.think else {}) | protocol.extensions(body.dgemma)


def _names(body: _Request, names: dict[str, str]) -> dict[str, str]:
    """`names`, and the dgemma settings `options` carried (and `dgemma` did not) named there."""
    carried = (body.options or {}).keys() & protocol.EXTENSIONS - (body.dgemma or {}).keys()
    return names | {k: f"options.{k}" for k in carried}


def _data_url(image: str, where: str) -> str:
    """A base64 image as a data: URL of the type its first bytes say (media.py checks the rest)."""
    try:
        head = base64.b64decode(image[:16], validate=True)
    except (binascii.Error, ValueError):
        head = b""
    kind = next((k for magic, k in _IMAGE_TYPES.items() if head.startswith(magic)), None)
    if kind is None or (kind == "webp" and head[8:12] != b"WEBP"):
        raise ApiError(400, f"{where}: is not a base64 PNG, JPEG, GIF or WebP image", where)
    return f"data:image/{kind};base64,{image}"


def _content(text: str, images: list[str] | None, where: str) -> str | list[dict]:
    """A message's text, or its images (first: part j is image j) and its text as parts."""
    if not images:
        return text
    parts = [{"type": "image_url", "image_url": {"url": _data_url(b, f"{where}.{j}")}} for j, b in enumerate(images)]
    return parts + ([{"type": "text", "text": text}] if text else [])


def _chat_messages(messages: list[_Message]) -> list[dict]:
    """Ollama's messages as chat messages. Tool messages answer the calls of the assistant message before
    them in order (Ollama's rule): one that names neither its function nor a call's id gets its call's name."""
    out, unanswered = [], []
    for i, m in enumerate(messages):
        chat = {"role": m.role, "content": _content(m.content, m.images, f"messages.{i}.images")}
        calls = [{"id": c.id, "function": c.function.model_dump(exclude={"index"})} for c in m.tool_calls or []]
        unanswered = [c["function"]["name"] for c in calls] if m.role == "assistant" else unanswered
        answered = unanswered.pop(0) if m.role == "tool" and unanswered else None
        name = m.tool_name or (None if m.tool_call_id else answered)
        extra = {"tool_calls": calls, "name": name, "tool_call_id": m.tool_call_id, "reasoning_content": m.thinking}
        out.append(chat | {k: v for k, v in extra.items() if v})
    return out


def _generate_body(body: OllamaGenerateRequest, model: str) -> tuple[type, dict, Renames]:
    """/api/generate's: with raw or a suffix the completions body (a suffix: infilling), else a chat body of
    its system and one user message."""
    fields = _common(body, model)
    if body.raw or body.suffix:
        for name in ("system", "images", "think"):
            if getattr(body, name):
                raise ApiError(400, f"{name}: applies to a chat prompt, not with raw or suffix", name)
        fields |= {"prompt": body.prompt} | ({"suffix": body.suffix} if body.suffix else {})
        return protocol.CompletionRequest, fields, Renames(_names(body, _NAMES))
    system = [{"role": "system", "content": body.system}] if body.system else []
    user = {"role": "user", "content": _content(body.prompt, body.images, "images")}
    names = _names(body, _NAMES) | {"messages": "prompt", "messages.*": "prompt", "messages.*.content": "prompt"}
    names |= {"messages.*.content.*": "images.*"}  # the user message's image parts: `images`
    return protocol.ChatCompletionRequest, fields | {"messages": [*system, user]}, Renames(names)


# ------------------------------------------------------------------------------------------------
# Answers: NDJSON lines or one object


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass
class _Run:
    """One request's lines: chat's `message` or generate's `response`, and the counts and durations of the
    last one (ns)."""

    model: str  # as the request named it
    chat: bool
    arrived: int  # time.monotonic_ns() when the request came
    started: Started | None = None
    submitted: int = field(default_factory=time.monotonic_ns)

    def line(self, done: bool = False, content: str = "", thinking: str = "", calls: list | None = None) -> dict:
        said = {"content": content} if self.chat else {"response": content}
        said |= {"thinking": thinking} if thinking else {}
        if calls:
            said["tool_calls"] = [
                {"id": new_id("call"), "function": {"index": k, "name": name, "arguments": arguments}}
                for k, (name, arguments) in enumerate(calls)
            ]
        said = {"message": {"role": "assistant", **said}} if self.chat else said
        return {"model": self.model, "created_at": _now(), **said, "done": done}

    def last(self, reason: str | None, **said) -> dict:
        now, started = time.monotonic_ns(), self.started
        return self.line(True, **said) | {
            "done_reason": "length" if reason == "length" else "stop",
            "total_duration": now - self.arrived,
            "load_duration": 0,
            "prompt_eval_count": started.prompt_tokens,
            "prompt_eval_duration": self.submitted - self.arrived,
            "eval_count": sum(c.returned_tokens for c in started.choices),
            "eval_duration": now - self.submitted,
        }


async def _lines(run: _Run) -> AsyncIterator[str]:
    """The NDJSON body: a line per piece of text, thought or the calls, then the last line (or an error's)."""
    async for piece in run.started.pieces:
        if piece.kind == "end":
            line = piece.error.body("/api/") if piece.error is not None else run.last(piece.finish_reason)
        elif piece.kind == "content":
            line = run.line(content=piece.text)
        elif piece.kind == "reasoning":
            line = run.line(thinking=piece.text)
        elif piece.kind == "calls":
            line = run.line(calls=piece.calls)
        else:
            continue  # a draft: Ollama has none
        yield json.dumps(line) + "\n"


async def _answer(served: Served, body: _Request, kind: type, fields: dict, rename: Renames, http, arrived: int):
    started = await start_mapped(served, kind, fields, http, rename)
    run = _Run(body.model, kind is protocol.ChatCompletionRequest, arrived, started)
    if body.stream:
        return StreamingResponse(_lines(run), media_type="application/x-ndjson")
    texts, reasons, calls = await gather(started.pieces)  # (errors as it ran named in Ollama's names)
    if not reasons:
        raise ApiError(499, "the client closed the request")
    text = texts.get(0, {})
    return run.last(reasons[0], content=text.get("content", ""), thinking=text.get("reasoning", ""), calls=calls.get(0))


# ------------------------------------------------------------------------------------------------
# The routes


def _card(served: Served) -> dict:
    """The served model as /api/tags lists it."""
    model = served.model
    count = count_parameters(model.config)["total"]
    size = f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count / 1e3:.0f}K"
    quantized = sorted({m.mode.upper() for m in model.modules() if isinstance(m, QuantLinear | QuantExperts)})
    level = "/".join(quantized) or _DTYPES.get(str(model.dtype), str(model.dtype))
    details = {"parent_model": "", "format": "safetensors", "family": "gemma4", "families": ["gemma4"]}
    tensors = itertools.chain(model.parameters(), model.buffers())
    card = {"name": served.name, "model": served.name, "modified_at": _now()}
    card |= {"size": sum(t.numel() * t.element_size() for t in tensors)}
    card |= {"digest": hashlib.sha256(served.name.encode()).hexdigest()}
    return card | {"details": details | {"parameter_size": size, "quantization_level": level}}


def _sees(served: Served) -> bool:
    """Whether the model reads images: a vision tower, and the tokenizer's image tokens."""
    try:
        image_token_strings(served.tokenizer, served.model.config)
    except ValueError:
        return False
    return served.model.vision_tower is not None


def _show(served: Served, card: dict) -> dict:
    """/api/show's answer: the card's details, a few config values and what the model can do."""
    template, t = served.tokenizer.chat_template or "", served.model.text_config
    has = {"tools": "tools" in template, "vision": _sees(served), "thinking": "enable_thinking" in template}
    info = {"general.architecture": "gemma4", "general.parameter_count": count_parameters(served.model.config)["total"]}
    info |= {"gemma4.context_length": served.context, "gemma4.embedding_length": t.hidden_size}
    info |= {"gemma4.block_count": t.num_hidden_layers, "gemma4.attention.head_count": t.num_attention_heads}
    shown = {"license": "", "modelfile": "", "parameters": f"num_ctx {served.context}", "template": _TEMPLATE}
    shown |= {"details": card["details"], "model_info": info | {"gemma4.vocab_size": t.vocab_size}}
    capabilities = ["completion", "insert", *(name for name, yes in has.items() if yes)]
    return shown | {"capabilities": capabilities, "modified_at": card["modified_at"]}


def add_routes(app: FastAPI, served: Served) -> None:
    card = _card(served)
    named = {served.name, f"{served.name}:latest"}

    def model_of(name: str) -> str:  # "<name>:latest" is the served name
        check_model(served, served.name if name in named else name)
        return served.name

    @app.post("/api/chat", summary="Ollama chat: a chat answer, as NDJSON lines (the default) or whole")
    async def chat(body: OllamaChatRequest, http: Request):
        arrived, model = time.monotonic_ns(), model_of(body.model)
        if not body.messages:  # Ollama's "load the model" ping
            return _Run(body.model, True, arrived).line(True) | {"done_reason": "load"}
        fields = _common(body, model) | {"messages": _chat_messages(body.messages)}
        fields |= {"tools": [t.model_dump(exclude_none=True) for t in body.tools]} if body.tools else {}
        return await _answer(
            served, body, protocol.ChatCompletionRequest, fields, Renames(_names(body, _NAMES)), http, arrived
        )

    @app.post("/api/generate", summary="Ollama generate: a prompt's answer, or the middle before a suffix")
    async def generate(body: OllamaGenerateRequest, http: Request):
        arrived, model = time.monotonic_ns(), model_of(body.model)
        if not body.prompt and not body.suffix:  # Ollama's "load the model" ping
            return _Run(body.model, False, arrived).line(True) | {"done_reason": "load"}
        kind, fields, rename = _generate_body(body, model)
        return await _answer(served, body, kind, fields, rename, http, arrived)

    @app.post("/api/show", summary="Ollama: the served model's details and capabilities")
    async def show(body: OllamaShowRequest):
        if body.model is None and body.name is None:
            raise ApiError(400, "model: is required", "model")
        model_of(body.model or body.name)
        return _show(served, card)

    @app.get("/api/tags", summary="Ollama: the served model")
    async def tags():
        return {"models": [card]}

    @app.get("/api/ps", summary="Ollama: the loaded model")
    async def ps():
        vram = card["size"] if served.model.device.type == "cuda" else 0
        running = {"expires_at": "9999-12-31T23:59:59Z", "size_vram": vram, "context_length": served.context}
        return {"models": [card | running]}

    @app.get("/api/version", summary="Ollama: the server's version (dgemma's)")
    async def version():
        return {"version": __version__}

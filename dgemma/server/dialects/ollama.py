"""The Ollama API (Open WebUI, Continue, Twinny, langchain-ollama, the `ollama` package), each body mapped onto a
chat or completions body (dialects.start_mapped), so every rule, limit and default is the task's (docs/server.md has
the table). /api/chat: a chat body (base64 `images`, replayed `tool_calls`, `tools` as chat's "auto", `format` "json"
or a schema, `think` as reasoning). /api/generate: with `suffix` (Infill) or `raw` a completions body, else a chat of
`system` and `prompt`. An empty one is Ollama's "load" ping, answered at once; /api/tags, show, ps and version
describe the served model. `options` map (temperature, num_predict, seed, stop, top_p) or are hints without effect
(num_ctx, num_gpu, ...; keep_alive too: the model stays loaded); sampling options a diffusion model lacks (top_k, ...)
are taken at their off value only; dgemma's settings go under `dgemma` or in `options`. Refused by name: `template`
(the checkpoint's applies), `context` (no context tokens are kept), think levels, `system` / `images` / `think` with
raw or suffix, unknown fields. `stream` defaults to true (NDJSON); errors are {"error": "<field>: ..."}.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from ... import __version__
from ...images import image_token_strings
from ...model.sizes import count_parameters
from ...quant.modules import QuantExperts, QuantLinear
from .. import protocol
from ..answers import gather
from ..output import new_id
from ..protocol import ApiError, Body, Text
from ..routes import SCHEMA, Started, check_model
from ..runs import Served
from . import EXTENSIONS, Renames, extensions, start_mapped

_REFUSED = {  # generate's fields that are refused: the first two always, the others with raw or a suffix
    "template": "the checkpoint's own chat template applies (raw: true sends a prompt as it is)",
    "context": "dgemma keeps no context tokens: send the conversation to /api/chat",
} | dict.fromkeys(("system", "images", "think"), "applies to a chat prompt, not with raw or suffix")
_MAPPED = {"temperature": "temperature", "num_predict": "max_tokens", "seed": "seed", "stop": "stop", "top_p": "top_p"}
_UNSET = {"num_predict": (-1, -2), "seed": (-1,)}  # Ollama's values for "not given"
# options with no counterpart in a diffusion model, taken only at the value that turns them off; then the options
# with no effect here, by type (the tuning of those, and hints for the machine)
_OFF = {"top_k": 0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0}
_OFF |= {"frequency_penalty": 0.0, "mirostat": 0, "tfs_z": 1.0}
_NO_EFFECT = dict.fromkeys(("num_ctx", "num_keep", "num_batch", "num_gpu", "main_gpu", "num_thread"), int)
_NO_EFFECT |= {"repeat_last_n": int, "draft_num_predict": int, "mirostat_tau": float, "mirostat_eta": float}
_NO_EFFECT |= dict.fromkeys(("numa", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mmap", "use_mlock"), bool)
_NO_EFFECT |= {"penalize_newline": bool, "embedding_only": bool}
# the chat / completions fields in Ollama's names (dialects.Renames)
_NAMES = {v: f"options.{k}" for k, v in _MAPPED.items()} | {"response_format": "format", SCHEMA: "format"}
_NAMES |= {"reasoning": "think", "messages.*.name": "messages.*.tool_name", "messages.*.content": "messages.*.images"}
_NAMES |= {"messages.*.reasoning_content": "messages.*.thinking", "messages.*.content.*": "messages.*.images.*"}
_IMAGE_TYPES = {"iVBORw0KGgo": "png", "/9j/": "jpeg", "R0lGOD": "gif", "UklGR": "webp"}  # magic numbers, base64
_Duration = Annotated[str, Field(max_length=32, pattern=r"^-?([0-9.]+(ns|us|µs|ms|s|m|h)?)+$")]  # "5m", "-1"
_DTYPES = {"torch.bfloat16": "BF16", "torch.float16": "F16", "torch.float32": "F32"}


class _Function(protocol.FunctionCall):
    index: int | None = Field(default=None, ge=0, le=protocol.MAX_TOOLS)  # the call's place in its answer
    arguments: protocol.Schema = Field(default_factory=dict)  # an object: Ollama sends no JSON text (chat does)


class _ToolCall(protocol.ToolCall):  # (langchain-ollama and Open WebUI send id, type and index)
    index: int | None = Field(default=None, ge=0, le=protocol.MAX_TOOLS)
    function: _Function


class _Message(Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text = ""
    images: list[str] | None = Field(default=None, max_length=protocol.MAX_IMAGES)  # base64
    tool_calls: list[_ToolCall] | None = Field(default=None, max_length=protocol.MAX_TOOLS)
    tool_name: Text | None = Field(default=None, max_length=256)
    tool_call_id: Text | None = Field(default=None, max_length=256)
    thinking: Text | None = None


class _Request(Body):  # what /api/chat and /api/generate share
    model: Text = Field(min_length=1, max_length=256)
    format: Literal["", "json"] | protocol.Schema | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: _Duration | float | None = None  # accepted: the model stays loaded
    think: bool | None = None
    num_predict: int | None = None  # options.num_predict where Open WebUI puts it for its own tasks (titles)
    dgemma: dict[str, Any] | None = None  # dgemma's diffusion settings (dialects.EXTENSIONS)


class OllamaChatRequest(_Request):
    messages: list[_Message] = Field(default_factory=list, max_length=protocol.MAX_MESSAGES)
    tools: list[Any] | None = Field(default=None, max_length=protocol.MAX_TOOLS)  # chat's, checked there


class OllamaGenerateRequest(_Request):
    prompt: Text = ""
    suffix: Text = ""
    system: Text = ""
    raw: bool = False
    images: list[str] | None = Field(default=None, max_length=protocol.MAX_IMAGES)
    template: Any = None
    context: Any = None


class OllamaShowRequest(Body):
    model: Text | None = Field(default=None, max_length=256)
    name: Text | None = Field(default=None, max_length=256)  # Ollama's older name for `model` (Continue's)
    verbose: bool = False


def _content(text: str, images: list[str] | None, where: str) -> str | list[dict]:
    """A message's text, or its images (part j: image j, typed by its first bytes) and its text as chat's parts."""
    parts = []
    for j, image in enumerate(images or []):
        kind = next((k for magic, k in _IMAGE_TYPES.items() if image.startswith(magic)), None)
        if kind is None:
            raise ApiError(400, f"{where}.{j}: is not a base64 PNG, JPEG, GIF or WebP image", f"{where}.{j}")
        parts.append({"type": "image_url", "image_url": {"url": f"data:image/{kind};base64,{image}"}})
    return parts + ([{"type": "text", "text": text}] if text else []) if parts else text


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


def _mapped(body: _Request, model: str) -> tuple[type, dict, Renames]:
    """The chat or completions body a request maps onto (generate's: with raw or a suffix completions, else a chat
    of its system and one user message), and the body's fields in Ollama's names (dialects.Renames)."""
    fields, names = {"model": model, "stream": body.stream}, dict(_NAMES)
    for key, value in ({"num_predict": body.num_predict} | (body.options or {})).items():
        if value is None or value in _UNSET.get(key, ()):  # null: not given, as Ollama reads it
            continue
        kind, problem = _NO_EFFECT.get(key) or type(_OFF.get(key)), None
        if key in _MAPPED or key in EXTENSIONS:  # (Ollama's clients pass options on as they are)
            fields[_MAPPED.get(key, key)] = value  # (a dgemma setting: named options.<key> unless `dgemma` has it)
            names |= {} if key in _MAPPED or key in (body.dgemma or {}) else {key: f"options.{key}"}
        elif key not in _NO_EFFECT and key not in _OFF:
            problem = "not an option this server knows (see docs/server.md)"
        elif not (type(value) is kind or (kind is float and type(value) is int)):
            problem = f"must be of type {kind.__name__}"
        elif key == "num_ctx" and value < 1:
            problem = "must be positive (any positive value: the server's --max-context bounds a request)"
        elif key in _OFF and value != _OFF[key]:
            problem = f"has no counterpart in a diffusion model; send {_OFF[key]}, or leave it out"
        if problem is not None:
            raise ApiError(400, f"options.{key}: {problem}", f"options.{key}")
    if body.format not in ("", None):  # "json" or a schema
        schema = {"type": "json_schema", "json_schema": {"name": "format", "schema": body.format}}
        fields["response_format"] = {"type": "json_object"} if body.format == "json" else schema
    fields |= ({"reasoning": True} if body.think else {}) | extensions(body.dgemma)
    if isinstance(body, OllamaChatRequest):
        fields |= {"messages": _chat_messages(body.messages), "tools": body.tools}
        return protocol.ChatCompletionRequest, fields, Renames(names)
    for name, why in _REFUSED.items():
        if getattr(body, name) and (name in ("template", "context") or body.raw or body.suffix):  # ("": not given)
            raise ApiError(400, f"{name}: {why}", name)
    if body.raw or body.suffix:
        fields |= {"prompt": body.prompt} | ({"suffix": body.suffix} if body.suffix else {})
        return protocol.CompletionRequest, fields, Renames(names)
    system = [{"role": "system", "content": body.system}] if body.system else []
    user = {"role": "user", "content": _content(body.prompt, body.images, "images")}
    names |= {"messages": "prompt", "messages.*": "prompt", "messages.*.content": "prompt"}
    names |= {"messages.*.content.*": "images.*"}  # the user message's image parts: `images`
    return protocol.ChatCompletionRequest, fields | {"messages": [*system, user]}, Renames(names)


def _now() -> str:
    """The time now as Ollama writes it (RFC 3339, UTC, "Z")."""
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass
class _Run:
    """One request's lines (chat's `message`, generate's `response`) and the last one's counts and durations (ns):
    the prompt is encoded with the first canvas, so prompt_eval_duration is the wait for the engine."""

    model: str  # as the request named it
    chat: bool
    arrived: int  # time.monotonic_ns() when the request came
    started: Started | None = None
    submitted: int = field(default_factory=time.monotonic_ns)

    def line(self, done: bool = False, content: str = "", reasoning: str = "", calls: list | None = None) -> dict:
        """A line of text, of reasoning (`thinking`) or of the calls (the pieces' kinds)."""
        said = {"content" if self.chat else "response": content} | ({"thinking": reasoning} if reasoning else {})
        made = [{"index": k, "name": name, "arguments": arguments} for k, (name, arguments) in enumerate(calls or [])]
        said |= {"tool_calls": [{"id": new_id("call"), "function": f} for f in made]} if made else {}
        said = {"message": {"role": "assistant", **said}} if self.chat else said
        return {"model": self.model, "created_at": _now(), **said, "done": done}

    def last(self, reason: str | None, **said: Any) -> dict:
        """The last line: why the answer ended, and its counts and durations."""
        now, started = time.monotonic_ns(), self.started
        said = self.line(True, **said) | {"done_reason": "length" if reason == "length" else "stop", "load_duration": 0}
        evaluated = started.prompt_tokens - started.choices[0].request.cached_tokens  # as Ollama: cached not counted
        said |= {"prompt_eval_count": evaluated, "prompt_eval_duration": self.submitted - self.arrived}
        said |= {"eval_count": sum(c.returned_tokens for c in started.choices), "eval_duration": now - self.submitted}
        return said | {"total_duration": now - self.arrived}


async def _lines(run: _Run) -> AsyncIterator[str]:
    """The NDJSON body: a line per piece of text, thought or the calls, then the last line (or an error's)."""
    async for piece in run.started.pieces:
        if piece.kind == "end":
            yield json.dumps(run.last(piece.finish_reason) if piece.error is None else piece.error.body("/api/")) + "\n"
        elif piece.kind in ("content", "reasoning", "calls"):  # (not a draft: Ollama has none)
            yield json.dumps(run.line(**{piece.kind: piece.calls if piece.kind == "calls" else piece.text})) + "\n"


async def _answer(served: Served, body: _Request, model: str, http: Request) -> dict | StreamingResponse:
    """A chat or generate request's answer: the load ping's at once, else its mapped body's, streamed or whole."""
    arrived, chat = time.monotonic_ns(), isinstance(body, OllamaChatRequest)
    if not (body.messages if chat else body.prompt or body.suffix):  # Ollama's "load the model" ping
        return _Run(body.model, chat, arrived).line(True) | {"done_reason": "load"}
    kind, fields, rename = _mapped(body, model)
    started = await start_mapped(served, kind, fields, http, rename)
    run = _Run(body.model, chat, arrived, started)
    if body.stream:
        return StreamingResponse(_lines(run), media_type="application/x-ndjson")
    texts, reasons, calls = await gather(started.pieces)  # (errors as it ran named in Ollama's names)
    return run.last(reasons[0], **texts.get(0, {}), calls=calls.get(0))


def _cards(served: Served) -> tuple[dict, dict]:
    """The served model as /api/tags lists it and as /api/show describes it: config values, capabilities, and a
    template whose `.Suffix` is Continue's sign of fill-in-the-middle (the Infill task here)."""
    model, t, template = served.model, served.model.text_config, served.tokenizer.chat_template or ""
    count = count_parameters(model.config)["total"]
    size = f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count / 1e3:.0f}K"
    quantized = sorted({m.mode.upper() for m in model.modules() if isinstance(m, QuantLinear | QuantExperts)})
    level = "/".join(quantized) or _DTYPES.get(str(model.dtype), str(model.dtype))
    details = {"parent_model": "", "format": "safetensors", "family": "gemma4", "families": ["gemma4"]}
    card = {"name": served.name, "model": served.name, "digest": hashlib.sha256(served.name.encode()).hexdigest()}
    card |= {"modified_at": _now(), "size": sum(x.nbytes for x in [*model.parameters(), *model.buffers()])}
    card |= {"details": details | {"parameter_size": size, "quantization_level": level}}
    try:  # vision: a vision tower, and image tokens in the tokenizer (else a ValueError)
        sees = bool(image_token_strings(served.tokenizer, model.config)) and model.vision_tower is not None
    except ValueError:
        sees = False
    has = {"tools": "tools" in template, "vision": sees, "thinking": "enable_thinking" in template}
    info = {"general.architecture": "gemma4", "general.parameter_count": count, "gemma4.context_length": served.context}
    info |= {"gemma4.embedding_length": t.hidden_size, "gemma4.block_count": t.num_hidden_layers}
    info |= {"gemma4.attention.head_count": t.num_attention_heads, "gemma4.vocab_size": t.vocab_size}
    shown = {"license": "", "modelfile": "", "parameters": f"num_ctx {served.context}", "details": card["details"]}
    shown |= {"template": "{{ .Prompt }}{{ .Suffix }}", "model_info": info, "modified_at": card["modified_at"]}
    return card, shown | {"capabilities": ["completion", "insert", *(name for name, yes in has.items() if yes)]}


def add_routes(app: FastAPI, served: Served) -> None:
    """Ollama's routes on `app`, answering for the served model (also as "<name>:latest")."""
    card, shown = _cards(served)
    vram = card["size"] if served.model.device.type == "cuda" else 0
    running = {"expires_at": "9999-12-31T23:59:59Z", "size_vram": vram, "context_length": served.context}

    def model_of(name: str) -> str:  # "<name>:latest" is the served name
        check_model(served, served.name if name in (served.name, f"{served.name}:latest") else name)
        return served.name

    @app.post("/api/chat", summary="Ollama chat: a chat answer, as NDJSON lines (the default) or whole")
    async def chat(body: OllamaChatRequest, http: Request):
        return await _answer(served, body, model_of(body.model), http)

    @app.post("/api/generate", summary="Ollama generate: a prompt's answer, or the middle before a suffix")
    async def generate(body: OllamaGenerateRequest, http: Request):
        return await _answer(served, body, model_of(body.model), http)

    @app.post("/api/show", summary="Ollama: the served model's details and capabilities")
    async def show(body: OllamaShowRequest):
        if body.model is None and body.name is None:
            raise ApiError(400, "model: is required", "model")
        model_of(body.model or body.name)
        return shown

    @app.get("/api/tags", summary="Ollama: the served model")
    async def tags():
        return {"models": [card]}

    @app.get("/api/ps", summary="Ollama: the loaded model")
    async def ps():
        return {"models": [card | running]}

    @app.get("/api/version", summary="Ollama: the server's version (dgemma's)")
    async def version():
        return {"version": __version__}

"""The HTTP API's request bodies (OpenAI-compatible, plus diffusion settings), error bodies, and the parsing
of model output into what clients expect: thoughts apart from the answer, tool calls, stop strings."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 8


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

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class TextPart(BaseModel):
    type: str
    text: str | None = None
    model_config = ConfigDict(extra="allow")


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    model_config = ConfigDict(extra="ignore")


class StreamOptions(BaseModel):
    include_usage: bool = False


class DiffusionSettings(BaseModel):
    """Sampling fields shared by both endpoints; the diffusion ones carry generation_config.json's names."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=4)
    max_denoising_steps: int | None = Field(default=None, ge=1, le=1024)
    entropy_bound: float | None = Field(default=None, gt=0)
    t_min: float | None = Field(default=None, gt=0)
    t_max: float | None = Field(default=None, gt=0)
    stability_threshold: int | None = Field(default=None, ge=0)
    confidence_threshold: float | None = Field(default=None, gt=0)
    sampler: Literal["entropy-bound", "confidence", "fixed"] | None = None
    mode: Literal["fast", "exact"] | None = None
    early_commit: bool | None = None  # default: on when streaming
    include_drafts: bool = False  # extension: stream each step's draft canvas in `dgemma_draft`
    ignore_eos: bool = False  # extension (as in vLLM): generate max_tokens even past end-of-text tokens
    model_config = ConfigDict(extra="ignore")

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else value
        if stops is not None and (len(stops) > 4 or any(not s for s in stops)):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops

    def sampling(self, max_tokens: int) -> dict[str, Any]:
        """SamplingParams fields for the engine."""
        out: dict[str, Any] = {"max_new_tokens": max_tokens}
        for name in (
            "max_denoising_steps",
            "entropy_bound",
            "t_min",
            "t_max",
            "stability_threshold",
            "confidence_threshold",
            "sampler",
            "mode",
        ):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.temperature is not None and self.t_min is None and self.t_max is None:
            # One OpenAI temperature becomes the schedule's start, ending at half of it (the defaults' ratio).
            top = max(self.temperature, 0.02)
            out["t_max"], out["t_min"] = top, top / 2
        out["early_commit"] = self.stream if self.early_commit is None else self.early_commit
        if self.ignore_eos:
            out["stop_token_ids"] = []
        if out.get("mode") == "exact":
            out["early_commit"] = False
        return out


class ChatCompletionRequest(DiffusionSettings):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    reasoning: bool = False  # turn on thinking (the chat template's enable_thinking)
    tools: list[dict[str, Any]] | None = None


class CompletionRequest(DiffusionSettings):
    prompt: str | list[int]
    suffix: str | None = None  # infilling: generate between prompt and suffix

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        return value


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


# ------------------------------------------------------------------------------------------------
# Output parsing

THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>thought\n", "<channel|>"
_TOOL_CALL = re.compile(r"<\|tool_call>\s*call:([A-Za-z0-9_.\-]+)\s*(\{.*?\})\s*<tool_call\|>", re.S)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """Gemma 4 thinking output `<|channel>thought\\n...<channel|>answer` -> (thought, answer)."""
    start = text.find(THOUGHT_OPEN)
    if start < 0:
        return None, text
    end = text.find(THOUGHT_CLOSE, start + len(THOUGHT_OPEN))
    if end < 0:  # the thought never closed: all of it is thought
        return text[start + len(THOUGHT_OPEN) :], text[:start]
    thought = text[start + len(THOUGHT_OPEN) : end]
    return thought, text[:start] + text[end + len(THOUGHT_CLOSE) :]


def _tool_arguments(raw: str) -> str:
    """Gemma 4 writes call arguments as JSON or as {key:value,...} with <|"|> quotes; return JSON text."""
    cleaned = raw.replace('<|"|>', '"')
    try:
        return json.dumps(json.loads(cleaned))
    except json.JSONDecodeError:
        pass
    quoted = re.sub(r"([{,]\s*)([A-Za-z_][A-Za-z0-9_]*)\s*:", r'\1"\2":', cleaned)
    try:
        return json.dumps(json.loads(quoted))
    except json.JSONDecodeError:
        return json.dumps({"raw": raw})


def extract_tool_calls(text: str) -> tuple[list[dict], str]:
    """Gemma 4 tool calls `<|tool_call>call:NAME{ARGS}<tool_call|>` -> OpenAI tool_calls, and the rest."""
    calls = []
    for m in _TOOL_CALL.finditer(text):
        calls.append(
            {
                "id": new_id("call"),
                "type": "function",
                "function": {"name": m.group(1), "arguments": _tool_arguments(m.group(2))},
            }
        )
    return calls, _TOOL_CALL.sub("", text).strip() if calls else text


def find_stop(text: str, stops: list[str] | None) -> int:
    """Index where the first stop string starts, or -1."""
    hits = [i for i in (text.find(s) for s in stops or []) if i >= 0]
    return min(hits) if hits else -1


class StreamText:
    """Turns the growing decoded text of one choice into deltas: held back while it could still become a
    stop string or a thought marker, split into reasoning and content."""

    def __init__(self, stops: list[str] | None, reasoning: bool):
        self.stops = stops or []
        self.reasoning = reasoning
        self.sent = 0  # characters of the decoded text already emitted
        self.in_thought = False
        self.stopped = False

    def _holdback(self, text: str) -> int:
        """How many trailing characters might begin a stop string or a marker."""
        keep = 0
        for s in [*self.stops, THOUGHT_OPEN, THOUGHT_CLOSE]:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        return keep

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        """New (kind, text) pieces, kind 'content' or 'reasoning', from the full decoded text so far."""
        if self.stopped:
            return []
        cut = find_stop(text[self.sent :], self.stops)
        if cut >= 0:
            text, final, self.stopped = text[: self.sent + cut], True, True
        end = len(text) if final else len(text) - self._holdback(text[self.sent :])
        pieces: list[tuple[str, str]] = []
        while self.sent < end:
            chunk = text[self.sent : end]
            marker = THOUGHT_CLOSE if self.in_thought else THOUGHT_OPEN
            i = chunk.find(marker)
            if i < 0:
                pieces.append(("reasoning" if self.in_thought else "content", chunk))
                self.sent = end
                break
            if i:
                pieces.append(("reasoning" if self.in_thought else "content", chunk[:i]))
            self.sent += i + len(marker)
            self.in_thought = not self.in_thought
        # Thoughts go out apart from the answer when asked for, and are dropped otherwise (a model may
        # write an empty thought block even with thinking off).
        return [(k, t) for k, t in pieces if t and (k == "content" or self.reasoning)]

"""Model output as OpenAI clients expect it: thoughts apart from the answer, Gemma 4 tool calls as
`tool_calls`, stop strings cut, and streamed text held back while it could still become a marker."""

from __future__ import annotations

import json
import re
import uuid

THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>thought\n", "<channel|>"
_TOOL_CALL = re.compile(r"<\|tool_call>\s*call:([A-Za-z0-9_.\-]+)\s*(\{.*?\})\s*<tool_call\|>", re.S)


def new_id(prefix: str) -> str:
    """A random OpenAI-style object id (`chatcmpl-...`, `call-...`)."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


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
        self.cut = -1  # with a stop string: where it starts in the decoded text (the text ends there)

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
            self.cut = self.sent + cut
            text, final, self.stopped = text[: self.cut], True, True
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

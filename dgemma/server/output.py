"""Model output as OpenAI clients expect it: thoughts apart from the answer, Gemma 4 tool calls as
`tool_calls`, stop strings cut, and streamed text held back while it could still become a marker."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ..tool_calls import CALL_OPEN

THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>thought\n", "<channel|>"


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


def openai_call(name: str, arguments: dict) -> dict:
    """One OpenAI tool_calls entry (arguments as JSON text)."""
    return {"id": new_id("call"), "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def find_stop(text: str, stops: list[str] | None) -> int:
    """Index where the first stop string starts, or -1."""
    hits = [i for i in (text.find(s) for s in stops or []) if i >= 0]
    return min(hits) if hits else -1


@dataclass
class StreamText:
    """Turns the growing decoded text of one choice into deltas: held back while it could still become a
    stop string, a thought marker or the start of a tool call, split into reasoning and content."""

    stops: list[str] | None
    reasoning: bool
    sent: int = 0  # characters of the decoded text already emitted
    in_thought: bool = False
    stopped: bool = False
    cut: int = -1  # with a stop string: where it starts in the decoded text (the text ends there)

    def _holdback(self, text: str) -> int:
        """How many trailing characters might begin a stop string or a marker, or are U+FFFD: the bytes of a
        character whose tokens have not all arrived decode so, and become that character once they do."""
        keep = len(text) - len(text.rstrip("\ufffd"))
        for s in [*(self.stops or []), THOUGHT_OPEN, THOUGHT_CLOSE, CALL_OPEN]:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        return keep

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        """New (kind, text) pieces, kind 'content' or 'reasoning', from the full decoded text so far."""
        if self.stopped:
            return []
        cut = find_stop(text[self.sent :], self.stops or [])
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

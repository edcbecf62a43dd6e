"""The answers of the generation routes, from the pieces their choices give (server/runs.py): SSE
chunks as they come, or one JSON body; chat messages (tool calls read out of the text), completion texts
(echo, logprobs), usage, and each choice's `dgemma` details."""

from __future__ import annotations

import json
import time

from fastapi.responses import StreamingResponse

from ..tool_calls import CALL_OPEN, parse_tool_calls
from . import logprobs as logprob_blocks
from .output import new_id, openai_call
from .protocol import ApiError, ChatCompletionRequest, CompletionRequest
from .runs import Piece, Served


def usage_of(
    prompt_tokens: int, completion_tokens: int, cached: int = 0, prediction: tuple[int, int] | None = None
) -> dict:
    """OpenAI's usage: `cached` of the prompt tokens were loaded from the prefix cache (prompt_tokens_details);
    with a prediction, its (accepted, rejected) tokens (completion_tokens_details)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
        **({} if prediction is None else {"completion_tokens_details": prediction_details(*prediction)}),
    }


def prediction_details(accepted: int, rejected: int) -> dict:
    """OpenAI's completion_tokens_details of a request with a prediction: its tokens the answers kept at
    their positions, and the others placed on their canvases."""
    return {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": rejected}


def prediction_of(choices) -> tuple[int, int] | None:
    """The (accepted, rejected) prediction tokens of a request's choices, summed; None without a prediction."""
    counts = [c.prediction for c in choices if c.prediction is not None]
    return (sum(a for a, _ in counts), sum(r for _, r in counts)) if counts else None


def cached_of(choices, chat: bool) -> int:
    """The prompt positions the prefix cache gave a request's choices: a chat prompt's once (usage counts it
    once), every completion choice's prompt (usage counts each)."""
    if chat:
        return choices[0].request.cached_tokens if choices else 0
    return sum(c.request.cached_tokens for c in choices)


def role_delta(index: int) -> dict:
    """A chat stream's first chunk of each choice: the assistant's role."""
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def gather(pieces, choices: int = 1) -> tuple[dict[int, dict[str, str]], dict[int, str], dict[int, list]]:
    """Non-streaming: the text of every choice by kind, each one's finish reason and its tool calls (errors
    raise; a 499 when the client left before all `choices` ended)."""
    texts: dict[int, dict[str, str]] = {}
    reasons: dict[int, str] = {}
    calls: dict[int, list] = {}
    async for piece in pieces:
        if piece.kind == "end":
            if piece.error is not None:
                raise piece.error
            reasons[piece.index] = piece.finish_reason
        elif piece.kind == "calls":
            calls[piece.index] = piece.calls
        elif piece.kind in ("content", "reasoning"):
            parts = texts.setdefault(piece.index, {})
            parts[piece.kind] = parts.get(piece.kind, "") + piece.text
    if len(reasons) < choices:
        raise ApiError(499, "the client closed the request")
    return texts, reasons, calls


async def with_calls(pieces, most: int | None = None):
    """The pieces of choices that were offered tools, with their calls read out: a choice's text from a tool
    call's start on is held, and at its end given as the text around the calls, then one "calls" piece
    (the first `most` calls) and an end whose reason is "tool_calls"; a call that does not parse stays
    text (dgemma.tool_calls)."""
    held: dict[int, str] = {}
    async for piece in pieces:
        if piece.kind == "content" and (piece.index in held or CALL_OPEN in piece.text):
            before, mark, after = ("", "", piece.text) if piece.index in held else piece.text.partition(CALL_OPEN)
            if before:
                yield Piece(piece.index, "content", before)
            held[piece.index] = held.get(piece.index, "") + mark + after
            continue
        if piece.kind == "end" and piece.index in held and piece.error is None:
            found, rest = parse_tool_calls(held.pop(piece.index))
            if rest:
                yield Piece(piece.index, "content", rest)
            if found:
                yield Piece(piece.index, "calls", calls=found[:most])
                piece = Piece(piece.index, "end", finish_reason="tool_calls")
        yield piece


async def chat_answer(served, body: ChatCompletionRequest, started) -> dict:
    choices = started.choices
    texts, reasons, calls = await gather(started.pieces, len(choices))
    out = []
    for c in choices:
        parts = texts.get(c.index, {})
        message = {"role": "assistant", "content": parts.get("content", "")}
        if body.reasoning and "reasoning" in parts:
            message["reasoning_content"] = parts["reasoning"]
        if calls.get(c.index):
            message["tool_calls"] = [openai_call(name, arguments) for name, arguments in calls[c.index]]
        entry = {"index": c.index, "message": message, "finish_reason": reasons[c.index]}
        if body.logprobs:
            n = c.returned_tokens
            lps, tops = c.logprobs or ([], [])
            k = body.top_logprobs or 0
            entry["logprobs"] = logprob_blocks.chat(served.tokenizer, c.tokens[:n], lps[:n], tops[:n], k)
        out.append(entry)
    return {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served.name,
        "choices": out,
        "usage": usage_of(
            started.prompt_tokens,
            sum(c.returned_tokens for c in choices),
            cached_of(choices, True),
            prediction_of(choices),
        ),
        "dgemma": {
            "steps_per_canvas": [c.steps_per_canvas for c in choices],
            "tokens_per_forward": [c.tokens_per_forward for c in choices],
            **({"choices": [c.details for c in choices]} if any(c.details for c in choices) else {}),
        },
    }


def call_limit(body: ChatCompletionRequest) -> int | None:
    """How many of the calls an answer holds are sent: one with `parallel_tool_calls: false`, else all."""
    return 1 if body.parallel_tool_calls is False else None


class Chunks:
    """The SSE chunks of one streamed answer: chat deltas (`delta`) or completion text (`text`)."""

    def __init__(self, served: Served, chat: bool):
        self.chat = chat
        self.head = {
            "id": new_id("chatcmpl" if chat else "cmpl"),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": served.name,
        }

    def choice(self, index: int, kind: str | None = None, text: str = "", reason=None, **extra) -> str:
        """One choice's chunk: `text` of `kind` ("content", "reasoning"; None: nothing), or its end."""
        if self.chat:
            field = "reasoning_content" if kind == "reasoning" else "content"
            body = {"delta": {field: text} if kind else {}}
        else:
            body = {"text": text, "logprobs": None}
        return sse({**self.head, "choices": [{"index": index, **body, "finish_reason": reason}], **extra})

    def usage(self, prompt_tokens: int, choices) -> str:
        made, cached = sum(c.returned_tokens for c in choices), cached_of(choices, self.chat)
        usage = usage_of(prompt_tokens, made, cached, prediction_of(choices))
        return sse({**self.head, "choices": [], "usage": usage})


async def event_stream(chunks: Chunks, pieces, choices, opening: list[str], prompt_tokens: int, usage: bool):
    """The SSE body of a streamed answer, chat or completion alike: `opening` chunks, then each piece as it
    comes (drafts, text, tool calls as `tool_calls` deltas, ends with the choice's `dgemma` details if any,
    errors), the usage if asked for, and [DONE]."""
    by_index = {c.index: c for c in choices}
    for text in opening:
        yield text
    async for piece in pieces:
        if piece.kind == "draft":
            yield chunks.choice(piece.index, dgemma_draft=piece.draft)
        elif piece.kind == "end" and piece.error is not None:
            yield sse(piece.error.body())
            yield chunks.choice(piece.index, reason="error")
        elif piece.kind == "calls":
            deltas = [{"index": k, **openai_call(name, arguments)} for k, (name, arguments) in enumerate(piece.calls)]
            yield sse({**chunks.head, "choices": [{"index": piece.index, "delta": {"tool_calls": deltas}}]})
        elif piece.kind == "end":
            details = by_index[piece.index].details  # set when the choice finished
            yield chunks.choice(piece.index, reason=piece.finish_reason, **({"dgemma": details} if details else {}))
        else:
            yield chunks.choice(piece.index, piece.kind, piece.text)
    if usage:
        yield chunks.usage(prompt_tokens, choices)
    yield sse("[DONE]")


async def completion_reply(served: Served, body: CompletionRequest, choices, pieces, prompts, plan, scored=None):
    """The completion answer, streamed or whole, from the choices' pieces."""
    echoes = [served.decode(prompts[c.index // body.n]) if body.echo else "" for c in choices]
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = Chunks(served, chat=False)
        opening = [chunks.choice(c.index, "content", echoes[k]) for k, c in enumerate(choices) if echoes[k]]
        prompt_tokens = sum(len(p) for p in prompts) * body.n
        body_ = event_stream(chunks, pieces, choices, opening, prompt_tokens, usage)
        return StreamingResponse(body_, media_type="text/event-stream")
    return await completion_answer(served, body, pieces, choices, echoes, prompts, plan, scored)


async def completion_logprobs(served: Served, body: CompletionRequest, choices, echoes, prompts, scored) -> list:
    """Each choice's legacy logprobs block (None without `logprobs`): the echoed prompt's (`echoes`: its
    text per choice), by the encoder, then the completion's, by the denoiser."""
    k = body.logprobs
    if k is None:
        return [None] * len(choices)
    tok = served.tokenizer
    blocks = []
    for c, echo in zip(choices, echoes, strict=True):
        head = None
        prompt = prompts[c.index // body.n]
        if scored is not None:
            head = logprob_blocks.legacy(tok, prompt, *scored[c.index // body.n])
        start = len(echo)
        lps, tops = c.logprobs or ([], [])
        n = c.returned_tokens
        blocks.append(logprob_blocks.join(head, logprob_blocks.legacy(tok, c.tokens[:n], lps[:n], tops[:n], start)))
    return blocks


async def completion_answer(served, body: CompletionRequest, pieces, choices, echoes, prompts, plan, scored):
    texts, reasons, _ = await gather(pieces, len(choices))
    blocks = await completion_logprobs(served, body, choices, echoes, prompts, scored)
    out = [
        {
            "index": c.index,
            "text": echoes[k] + texts.get(c.index, {}).get("content", ""),
            "finish_reason": reasons[c.index],
            "logprobs": blocks[k],
        }
        for k, c in enumerate(choices)
    ]
    answer = {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": served.name,
        "choices": out,
        "usage": usage_of(
            sum(len(p) for p in prompts) * body.n,
            sum(c.returned_tokens for c in choices),
            cached_of(choices, False),
            prediction_of(choices),
        ),
    }
    if plan is not None:  # the length given (None: chosen per choice), and each choice's
        fixed = plan.lengths[0] if len(plan.lengths) == 1 else None
        answer["dgemma"] = {"middle_length": fixed, "choices": [c.details for c in choices]}
    elif any(c.details for c in choices):  # `choices` scores, JSON attempts
        answer["dgemma"] = {"choices": [c.details for c in choices]}
    return answer

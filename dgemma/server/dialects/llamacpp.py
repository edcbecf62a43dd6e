"""llama.cpp server's `POST /infill` and `POST /completion` (what llama.vscode and llama.vim send on every
keystroke), each mapped onto a /v1/completions body and started as that route starts it (dialects.start_mapped):
every rule, limit and default is the completions body's and its task's.

/infill: the `input_extra` chunks' texts (each followed by a newline, in order; a chunk's `filename` is not
written: the model has no file-separator token to set it apart), then `input_prefix`, then `prompt` (what the
user typed since the cursor: llama.cpp puts it after the middle marker, so the middle starts with it and it
joins the prefix) are the completions `prompt`; `input_suffix` is its `suffix`: the Infill task. `n_predict`
absent or -1: the middle's length is chosen by score; else the middle is that many tokens (max_tokens with a
suffix: at most what the canvas holds beside the suffix, and cut at an end of text). The answer's `content` is
the middle: what comes after `prompt`.
/completion: `prompt` (one string or one list of token ids), `n_predict` (-1 or absent: not given) as
max_tokens: the Generate task.
Both: `temperature`, `seed` (-1: a random one, as in llama.cpp), `stop`, `stream`, `model`, and dgemma's
settings under `dgemma` (dialects.EXTENSIONS). `n_predict: 0` (llama.vscode's cache-warming call) runs the
prompt's prefill only, which keeps it in the server's prefix cache for the calls that follow (unless
`cache_prompt` is false or the server has none), and answers with empty content and the prompt's token count.

Accepted and without effect (llama.vscode sends them; a diffusion model has no counterpart), and named in the
answer's `generation_settings.not_applied`: top_k, top_p, samplers, n_indent,
t_max_prompt_ms, t_max_predict_ms, and input_extra[].time. Refused unless at their no-op value: lora (one
model, no per-request adapters), grammar, json_schema (/v1/completions' response_format makes JSON by
construction), n_probs (its logprobs), logit_bias. Any other field is refused as unknown.

The answer: {content, stop: true, model, tokens_predicted, tokens_evaluated, stop_type ("eos" | "limit" |
"word"), stopping_word, truncated, tokens_cached, generation_settings, timings} (tokens_evaluated: the
prompt's tokens, /v1/completions' prompt_tokens; an infill's suffix is not counted); streamed, SSE lines
`data: {"content": ..., "stop": false}` per piece of text, then one with `stop: true` and the other fields,
or `data: {"error": {...}}` when the request fails on the way (llama.cpp sends no [DONE]).
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, field_validator

from ...generation.engine import DoneEvent, EncodeCall, Program
from ..answers import gather, sse
from ..protocol import ApiError, Body, CompletionRequest, Text
from ..routes import Started, completion_checked, outcome
from ..runs import Choice, Served
from . import Renames, extensions, mapped, start_mapped

MAX_EXTRA = 256  # input_extra chunks (llama.vscode keeps 16 by default)
NOT_APPLIED = ("top_k", "top_p", "samplers", "n_indent", "t_max_prompt_ms", "t_max_predict_ms")
_REFUSED = {  # field -> (its no-op values, why another value is refused)
    "lora": (([],), "per-request LoRA adapters are not supported (the server runs one model)"),
    "grammar": (("",), "grammars are not supported; /v1/completions' response_format makes JSON by construction"),
    "json_schema": ((), "use /v1/completions with response_format json_schema (valid by construction)"),
    "n_probs": ((0,), "token probabilities: use /v1/completions' logprobs"),
    "logit_bias": (([], {}), "is not supported by this server (a diffusion model)"),
}
Millis = Annotated[int, Field(ge=-1, le=2**31)]


class ExtraChunk(Body):
    """input_extra[]: another file's chunk, context before the prefix."""

    text: Text
    filename: Text | None = Field(default=None, max_length=4096)  # not written (see the module docstring)
    time: int | None = Field(default=None, ge=0, le=2**53)  # when llama.vscode picked it: no effect


class LlamaSettings(Body):
    """What /infill and /completion share."""

    model: Text | None = Field(default=None, max_length=256)
    n_predict: int | None = Field(default=None, ge=-1)  # its upper bound: the completions body's max_tokens
    temperature: float | None = None  # its range: the completions body's
    seed: int | None = Field(default=None, ge=-1)
    stop: Any = None  # a string or a list of them: checked by the completions body
    stream: bool = False
    dgemma: dict[str, Any] | None = None
    top_k: int | None = Field(default=None, ge=0, le=2**31)
    top_p: float | None = Field(default=None, ge=0, le=1)
    samplers: list[Annotated[str, Field(max_length=32)]] | Annotated[str, Field(max_length=64)] | None = Field(
        default=None, max_length=32
    )
    cache_prompt: bool | None = None
    n_indent: int | None = Field(default=None, ge=0, le=2**16)
    t_max_prompt_ms: Millis | None = None
    t_max_predict_ms: Millis | None = None
    lora: Any = None
    grammar: Any = None
    json_schema: Any = None
    n_probs: Any = None
    logit_bias: Any = None

    @field_validator(*_REFUSED)
    @classmethod
    def _no_op_only(cls, value: Any, info) -> Any:
        allowed, why = _REFUSED[info.field_name]
        if value is None or any(value == a and type(value) is type(a) for a in allowed):
            return value
        raise ValueError(why)

    def fields(self) -> dict:
        """The completions body's fields this request sets (the route adds its prompt)."""
        out: dict[str, Any] = {"stream": self.stream}
        if self.n_predict not in (None, -1):
            out["max_tokens"] = self.n_predict
        if self.seed not in (None, -1):
            out["seed"] = self.seed
        for name in ("model", "temperature", "stop", "cache_prompt"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return {**out, **extensions(self.dgemma)}


class InfillRequest(LlamaSettings):
    input_prefix: Text = ""
    input_suffix: Text = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list, max_length=MAX_EXTRA)
    prompt: Text = ""


class LlamaCompletionRequest(LlamaSettings):
    prompt: Any  # one prompt: a string or a non-empty list of token ids (the ids checked by the task)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> str | list[int]:
        ids = isinstance(value, list) and value and all(type(t) is int for t in value)
        if not (isinstance(value, str) or ids):
            raise ValueError("must be a string or a non-empty list of token ids (one prompt)")
        return value  # its text's Unicode: checked by the completions body


def add_routes(app: FastAPI, served: Served) -> None:
    @app.post("/infill", summary="llama.cpp infill (llama.vscode, llama.vim): the middle between prefix and suffix")
    async def infill(body: InfillRequest, http: Request):
        text = "".join(chunk.text + "\n" for chunk in body.input_extra) + body.input_prefix + body.prompt
        fields = {**body.fields(), "prompt": text, "suffix": body.input_suffix}
        names = {"prompt": "input_prefix", "suffix": "input_suffix", "max_tokens": "n_predict"}
        return await _serve(served, body, fields, http, Renames(names))

    @app.post("/completion", summary="llama.cpp completion: text after a prompt (a string or token ids)")
    async def completion(body: LlamaCompletionRequest, http: Request):
        fields = {**body.fields(), "prompt": body.prompt}
        return await _serve(served, body, fields, http, Renames({"max_tokens": "n_predict"}))


async def _serve(served: Served, body: LlamaSettings, fields: dict, http: Request, rename: Renames):
    """Start the completions body `fields` make (or, with n_predict 0, only check and count its prompt) and
    answer in llama.cpp's shape, streamed or whole."""
    begun = time.perf_counter()
    if body.n_predict == 0:
        evaluated = await _warm(served, fields, rename)
        answer = _answer(served, body, None, "", evaluated, "limit", (begun, time.perf_counter()))
        return StreamingResponse(iter([sse(answer)]), media_type="text/event-stream") if body.stream else answer
    started = await start_mapped(served, CompletionRequest, fields, http, rename)
    clock = (begun, time.perf_counter())
    if body.stream:
        return StreamingResponse(_stream(served, body, started, clock, http.url.path), media_type="text/event-stream")
    texts, reasons, _ = await gather(started.pieces)
    text = texts.get(0, {}).get("content", "")
    return _answer(served, body, started.choices[0], text, started.prompt_tokens, reasons[0], clock)


def _prefill_only(program: Program) -> Program:
    """`program` up to and with its first encode (its prompt's prefill), then done (a DoneEvent of None):
    what warms a prefix cache with the prompt a request will bring."""

    def steps():
        reply = None
        try:
            while True:
                item = program.steps.send(reply)
                reply = yield item
                if isinstance(item, EncodeCall):
                    break
        except StopIteration:
            pass
        finally:
            program.steps.close()
        yield DoneEvent(None)

    return Program(steps(), program.reference, program.prompt_tokens)


async def _warm(served: Served, fields: dict, rename: Renames) -> int:
    """llama.vscode's cache-warming call (n_predict 0): the body checked as the completions body, its prompt
    tokenized and counted, and its task's prefill run into the prefix cache (_prefill_only)."""
    fields = {k: v for k, v in fields.items() if k != "max_tokens"}  # 0: nothing to generate
    body = mapped(CompletionRequest, fields, rename)
    try:
        prompts, tasks = await completion_checked(served, body, None)  # the body's and its task's checks
        if served.engine.prefix_cache is not None and body.cache_prompt:
            program = tasks[0].program(served.model, served.engine.runner.canvas_stats)
            await outcome(served.engine, _prefill_only(program), served.request_timeout)
        return len(prompts[0])
    except ApiError as e:
        raise e.renamed(rename) from None


async def _stream(served: Served, body: LlamaSettings, started: Started, clock: tuple[float, float], path: str):
    """SSE: each piece of text as `{content, stop: false}`, then the answer's fields with `stop: true`."""
    async for piece in started.pieces:
        if piece.kind == "content" and piece.text:
            yield sse({"content": piece.text, "stop": False})
        elif piece.kind == "end" and piece.error is not None:
            yield sse(piece.error.body(path))
            return
        elif piece.kind == "end":
            choice = started.choices[0]
            yield sse(_answer(served, body, choice, "", started.prompt_tokens, piece.finish_reason, clock))


def _answer(
    served: Served, body: LlamaSettings, choice: Choice | None, content: str, evaluated: int, reason: str, clock
) -> dict:
    """llama.cpp's answer: the text (empty at a stream's end), why it stopped, counts, settings, timings."""
    predicted = choice.returned_tokens if choice is not None else 0
    cached = 0 if choice is None else choice.request.cached_tokens
    kind, word = _stop_type(served, body, choice, reason)
    begun, queued = clock
    done = time.perf_counter()
    prompt_ms, predicted_ms = (queued - begun) * 1000, (done - queued) * 1000
    answer = {
        "content": content,
        "stop": True,
        "model": served.name,
        "tokens_predicted": predicted,
        "tokens_evaluated": evaluated,
        "stop_type": kind,
        "stopping_word": word,
        "truncated": False,
        "tokens_cached": cached,
        "generation_settings": _settings(served, body),
        # prompt: until the request was on the engine (checked, tokenized, queued); predicted: from then to its
        # end (a diffusion model's passes read the prompt and write the answer together)
        "timings": {
            "cache_n": cached,
            "prompt_n": evaluated - cached,
            "prompt_ms": round(prompt_ms, 3),
            "prompt_per_second": round((evaluated - cached) / prompt_ms * 1000, 3) if prompt_ms > 0 else 0.0,
            "predicted_n": predicted,
            "predicted_ms": round(predicted_ms, 3),
            "predicted_per_second": round(predicted / predicted_ms * 1000, 3) if predicted_ms > 0 else 0.0,
        },
    }
    if choice is not None and (choice.details or choice.steps_per_canvas):
        answer["dgemma"] = {"steps_per_canvas": choice.steps_per_canvas, **choice.details}
    return answer


def _stop_type(served: Served, body: LlamaSettings, choice: Choice | None, reason: str) -> tuple[str, str]:
    """llama.cpp's stop_type and stopping_word: a stop string ("word"), the length asked for ("limit"), else
    "eos". A middle is whole unless n_predict sized it and it fills that length (an infill's rows run past
    end-of-text tokens, so their finish reason is always the length)."""
    word = choice.stop_string(served.decode) if choice is not None else None
    if word is not None:
        return "word", word
    if choice is not None and "middle_length" in choice.details:
        sized = body.n_predict not in (None, -1) and choice.returned_tokens >= choice.details["middle_length"]
        return ("limit" if sized else "eos"), ""
    return ("limit" if reason == "length" else "eos"), ""


def _settings(served: Served, body: LlamaSettings) -> dict:
    """The settings the request asked for, and the fields it sent that a diffusion model does not apply."""
    sent = body.model_fields_set
    not_applied = [name for name in NOT_APPLIED if name in sent]
    if isinstance(body, InfillRequest) and any(chunk.time is not None for chunk in body.input_extra):
        not_applied.append("input_extra.time")
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    return {
        "n_predict": -1 if body.n_predict is None else body.n_predict,
        "temperature": body.temperature,
        "seed": -1 if body.seed is None else body.seed,
        "stop": stop,
        "stream": body.stream,
        "n_ctx": served.context,
        "model": served.name,
        "dgemma": body.dgemma or {},
        "not_applied": not_applied,
    }

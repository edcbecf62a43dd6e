"""Every task is a program of model calls: driven alone (`dgemma.generation.engine.run`, what the library and the CLI
do) and on the serving engine (mixed with other requests, a cancelled one and one past its deadline), each
program gives the same answer. The engine batches denoising passes with other requests, so logits differ
from a lone run by rounding (tests/test_engine.py): tokens are asserted equal (a few steps per canvas keep
that with margin), scores from a batched denoising pass to 1e-4 (fp32 rounding of a log-softmax mean)."""

from __future__ import annotations

import functools

import pytest
from helpers import generation_request, load_quiet

from dgemma.checkpoints.tokenizer import Tokenizer
from dgemma.generation.choose import Call, Choose, Chosen, ToolCall
from dgemma.generation.engine import (
    DenoiseCall,
    DoneEvent,
    EncodeCall,
    Engine,
    EngineRequest,
    RequestTimeout,
    ScoreCall,
    WorkCall,
    run,
)
from dgemma.generation.loop import GenerationResult
from dgemma.generation.programs import Fill, Generate, Infill, Json, JsonResult
from dgemma.generation.sampling import SamplingParams
from dgemma.runtime.runner import Runner

WAIT = 120
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}, "n": {"enum": [1, 22]}},
    "required": ["name", "ok", "n"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}},
        },
    },
]


@pytest.fixture(scope="module")
def served(model_dir):
    return load_quiet(model_dir, dtype="fp32"), Tokenizer.from_dir(model_dir)


def params(seed: int, **kw) -> SamplingParams:
    return SamplingParams(seed=seed, max_denoising_steps=3, **kw)


def programs(model, tok) -> dict:
    """Each task's program, as a function of the runner it will run on."""
    prompt = tok.encode("say a b c")
    suffix = tok.encode(" then z", add_special_tokens=False)
    options = ["yes", "no", "maybe so"]
    tasks = {
        "generate": Generate([prompt], params(1, max_new_tokens=12)),
        "fill": Fill([5, None, None, 7, None], prompt, params(2)),
        "infill, encoder": Infill(prompt, suffix, "auto", params(3)),
        "infill, denoiser": Infill(prompt, suffix, "auto", params(4), "denoiser"),
        "json": Json(prompt, SCHEMA, tok, params(5), retries=2),
        "json object": Json(prompt, None, tok, params(6, max_new_tokens=24), retries=1),
        "tool call": Call(prompt, TOOLS, tok, None, params(7)),
        "choose": Choose(prompt, options, tok),
    }
    return {name: functools.partial(_program, task) for name, task in tasks.items()}


def _program(task, runner):
    return task.check(runner.model).program(runner.model, runner.canvas_stats)


def outcome(result):
    """What a program's result says, to compare (scores rounded where a batched pass may round them)."""
    if isinstance(result, Exception):
        return type(result).__name__, str(result)
    if isinstance(result, GenerationResult):
        return result.tokens, result.finish_reasons
    if isinstance(result, JsonResult):
        return result.text, result.attempts, result.result.tokens
    if isinstance(result, ToolCall):
        return result.name, result.text, result.scores
    if isinstance(result, Chosen):
        return result.index, result.scores
    scores = {n: round(s, 4) for n, s in result.scores.items()}  # an InfillResult
    return result.middle, result.middle_length, scores, result.result.tokens


def alone(runner, program):
    try:
        return run(runner, program)
    except Exception as e:  # a JSON answer that never validated: the same error on the engine
        return e


def collect(request: EngineRequest):
    while True:
        event = request.events.get(timeout=WAIT)
        if isinstance(event, DoneEvent | Exception):
            return event.result if isinstance(event, DoneEvent) else event


def test_every_program_gets_the_same_answer_alone_and_on_the_engine(served):
    model, tok = served
    runner = Runner(model)
    made = programs(model, tok)
    want = {name: outcome(alone(runner, make(runner))) for name, make in made.items()}
    engine = Engine(model, max_batch=16)
    try:
        other = [generation_request(engine.runner, [3, 4, 5 + i], params(20 + i, max_new_tokens=20)) for i in range(3)]
        gone = generation_request(engine.runner, [6, 7], params(30, max_new_tokens=64), want_drafts=True)
        late = generation_request(engine.runner, [8, 9], params(31, max_new_tokens=64), timeout=0.0)
        submitted = {name: EngineRequest(make(engine.runner)) for name, make in made.items()}
        for request in [*other[:2], gone, late, *submitted.values(), other[2]]:
            engine.submit(request)
        gone.cancel()
        got = {name: outcome(collect(request)) for name, request in submitted.items()}
        assert isinstance(collect(late), RequestTimeout)
        assert all(isinstance(collect(r), GenerationResult) for r in other)
    finally:
        engine.close()
    assert got == want
    assert any(not isinstance(r, tuple) or r[0] != "StructuredOutputError" for r in want.values())


def test_programs_yield_every_model_pass_and_hold_no_runner(served):
    """A program's passes are its calls: counting them from outside sees every encode, denoise and score."""
    model, tok = served
    runner = Runner(model)
    seen = []
    program = programs(model, tok)["infill, denoiser"](runner).steps
    reply = None
    while True:
        try:
            item = program.send(reply)
        except StopIteration:
            break
        reply = item.fn(*item.args) if isinstance(item, WorkCall) else None
        if isinstance(item, DenoiseCall | EncodeCall | ScoreCall):
            seen.append(type(item).__name__)
            from dgemma.generation.engine import answer

            reply = answer(runner, item)
    assert seen[0] == "EncodeCall" and seen.count("DenoiseCall") >= 2 and seen[-1] == "DenoiseCall"


def test_exact_mode_never_runs_on_the_fast_modules(served, monkeypatch):
    """Issue 56: a task in mode "exact" on an accelerated runner is answered by the reference modules only
    (its Program says so, and `drive` reads it), or it is refused by name when it pins or constrains
    positions (the reference has neither). Choose and Score sample nothing: they have no mode."""
    import dgemma
    from dgemma.generation.sampling import RequestError

    model, tok = served
    runner = dgemma.accelerate(model)
    assert runner.fast is not None and runner.reference is not runner
    fast = []
    for name in ("encode", "denoise"):
        original = getattr(runner, name)
        monkeypatch.setattr(runner, name, lambda *a, _o=original, _n=name, **k: (fast.append(_n), _o(*a, **k))[1])
    prompt = tok.encode("say a b c")
    exact = params(1, mode="exact", max_new_tokens=12)
    out = dgemma.generate(runner, [prompt], exact)
    assert len(out.tokens[0]) > 0 and not fast
    exact = params(1, mode="exact")
    refused = {
        "fill": lambda: dgemma.fill(runner, [5, None, None, 7, None], prompt, exact),
        "infill": lambda: dgemma.infill(runner, prompt, tok.encode(" z", add_special_tokens=False), 4, exact),
        "edit": lambda: dgemma.edit(runner, prompt, (1, 2), exact),
        "json": lambda: dgemma.generate_json(runner, prompt, SCHEMA, exact, tokenizer=tok),
        "json object": lambda: dgemma.generate_json(runner, prompt, None, exact, tokenizer=tok),
        "tool call": lambda: dgemma.tool_call(runner, prompt, TOOLS, exact, tokenizer=tok, name="get_weather"),
        "auto": lambda: dgemma.tool_call(runner, prompt, TOOLS, exact, tokenizer=tok, name="auto"),
    }
    for name, ask in refused.items():
        with pytest.raises(RequestError) as e:
            ask()
        assert e.value.param == "mode", name
    assert not fast

"""Every task is a program of model calls: driven alone (`dgemma.calls.run`, what the library and the CLI
do) and on the serving engine (mixed with other requests, a cancelled one and one past its deadline), each
program gives the same answer. The engine batches denoising passes with other requests, so logits differ
from a lone run by rounding (tests/test_engine.py): tokens are asserted equal (a few steps per canvas keep
that with margin), scores from a batched denoising pass to 1e-4 (fp32 rounding of a log-softmax mean)."""

from __future__ import annotations

import pytest
from helpers import load_quiet

from dgemma.calls import DenoiseCall, DoneEvent, EncodeCall, ScoreCall, WorkCall, run
from dgemma.checkpoints.tokenizer import Tokenizer
from dgemma.editing import plan_infill
from dgemma.engine import Engine, EngineRequest, RequestTimeout, generation_request
from dgemma.generate import GenerationResult, SamplingParams
from dgemma.programs import (
    Chosen,
    ToolCall,
    choose_program,
    fill_program,
    generate_program,
    infill_program,
    json_plan,
    json_program,
    option_ids,
    tool_call_program,
    tool_plans,
)
from dgemma.runtime.runner import Runner
from dgemma.structured import JsonResult

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
    return {
        "generate": lambda r: generate_program(r, [prompt], params(1, max_new_tokens=12)),
        "fill": lambda r: fill_program(r, [5, None, None, 7, None], prompt, params(2)),
        "infill, encoder": lambda r: infill_program(r, plan_infill(r, prompt, suffix, "auto"), params(3)),
        "infill, denoiser": lambda r: infill_program(
            r, plan_infill(r, prompt, suffix, "auto", length_score="denoiser"), params(4)
        ),
        "json": lambda r: json_program(r, json_plan(r, tok, SCHEMA, 0), prompt, params(5), retries=2),
        "json object": lambda r: json_program(r, json_plan(r, tok, None, 24), prompt, params(6), retries=1),
        "tool call": lambda r: tool_call_program(r, prompt, tool_plans(r, tok, TOOLS), params(7), tokenizer=tok),
        "choose": lambda r: choose_program(r, prompt, options, option_ids(model, options, tok)),
    }


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
    program = programs(model, tok)["infill, denoiser"](runner)
    reply = None
    while True:
        try:
            item = program.send(reply)
        except StopIteration:
            break
        reply = item.fn(*item.args) if isinstance(item, WorkCall) else None
        if isinstance(item, DenoiseCall | EncodeCall | ScoreCall):
            seen.append(type(item).__name__)
            from dgemma.calls import answer

            reply = answer(runner, item)
    assert seen[0] == "EncodeCall" and seen.count("DenoiseCall") >= 2 and seen[-1] == "DenoiseCall"

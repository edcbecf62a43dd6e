"""Gemma 4's tool protocol: the parser reads every call or none, the shipped template writes declarations,
calls and responses in the protocol's syntax, and a live server makes required calls by construction (the
openai client reads them as tool_calls whose arguments validate against the function's schema)."""

from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest
from helpers import TEMPLATE_PATH
from live_server import KEY

from dgemma.checkpoints.tokenizer import compile_chat_template
from dgemma.generation.programs import sizes_of
from dgemma.tool_calls import Unparsed, call_text, parse_arguments, parse_tool_calls

Q = '<|"|>'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City", "maxLength": 12},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 0, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": {}}}
FAST = {"max_denoising_steps": 3}


# -- the parser --------------------------------------------------------------------------------------------


def test_calls_in_the_protocols_syntax_and_in_json_are_read():
    args = f"{{a:{Q}x, y: {{z}}{Q},b:[1,-2.5,true,null],c:{{d:{Q}e{Q}}},{Q}k k{Q}:3}}"
    text = f"Sure.<|tool_call>call:f{args}<tool_call|> ok"
    calls, rest = parse_tool_calls(text)
    assert calls == [("f", {"a": "x, y: {z}", "b": [1, -2.5, True, None], "c": {"d": "e"}, "k k": 3})]
    assert rest == "Sure. ok"
    calls, _ = parse_tool_calls(
        '<|tool_call>call:g{"q": "a\\"b", "n": 1e3}<tool_call|><|tool_call>call:h{}<tool_call|>'
    )
    assert calls == [("g", {"q": 'a"b', "n": 1000.0}), ("h", {})]


@pytest.mark.parametrize(
    "text",
    [
        f"<|tool_call>call:f{{a:{Q}x}}",  # no close
        f"<|tool_call>call:f{{a:{Q}x}}<tool_call|> and <|tool_call>call:g{{a:}}<tool_call|>",  # one bad of two
        "<|tool_call>call:{a:1}<tool_call|>",  # no name
        "<|tool_call>call:f{a:" + Q + "x}<tool_call|>",  # a string that does not close
        "<|tool_call>call:f{a:1 b:2}<tool_call|>",  # no comma
        "<|tool_call>call:f" + "{a:" * 100 + "1" + "}" * 100 + "<tool_call|>",  # nested too deeply
    ],
)
def test_a_call_that_does_not_parse_leaves_the_whole_answer_text(text):
    assert parse_tool_calls(text) == ([], text)


def test_written_arguments_read_back_the_same():
    rng = random.Random(0)

    def value(depth: int):
        kind = rng.choice(["s", "i", "f", "b", "n"] + (["l", "o"] if depth < 3 else []))
        if kind == "l":
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        if kind == "o":
            return {f"k{rng.randint(0, 99)}": value(depth + 1) for _ in range(rng.randint(0, 3))}
        return {"s": 'a, b: {c} "d"', "i": rng.randint(-99, 99), "f": 0.25, "b": True, "n": None}[kind]

    for _ in range(50):
        args = {f"a{i}": value(0) for i in range(rng.randint(0, 4))} | {"a key, not bare": 1}
        assert parse_tool_calls(call_text("f", args))[0] == [("f", args)]
    with pytest.raises(Unparsed):
        parse_arguments("{a:1} extra")


# -- the shipped template ----------------------------------------------------------------------------------


def _render(messages, **kw):
    return compile_chat_template(TEMPLATE_PATH.read_text()).render(messages=messages, bos_token="<bos>", **kw)


def test_the_template_writes_the_tool_protocol():
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "function": {"name": "get_weather", "arguments": {"unit": "c", "city": "Paris", "days": 1}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": " 18 C "},
        {"role": "assistant", "content": "It is 18 C."},
        {"role": "user", "content": "thanks"},
    ]
    declaration = (
        "<|tool>declaration:get_weather{description:" + Q + "The weather now" + Q + ",parameters:{properties:{"
        "city:{description:" + Q + "City" + Q + ",type:" + Q + "STRING" + Q + "},"
        "days:{type:" + Q + "INTEGER" + Q + "},"
        "unit:{enum:[" + Q + "c" + Q + "," + Q + "f" + Q + "],type:" + Q + "STRING" + Q + "}},"
        "required:["
        + Q
        + "city"
        + Q
        + ","
        + Q
        + "unit"
        + Q
        + ","
        + Q
        + "days"
        + Q
        + "],type:"
        + Q
        + "OBJECT"
        + Q
        + "}}<tool|>"
    )
    assert _render(history, tools=[WEATHER], add_generation_prompt=True) == (
        "<bos><|turn>system\n" + declaration + "<turn|>\n"
        "<|turn>user\nWeather in Paris?<turn|>\n"
        "<|turn>model\n<|tool_call>call:get_weather{city:" + Q + "Paris" + Q + ",days:1,unit:" + Q + "c" + Q + "}"
        "<tool_call|><|tool_response>response:get_weather{value:" + Q + "18 C" + Q + "}<tool_response|>"
        "It is 18 C.<turn|>\n<|turn>user\nthanks<turn|>\n<|turn>model\n"
    )
    # after the tools answer, the model's turn goes on: no new turn is opened
    assert _render(history[:3], tools=[WEATHER], add_generation_prompt=True).endswith("<tool_response|>")


def test_conversations_without_tools_render_as_before():
    messages = [
        {"role": "system", "content": " S "},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]},
    ]
    assert _render(messages, tools=None, add_generation_prompt=True) == (
        "<bos><|turn>system\nS<turn|>\n<|turn>user\nhi<turn|>\n<|turn>model\nyo<turn|>\n"
        "<|turn>user\na<|image|><turn|>\n<|turn>model\n"
    )


def test_transformers_renders_our_template_the_same(model_dir):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "1", "content": "noon"},
    ]
    want = theirs.apply_chat_template(history, tools=[WEATHER, TIME], tokenize=False, add_generation_prompt=True)
    assert _render(history, tools=[WEATHER, TIME], add_generation_prompt=True) == want


def test_the_shipped_models_carry_the_template():
    from dgemma.tasks.code import MODEL_DIR

    for name in ("code", "shapes"):
        assert (MODEL_DIR.parent / name / "chat_template.jinja").read_text() == TEMPLATE_PATH.read_text()


# -- a live server ---------------------------------------------------------------------------------------


def test_a_drafted_call_sizes_the_arguments_in_the_call_syntax(model_dir):
    from helpers import load_quiet

    from dgemma.checkpoints.tokenizer import Tokenizer
    from dgemma.generation.programs import read_answer
    from dgemma.structured import tool_call_plan

    model, tok = load_quiet(model_dir), Tokenizer.from_dir(model_dir)
    plan = tool_call_plan(sizes_of(model), tok, "get_weather", WEATHER["function"]["parameters"])
    arguments = {"city": "Oslo", "days": 3, "unit": "f"}
    drafted = plan.resize("Let me look. " + call_text("get_weather", arguments))
    city, unit, days = (node for _, node in drafted.root.properties)
    assert city.length == len(tok.encode("Oslo", add_special_tokens=False)) and unit.drafted == ["f"]
    assert days.drafted == [3]  # 0 to 7: a choice
    text = call_text("get_weather", arguments)
    tokens = tok.encode(text, add_special_tokens=False)
    head = drafted.template[: len(tokens)]
    assert all(t == p for t, p in zip(tokens, head, strict=True) if p is not None)  # the call's own split
    assert read_answer(model, drafted, [], tokens + drafted.template[len(tokens) :]) == (arguments, None)
    other = plan.resize(call_text("get_time", {}))  # no call of this function: the schema's budgets
    assert other.root.properties[0][1].length is None


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _ask(client, **kw):
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], extra_body=FAST, **kw
    )


def test_required_calls_are_made_by_construction(client):
    schema = WEATHER["function"]["parameters"]
    for seed in range(3):
        r = _ask(client, tools=[WEATHER], tool_choice="required", seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call")
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_named_function_is_called_and_one_without_arguments_needs_no_model(client):
    r = _ask(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {})
    r = _ask(client, tools=[WEATHER, TIME], tool_choice="required", seed=1, n=2)
    names = {c.message.tool_calls[0].function.name for c in r.choices}
    assert len(r.choices) == 2 and names <= {"get_weather", "get_time"} and len(names) == 1  # one scored choice


def test_a_streamed_required_call_arrives_as_tool_call_deltas(client):
    chunks = list(_ask(client, tools=[WEATHER], tool_choice="required", stream=True, seed=2))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].function.name == "get_weather"
    jsonschema.validate(json.loads(deltas[0].function.arguments), WEATHER["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_auto_answers_never_carry_a_broken_call(client):
    for seed in range(3):
        message = _ask(client, tools=[WEATHER], seed=seed).choices[0].message
        for call in message.tool_calls or []:
            assert isinstance(json.loads(call.function.arguments), dict)


def test_a_conversation_with_tool_results_goes_on(client):
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ]
    # tool_choice "auto" (the default with tools): max_tokens must hold the shortest call (issue 56: else a 400)
    r = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=96, extra_body=FAST)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "extra_body": {"reasoning": True}}, "reasoning"),
        ({"tools": [WEATHER], "tool_choice": "required", "max_tokens": 3}, "max_tokens"),
        ({"tools": [WEATHER], "tool_choice": "required", "stop": ["}"]}, "stop"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "string", "pattern": "\\1"}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools.0.function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"},
            "tools.0.function.name",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], **extra)
    assert e.value.body["param"] == param, e.value.body


@pytest.mark.parametrize("calls", [True, False])
def test_auto_is_the_models_choice_between_a_call_and_text(model_dir, calls):
    """tool_choice "auto": one Score call reads the likeliest first token; a call's opening makes the answer
    a call by construction, anything else text. The score is given here (a random model would rarely open
    a call), every other model call is answered by the model."""
    from helpers import load_quiet

    import dgemma
    from dgemma.generation.choose import Auto, ToolCall
    from dgemma.generation.engine import MODEL_CALLS, DoneEvent, ScoreCall, Scores, answer
    from dgemma.generation.loop import GenerationResult
    from dgemma.runtime.runner import as_runner
    from dgemma.tool_calls import CALL_OPEN

    runner, tok = as_runner(load_quiet(model_dir)), dgemma.Tokenizer.from_dir(model_dir)
    opening = tok.encode(CALL_OPEN, add_special_tokens=False)[0]
    first = opening if calls else (opening + 1) % runner.text_config.vocab_size
    prompt = tok.encode("Weather in Paris?")
    task = Auto(prompt, [WEATHER], tok, None, dgemma.SamplingParams(seed=0, **FAST)).check(runner.model)
    program = task.program(runner.model, runner.canvas_stats).steps
    reply, result = None, None
    while result is None:
        item = program.send(reply)
        if isinstance(item, ScoreCall):
            reply = Scores([], top=[[[(first, -0.1)]]])
        elif isinstance(item, DoneEvent):
            result = item.result
        else:
            reply = answer(runner, item) if isinstance(item, MODEL_CALLS) else None
    if calls:
        assert isinstance(result, ToolCall) and result.name == "get_weather"
        jsonschema.validate(result.arguments, WEATHER["function"]["parameters"])
    else:
        assert isinstance(result, GenerationResult) and result.tokens[0]


def test_auto_on_the_server_and_in_the_library_agree(client, model_dir):
    """The server's tool_choice "auto" (default with tools) and `dgemma.tool_call(name="auto")` run the same
    program: the same answer for the same seed (here text: the random model does not open a call)."""
    from helpers import load_quiet

    import dgemma
    from dgemma.checkpoints.tokenizer import Tokenizer
    from dgemma.generation.choose import ToolCall

    tok = Tokenizer.from_dir(model_dir)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    prompt, _ = dgemma.chat_prompt(tok, load_quiet(model_dir).config, messages, tools=[WEATHER])
    out = dgemma.tool_call(load_quiet(model_dir), prompt, [WEATHER], tokenizer=tok, name="auto", seed=4, **FAST)
    served = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], seed=4, extra_body=FAST)
    message = served.choices[0].message
    if isinstance(out, ToolCall):
        assert message.tool_calls[0].function.name == out.name
    else:
        assert message.content == out.text[0] and not message.tool_calls

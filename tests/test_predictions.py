"""Predicted outputs (issue 58): a prediction's tokens seed the canvas. On the shipped Sudoku model, whose
answers are known: a right prediction ends a canvas in the two steps the stop rule needs, pins win over
it, a prediction the model mostly disagrees with is dropped after one step, and the counts are OpenAI's.
Refused where it cannot apply, by the library (RequestError) and the server (a 400 naming `prediction`);
the other dialects do not know the field. Hostile predictions are refused or cut, never crash."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import httpx
import pytest
import torch

from dgemma.generation.engine import drive
from dgemma.generation.prediction import check_prediction, misled_rows, prediction_counts, seeded_start
from dgemma.generation.programs import Generate, generate
from dgemma.generation.sampling import RequestError, SamplingParams
from dgemma.runtime.runner import as_runner
from dgemma.tasks import sudoku

CHAT = "/v1/chat/completions"
FAST = {"max_denoising_steps": 3, "seed": 0}


@pytest.fixture(scope="module")
def solver() -> SimpleNamespace:
    """The shipped Sudoku model and its tokenizer, with six puzzles: their prompts, pins and solutions."""
    model, tok = sudoku.load_model()
    puzzles = [sudoku.generate(seed) for seed in range(6)]
    pins = torch.tensor([[-1 if t is None else t for t in sudoku.template(tok, p.puzzle)] for p in puzzles])
    prompts = [sudoku.prompt_ids(tok, p.puzzle) for p in puzzles]
    blanks = [p.puzzle.count(sudoku.BLANK) for p in puzzles]
    return SimpleNamespace(model=model, tok=tok, puzzles=puzzles, pins=pins, prompts=prompts, blanks=blanks)


def _solve(s: SimpleNamespace, grids: list[str] | None):
    """The puzzles solved in one canvas with `grids` as the prediction: the result, and which were solved."""
    prediction = None if grids is None else [sudoku.solution_ids(s.tok, g) for g in grids]
    r = generate(s.model, s.prompts, pins=s.pins, prediction=prediction, stop_token_ids=[], seed=0)
    grids = [sudoku.decode_grid(s.tok, t) for t in r.tokens]
    return r, [sudoku.is_solution(g, p.puzzle) for g, p in zip(grids, s.puzzles, strict=True)]


def _wrong(solution: str, puzzle: str, k: int, rng: random.Random) -> str:
    """`solution` with `k` of the puzzle's blank cells set to another digit."""
    cells = list(solution)
    for i in rng.sample([i for i, ch in enumerate(puzzle) if ch == sudoku.BLANK], k):
        cells[i] = rng.choice([d for d in sudoku.DIGITS if d != cells[i]])
    return "".join(cells)


# -- the seeded canvas --------------------------------------------------------------------------------


def test_a_right_prediction_ends_the_canvas_in_two_steps(solver):
    plain, _ = _solve(solver, None)
    seeded, solved = _solve(solver, [p.solution for p in solver.puzzles])
    assert all(solved) and [s[0] for s in seeded.stats.steps_per_canvas] == [2] * len(solved)
    assert 2 * sum(s[0] for s in seeded.stats.steps_per_canvas) < sum(s[0] for s in plain.stats.steps_per_canvas)
    assert seeded.accepted_prediction_tokens == solver.blanks
    assert seeded.rejected_prediction_tokens == [0] * len(solved)
    assert plain.accepted_prediction_tokens is None  # no prediction, no counts


def test_pins_win_and_only_placed_tokens_are_counted(solver):
    """Every clue cell predicted wrong: the clues stay (pinned), and they are neither accepted nor rejected."""
    grids = [
        "".join(str(int(s) % 9 + 1) if c != sudoku.BLANK else s for c, s in zip(p.puzzle, p.solution, strict=True))
        for p in solver.puzzles
    ]
    r, solved = _solve(solver, grids)
    assert all(solved)  # a solution keeps the puzzle's clues
    assert r.accepted_prediction_tokens == solver.blanks and r.rejected_prediction_tokens == [0] * len(solved)


def test_a_few_wrong_cells_are_fixed_and_counted_as_rejected(solver):
    rng = random.Random(0)
    r, solved = _solve(solver, [_wrong(p.solution, p.puzzle, 5, rng) for p in solver.puzzles])
    assert all(solved) and r.rejected_prediction_tokens == [5] * len(solved)
    assert [a + 5 for a in r.accepted_prediction_tokens] == solver.blanks


def _second_canvas(s: SimpleNamespace, grids: list[str]) -> torch.Tensor:
    """The canvas the second denoising step reads (what the first step left), [B, 81]."""
    prediction = [sudoku.solution_ids(s.tok, g) for g in grids]
    task = Generate(s.prompts, SamplingParams(stop_token_ids=[], seed=0), s.pins, prediction=prediction)
    task, runner, seen = task.check(s.model), as_runner(s.model), []
    for _ in drive(runner, task.program(s.model, runner.canvas_stats), observe=lambda call: seen.append(call.tokens)):
        if len(seen) == 2:
            return seen[1]
    raise AssertionError("fewer than two steps")


def test_a_prediction_the_model_disagrees_with_is_dropped_after_one_step(solver):
    """A random valid grid (wrong almost everywhere, and self-consistent) starts again from noise after the
    first step; a prediction with a few wrong cells goes on from what the model kept of it."""
    rng = random.Random(1)
    blank = solver.pins < 0
    for grids, kept in (([sudoku.random_solution(rng) for _ in solver.puzzles], False),
                        ([_wrong(p.solution, p.puzzle, 5, rng) for p in solver.puzzles], True)):  # fmt: skip
        ids = torch.tensor([sudoku.solution_ids(solver.tok, g) for g in grids])
        share = ((_second_canvas(solver, grids) == ids) & blank).sum(-1) / blank.sum(-1)
        assert bool((share > 0.6).all()) if kept else bool((share < 0.4).all()), share


def test_where_a_seeded_canvas_starts_and_what_misleads_and_what_counts():
    assert [seeded_start(48, share) for share in (0, 0.5, 1)] == [48, 36, 24]  # in proportion to what is seeded
    assert seeded_start(12, 1) == 6 and seeded_start(2, 1) == 2 and seeded_start(1, 1) == 1  # the stop rule's 2
    seeds = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [-1, -1, -1, -1]])
    argmax = torch.tensor([[5, 6, 0, 0], [5, 0, 0, 0], [1, 2, 3, 4]])
    assert misled_rows(argmax, seeds).tolist() == [False, True, False]  # half kept is not misled
    prediction = torch.tensor([[1, 2, 3, 4], [1, 2, -1, -1]])
    pins = torch.tensor([[9, -1, -1, -1, -1], [-1, -1, -1, -1, -1]])
    # row 0: position 0 pinned (not counted), 1 and 2 kept, 3 past the answer's end; row 1: 1 kept of 2
    assert prediction_counts(prediction, pins, [[9, 2, 3], [7, 2, 5, 5, 5]]) == ([2, 1], [1, 1])


# -- the library's checks -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prediction, match",
    [
        (5, "a list of token ids"),
        ({"type": "content"}, "a list of token ids"),
        ("text", "needs a tokenizer"),
        ([1, "a"], "a list of token ids"),
        ([1, [2, [3]]], "a list of token ids"),
        ([[1, None]], "a list of token ids"),
        ([[1, 2], 3], "2 rows for a batch of 1"),
        ([True, False], "a list of token ids"),
        ([1.0], "a list of token ids"),
        ([-1], "outside the vocabulary"),
        ([15], "outside the vocabulary"),
        ([[1], [2], [3]], "3 rows for a batch of 1"),
        (torch.tensor([[1, 2], [3, 4]]), "2 rows for a batch of 1"),
    ],
)
def test_hostile_predictions_are_refused_by_name(solver, prediction, match):
    with pytest.raises(RequestError, match=match) as e:
        generate(solver.model, solver.prompts[0], prediction=prediction, max_new_tokens=8)
    assert e.value.param == "prediction"


def test_what_does_not_fit_is_dropped_unread(solver):
    huge = sudoku.solution_ids(solver.tok, solver.puzzles[0].solution) + ["junk"] * 10**6  # never read
    assert check_prediction(huge, 1, 81, 15) == [huge[:81]]
    r = generate(solver.model, solver.prompts[0], pins=solver.pins[:1], prediction=huge, stop_token_ids=[], seed=0)
    assert r.accepted_prediction_tokens[0] + r.rejected_prediction_tokens[0] == solver.blanks[0]
    short = generate(solver.model, solver.prompts[0], prediction=huge[:3], max_new_tokens=8, seed=0)
    assert short.accepted_prediction_tokens[0] + short.rejected_prediction_tokens[0] == 3


def test_text_and_tensor_predictions_and_exact_mode(solver):
    one = {"pins": solver.pins[:1], "tokenizer": solver.tok, "seed": 0}
    by_text = generate(solver.model, solver.prompts[0], prediction=solver.puzzles[0].solution, **one)
    ids = torch.tensor(sudoku.solution_ids(solver.tok, solver.puzzles[0].solution))
    by_tensor = generate(solver.model, solver.prompts[0], prediction=ids, **one)
    for r in (by_text, by_tensor):
        assert r.accepted_prediction_tokens == solver.blanks[:1] and r.stats.steps_per_canvas == [[2]]
    with pytest.raises(RequestError, match="mode 'exact' has no prediction") as e:
        generate(solver.model, solver.prompts[0], prediction=[1, 2], mode="exact", max_new_tokens=8)
    assert e.value.param == "prediction"


# -- the server -----------------------------------------------------------------------------------------


def _post(server, path: str, body: dict) -> httpx.Response:
    from live_server import KEY

    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    return httpx.post(server.url + path, content=json.dumps(body), headers=headers, timeout=120)  # \ud800 escaped


def _user(text: str = "hi") -> list[dict]:
    return [{"role": "user", "content": text}]


def _details(usage: dict) -> dict:
    return usage["completion_tokens_details"]


def test_chat_and_completions_report_the_prediction_tokens(server):
    predicted = {"type": "content", "content": "def f(x):\n    return x + 1\n"}
    r = _post(server, CHAT, {"messages": _user(), "prediction": predicted, "max_tokens": 16, **FAST})
    assert r.status_code == 200, r.text
    details = _details(r.json()["usage"])
    placed = details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"]
    assert 0 < placed <= 16
    parts = {"type": "content", "content": [{"type": "text", "text": "def f(x):"}, {"type": "text", "text": " pass"}]}
    body = {"prompt": "x = ", "prediction": parts, "max_tokens": 8, "n": 2, **FAST}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert sum(_details(r.json()["usage"]).values()) <= 16  # both choices' counts
    assert "completion_tokens_details" not in _post(server, CHAT, {"messages": _user(), **FAST}).json()["usage"]
    empty = {"type": "content", "content": ""}  # seeds nothing, and says so
    r = _post(server, CHAT, {"messages": _user(), "prediction": empty, "max_tokens": 8, **FAST})
    assert _details(r.json()["usage"]) == {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}


def test_streamed_usage_reports_them_too(server):
    from live_server import KEY

    body = {"messages": _user(), "prediction": {"type": "content", "content": "hello there"}, "max_tokens": 8}
    body |= {"stream": True, "stream_options": {"include_usage": True}, **FAST}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server.url + CHAT, json=body, headers=headers, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    usage = json.loads(lines[-1][6:])["usage"]
    assert set(_details(usage)) == {"accepted_prediction_tokens", "rejected_prediction_tokens"}


PREDICTED = {"type": "content", "content": "something"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "path, extra",
    [
        (CHAT, {"tools": [TOOL]}),
        (CHAT, {"tools": [TOOL], "tool_choice": "required"}),
        (CHAT, {"response_format": {"type": "json_object"}}),
        (CHAT, {"choices": ["yes", "no"]}),
        (CHAT, {"mode": "exact"}),
        ("/v1/completions", {"suffix": "return x"}),
        ("/v1/completions", {"response_format": {"type": "json_object"}}),
        ("/v1/completions", {"mode": "exact"}),
        (CHAT, {"prediction": {"type": "text", "content": "x"}}),
        (CHAT, {"prediction": {"type": "content", "content": 5}}),
        (CHAT, {"prediction": {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}}),
        (CHAT, {"prediction": {"type": "content", "content": [{"type": "text", "text": "a", "extra": 1}]}}),
        (CHAT, {"prediction": {"type": "content", "content": [[["deep"]]]}}),
        (CHAT, {"prediction": {"type": "content", "content": [{"type": "text", "text": "a"}] * 257}}),
        (CHAT, {"prediction": {"type": "content"}}),
        (CHAT, {"prediction": "just text"}),
        (CHAT, {"prediction": {"type": "content", "content": "\ud800"}}),
        (CHAT, {"prediction": {"type": "content", "content": "x" * 10**6}}),
        ("/v1/completions", {"prediction": {"type": "content", "content": [1, 2, 3]}}),
    ],
)
def test_the_server_refuses_what_a_prediction_cannot_seed(server, path, extra):
    body = {"messages": _user()} if path == CHAT else {"prompt": "x = "}
    r = _post(server, path, {**body, "prediction": PREDICTED, "max_tokens": 8, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("prediction"), r.json()


GOES_WITH = [{"tools": [TOOL], "tool_choice": "none"}, {"n": 2}, {"logprobs": True, "top_logprobs": 2}]


@pytest.mark.parametrize("extra", [*GOES_WITH, {"stop": ["\n"]}, {"reasoning": True}, {"temperature": 0}])
def test_what_a_prediction_goes_with(server, extra):
    r = _post(server, CHAT, {"messages": _user(), "prediction": PREDICTED, "max_tokens": 8, **FAST, **extra})
    assert r.status_code == 200 and "completion_tokens_details" in r.json()["usage"], r.text


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/responses", {"input": "hi"}),
        ("/v1/messages", {"model": "tiny", "max_tokens": 8, "messages": _user()}),
        ("/api/chat", {"model": "tiny", "messages": _user()}),
        ("/api/generate", {"model": "tiny", "prompt": "x"}),
        ("/completion", {"prompt": "x"}),
        ("/infill", {"input_prefix": "x", "input_suffix": "y"}),
    ],
)
def test_the_other_dialects_do_not_know_the_field(server, path, body):
    r = _post(server, path, {**body, "prediction": PREDICTED})
    assert r.status_code == 400 and "prediction" in r.text, r.text


def test_the_openai_client_sends_a_prediction(server):
    openai = pytest.importorskip("openai")
    from live_server import KEY

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model="tiny", messages=_user(), prediction={"type": "content", "content": "def f(x): return x"},
        max_tokens=8, seed=0, extra_body={"max_denoising_steps": 3},
    )  # fmt: skip
    details = r.usage.completion_tokens_details
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
    with pytest.raises(openai.BadRequestError, match="prediction"):
        client.chat.completions.create(
            model="tiny", messages=_user(), prediction={"type": "content", "content": "x"}, tools=[TOOL], max_tokens=8
        )

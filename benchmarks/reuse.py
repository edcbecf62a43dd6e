"""Never pay twice: the prefix cache and predicted outputs, side by side in one run on the shipped models.

- agent loop (shapes model, context 4096): a system prompt of ~1,500 tokens with two tools, then `--turns`
  turns, each adding the model's answer, a tool result and a user line; per turn the time to first token
  (submit -> first final tokens, streamed as a server streams: early commit on) with and without the cache,
  and the positions the encoder computed in all;
- editor loop (code model; its context raised to 4096 for the run, which only the timing reads): a file
  prefix of ~2,000 tokens and `--requests` infill requests whose prefixes differ in the last line; the time
  to the middle (an infill's answer comes whole) with and without the cache, and with blocks of 1 (a
  token-granular match, what a radix tree finds), 16 (the default) and 64 tokens;
- predictions (benchmarks/reuse_predict.py): Sudoku with the solution, the solution with 10 cells wrong and a
  random grid as the prediction, against none (steps per puzzle, solve rate); a code edit whose prediction
  is the original file (forwards per token);
- memory: the agent loop again with a store bounded at a quarter of what it keeps: the most bytes the store
  ever held against its bound, and the process's peak resident memory.

Prints a table, then one JSON line. `--quick` runs a smaller version (for a smoke test).

    python benchmarks/reuse.py [--turns 10] [--requests 20] [--puzzles 200] [--quick]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from pathlib import Path

from _measure import print_flat, until_done

import dgemma
from dgemma.checkpoints.tokenizer import Tokenizer, chat_prompt
from dgemma.generation.engine import Engine, EngineRequest
from dgemma.generation.programs import Generate, Infill
from dgemma.generation.sampling import SamplingParams
from dgemma.model.kv_cache import PrefixCache
from dgemma.tasks import code, shapes

CONTEXT = 4096
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_shape",
            "description": "Look up a shape in the catalogue by its name and return its sides and colour.",
            "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "measure",
            "description": "Measure the area of a shape given its sides, in square units.",
            "parameters": {"type": "object", "properties": {"sides": {"type": "integer"}}, "required": ["sides"]},
        },
    },
]


def load(path: Path):
    return dgemma.accelerate(dgemma.load(path, dtype="fp32")), Tokenizer.from_dir(path)


def _submit(engine: Engine, task) -> tuple[float, object]:
    task = task.check(engine.model, CONTEXT)
    t0 = time.perf_counter()
    request = engine.submit(EngineRequest(task.program(engine.model, engine.runner.canvas_stats)))
    first, _, result = until_done(request, t0)
    return first, result


# -- the agent loop ---------------------------------------------------------------------------------------


def system_prompt(tok, tokens: int) -> str:
    """Rules for the agent, about `tokens` long with this tokenizer."""
    lines, k = [], 0
    while len(tok.encode(" ".join(lines), add_special_tokens=False)) < tokens:
        lines.append(f"Rule {k}: a shape with {k % 9 + 3} sides is drawn in colour {k % 7} before step {k}.")
        k += 1
    return " ".join(lines)


def agent_loop(runner, tok, turns: int, store: PrefixCache | None) -> dict:
    """TTFT per turn and the encoder's positions, the conversation growing by a tool result and a user line."""
    params = SamplingParams(max_new_tokens=runner.model.config.canvas_length, seed=0, early_commit=True)
    messages = [{"role": "system", "content": system_prompt(tok, 1500)}, {"role": "user", "content": "Start."}]
    ttft, prompts = [], []
    with Engine(runner, prefix_cache=store) as engine:
        for turn in range(turns):
            ids, _ = chat_prompt(tok, runner.model.config, messages, tools=TOOLS)
            first, result = _submit(engine, Generate([ids], params))
            ttft.append(first)
            prompts.append(len(ids))
            answer = tok.decode(result.tokens[0])
            call = {"id": f"c{turn}", "type": "function", "function": {"name": "measure", "arguments": "{}"}}
            messages.append({"role": "assistant", "content": answer, "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": f"c{turn}", "content": f"area {turn * 3 + 4}"})
            messages.append({"role": "user", "content": f"Now the shape with {turn + 4} sides."})
        encoded = engine.stats.encoded_tokens
    return {"ttft_s": ttft, "prompt_tokens": prompts, "encoded_tokens": encoded}


# -- the editor loop --------------------------------------------------------------------------------------


def source_file(tok, tokens: int) -> str:
    """Python source about `tokens` long with this tokenizer."""
    lines, k = [], 0
    while len(tok.encode("\n".join(lines), add_special_tokens=False)) < tokens:
        lines += [f"def step_{k}(values, scale={k % 5 + 1}):", f"    return [v * scale + {k} for v in values]", ""]
        k += 1
    return "\n".join(lines)


def editor_loop(runner, tok, requests: int, store: PrefixCache | None) -> dict:
    """Time to the middle of each infill: the same file prefix, the last line typed differently each time."""
    prefix = tok.encode(source_file(tok, 2000))
    suffix = tok.encode("\n\nprint(total)\n", add_special_tokens=False)
    params = SamplingParams(seed=0)
    times = []
    with Engine(runner, prefix_cache=store) as engine:
        for k in range(requests):
            line = tok.encode(f"\ntotal = step_{k}([1, 2, {k}])", add_special_tokens=False)
            took, _ = _submit(engine, Infill(prefix + line, suffix, 16, params))
            times.append(took)
        encoded = engine.stats.encoded_tokens
    return {"time_s": times, "prefix_tokens": len(prefix), "encoded_tokens": encoded}


# -- the run ---------------------------------------------------------------------------------------------


def _store(runner, block_size: int = 16, max_bytes: int = 1 << 30) -> PrefixCache:
    return PrefixCache.for_model(runner.model, max_bytes, block_size)


def _median_after_first(times: list[float]) -> float:
    return statistics.median(times[1:] if len(times) > 1 else times)


def measure_agent(turns: int) -> dict:
    runner, tok = load(shapes.MODEL_DIR)
    agent_loop(runner, tok, 2, None)  # warm up
    cold = agent_loop(runner, tok, turns, None)
    store = _store(runner)
    warm = agent_loop(runner, tok, turns, store)
    bounded = _store(runner, max_bytes=max(store.nbytes // 4, 1))  # a quarter of what the loop kept
    agent_loop(runner, tok, turns, bounded)
    return {
        "agent_turn_last_ttft_s_cold": cold["ttft_s"][-1],
        "agent_turn_last_ttft_s_cached": warm["ttft_s"][-1],
        "agent_ttft_speedup_last": cold["ttft_s"][-1] / warm["ttft_s"][-1],
        "agent_prompt_tokens_last": cold["prompt_tokens"][-1],
        "agent_prompt_tokens_all": sum(cold["prompt_tokens"]),
        "agent_encoded_tokens_cold": cold["encoded_tokens"],
        "agent_encoded_tokens_cached": warm["encoded_tokens"],
        "agent_store_bytes": store.nbytes,
        "bounded_store_max_bytes": bounded.max_bytes,
        "bounded_store_most_held": bounded.stats.peak_bytes,
        "bounded_store_evictions": bounded.stats.evictions,
    }


def measure_editor(requests: int) -> dict:
    runner, tok = load(code.MODEL_DIR)
    editor_loop(runner, tok, 2, None)  # warm up
    cold = editor_loop(runner, tok, requests, None)
    out = {"editor_prefix_tokens": cold["prefix_tokens"], "editor_time_s_cold": _median_after_first(cold["time_s"])}
    out["editor_encoded_tokens_cold"] = cold["encoded_tokens"]
    for bs in (1, 16, 64):
        warm = editor_loop(runner, tok, requests, _store(runner, bs))
        out[f"editor_time_s_block{bs}"] = _median_after_first(warm["time_s"])
        out[f"editor_encoded_tokens_block{bs}"] = warm["encoded_tokens"]
    out["editor_speedup"] = out["editor_time_s_cold"] / out["editor_time_s_block16"]
    return out


def measure_predictions(puzzles: int) -> dict:
    from reuse_predict import code_edit_prediction, sudoku_predictions

    return {**sudoku_predictions(puzzles, 0), **code_edit_prediction()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--puzzles", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="3 turns, 4 requests, 4 puzzles")
    args = ap.parse_args(argv)
    if args.quick:
        args.turns, args.requests, args.puzzles = 3, 4, 4
    out = {**measure_agent(args.turns), **measure_editor(args.requests), **measure_predictions(args.puzzles)}
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print_flat("reuse", out)


if __name__ == "__main__":
    main()

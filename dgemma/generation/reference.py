"""Exact mode: transformers' `generate`, operation for operation and random draw for random draw, as a
program of model calls (dgemma/generation/engine.py) of its own.

    encode(prompt)
    for each canvas:
        canvas = uniform random tokens (torch's global generator, as the reference draws)
        for step = N, ..., 1:
            processed = denoise(canvas, cache, soft embedding of the last processed logits) / temperature
            the entropy-bound transition (sampling.reference_transition), every row, every step
            a row stops once its argmax canvas is stable and confident (it then keeps its state)
        commit the argmax canvas (pad after a stop token) through encode

Every row is denoised until all have stopped, and the seed seeds the global generator. Its driver answers
its calls on the reference modules (`Runner.reference`), so its numbers are transformers'; the fast loop
(dgemma/generation/loop.py) computes the same distribution with less work and has none of this.
"""

from __future__ import annotations

import math

import torch

from ..model.kv_cache import KVCache
from ..model.model import DiffusionGemma
from .engine import DenoiseCall, DoneEvent, DraftEvent, EncodeCall
from .loop import Output, sequence_canvas
from .sampling import (
    SamplingParams,
    StableAndConfident,
    entropy_reference,
    random_tokens,
    reference_transition,
    temperature,
)


def reference_program(
    model: DiffusionGemma, cache: KVCache, p: SamplingParams, prompt: EncodeCall, out: Output, step_stats: bool = False
):
    """The reference's canvases after `prompt` (its encode, asked for first), with `p` resolved; `out`
    keeps what is returned. Ends with a DoneEvent holding the GenerationResult."""
    if p.seed is not None:
        torch.manual_seed(p.seed)  # the reference draws from the global generator
    b, c, device = cache.batch_size, model.config.canvas_length, model.device
    n = p.max_denoising_steps
    temperatures = {s: temperature(s, n, p.t_min, p.t_max, device) for s in range(1, n + 1)}
    stop = torch.tensor(p.stop_token_ids or [-1], device=device)
    yield prompt
    sequences, finished = [], torch.zeros(b, dtype=torch.bool, device=device)
    for k in range(math.ceil(p.max_new_tokens / c)):
        argmax, steps, done = yield from _canvas(model, cache, p, temperatures, k, finished, out, step_stats)
        out.end_canvas(steps, done | finished)
        seq, hit_stop = sequence_canvas(argmax, stop, out.pad_id, finished)
        sequences.append(seq)
        for r in range(b):
            if not out.finished(r):
                event = out.take(r, argmax[r].tolist(), k, early=False)
                if event:
                    yield event
        finished = finished | hit_stop
        if all(out.finished(r) for r in range(b)) or k == math.ceil(p.max_new_tokens / c) - 1:
            break
        yield EncodeCall(seq, cache, is_generated=True)
    yield DoneEvent(out.result(torch.cat(sequences, dim=1)))


def _canvas(model: DiffusionGemma, cache, p, temperatures, k: int, finished, out: Output, step_stats: bool):
    """One canvas, denoised step by step as the reference does: its argmax, steps run per row, and which
    rows stopped."""
    b, c, device = cache.batch_size, model.config.canvas_length, model.device
    tokens = random_tokens((b, c), model.text_config.vocab_size, device, None)
    argmax, processed = tokens, None
    done = torch.zeros(b, dtype=torch.bool, device=device)  # the reference denoises every row
    steps = torch.zeros(b, dtype=torch.long, device=device)
    stopper = StableAndConfident(p.stability_threshold, p.confidence_threshold, None, device)
    for n, step in enumerate(range(p.max_denoising_steps, 0, -1), 1):
        counted = (~(done | finished)).long()
        out.passes += counted
        steps += counted
        # the reference embeds its processed logits inside its forward; the same function, here
        sc = None if processed is None else model.soft_embedding(processed)
        logits = yield DenoiseCall(tokens, cache, self_conditioning=sc)
        now = logits / temperatures[step]
        t = reference_transition(now, tokens, p.entropy_bound)
        new_tokens, new_argmax, entropy = t.tokens, t.argmax, t.entropy
        if done.any():  # stopped rows keep their state
            new_argmax = torch.where(done[:, None], argmax, new_argmax)
            new_tokens = torch.where(done[:, None], tokens, new_tokens)
            now = torch.where(done[:, None, None], processed, now)
            entropy = entropy_reference(now)
        done |= stopper(new_argmax, entropy)
        stats = (entropy.float(), torch.softmax(now.float(), -1).amax(-1)) if step_stats else (None, None)
        processed, tokens, argmax = now.to(model.dtype), new_tokens, new_argmax
        yield DraftEvent(k, n, argmax, t.accepted, *stats)
        if bool(done.all()):
            break
    return argmax, steps, done

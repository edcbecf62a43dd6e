"""The batching engine against `dgemma.generate`: requests denoised together get what each gets alone.

The engine drives each request's own canvas loop and batches only the model calls (caches of different
lengths stacked, prefixes left-padded and masked). A request's logits then differ from its solo run by
rounding, not bits (up to 5e-6 on the first step here), so its token ids can differ only where a draw,
an acceptance or the stop rule sits on a rounding boundary. Token ids equal is what is asserted: it is the
feature, and it holds with margin for canvases of a few steps: none of 480 requests differed (120 batches
of `requests(seed)`, seeds 0-119, on this tiny MoE and on a dense one). Longer canvases would not do on
random weights: self-conditioning feeds each step's logits into the next, and on such a model the
difference grows (x1.6 per step on the dense one, 4e-6 -> 0.7 in 20 steps; a routing flip on the MoE
one), so with one 48-step request per batch 19 of 480 (MoE) and 120 of 480 (dense) requests differed.

Fast mode gives each request its own torch.Generator, so its draws are its own whatever else is in the
batch. Exact mode draws from the global generator (as transformers' `generate` does): see the last test.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import generation_request, load_quiet

from dgemma.generation.engine import (
    DoneEvent,
    DraftEvent,
    Engine,
    EngineRequest,
    Program,
    RequestTimeout,
    WorkCall,
)
from dgemma.generation.programs import generate

WAIT = 120  # seconds to wait for an event: a generous bound for a loaded 2-core machine


@pytest.fixture(scope="module")
def model(moe_ckpt):
    return load_quiet(moe_ckpt[0], dtype="fp32")


@pytest.fixture()
def engine(model):
    engine = Engine(model, max_batch=8)
    yield engine
    engine.close()


def requests(seed: int) -> list[tuple[list[int], dict]]:
    """Four fast-mode requests with mixed prompt lengths (one beyond the sliding window of 16), lengths,
    step counts, temperatures, samplers and stop tokens, so that they leave the batch at different steps."""
    g = torch.Generator().manual_seed(seed)

    def prompt(n: int) -> list[int]:
        return torch.randint(3, 512, (n,), generator=g).tolist()

    return [
        (prompt(3), dict(seed=4 * seed, max_new_tokens=8, max_denoising_steps=4)),
        (prompt(21), dict(seed=4 * seed + 1, max_new_tokens=19, max_denoising_steps=5, t_min=0.3, t_max=1.0)),
        # one token in 9 stops the row: it ends in its first or second canvas, or runs to its length
        (
            prompt(9),
            dict(seed=4 * seed + 2, max_new_tokens=16, max_denoising_steps=3, stop_token_ids=list(range(3, 60))),
        ),
        (
            prompt(5),
            dict(
                seed=4 * seed + 3,
                max_new_tokens=12,
                max_denoising_steps=6,
                sampler="confidence",
                confidence=0.2,
                early_commit=True,
            ),
        ),
    ]


def collect(request: EngineRequest):
    """The request's GenerationResult, or the exception it ended with (other events are passed over)."""
    while True:
        event = request.events.get(timeout=WAIT)
        if isinstance(event, DoneEvent):
            return event.result
        if isinstance(event, Exception):
            return event


def solo(model, prompt, params):
    result = generate(model, prompt, **params)
    return result.tokens[0], result.finish_reasons[0]


def test_batched_requests_get_the_tokens_they_get_alone(model, engine):
    cases = requests(seed=0)
    alone = [solo(model, prompt, params) for prompt, params in cases]
    submitted = [engine.submit(generation_request(engine.runner, prompt, dict(params))) for prompt, params in cases]
    batched = [collect(r) for r in submitted]
    assert [(r.tokens[0], r.finish_reasons[0]) for r in batched] == alone
    assert engine.stats.row_steps > engine.stats.denoising_steps  # they did share forward passes
    assert {reason for _, reason in alone} == {"stop", "length"}  # and left the batch at different points


def test_a_cancelled_and_a_timed_out_request_leave_the_others_unchanged(model, engine):
    cases = requests(seed=1)
    alone = [solo(model, prompt, params) for prompt, params in cases]
    long = dict(seed=99, max_new_tokens=160, max_denoising_steps=8)  # far longer than the others
    doomed = [generation_request(engine.runner, [7, 8, 9], dict(long), want_drafts=True) for _ in range(2)]
    for request in doomed:
        engine.submit(request)
    submitted = [engine.submit(generation_request(engine.runner, prompt, dict(params))) for prompt, params in cases]
    for request in doomed:  # both have taken part in a batched step before they go
        assert isinstance(request.events.get(timeout=WAIT), DraftEvent)
    doomed[0].cancel()
    doomed[1].timeout = 0.0  # past its deadline at the next step
    assert [(r.tokens[0], r.finish_reasons[0]) for r in (collect(r) for r in submitted)] == alone
    assert isinstance(collect(doomed[1]), RequestTimeout)
    deadline = time.monotonic() + WAIT
    while engine.active and time.monotonic() < deadline:  # the cancelled one is dropped at a step
        time.sleep(0.01)
    assert engine.active == 0 and engine.stats.requests_cancelled == 1
    left = []
    while not doomed[0].events.empty():
        left.append(doomed[0].events.get_nowait())
    assert all(isinstance(e, DraftEvent) for e in left)  # dropped: no result, no error


def test_exact_requests_batched_together_get_their_solo_tokens(model, engine):
    """Exact mode draws from the global generator, seeded when its loop starts (as transformers' `generate`
    does). In one engine thread, two exact requests would reseed and share that stream, and a seedless
    fast request draws from it too; the engine keeps one generator state per exact request and swaps it in
    around the request's own work, so each sees the draws it sees alone. Exact mode draws at every position
    each step, so a rounding-flipped acceptance would not shift its draws either."""
    exact = [
        ([5, 6, 7, 8], dict(mode="exact", seed=3, max_new_tokens=20, max_denoising_steps=5)),
        (list(range(20, 41)), dict(mode="exact", seed=4, max_new_tokens=16, max_denoising_steps=4, t_max=1.0)),
    ]
    seeded, seedless = requests(seed=2)[:2]
    cases = [*exact, seeded]
    alone = [solo(model, prompt, params) for prompt, params in cases]
    submitted = [engine.submit(generation_request(engine.runner, prompt, dict(params))) for prompt, params in cases]
    other = engine.submit(generation_request(engine.runner, seedless[0], {**seedless[1], "seed": None}))
    assert [(r.tokens[0], r.finish_reasons[0]) for r in (collect(r) for r in submitted)] == alone
    assert not isinstance(collect(other), Exception)
    assert engine.stats.row_steps > engine.stats.denoising_steps


def test_an_accelerated_engine_answers_exact_requests_on_the_reference_modules(model, monkeypatch):
    """On a fast runner, exact requests are denoised one by one on the reference modules: the bare model's
    tokens and committed canvases bit for bit, next to fast requests batched on the fast modules (here
    forced onto the dense expert path, whose rounding differs from the reference loop)."""
    import dgemma
    import dgemma.runtime.fast as fast

    monkeypatch.setattr(fast, "DENSE_EXPERTS_MAX_EXTRA", 10**15)
    exact = [
        ([5, 6, 7, 8], dict(mode="exact", seed=3, max_new_tokens=20, max_denoising_steps=5)),
        (list(range(20, 41)), dict(mode="exact", seed=4, max_new_tokens=16, max_denoising_steps=4)),
    ]
    alone = [generate(model, prompt, **params) for prompt, params in exact]
    runner = dgemma.accelerate(model)
    fast_calls = []
    for module in runner.fast.modules():
        if isinstance(module, fast.FastExperts):
            module.register_forward_hook(lambda *_: fast_calls.append(1))
    engine = Engine(runner, max_batch=8)
    try:
        served = [
            collect(engine.submit(generation_request(engine.runner, prompt, dict(params)))) for prompt, params in exact
        ]
        assert not fast_calls  # not one fast module ran for them
        submitted = [engine.submit(generation_request(engine.runner, prompt, dict(params))) for prompt, params in exact]
        others = [
            engine.submit(generation_request(engine.runner, prompt, dict(params)))
            for prompt, params in requests(seed=3)[:2]
        ]
        served += [collect(r) for r in submitted]
        assert all(not isinstance(collect(r), Exception) for r in others)
    finally:
        engine.close()
    for got, want in zip(served, alone + alone, strict=True):
        assert got.tokens == want.tokens and torch.equal(got.sequences, want.sequences)
    assert fast_calls  # the fast requests ran the fast modules


def test_fast_batches_reuse_one_logits_buffer_and_release_it_when_idle(model):
    """The engine answers its fast batches in one logits buffer (grown to the largest batch; on a CPU a
    fresh one is faulted in on every step) and holds none once no request is active."""
    from dgemma import Runner

    seen = []

    class Recording(Runner):
        def denoise(self, *args, out=None, **kwargs):
            seen.append(None if out is None else out.untyped_storage().data_ptr())
            return super().denoise(*args, out=out, **kwargs)

    engine = Engine(Recording(model, fast=True), max_batch=8)
    try:
        cases = requests(seed=2)
        alone = [solo(model, prompt, params) for prompt, params in cases]
        submitted = [engine.submit(generation_request(engine.runner, prompt, dict(params))) for prompt, params in cases]
        assert [(r.tokens[0], r.finish_reasons[0]) for r in map(collect, submitted)] == alone
        # every fast step got the buffer, and it was reused (it is regrown only when a batch outgrows it)
        assert seen and None not in seen and len(set(seen)) <= 4 < len(seen)
        deadline = time.monotonic() + WAIT
        while engine._logits.tensor is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine._logits.tensor is None
    finally:
        engine.close()


def test_requests_whose_clients_left_while_they_waited_are_never_prefilled(model, monkeypatch):
    """Issue 40: a waiting request that was cancelled, or whose deadline passed, is dropped before its prompt
    is encoded, so the next client does not wait behind work nobody will read."""
    engine = Engine(model, max_batch=1, max_queue=64)
    encoded: list[int] = []
    encode = engine.runner.encode

    def counted(ids, *args, **kwargs):
        encoded.append(ids.shape[-1])
        return encode(ids, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "encode", counted)
    try:
        busy = generation_request(
            engine.runner, [5] * 3, dict(seed=0, max_new_tokens=128, max_denoising_steps=8), want_drafts=True
        )
        engine.submit(busy)
        assert isinstance(busy.events.get(timeout=WAIT), DraftEvent)  # it holds the one batch slot
        left = [
            engine.submit(generation_request(engine.runner, [6] * 40, dict(seed=1, max_new_tokens=8))) for _ in range(6)
        ]
        late = engine.submit(generation_request(engine.runner, [7] * 41, dict(seed=2, max_new_tokens=8), timeout=0.0))
        for request in left:
            request.cancel()
        after = engine.submit(
            generation_request(engine.runner, [8] * 4, dict(seed=3, max_new_tokens=8, max_denoising_steps=2))
        )
        assert not isinstance(collect(after), Exception) and isinstance(collect(late), RequestTimeout)
        assert not isinstance(collect(busy), Exception)
    finally:
        engine.close()
    assert 40 not in encoded and 41 not in encoded and 4 in encoded  # only the requests someone reads
    assert engine.stats.requests_cancelled == 6


def test_the_prefill_work_waiting_is_bounded(model):
    """Prompt tokens waiting for their prefill are bounded: beyond `max_queued_tokens` a request is refused
    at once (a 429 on the server); a longer request alone still runs."""
    from dgemma.generation.engine import QueueFull

    engine = Engine(model, max_batch=1, max_queue=64, max_queued_tokens=100)
    try:
        busy = generation_request(
            engine.runner, [5] * 3, dict(seed=0, max_new_tokens=128, max_denoising_steps=8), want_drafts=True
        )
        engine.submit(busy)
        assert isinstance(busy.events.get(timeout=WAIT), DraftEvent)  # running: nothing waits yet
        first = engine.submit(generation_request(engine.runner, [6] * 60, dict(seed=1, max_new_tokens=8)))
        with pytest.raises(QueueFull, match="prompt tokens"):
            engine.submit(generation_request(engine.runner, [6] * 41, dict(seed=1, max_new_tokens=8)))
        second = engine.submit(generation_request(engine.runner, [6] * 40, dict(seed=1, max_new_tokens=8)))
        for request in (busy, first, second):
            assert not isinstance(collect(request), Exception)
        alone = engine.submit(
            generation_request(engine.runner, [6] * 150, dict(seed=1, max_new_tokens=8))
        )  # nothing else waits
        assert not isinstance(collect(alone), Exception)
    finally:
        engine.close()


def test_prompts_of_one_shape_share_an_encode_pass_and_get_their_own_tokens(model):
    """Requests whose prompts have the same length are encoded in one pass (an EncodeStack writes each row
    into its own cache), their commits too; each gets the tokens it gets alone. A bad prompt among them
    (an id outside the vocabulary) fails alone, and the others go on."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (12,), generator=g).tolist() for _ in range(4)]
    params = [dict(seed=i, max_new_tokens=20, max_denoising_steps=3) for i in range(4)]
    alone = [solo(model, p, kw) for p, kw in zip(prompts, params, strict=True)]
    counts = {}
    for batched in (False, True):
        engine = Engine(model, max_batch=8, batch_encodes=batched)
        try:
            bad = generation_request(
                engine.runner, [3] * 11 + [10**6], dict(seed=9, max_new_tokens=8), check=False
            )  # 12 too
            submitted = [generation_request(engine.runner, p, dict(kw)) for p, kw in zip(prompts, params, strict=True)]
            for r in [*submitted[:2], bad, *submitted[2:]]:
                engine.submit(r)
            got = [collect(r) for r in submitted]
            assert isinstance(collect(bad), ValueError)
            counts[batched] = engine.stats.encode_passes
        finally:
            engine.close()
        assert [(r.tokens[0], r.finish_reasons[0]) for r in got] == alone
    # alone: 4 prompts + 4 x 2 commits (the bad prompt is refused before its pass); batched: the bad prompt
    # makes its group go alone (4 + 1 refused), then the commits share a pass per canvas (2)
    assert counts == {False: 12, True: 6}, counts
    engine = Engine(model, max_batch=8)
    try:
        submitted = [generation_request(engine.runner, p, dict(kw)) for p, kw in zip(prompts, params, strict=True)]
        with engine._lock:  # all four arrive before the engine's next step
            for r in submitted:
                engine.submit(r)
        assert [(r.tokens[0], r.finish_reasons[0]) for r in map(collect, submitted)] == alone
        assert engine.stats.encode_passes == 3  # one for the four prompts, one per commit of their canvases
    finally:
        engine.close()


def test_work_calls_run_beside_the_passes_of_other_requests(model, engine):
    """Client-sized work (a schema's layout, an answer's validation) runs on the engine's worker thread: a
    request blocked in its work holds up no other request, and what the work raises ends its own request."""
    gate, threads = threading.Event(), []

    def work(value):
        threads.append(threading.current_thread().name)
        assert gate.wait(WAIT), "never released"
        if value is None:
            raise ValueError("a bad answer")
        return value

    def program(value):
        yield DoneEvent((yield WorkCall(work, (value,))))

    blocked = engine.submit(EngineRequest(Program(program(7))))
    prompt, params = requests(seed=2)[0]
    plain = engine.submit(generation_request(engine.runner, prompt, dict(params)))
    assert collect(plain).tokens[0] == solo(model, prompt, params)[0]  # done while the work still waits
    gate.set()
    assert collect(blocked) == 7 and threads[0].startswith("dgemma-work")
    failing = engine.submit(EngineRequest(Program(program(None))))
    assert isinstance(collect(failing), ValueError)

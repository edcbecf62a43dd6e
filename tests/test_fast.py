"""The fast modules give the reference's numbers (to float rounding), each path forced in turn; the model
they are made from is never changed; a Runner sends exact requests to the reference modules."""

from __future__ import annotations

import pytest
import torch
from helpers import fp32_logit_tolerance, fp32_tolerance, fp32_tolerances, load_quiet, request_result

import dgemma
import dgemma.runtime.fast as fast
from dgemma import Runner, build, preset


@pytest.fixture()
def model(moe_ckpt):
    return load_quiet(moe_ckpt[0], dtype="fp32")


def _run(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (2, 30), generator=g)
    cache = model.new_cache(2, 64)
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :9] = 0
    hidden = model.encode(ids, cache, attention_mask=mask).hidden_states
    canvas = torch.randint(0, 512, (2, 8), generator=g)
    first = model.denoise(canvas, cache)
    second = model.denoise(canvas, cache, model.soft_embedding(first / 0.7))
    return hidden, first, second


@pytest.mark.parametrize("experts", ["dense", "sorted", "grouped"])
def test_accelerated_model_matches_reference(model, monkeypatch, experts):
    ref = _run(model)
    monkeypatch.setattr(fast, "DENSE_EXPERTS_MAX_EXTRA", 10**15 if experts == "dense" else -1)
    twin = fast.fast_twin(model, grouped=experts == "grouped")
    assert fast.is_fast(twin) and not fast.is_fast(model)
    shown = repr(twin)  # print() tells what runs
    assert "FastExperts" in shown and "FastRMSNorm" in shown and f"grouped={experts == 'grouped'}" in shown
    for name, t in model.state_dict().items():  # the same weights, not copies
        assert twin.state_dict()[name].data_ptr() == t.data_ptr(), name
    out = _run(twin)
    text = model.text_config
    for a, b in zip(ref, out, strict=True):  # other kernels: equal to fp32 rounding at each output's scale
        tol = fp32_tolerance(a.abs().max().item(), text.hidden_size, text.num_hidden_layers)
        torch.testing.assert_close(b, a, rtol=0, atol=tol)
    # the model itself still runs the reference modules: the very same computation again, so bit for bit
    assert all(torch.equal(a, b) for a, b in zip(ref, _run(model), strict=True))


def test_accelerated_bf16_and_dense_only_models():
    for name in ("tiny", "tiny-dense"):
        m = build(preset(name), dtype=torch.bfloat16)
        ids = torch.randint(3, 512, (1, 12))
        cache = m.new_cache(1, 32)
        ref = m.encode(ids, cache, return_logits=True).logits
        runner = fast_runner(m)
        cache = m.new_cache(1, 32)
        out = runner.encode(ids, cache, return_logits=True).logits
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref, rtol=0.02, atol=0.05)


def test_sorted_experts_handle_unused_experts():
    m = build(preset("tiny"))
    layer = m.layers[0]
    x = torch.randn(5, 64)
    index = torch.tensor([[0, 2]] * 5)  # experts 1 and 3 get no tokens
    weights = torch.rand(5, 2)
    ref = layer.experts(x, weights, index)
    tol = fp32_tolerance(ref.abs().max().item(), 64, num_layers=0)  # one block, matmuls over other row counts
    for path in (fast.experts_sorted, fast.experts_dense, fast.experts_grouped):
        torch.testing.assert_close(path(layer.experts, x, weights, index), ref, rtol=0, atol=tol)


def test_grouped_experts_in_bf16_match_the_reference():
    m = build(preset("tiny"), dtype=torch.bfloat16)
    experts = m.layers[1].experts
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    weights = torch.softmax(torch.randn(40, 2), -1)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(40)])
    ref = experts(x, weights, index)
    # Bit for bit on the CPUs tried, but nothing promises that torch's grouped matmul accumulates as a
    # per-expert matmul does: one bf16 ulp (2^-7 relative at most) where another fp32 accumulation order
    # flips a rounding, half an ulp of the largest output where a sum cancels.
    out = fast.experts_grouped(experts, x, weights, index)
    torch.testing.assert_close(out, ref, rtol=2**-7, atol=2**-8 * ref.abs().max().item())


@pytest.mark.parametrize("prompt", [5, 30])  # the sliding ring (15 slots) partly written, and full
@torch.no_grad()
def test_static_step_matches_denoise(model, prompt):
    """The fixed-shape step a CUDA graph records (here run without the graph) gives denoise's logits:
    padded rows, a partly or fully written sliding ring, a signal or none, a second canvas after a commit."""
    from dgemma.runtime.graphs import GraphedDenoise

    graphed = GraphedDenoise(model, capture=False)
    tol = fp32_logit_tolerance(model)  # a padded ring and fixed shapes: other matmul shapes, same values
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 512, (2, prompt), generator=g)
    mask = torch.ones(2, prompt, dtype=torch.long)
    mask[1, : prompt // 3] = 0
    cache = model.new_cache(2, 64)
    model.encode(ids, cache, attention_mask=mask)
    for _ in range(2):
        canvas = torch.randint(0, 512, (2, 8), generator=g)
        first = model.denoise(canvas, cache)
        torch.testing.assert_close(graphed(canvas, cache), first, rtol=0, atol=tol)
        soft = model.soft_embedding(first / 0.7)
        ref = model.denoise(canvas, cache, soft)
        torch.testing.assert_close(graphed(canvas, cache, soft), ref, rtol=0, atol=tol)
        model.encode(ref.argmax(-1), cache)  # commit: the next canvas sits 8 positions later
    assert len(graphed.entries) == 2 and graphed.fallbacks == 0  # one entry per (signal or not), reused
    graphed(canvas[:1], cache.rows(torch.tensor([0])))  # a view of some rows: served by the ordinary denoise
    assert graphed.fallbacks == 1


@torch.no_grad()
def test_server_batches_replay_one_graph_per_bucket(model):
    """A server batch (a StackedCache of caches at their own lengths) runs the static step of its bucket
    (rows and prefix slots rounded up to powers of two, as graphs are captured per batch size): the
    stacked denoise's logits, padded rows dropped; the prefixes are copied once per change of the batch
    or of a cache, and the buffers grow (their graphs dropped) when a batch needs more."""
    from dgemma.model.kv_cache import StackedCache
    from dgemma.runtime.graphs import GraphedDenoise, bucket

    assert [bucket(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8] and bucket(5, 16) == 16
    graphed = GraphedDenoise(model, capture=False)
    tol = fp32_logit_tolerance(model)  # padded prefixes and rows: other matmul shapes, same values
    g = torch.Generator().manual_seed(2)
    caches = []
    for rows, length in ((1, 5), (2, 30), (1, 12)):  # a sliding ring (15 slots) partly written, and full
        cache = model.new_cache(rows, 64)
        mask = torch.ones(rows, length, dtype=torch.long)
        mask[-1, : length // 3] = 0  # left padding in the last row
        model.encode(torch.randint(3, 512, (rows, length), generator=g), cache, attention_mask=mask)
        caches.append(cache)

    def check(parts, soft=False):
        stacked = StackedCache(parts)
        canvas = torch.randint(0, 512, (stacked.batch_size, 8), generator=g)
        signal = model.soft_embedding(torch.randn(stacked.batch_size, 8, 512, generator=g)) if soft else None
        ref = model.denoise(canvas, stacked, signal)
        torch.testing.assert_close(graphed(canvas, stacked, signal), ref, rtol=0, atol=tol)
        return ref

    check(caches)
    check(caches, soft=True)  # four rows, 30 positions: the (4, 32) bucket, one load for both
    assert [k for k in graphed.entries] == [("stack", 4, 32, 8, None), ("stack", 4, 32, 8, torch.float32)]
    assert graphed.stack.loads == 1
    check(caches[1:], soft=True)  # three rows: the same graph, a padded row, the prefixes loaded again
    assert len(graphed.entries) == 2 and graphed.stack.loads == 2
    model.encode(torch.randint(3, 512, (1, 8), generator=g), caches[2])  # a commit: that cache changed
    check(caches[1:], soft=True)
    assert len(graphed.entries) == 2 and graphed.stack.loads == 3
    ref = check([*caches, caches[0]])  # five rows: the buffers grow to eight rows, the old graphs go
    assert [k[:3] for k in graphed.entries] == [("stack", 8, 32)] and graphed.stack.rows == 8
    model.encode(ref[:1].argmax(-1), caches[0])
    model.encode(torch.randint(3, 512, (1, 30), generator=g), caches[0])  # 43 positions: 64 slots
    check([caches[0]], soft=True)
    assert (graphed.stack.rows, graphed.stack.slots) == (8, 64) and graphed.fallbacks == 0


def test_a_graphed_engine_serves_every_batch_from_buckets(model):
    """On a graphed runner the engine stacks even a lone request's cache: each step is a bucket's graph
    (no capture per request), and every request ends as it does on the ordinary runner's engine."""
    from helpers import generation_request

    from dgemma.generation.engine import Engine

    settings = dict(max_new_tokens=16, max_denoising_steps=4, stop_token_ids=[])
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    results = {}
    for graphs in (False, True):
        runner = dgemma.accelerate(model, grouped=True, graphs=graphs)
        engine = Engine(runner, max_batch=4)
        try:
            requests = [
                engine.submit(generation_request(runner, p, dict(seed=i, **settings))) for i, p in enumerate(prompts)
            ]
            results[graphs] = [request_result(r) for r in requests]
        finally:
            engine.close()
    assert all(len(t) == 16 for r in results[True] for t in r.tokens)
    assert runner.graphs.fallbacks == 0 and all(k[0] == "stack" for k in runner.graphs.entries)
    agree = sum(a.tokens == b.tokens for a, b in zip(results[True], results[False], strict=True))
    assert agree >= 2  # the same tokens up to rounding: padded shapes may flip a near-tie on random weights


def test_generation_with_the_graphed_step_is_unchanged(model):
    import dgemma

    settings = dict(max_new_tokens=16, seed=3, stop_token_ids=[])
    ref = dgemma.generate(model, [5, 6, 7, 8], **settings).tokens
    runner = dgemma.accelerate(model, grouped=True, graphs=True)
    assert dgemma.generate(runner, [5, 6, 7, 8], **settings).tokens == ref
    assert runner.graphs.fallbacks == 0 and len(runner.graphs.entries) >= 1
    runner.release()
    assert not runner.graphs.entries
    assert "denoise" not in model.__dict__ and not fast.is_fast(model)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_scale", [True, False])
def test_fast_rms_norm_is_the_reference_norm(dtype, with_scale):
    """fp32 runs torch's fused rms_norm, other dtypes the few-op path: both the reference's values, to a
    few roundings of fp32 (another summation of the mean of squares, rsqrt for pow(-1/2)) and in bf16 to
    one bf16 rounding of that fp32 result."""
    from dgemma.model.model import RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-6, with_scale=with_scale)
    if with_scale:
        norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    norm = norm.to(dtype)
    x = (torch.randn(3, 5, 64, generator=g) * 3).to(dtype)
    got, ref = fast.FastRMSNorm.like(norm)(x), norm(x)
    assert got.dtype == ref.dtype == dtype
    # fp32: the 64 squares summed in another order (log2 64 = 6 roundings of the mean, halved by rsqrt),
    # rsqrt's own and the two products' roundings: under 8 eps on any vectorisation.
    rtol = torch.finfo(dtype).eps * (8 if dtype == torch.float32 else 1)
    torch.testing.assert_close(got, ref, rtol=rtol, atol=0)


@torch.no_grad()
def test_fast_lm_head_writes_the_reference_logits_into_the_buffer(model, monkeypatch):
    """The chunked head gives the reference head's logits (fp32: to rounding; the chunks' products are the
    same dot products, the cap is tanh's sigmoid identity), softcapped or not, in bf16, and into the
    caller's buffer when given one."""
    twin = fast.fast_twin(model)
    assert isinstance(twin.head, fast.FastLMHead) and "softcap" in repr(twin.head)
    w = model.embed_tokens.weight
    hidden = torch.randn(2, 8, w.shape[1], generator=torch.Generator().manual_seed(0))
    for cap in (model.text_config.final_logit_softcapping, None):
        monkeypatch.setattr(model.text_config, "final_logit_softcapping", cap)  # read at each call, both heads
        ref = model.head(hidden, w)
        tol = fp32_tolerance(ref.abs().max().item(), w.shape[1], 1)
        tol += 0 if cap is None else 4 * cap * torch.finfo(torch.float32).eps  # 2c x a sigmoid's 2 ulp of 1
        torch.testing.assert_close(twin.head(hidden, w), ref, rtol=0, atol=tol)
        buffer = torch.full_like(ref, float("nan"))
        assert twin.head(hidden, w, buffer) is buffer
        torch.testing.assert_close(buffer, ref, rtol=0, atol=tol)
        assert model.head(hidden, w, buffer.zero_()) is buffer and torch.equal(buffer, ref)
    half = w.bfloat16()  # bf16 products, cast to fp32 as the reference casts them
    torch.testing.assert_close(twin.head(hidden.bfloat16(), half), model.head(hidden.bfloat16(), half))


def test_fast_lm_head_trains_as_the_reference(model):
    w = model.embed_tokens.weight
    hidden = torch.randn(1, 4, w.shape[1], requires_grad=True)
    fast.FastLMHead.like(model.head)(hidden, w).square().sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


def test_fast_steps_reuse_one_logits_buffer(model):
    """A driven generation allocates its [b, C, V] logits once: every fast step is answered in the same
    buffer (its first rows once some rows are done), and the tokens are those of fresh logits."""
    outs = []

    class Recording(Runner):
        def denoise(self, *args, out=None, **kwargs):
            outs.append((args[0].shape, out))
            return super().denoise(*args, out=out, **kwargs)

    class Fresh(Runner):  # answers with newly allocated logits, ignoring the buffer
        def denoise(self, *args, out=None, **kwargs):
            return super().denoise(*args, **kwargs)

    kw = dict(max_new_tokens=24, max_denoising_steps=6, seed=5, stop_token_ids=[])
    done = dgemma.generate(Recording(model, fast=True), [[5, 6, 7], [8, 9]], **kw)
    assert len(outs) > 6 and all(out is not None for _, out in outs)
    assert len({out.data_ptr() for _, out in outs}) == 1
    assert all(out.shape == (*shape, model.text_config.vocab_size) for shape, out in outs)
    assert dgemma.generate(Fresh(model, fast=True), [[5, 6, 7], [8, 9]], **kw).tokens == done.tokens
    outs.clear()
    dgemma.generate(Recording(model, fast=True), [[5, 6, 7]], mode="exact", **kw)
    assert not outs  # exact mode is answered by the runner's reference (Runner.reference), unbuffered
    outs.clear()
    dgemma.generate(Recording(model), [[5, 6, 7]], **kw)  # reference modules only: a buffer would be a copy
    assert outs and all(out is None for _, out in outs)


def fast_runner(model):
    return Runner(model, fast=True)


def test_exact_requests_run_the_reference_modules(model, monkeypatch):
    """On a fast runner, exact mode gives the bare model's tokens bit for bit even when the fast modules
    would round differently (forced here: the dense expert path on every call)."""
    import dgemma

    monkeypatch.setattr(fast, "DENSE_EXPERTS_MAX_EXTRA", 10**15)
    settings = dict(max_new_tokens=12, seed=5, stop_token_ids=[], mode="exact")
    runner = fast_runner(model)
    calls = []
    for module in runner.fast.modules():
        if isinstance(module, fast.FastExperts):
            module.register_forward_hook(lambda *_: calls.append(1))
    ref = dgemma.generate(model, [[5, 6, 7], [9, 10, 11]], **settings)
    out = dgemma.generate(runner, [[5, 6, 7], [9, 10, 11]], **settings)
    assert out.tokens == ref.tokens and torch.equal(out.sequences, ref.sequences)
    assert not calls  # not one fast module ran
    dgemma.generate(runner, [5, 6, 7], max_new_tokens=4, seed=5)
    assert calls  # fast mode does run them


@torch.no_grad()
def test_compiled_denoise_matches_the_eager_twin(model):
    """`compile=True` (on a CPU with inductor's C++ wrapper) gives the eager twin's logits, to the rounding
    of fused kernels, with and without self-conditioning. Compiling takes about a minute on 2 cores the
    first time, seconds from inductor's on-disk cache."""
    runner = Runner(model, fast=True, compile=True)
    g = torch.Generator().manual_seed(0)
    cache = model.new_cache(1, 16 + 8)
    model.encode(torch.randint(3, 512, (1, 16), generator=g), cache)
    canvas = torch.randint(0, 512, (1, 8), generator=g)
    tol = fp32_logit_tolerance(model)
    first = runner.denoise(canvas, cache)
    torch.testing.assert_close(first, runner.fast.denoise(canvas, cache), rtol=0, atol=tol)
    sc = model.soft_embedding(first / 0.7)
    torch.testing.assert_close(
        runner.denoise(canvas, cache, sc), runner.fast.denoise(canvas, cache, sc), rtol=0, atol=tol
    )


@torch.no_grad()
def test_compiled_encode_matches_the_eager_twin(model):
    """`compile=True` compiles the twin's encode too (prompts and commits): the same hidden states, logits
    and cache contents as the eager twin, to the rounding of fused kernels, for a left-padded batch and a
    commit of another length after it (dynamo recompiles for the new length and for the missing mask);
    the id check still refuses bad ids, eagerly."""
    runner = Runner(model, fast=True, compile=True)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 512, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0  # the second prompt is left-padded
    commit = torch.randint(3, 512, (2, 8), generator=g)
    caches = []
    for encode in (runner.encode, runner.fast.encode):
        cache = model.new_cache(2, 12 + 8)
        first = encode(prompts, cache, mask, return_logits=True)
        second = encode(commit, cache, return_logits=True)
        caches.append((cache, first, second))
    (got, *outs), (want, *refs) = caches
    logit_tol, state_tol = fp32_tolerances(model)
    for out, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=logit_tol)
        torch.testing.assert_close(out.hidden_states, ref.hidden_states, rtol=0, atol=state_tol)
    assert got.length == want.length == 20 and torch.equal(got.valid, want.valid)
    for a, b in zip(got.keys + got.values, want.keys + want.values, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=state_tol)
    with pytest.raises(ValueError, match="token ids must lie"):
        runner.encode(torch.full((2, 4), 512), got)


@torch.no_grad()
def test_compiled_canvas_stats_match_the_eager_pass(model):
    """With `compile`, a step's statistics over a one-chunk vocabulary run compiled: the same argmax (ties
    go to the first index) and, to the rounding of a fused V-term sum, the same entropy, confidence and
    soft embedding. Rows longer than a chunk keep the eager pass, bit for bit."""
    from dgemma.generation.sampling import canvas_stats

    runner = Runner(model, fast=True, compile=True)
    g = torch.Generator().manual_seed(2)
    w = model.embed_tokens.weight
    scale = model.embed_scale(w.dtype)
    logits = 4 * torch.randn(2, 8, 512, generator=g)
    logits[0, 3, [7, 300]] = logits[0, 3].max() + 1  # a tie: the first index wins
    got, want = runner.canvas_stats(logits, w, scale), canvas_stats(logits, w, scale)
    assert torch.equal(got.argmax, want.argmax) and got.argmax[0, 3] == 7
    # each is a V-term fp32 sum: its rounding scales with the terms summed (the logits for the entropy's
    # sum of p * l, the embedding rows for the soft embedding), which can exceed the result's magnitude
    v = logits.shape[-1]
    terms = {"entropy": logits.abs().max(), "confidence": 1.0, "soft_embeds": w.abs().max() * scale}
    for name, magnitude in terms.items():
        a, b = getattr(got, name), getattr(want, name)
        torch.testing.assert_close(a, b, rtol=0, atol=fp32_tolerance(float(magnitude), v, num_layers=0))
    long = torch.randn(1, 600, 512, generator=g)  # 600 x 512 fp32 rows: more than one 1 MB chunk
    got, want = runner.canvas_stats(long, w, scale), canvas_stats(long, w, scale)
    assert all(torch.equal(getattr(got, n), getattr(want, n)) for n in ("entropy", "argmax", "soft_embeds"))


def test_runner_arguments_are_checked(model):
    with pytest.raises(ValueError, match="fast=True"):
        Runner(model, compile=True)
    with pytest.raises(TypeError, match="DiffusionGemma"):
        Runner(object())


@pytest.mark.parametrize("spec", ["int8", "int4", "fp8", "nvfp4", "int4-symmetric"])
def test_grouped_quantized_experts_match_the_quantized_reference(spec):
    """The fast twin's quantized experts (whole stacks dequantized, two grouped matmuls, no host loop)
    against QuantExperts' loop over experts on the same codes."""
    from dgemma.quant import QuantExperts, QuantSpec

    mode, _, zero = spec.partition("-")
    m = build(preset("tiny"), seed=0)
    q = QuantExperts.from_experts(m.layers[1].experts, QuantSpec.of(mode, 16, zero or "mid"))
    grouped = fast.GroupedQuantExperts.like(q)
    assert all(a is b for a, b in zip(grouped.buffers(), q.buffers(), strict=True))  # shared, not copied
    x = torch.randn(40, 64)
    weights = torch.softmax(torch.randn(40, 2), -1)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(40)])
    ref = q(x, weights, index)
    tol = fp32_tolerance(ref.abs().max().item(), 64, num_layers=0)  # the same weights, other matmul shapes
    torch.testing.assert_close(grouped(x, weights, index), ref, rtol=0, atol=tol)


def test_the_grouped_twin_of_a_quantized_model_needs_no_host_loop():
    from dgemma.quant import quantize_model

    model = quantize_model(build(preset("tiny"), seed=0), "nvfp4")
    twin = fast.fast_twin(model, grouped=True)
    assert all(isinstance(m, fast.GroupedQuantExperts) for m in twin.modules() if "experts" in type(m).__name__.lower())
    assert "GroupedQuantExperts" in str(twin)
    # capturable() also wants CUDA; on CPU its module test is what can be checked
    experts = [m for m in twin.modules() if isinstance(m, fast.QuantExperts)]
    assert experts and all(isinstance(m, fast.GroupedQuantExperts) for m in experts)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (1, 10), generator=g)
    outs = []
    for m in (model, twin):
        cache = m.new_cache(1, 18)
        m.encode(ids, cache)
        outs.append(m.denoise(ids[:, :8], cache))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=fp32_logit_tolerance(model))

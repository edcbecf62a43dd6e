"""The prefix cache (dgemma/model/kv_cache.py): a stored prefix gives the same tokens as encoding it (fast
mode; exact mode bypasses it), its logits move by rounding only, the store stays within its bound while
requests run and evict, images are keyed by their pixels, and no request reads another's."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    TINY_IMAGE_IDS,
    fp32_logit_tolerance,
    generation_request,
    image_prompt,
    load_quiet,
    make_oracle_checkpoint,
    random_pixels,
    request_result,
)

import dgemma
from dgemma.generation.engine import Engine, drive
from dgemma.generation.programs import Generate
from dgemma.generation.sampling import SamplingParams
from dgemma.model.kv_cache import PrefixCache, Reuse
from dgemma.runtime.runner import as_runner

SETTINGS = dict(max_new_tokens=20, max_denoising_steps=4, seed=3, stop_token_ids=[])
IMAGE, BOI, EOI = TINY_IMAGE_IDS["image_token_id"], TINY_IMAGE_IDS["boi_token_id"], TINY_IMAGE_IDS["eoi_token_id"]


@pytest.fixture(scope="module")
def model(moe_ckpt):
    return load_quiet(moe_ckpt[0], dtype="fp32")  # sliding window 16: a block (16) outlives the ring (15)


def _text(n: int, start: int = 0) -> list[int]:
    return [3 + (start + 7 * i) % 490 for i in range(n)]


def _run(engine: Engine, prompt, settings=SETTINGS, **kwargs):
    request = engine.submit(generation_request(engine.runner, prompt, dict(settings), **kwargs))
    return request_result(request), request.cached_tokens


# -- the store on its own --------------------------------------------------------------------------------


def _block_bytes(model) -> int:
    """The bytes of one block of 16 positions: every layer's keys and values, fp32."""
    return 2 * 16 * sum(k.shape[1] * k.shape[3] * 4 for k in model.new_cache(1, 1).keys)


def _stored(model, store: PrefixCache, ids: list[int]) -> Reuse:
    """`ids` encoded through the store (loading what it holds, keeping what it completes)."""
    cache = model.new_cache(1, len(ids))
    reuse = Reuse()
    call = store.admit(dgemma.generation.engine.EncodeCall(torch.tensor([ids]), cache), reuse)
    if call is not None:
        model.encode(call.ids, cache, pixels=call.pixels)
    store.keep(reuse)
    return reuse


def test_blocks_match_by_exact_tokens_and_evict_least_recently_used_leaves(model):
    store = PrefixCache(5 * _block_bytes(model), block_size=16)
    a, b = _text(48, 0), _text(48, 1)
    assert _stored(model, store, a).cached == 0 and store.blocks == 3
    assert _stored(model, store, a[:40] + [7] * 8).cached == 32  # whole blocks, up to the first change
    assert _stored(model, store, a).cached == 48
    _stored(model, store, b)  # 3 more blocks in a store of 4 + 3: the least recently used leaves go, one by one
    assert store.blocks == 5 and store.nbytes <= store.max_bytes and store.stats.evictions == 2
    assert store.match(a[:40] + [7] * 8) == store.match(a)[:2]  # the branch went first, then a's last block
    assert _stored(model, store, a).cached == 32
    assert _stored(model, store, b).cached == 32  # b's last block made room for a's again
    assert store.match(_text(15, 0)) == []  # no whole block


def test_one_prompt_larger_than_the_store_keeps_what_fits(model):
    store = PrefixCache(2 * _block_bytes(model))
    _stored(model, store, _text(100))
    assert store.blocks == 2 and store.nbytes <= store.max_bytes
    assert _stored(model, store, _text(100)).cached == 32


# -- numbers ----------------------------------------------------------------------------------------------


@torch.no_grad()
def test_a_stored_prefix_moves_the_logits_by_rounding_only(model):
    """A prompt encoded in two passes (stored prefix, then the rest) against one pass: other matmul shapes,
    the same keys up to fp32 rounding, so the canvas's logits agree within the suite's fp32 bound."""
    ids = _text(70, 2)
    store = PrefixCache(1 << 26)
    _stored(model, store, ids[:64])
    split = model.new_cache(1, 70)
    rest = store.admit(dgemma.generation.engine.EncodeCall(torch.tensor([ids]), split), Reuse())
    assert rest.ids.shape[1] == 6
    model.encode(rest.ids, split)
    whole = model.new_cache(1, 70)
    model.encode(torch.tensor([ids]), whole)
    canvas = torch.tensor([_text(8, 9)])
    a, b = model.denoise(canvas, split), model.denoise(canvas, whole)
    torch.testing.assert_close(a, b, rtol=0, atol=fp32_logit_tolerance(model))


CASES = {  # the suite's generation cases, each run with and without a stored prefix
    "text": dict(),
    "early_commit": dict(early_commit=True),
    "greedy": dict(greedy=True),
    "constrained": dict(allowed=[set(range(3, 40))] * 20),
    "pinned": dict(pins=torch.tensor([[-1, -1, 9, 9, -1] + [-1] * 15])),
    "logprobs": dict(logprobs=2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_reuse_gives_the_same_tokens_as_no_reuse(model, name):
    case = dict(CASES[name])
    extra = {k: case.pop(k) for k in ("allowed", "pins", "logprobs") if k in case}
    settings = {**SETTINGS, **case}
    prompt = _text(50, 4)
    with Engine(model) as plain, Engine(model, prefix_cache=PrefixCache(1 << 26)) as reusing:
        want, _ = _run(plain, prompt, settings, **extra)
        first, cached_first = _run(reusing, prompt, settings, **extra)
        second, cached = _run(reusing, [*prompt, 5, 6], settings, **extra)
        again, _ = _run(plain, [*prompt, 5, 6], settings, **extra)
    assert cached_first == 0 and cached == 48
    assert first.tokens == want.tokens and second.tokens == again.tokens


def test_a_prompt_the_store_holds_whole_is_not_encoded_at_all(model):
    with Engine(model) as plain, Engine(model, prefix_cache=PrefixCache(1 << 26)) as reusing:
        want, _ = _run(plain, _text(48, 6))
        _run(reusing, _text(48, 6))
        passes = reusing.stats.encode_passes
        again, cached = _run(reusing, _text(48, 6))
    assert cached == 48 and again.tokens == want.tokens
    assert reusing.stats.encode_passes - passes == 2  # the two commits: no prefill


def test_exact_mode_bypasses_the_cache(model):
    store = PrefixCache(1 << 26)
    with Engine(model, prefix_cache=store) as engine:
        for _ in range(2):
            result, cached = _run(engine, _text(40), {**SETTINGS, "mode": "exact"})
            assert cached == 0
    assert store.blocks == 0 and store.stats.lookups == 0
    ref = dgemma.generate(model, _text(40), mode="exact", **SETTINGS)
    assert result.tokens == ref.tokens  # transformers' numbers, untouched


def test_a_request_that_opts_out_neither_loads_nor_keeps(model):
    store = PrefixCache(1 << 26)
    with Engine(model, prefix_cache=store) as engine:
        _run(engine, _text(40))
        task = Generate([_text(40)], SamplingParams(**SETTINGS)).check(model)
        request = engine.submit(
            dgemma.generation.engine.EngineRequest(task.program(model, as_runner(model).canvas_stats), reuse=False)
        )
        request_result(request)
    assert request.cached_tokens == 0 and store.stats.lookups == 1


# -- pressure, images, other clients ----------------------------------------------------------------------


def test_eviction_under_pressure_with_requests_running(model):
    """Eight requests at once with other prompts, in a store of four blocks: every answer is its own (the same
    tokens as alone), the store never holds more than its bound, and a running request reads only its copy."""
    store = PrefixCache(4 * _block_bytes(model))
    prompts = [_text(40 + k, k) for k in range(8)]
    with Engine(model) as plain:
        alone = [_run(plain, p)[0].tokens for p in prompts]
    with Engine(model, max_batch=8, prefix_cache=store) as engine:
        requests = [engine.submit(generation_request(engine.runner, p, dict(SETTINGS))) for p in prompts * 2]
        results = [request_result(r).tokens for r in requests]
    assert results == alone * 2
    assert store.stats.stored_blocks and store.stats.peak_bytes <= store.max_bytes and store.stats.evictions > 0


def test_images_in_a_stored_prefix_are_keyed_by_their_pixels(tmp_path_factory):
    path = tmp_path_factory.mktemp("vision") / "ckpt"
    make_oracle_checkpoint(path, images=True, seed=3)
    model = dgemma.load(path, dtype="fp32")
    pixels, _ = random_pixels([(6, 9)], 72, seed=1)
    other, _ = random_pixels([(6, 9)], 72, seed=2)
    prompt = image_prompt([_text(20, 0), 6, _text(30, 1)], IMAGE, BOI, EOI)  # the image at 21..28
    store = PrefixCache.for_model(model, 1 << 26)
    with Engine(model, prefix_cache=store) as engine, Engine(model) as plain:
        _run(engine, prompt, pixels=pixels)
        longer = prompt + _text(5, 3)
        same, cached = _run(engine, longer, pixels=pixels)
        assert cached == 48 and same.tokens == _run(plain, longer, pixels=pixels)[0].tokens
        swapped, cached = _run(engine, longer, pixels=other)  # same text, another image: the block before it only
        assert cached == 16 and swapped.tokens == _run(plain, longer, pixels=other)[0].tokens
        cut = image_prompt([_text(12, 0), 6, _text(30, 1)], IMAGE, BOI, EOI)  # the image across blocks 0-1
        _run(engine, cut, pixels=pixels)
        _, cached = _run(engine, [*cut, 5], pixels=pixels)
        assert cached == 48
    assert store.match(store.keys_of(_call(cut[:18], pixels))) == []  # a match never ends inside an image


def _call(ids, pixels):
    return dgemma.generation.engine.EncodeCall(torch.tensor([ids]), None, None, pixels)


def test_the_library_session_and_drive_use_the_same_store(model):
    store = PrefixCache(1 << 26)
    task = Generate([_text(40)], SamplingParams(**SETTINGS)).check(model)
    for _ in drive(model, task.program(model, as_runner(model).canvas_stats), prefix=store):
        pass
    session = dgemma.Session(model, prefix_cache=store)
    session.generate([*_text(40), 9], **SETTINGS)
    assert session.cached_tokens == 32  # stored by drive: the blocks up to where the prompts part


# -- through the server -------------------------------------------------------------------------------------


def _post(url: str, path: str, body: dict) -> dict:
    import httpx
    from live_server import KEY

    r = httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


FAST = {"max_denoising_steps": 2, "seed": 1}
LONG = "Rules for the assistant: " + " ".join(f"rule {k} says keep step {k * 7} in mind." for k in range(12))


def test_every_dialect_counts_cached_tokens_in_its_own_field(server):
    """The same system prompt sent again: each dialect says how much of it came from the prefix cache."""
    user = [{"role": "system", "content": LONG}, {"role": "user", "content": "go"}]
    first = _post(server.url, "/v1/chat/completions", {"messages": user, "max_tokens": 4, **FAST})
    chat = _post(server.url, "/v1/chat/completions", {"messages": user, "max_tokens": 4, **FAST})
    prompt, cached = chat["usage"]["prompt_tokens"], chat["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < cached and prompt - 16 < cached <= prompt
    responses = _post(server.url, "/v1/responses", {"instructions": LONG, "input": "go", "dgemma": FAST})
    assert responses["usage"]["input_tokens_details"]["cached_tokens"] == cached
    messages = _post(
        server.url, "/v1/messages", {"system": LONG, "messages": user[1:], "max_tokens": 4, "dgemma": FAST}
    )
    usage = messages["usage"]
    assert usage["cache_read_input_tokens"] == cached and usage["input_tokens"] == prompt - cached
    ollama = _post(server.url, "/api/chat", {"model": "tiny", "messages": user, "stream": False, "dgemma": FAST})
    assert ollama["prompt_eval_count"] == prompt - cached  # as Ollama: what was evaluated
    plain = _post(
        server.url, "/v1/chat/completions", {"messages": user, "max_tokens": 4, "cache_prompt": False, **FAST}
    )
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert plain["choices"][0]["message"]["content"] == chat["choices"][0]["message"]["content"]
    streamed = _stream_usage(server.url, {"messages": user, "max_tokens": 4, **FAST})
    assert streamed["prompt_tokens_details"]["cached_tokens"] == cached
    metrics = __import__("httpx").get(server.url + "/metrics", headers=_auth()).text
    assert "dgemma_prefix_cache_hits_total" in metrics and "dgemma_prefix_cache_bytes " in metrics


def _auth() -> dict:
    from live_server import KEY

    return {"Authorization": f"Bearer {KEY}"}


def _stream_usage(url: str, body: dict) -> dict:
    import json

    import httpx

    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=_auth(), timeout=120) as r:
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: {")]
    return json.loads(lines[-1])["usage"]


def test_a_hostile_client_cannot_fill_the_cache_past_its_bound(model_dir):
    """Distinct long prompts from many clients at once, into a store of 8 blocks: the bytes held stay within it,
    and each answer is the one its prompt gets from a server without a cache (nothing of another request)."""
    from concurrent.futures import ThreadPoolExecutor

    from live_server import LiveServer

    from dgemma.checkpoints.tokenizer import Tokenizer
    from dgemma.server.app import create_app

    tok = Tokenizer.from_dir(model_dir)
    kw = dict(model_name="tiny", api_key=__import__("live_server").KEY, max_batch=4, max_queue=32)
    bound = 256 / (1 << 20)  # GiB: 8 blocks of this model's 32 KiB
    small = create_app(load_quiet(model_dir), tok, prefix_cache_gb=bound, **kw)
    none = create_app(load_quiet(model_dir), tok, prefix_cache_gb=0, **kw)
    bodies = [{"prompt": f"case {k}: " + LONG, "max_tokens": 4, **FAST} for k in range(12)]
    with LiveServer(small) as a, LiveServer(none) as b, ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda body: _post(a.url, "/v1/completions", body), bodies * 2))
        want = [_post(b.url, "/v1/completions", body) for body in bodies]
        store = small.state.engine.prefix_cache
    assert store.nbytes <= store.max_bytes == 256 << 10 and store.stats.evictions > 0
    assert [g["choices"][0]["text"] for g in got] == [w["choices"][0]["text"] for w in want] * 2
    assert none.state.engine.prefix_cache is None

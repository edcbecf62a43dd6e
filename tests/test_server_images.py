"""Images over the OpenAI API: `image_url` parts with data: URLs give the Python API's tokens; remote URLs,
bad images and misplaced fields are 400s naming the part or field, never a 5xx."""

from __future__ import annotations

import base64
import io
import json

import httpx
import jsonschema
import pytest
import torch

import dgemma

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
from live_server import KEY  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
SETTINGS = {"max_tokens": 6, "max_denoising_steps": 3, "seed": 3}


@pytest.fixture()
def vision(vision_server, vision_dir):
    return vision_server, vision_dir


def _png(w: int, h: int, seed: int = 0) -> bytes:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    buf = io.BytesIO()
    Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()).save(buf, "PNG")
    return buf.getvalue()


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _ask(*urls: str, text: str = "what is this?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + CHAT, json=body, headers=AUTH, timeout=60)


def test_an_image_url_part_gives_the_python_api_tokens(vision):
    live, path = vision
    from PIL import Image

    from dgemma.checkpoints.tokenizer import chat_prompt

    a, b = _png(100, 60, 1), _png(30, 200, 2)
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    r = client.chat.completions.create(
        model="tiny",
        messages=_ask(_url(a), _url(b)),
        max_tokens=6,
        seed=3,
        extra_body={"max_denoising_steps": 3, "max_soft_tokens": 70},
    )
    tok, model = dgemma.Tokenizer.from_dir(path), dgemma.load(path)
    parts = [{"type": "image", "image": Image.open(io.BytesIO(x))} for x in (a, b)]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "what is this?"}]}]
    ids, pixels = chat_prompt(tok, model.config, messages, budget=70)
    api = dgemma.generate(model, ids, pixels=pixels, max_new_tokens=6, max_denoising_steps=3, seed=3)
    assert r.choices[0].message.content == tok.decode(api.tokens[0])
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(api.tokens[0])


@pytest.mark.parametrize(
    "content, param, words",
    [
        ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], "messages.0.content", "remote"),
        ([{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}], "messages.0.content", "data:image"),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}], "messages.0.content.0", "base64"),
        ([{"type": "image_url", "image_url": {"url": _url(b"plain text")}}], "messages.0.content.0", "not an image"),
        ([{"type": "image_url", "image_url": {"url": _url(_png(64, 64)[:200])}}], "messages.0.content.0", "decoded"),
        (
            [{"type": "image_url", "image_url": {"url": _url(_png(8, 8)), "detail": "low"}}],
            "messages.0.content",
            "detail",
        ),
        ([{"type": "image_url", "image_url": "x"}], "messages.0.content", "image_url"),
    ],
)
def test_bad_image_parts_are_400s_naming_the_part(vision, content, param, words):
    live, _ = vision
    r = _post(live.url, {"messages": [{"role": "user", "content": content}], **SETTINGS})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_bounds_on_images_are_400s(vision, monkeypatch):
    live, _ = vision
    one = _url(_png(16, 16))
    cases = [
        ({"messages": _ask(*[one] * 17)}, "messages", "at most 16 images"),
        ({"messages": _ask(one), "max_soft_tokens": 100}, "max_soft_tokens", ""),
        ({"messages": [{"role": "user", "content": "hi"}], "max_soft_tokens": 70}, "max_soft_tokens", "none"),
    ]
    for body, param, words in cases:
        r = _post(live.url, {**body, **SETTINGS})
        assert r.status_code == 400 and r.json()["error"]["param"] == param and words in r.text, r.text
    from dgemma import images

    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 100)  # a decompression bomb, in miniature
    r = _post(live.url, {"messages": _ask(one), **SETTINGS})
    assert r.status_code == 400 and "more than the 100" in r.text
    monkeypatch.undo()
    # more image tokens than the context holds (the tiny model's context is short)
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (1000, 1000), (200, 30, 30)).save(buf, "PNG")  # one colour: a small file, 1089 tokens
    r = _post(live.url, {"messages": _ask(*[_url(buf.getvalue())] * 8), "max_soft_tokens": 1120, **SETTINGS})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert httpx.get(live.url + "/health").json()["status"] == "ok"


def test_an_image_for_a_model_without_images_is_a_400(server):
    body = {"messages": _ask(_url(_png(16, 16))), **SETTINGS}
    r = httpx.post(server.url + CHAT, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text  # its tokenizer has no image tokens


def test_a_score_of_a_prompt_holding_an_image_marker_names_the_prompt(vision):
    """Issue 56: the Score task refuses image placeholders in its prompt (a score takes no images) before any
    pass, naming `prompt` (it named `canvas`, after the pass failed)."""
    server, path = vision
    image = dgemma.load(path).config.image_token_id
    body = {"prompt": [5, image, 6], "canvas": [1]}
    r = httpx.post(server.url + "/v1/canvas/score", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


@pytest.fixture(scope="module")
def second_geometry(tmp_path_factory):
    """A live server on a tiny checkpoint whose tower cuts 14-pixel patches pooled 2 x 2, and its path."""
    from unittest import mock

    import helpers as testing
    from live_server import LiveServer

    from dgemma.server.app import create_app

    path = tmp_path_factory.mktemp("geometry") / "ckpt"
    with mock.patch.dict(testing.TINY_VISION, patch_size=14, pooling_kernel_size=2):
        testing.make_oracle_checkpoint(path, images=True, seed=7)
    testing.make_tokenizer(images=True).save(path)
    model = testing.load_quiet(path)
    app = create_app(model, dgemma.Tokenizer.from_dir(path), model_name="tiny", api_key=KEY)
    with LiveServer(app) as live:
        yield live, path


def test_an_image_for_a_checkpoint_of_another_geometry(second_geometry):
    """The server cuts images as the checkpoint's vision_config says (patch_size 14, pooling_kernel_size 2):
    the Python API's prompt and tokens."""
    from PIL import Image

    from dgemma.checkpoints.tokenizer import chat_prompt

    live, path = second_geometry
    a = _png(100, 60, 1)
    r = _post(live.url, {"messages": _ask(_url(a)), "max_soft_tokens": 70, **SETTINGS})
    assert r.status_code == 200, r.text
    tok, model = dgemma.Tokenizer.from_dir(path), dgemma.load(path)
    parts = [{"type": "image", "image": Image.open(io.BytesIO(a))}, {"type": "text", "text": "what is this?"}]
    ids, pixels = chat_prompt(tok, model.config, [{"role": "user", "content": parts}], budget=70)
    assert pixels.values.shape[1:] == (4 * 70, 3 * 14 * 14)
    api = dgemma.generate(model, ids, pixels=pixels, max_new_tokens=6, max_denoising_steps=3, seed=3)
    answer = r.json()
    assert answer["choices"][0]["message"]["content"] == tok.decode(api.tokens[0])
    assert answer["usage"]["prompt_tokens"] == len(ids)


def test_a_request_over_its_pixel_budget_is_a_400_before_any_decoding(vision, monkeypatch):
    """The decoded pixels of a request's images together are bounded (media.MAX_REQUEST_PIXELS), read
    from the images' headers: the part that goes over is named, and no image of the request is decoded."""
    from dgemma import images
    from dgemma.server import media

    live, _ = vision
    decoded, decode = [], images.decode

    def counted(image, what: str = "image"):
        decoded.append(what)
        return decode(image, what)

    monkeypatch.setattr(media, "MAX_REQUEST_PIXELS", 2 * 100 * 60)
    monkeypatch.setattr(images, "decode", counted)
    one = _url(_png(100, 60, 1))
    assert _post(live.url, {"messages": _ask(one, one), **SETTINGS}).status_code == 200  # at the budget
    assert decoded == ["messages.0.content.0", "messages.0.content.1"]
    decoded.clear()
    r = _post(live.url, {"messages": _ask(one, one, one), **SETTINGS})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages.0.content.2" and "more than the 12,000" in err["message"], err
    assert decoded == []


def _images_body(n: int, w: int, h: int, seed: int) -> dict:
    return {"messages": _ask(*[_url(_png(w, h, seed + k)) for k in range(n)]), "max_soft_tokens": 70, **SETTINGS}


def test_concurrent_decodes_wait_for_the_shared_budget(vision, monkeypatch):
    """Across the server at most media.MAX_DECODING_PIXELS are decoded at once: with room for one image,
    six requests of two images each sent together all succeed (their decodes waited their turn), and at no
    moment were two images decoded at once."""
    from concurrent.futures import ThreadPoolExecutor

    from dgemma.server import media

    live, _ = vision
    budget = media.PixelBudget(total=200 * 150)
    monkeypatch.setattr(media, "DECODING", budget)
    bodies = [_images_body(2, 200, 150, 10 * k) for k in range(6)]
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda body: _post(live.url, body), bodies))
    assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers if r.status_code != 200]
    assert budget.peak == 200 * 150 and budget.held == 0


def test_the_pixel_budget_is_first_come_first_served():
    """PixelBudget.hold waits until the pixels fit, in the order asked: a small request behind a large one
    waits even where it would fit, so large images are not starved."""
    import threading
    import time

    from dgemma.server.media import PixelBudget

    budget, order = PixelBudget(10, trim_after=10**9), []
    first = budget.hold(8)
    first.__enter__()

    def take(name: str, pixels: int) -> None:
        with budget.hold(pixels):
            order.append(name)

    large = threading.Thread(target=take, args=("large", 5))
    large.start()
    time.sleep(0.2)
    small = threading.Thread(target=take, args=("small", 1))  # fits beside the 8, but asked after the 5
    small.start()
    time.sleep(0.2)
    assert order == [] and budget.held == 8
    first.__exit__(None, None, None)
    large.join(5)
    small.join(5)
    assert order == ["large", "small"] and budget.held == 0 and budget.peak == 8
    with budget.hold(10**6):  # more than the whole budget: waits for all of it, does not fail
        assert budget.held == 10


def test_the_pixel_budget_hands_memory_back_after_a_burst(monkeypatch):
    """When the last decode of a burst of at least `trim_after` pixels lets go, the freed memory goes back to
    the kernel at once and again `trim_delay` later (when its requests have freed their tensors)."""
    import time

    from dgemma.server import media

    calls = []
    monkeypatch.setattr(media, "release_freed_memory", lambda: calls.append(time.perf_counter()))
    budget = media.PixelBudget(100, trim_after=50, trim_delay=0.1)
    with budget.hold(30):
        pass
    assert calls == []  # 30 pixels since the last trim: not worth one
    with budget.hold(30), budget.hold(30):
        pass
    assert len(calls) == 1  # once, when the last holder let go
    time.sleep(0.5)
    assert len(calls) == 2


RSS_BURST = """
import asyncio, io, sys, time
from types import SimpleNamespace
import torch
from PIL import Image
from dgemma.runtime.cpu import reuse_freed_memory
from dgemma.server import media

reuse_freed_memory()  # as a CPU runner sets it
if sys.argv[1] == "keep":
    media.release_freed_memory = lambda: False

def png(seed):
    g = torch.Generator().manual_seed(seed)
    y, x = torch.meshgrid(torch.arange(2000), torch.arange(3000), indexing="ij")
    rgb = torch.stack([x % 256, y % 256, (x + y * seed) % 256], -1).to(torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb.numpy()).save(buf, "PNG", compress_level=1)
    return "data:image/png;base64," + __import__("base64").b64encode(buf.getvalue()).decode()

def rss(field):
    return next(int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith(field + ":"))

urls = [png(k) for k in range(4)]
model = SimpleNamespace(vision_tower=object(), config=None)

def body():
    message = SimpleNamespace(image_urls=lambda: list(enumerate(urls)))
    return SimpleNamespace(messages=[message], max_soft_tokens=280)

async def burst():
    messages = [[{"content": list(urls)}] for _ in range(4)]
    return await asyncio.gather(*(media.decode_image_parts(model, body(), m) for m in messages))

base = rss("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
kept = asyncio.run(burst())
assert all(p["image"].image.size == (960, 624) for m in kept for p in m[0]["content"])
del kept
time.sleep(media.TRIM_DELAY_S + 1)
print(round(base), round(rss("VmHWM")), round(rss("VmRSS")))
"""


def test_memory_comes_back_after_a_burst_of_decodes():
    """Four requests of four 6 MP PNGs decoded together on the decode threads (glibc as a CPU runner sets
    it): RSS rises by ~100 MB (two images decoded at a time) and is back to where it was once the burst is
    over. With the memory kept (no malloc_trim) it stays at its peak: the negative control."""
    import subprocess
    import sys

    from dgemma.runtime.cpu import on_glibc

    if not on_glibc():
        pytest.skip("glibc's arenas are what keeps the memory; other allocators are not measured")

    def run(mode: str) -> tuple[int, int, int]:
        out = subprocess.run([sys.executable, "-c", RSS_BURST, mode], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return tuple(int(x) for x in out.stdout.split())

    base, peak, settled = run("trim")
    assert peak > base + 60 and settled < base + 30, (base, peak, settled)
    base, peak, settled = run("keep")
    assert settled > base + 60, (base, peak, settled)


def test_answers_shaped_by_the_models_scores_see_the_images(vision):
    """A JSON answer whose enum or union the encoder's scores choose, a call of one of several tools (the
    one it scores best) and tool_choice auto: each Score call carries the prompt's images, so they work
    with images as without (they were a 400: placeholders without pixels). The scores are those of the
    library's programs given the same pixels."""
    live, path = vision
    from PIL import Image

    from dgemma.checkpoints.tokenizer import chat_prompt
    from dgemma.generation.engine import ScoreCall, answer
    from dgemma.runtime.runner import as_runner

    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "rose", "blue"]}, "note": {"type": ["string", "null"]}},
        "required": ["colour", "note"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
        for n in ("look", "describe")
    ]
    png = _png(40, 30, 4)
    asks = [{"response_format": fmt}, {"tools": tools, "tool_choice": "required"}, {"tools": tools}]
    for extra in asks:
        body = {"model": "tiny", "messages": _ask(_url(png)), "max_denoising_steps": 3, "seed": 1, **extra}
        r = _post(live.url, body)
        assert r.status_code == 200, (extra, r.text)
        message = r.json()["choices"][0]["message"]
        if "response_format" in extra:
            assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(message["content"]))
        elif extra.get("tool_choice") == "required":
            assert message["tool_calls"][0]["function"]["name"] in ("look", "describe")
    model, tok = dgemma.load(path), dgemma.Tokenizer.from_dir(path)
    messages = [{"role": "user", "content": [{"type": "image", "image": Image.open(io.BytesIO(png))},
                                             {"type": "text", "text": "what is this?"}]}]  # fmt: skip
    ids, pixels = chat_prompt(tok, model.config, messages)
    two = answer(as_runner(model), ScoreCall(ids, [[5, 6], [7]], pixels=pixels))
    one = answer(as_runner(model), ScoreCall(ids, [[7]], pixels=pixels))
    torch.testing.assert_close(two.logprobs[1], one.logprobs[0], rtol=0, atol=1e-4)  # rows see the same images
    with pytest.raises(ValueError, match="no images were given"):
        answer(as_runner(model), ScoreCall(ids, [[7]]))

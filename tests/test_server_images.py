"""Images over the OpenAI API: `image_url` parts with data: URLs give the Python API's tokens; remote URLs,
bad images and misplaced fields are 400s naming the part or field, never a 5xx."""

from __future__ import annotations

import base64
import io

import httpx
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

    from dgemma.images import chat_prompt

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


@pytest.fixture(scope="module")
def second_geometry(tmp_path_factory):
    """A live server on a tiny checkpoint whose tower cuts 14-pixel patches pooled 2 x 2, and its path."""
    from unittest import mock

    from live_server import LiveServer

    from dgemma import testing
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

    from dgemma.images import chat_prompt

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

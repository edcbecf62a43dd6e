"""Image preprocessing against transformers' Pillow backend (`Gemma4ImageProcessorPil`): the same pixel
values (bit for bit: the same Pillow resize, the same float64 rescale), patch positions and soft-token
counts, for many sizes and aspect ratios, every budget and every image mode; and bad images refused with
errors that say what is wrong."""

from __future__ import annotations

import io

import pytest
import torch

from dgemma import images
from dgemma.checkpoints.tokenizer import chat_prompt

Image = pytest.importorskip("PIL.Image")
pytest.importorskip("transformers")

SIZES = [(1, 1), (7, 3000), (3000, 7), (4000, 3000), (333, 517), (48, 48), (50, 1000), (1001, 999)]  # (w, h)


SECOND = {"patch_size": 14, "pooling_kernel_size": 2}  # a tower cut otherwise than Gemma 4's 16 and 3


def _oracle(budget: int, **geometry):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(max_soft_tokens=budget, **geometry)


def _picture(w: int, h: int, mode: str = "RGB", seed: int = 0):
    """Smooth gradients plus noise (resampling has edges and flat parts to get right)."""
    g = torch.Generator().manual_seed(seed)
    y, x = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
    base = torch.stack([x, y, (x + y) / 2], -1) * 200 + torch.randint(0, 55, (h, w, 3), generator=g)
    rgb = Image.fromarray(base.to(torch.uint8).numpy(), "RGB")
    if mode == "RGBA":
        alpha = Image.fromarray((torch.rand(h, w, generator=g) * 255).to(torch.uint8).numpy(), "L")
        rgba = rgb.convert("RGBA")
        rgba.putalpha(alpha)
        return rgba
    if mode == "I;16":
        return Image.fromarray((base[..., 0].to(torch.int32) * 250).numpy().astype("uint16"))  # mode I;16
    return rgb.convert(mode)


def _same(ours, counts, theirs) -> None:
    assert torch.equal(ours.values, torch.as_tensor(theirs["pixel_values"]))
    assert torch.equal(ours.positions, torch.as_tensor(theirs["image_position_ids"]).long())
    assert counts == list(theirs["num_soft_tokens_per_image"])


@pytest.mark.parametrize("budget", images.SOFT_TOKEN_BUDGETS)
def test_pixels_match_the_pillow_processor_at_every_size(budget):
    oracle = _oracle(budget)
    for w, h in SIZES:
        picture = _picture(w, h, seed=w + h)
        ours, counts = images.preprocess([picture], budget)
        _same(ours, counts, oracle(images=[picture], return_tensors="pt"))
        assert counts[0] <= budget


@pytest.mark.parametrize("budget", images.SOFT_TOKEN_BUDGETS)
def test_pixels_match_the_pillow_processor_at_a_second_geometry(budget):
    """A tower of 14-pixel patches pooled 2 x 2 (vision_config's patch_size and pooling_kernel_size): the
    processor configured the same way gives the same pixels, positions and counts; count_soft_tokens agrees."""
    oracle = _oracle(budget, **SECOND)
    for w, h in SIZES:
        picture = _picture(w, h, seed=w + h)
        ours, counts = images.preprocess([picture], budget, **SECOND)
        _same(ours, counts, oracle(images=[picture], return_tensors="pt"))
        assert ours.values.shape == (1, 4 * budget, 3 * 14 * 14)
        assert images.count_soft_tokens(picture, budget, **SECOND) == counts[0] <= budget


def test_chat_prompt_cuts_images_as_the_checkpoint_says():
    """chat_prompt and text_prompt read patch_size and pooling_kernel_size from the config's vision_config
    (Gemma 4's 16 and 3 without one)."""
    from types import SimpleNamespace

    from helpers import TINY_IMAGE_IDS, make_tokenizer

    tok = make_tokenizer(images=True)
    picture = _picture(333, 517, seed=5)
    messages = [{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": "?"}]}]
    for vision, geometry in (({"model_type": "gemma4_vision", **SECOND}, SECOND), (None, {})):
        config = SimpleNamespace(**TINY_IMAGE_IDS, vision_config=vision)
        assert images.geometry(config) == (geometry or {"patch_size": 16, "pooling_kernel_size": 3})
        theirs = _oracle(140, **geometry)(images=[picture], return_tensors="pt")
        ids, pixels = chat_prompt(tok, config, messages, budget=140)
        _same(pixels, [ids.count(TINY_IMAGE_IDS["image_token_id"])], theirs)
        text_ids, text_pixels = images.text_prompt(tok, config, "<|image|> what?", [picture], 140)
        assert torch.equal(text_pixels.values, pixels.values)
        assert text_ids.count(TINY_IMAGE_IDS["image_token_id"]) == theirs["num_soft_tokens_per_image"][0]


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P", "CMYK", "LA", "I;16", "1"])
def test_pixels_match_the_pillow_processor_in_every_mode(mode):
    oracle = _oracle(140)
    pictures = [_picture(640, 480, mode, seed=1), _picture(90, 300, mode, seed=2)]  # two sizes, one call
    assert pictures[0].mode == mode
    ours, counts = images.preprocess(pictures, 140)
    _same(ours, counts, oracle(images=pictures, return_tensors="pt"))


def test_known_sizes_and_counts():
    """vision.md's figures: 480x640 at 280 -> 672x912 (266 tokens); 100x100 -> 768x768 (256); 1000x300 at 70
    -> 720x192 (60)."""
    assert images.target_size(480, 640, 280) == (672, 912)
    assert images.target_size(100, 100, 280) == (768, 768)
    assert images.target_size(1000, 300, 70) == (720, 192)
    _, counts = images.preprocess([_picture(640, 480), _picture(100, 100)], 280)
    assert counts == [266, 256]


def _png(picture) -> bytes:
    buf = io.BytesIO()
    picture.save(buf, format="PNG")
    return buf.getvalue()


def test_exif_orientation_is_applied_to_files_and_bytes(tmp_path):
    picture = _picture(60, 20)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    path = tmp_path / "rotated.jpg"
    picture.save(path, exif=exif)
    opened = images.open_image(path)
    assert opened.size == (20, 60)
    assert images.open_image(path.read_bytes()).size == (20, 60)


def test_bad_images_are_refused_with_a_reason(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="not an image"):
        images.preprocess([b"this is text, not a picture"])
    png = _png(_picture(64, 64))
    with pytest.raises(ValueError, match="image 1"):  # the error names which image of the call
        images.preprocess([png, png[: len(png) // 2]])
    with pytest.raises(ValueError, match="no pixels"):
        images.preprocess([Image.new("RGB", (0, 5))])
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(ValueError, match="more than the 1,000"):  # refused before it is decoded
        images.preprocess([png])
    monkeypatch.undo()
    with pytest.raises(ValueError, match="max_soft_tokens must be one of"):
        images.preprocess([png], budget=100)
    with pytest.raises(ValueError, match="cannot read"):
        images.preprocess([tmp_path / "missing.png"])
    with pytest.raises(ValueError, match="expected a path, bytes or a PIL image"):
        images.preprocess([42])


def test_chat_prompt_places_images_as_the_gemma4_processor_does():
    """Image parts of chat messages render as one image token each (the template), then expand to
    begin-of-image, that image's placeholders and end-of-image with transformers' own replacement strings
    and counts (Gemma4Processor.replace_image_token on its Pillow processor's output)."""
    from types import SimpleNamespace

    from helpers import IMAGE_TOKENS, TINY_IMAGE_IDS, make_tokenizer
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    tok = make_tokenizer(images=True)
    config = SimpleNamespace(**TINY_IMAGE_IDS)
    pictures = [_picture(640, 480, seed=3), _picture(50, 400, seed=4)]
    messages = [
        {"role": "user", "content": [{"type": "image", "image": pictures[0]}, {"type": "text", "text": "and"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "image", "image": pictures[1]}, {"type": "text", "text": "what?"}]},
    ]
    ids, pixels = chat_prompt(tok, config, messages, budget=70)
    processed = _oracle(70)(images=pictures, return_tensors="pt")
    layout = SimpleNamespace(boi_token=IMAGE_TOKENS[0], image_token=IMAGE_TOKENS[1], eoi_token=IMAGE_TOKENS[2])
    replacements = [Gemma4Processor.replace_image_token(layout, processed, i) for i in range(2)]
    pieces = tok.render_chat(messages).split(IMAGE_TOKENS[1])
    assert len(pieces) == 3  # one image token per image part
    expected = pieces[0] + replacements[0] + pieces[1] + replacements[1] + pieces[2]
    assert ids == tok.encode(expected, add_special_tokens=False)
    assert torch.equal(pixels.values, torch.as_tensor(processed["pixel_values"]))
    counts = list(processed["num_soft_tokens_per_image"])
    assert ids.count(TINY_IMAGE_IDS["image_token_id"]) == sum(counts)
    assert ids.count(TINY_IMAGE_IDS["boi_token_id"]) == ids.count(TINY_IMAGE_IDS["eoi_token_id"]) == 2


def test_video_frames_are_laid_out_as_the_gemma4_processor_does():
    """A video part: each frame a budget-70 image after its "MM:SS" time, joined by spaces: Gemma 4's
    processor layout (Gemma4Processor.replace_video_token), with image tokens as the placeholders since
    DiffusionGemma has no video token."""
    from types import SimpleNamespace

    from helpers import IMAGE_TOKENS, TINY_IMAGE_IDS, make_tokenizer
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    frames = [_picture(320, 240, seed=k) for k in range(3)]
    fps = 0.5
    counts = images.preprocess(frames, images.VIDEO_FRAME_BUDGET)[1]
    layout = SimpleNamespace(boi_token=IMAGE_TOKENS[0], video_token=IMAGE_TOKENS[1], eoi_token=IMAGE_TOKENS[2])
    meta = SimpleNamespace(fps=fps, timestamps=[k / fps for k in range(3)])
    theirs = Gemma4Processor.replace_video_token(
        layout, {"num_soft_tokens_per_video": [counts[0]], "video_metadata": [meta]}, 0
    )
    assert images.frames_text(counts, fps, IMAGE_TOKENS) == theirs and theirs.startswith("00:00 ")
    tok = make_tokenizer(images=True)
    config = SimpleNamespace(**TINY_IMAGE_IDS)
    content = [
        {"type": "image", "image": _picture(100, 80)},
        {"type": "video", "video": frames, "fps": fps},
        {"type": "text", "text": "what happens?"},
    ]
    ids, pixels = chat_prompt(tok, config, [{"role": "user", "content": content}], budget=140)
    assert pixels.values.shape[:2] == (4, 9 * 140)  # the image and three frames, padded to the larger budget
    assert ids.count(TINY_IMAGE_IDS["boi_token_id"]) == 4
    assert "00:04" in tok.decode(ids) and theirs.replace(" ", "") in tok.decode(ids).replace(" ", "")
    with pytest.raises(ValueError, match="fps must be"):
        chat_prompt(tok, config, [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 0}]}])


@pytest.fixture(scope="module")
def second_geometry(tmp_path_factory):
    """A tiny checkpoint (and its transformers oracle) whose tower cuts 14-pixel patches pooled 2 x 2."""
    from unittest import mock

    import helpers as testing

    path = tmp_path_factory.mktemp("geometry") / "ckpt"
    with mock.patch.dict(testing.TINY_VISION, SECOND):
        oracle = testing.make_oracle_checkpoint(path, images=True, seed=7)
    testing.make_tokenizer(images=True).save(path)
    assert oracle.config.vision_config.patch_size == 14
    return path, oracle


@torch.no_grad()
def test_a_second_geometry_end_to_end(second_geometry, tmp_path, capsys):
    """A checkpoint of 14-pixel patches pooled 2 x 2: chat_prompt's pixels are its processor's, the prefill
    and the denoiser after it give the oracle's logits, and generate (images=) and `dgemma generate --image`
    run on it."""
    import json

    from helpers import fp32_logit_tolerance, load_quiet, oracle_image_encode
    from transformers.cache_utils import DynamicCache

    import dgemma
    from dgemma.cli import main

    path, oracle = second_geometry
    model, tok = load_quiet(path, dtype="fp32"), dgemma.Tokenizer.from_dir(path)
    pictures = [_picture(160, 90, seed=1), _picture(40, 300, seed=2)]
    content = [{"type": "image", "image": p} for p in pictures] + [{"type": "text", "text": "what is this?"}]
    ids, pixels = chat_prompt(tok, model.config, [{"role": "user", "content": content}], budget=70)
    theirs = _oracle(70, **SECOND)(images=pictures, return_tensors="pt")
    _same(pixels, images.preprocess(pictures, 70, **SECOND)[1], theirs)
    assert ids.count(oracle.config.image_token_id) == sum(theirs["num_soft_tokens_per_image"])
    prompt = torch.tensor([ids])
    pkv = DynamicCache(config=oracle.config.text_config)
    oracle_image_encode(oracle, prompt, None, pixels, pkv)
    cache = model.new_cache(1, len(ids) + model.config.canvas_length)
    model.encode(prompt, cache, pixels=pixels)
    canvas = torch.randint(0, 500, (1, model.config.canvas_length), generator=torch.Generator().manual_seed(0))
    ref = oracle(past_key_values=pkv, decoder_input_ids=canvas).logits
    torch.testing.assert_close(model.denoise(canvas, cache), ref, rtol=0, atol=fp32_logit_tolerance(model))
    out = dgemma.generate(
        model, "<|image|> hi", tokenizer=tok, images=[pictures[0]], max_soft_tokens=70, max_new_tokens=3
    )
    assert len(out.tokens[0]) == 3
    pictures[1].save(tmp_path / "b.png")
    args = ["generate", "-m", str(path), "-p", "what?", "--image", str(tmp_path / "b.png"), "--max-soft-tokens", "70"]
    assert main([*args, "--max-new-tokens", "3", "--max-denoising-steps", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] <= 3


def test_pixels_cut_for_another_geometry_are_refused_where_they_meet_the_tower(second_geometry):
    """Pixels cut for Gemma 4's 16-pixel patches pooled 3 x 3, given to a model of 14 and 2 (and each other
    mix of patch and pool): one ValueError naming what they were cut for and what the tower takes, not a
    matmul's shape error deep inside."""
    from helpers import TINY_VISION, load_quiet

    from dgemma.model.vision import Pixels, VisionConfig, VisionTower

    model = load_quiet(second_geometry[0], dtype="fp32")
    picture = _picture(160, 90, seed=3)
    gemma4 = images.preprocess([picture], 70)[0]
    with pytest.raises(ValueError, match=r"cut for patch_size 16 \(768 values a patch\), but this model's vision "
                       r"tower takes patch_size 14 and pooling_kernel_size 2 \(588 values"):  # fmt: skip
        model.image_features(gemma4)
    assert model.image_features(images.preprocess([picture], 70, **SECOND)[0]).shape[0] > 0
    tiny = {k: v for k, v in TINY_VISION.items() if k != "model_type"}
    for cut, tower, message in [
        ({"patch_size": 16, "pooling_kernel_size": 3}, (16, 2), "cut for pooling_kernel_size 3 "),
        ({"patch_size": 16, "pooling_kernel_size": 2}, (16, 3), "cut for pooling_kernel_size 2 "),
        (SECOND, (16, 3), "cut for patch_size 14 "),
    ]:
        pixels = images.preprocess([picture], 70, **cut)[0]
        config = VisionConfig(**tiny, patch_size=tower[0], pooling_kernel_size=tower[1])
        with pytest.raises(
            ValueError, match=message + ".*takes patch_size {} and pooling_kernel_size {}".format(*tower)
        ):
            VisionTower(config)(pixels.values, pixels.positions)
    with pytest.raises(ValueError, match="images cut for different patch sizes"):
        Pixels.cat([gemma4, images.preprocess([picture], 70, **SECOND)[0]])


def test_training_cuts_images_as_the_checkpoint_says(second_geometry, tmp_path):
    """dgemma train on records with images, at a second geometry: each record's images are counted and cut
    into the tower's 14-pixel patches pooled 2 x 2 (not Gemma 4's 16 and 3), and the steps run."""
    import json

    from dgemma.train.config import TrainConfig
    from dgemma.train.trainer import load_data, prepare, train

    path, oracle = second_geometry
    for i, (w, h) in enumerate([(160, 90), (40, 300)]):
        _picture(w, h, seed=i).save(tmp_path / f"{i}.png")
    with (tmp_path / "data.jsonl").open("w") as f:
        for i in range(2):
            user = [{"type": "image", "image": f"{i}.png"}, {"type": "text", "text": "what?"}]
            record = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "this"}]}
            f.write(json.dumps({**record, "max_soft_tokens": 70}) + "\n")
    sections = {
        "model": {"path": str(path)},
        "data": {"train": str(tmp_path / "data.jsonl"), "max_length": 160},
        "train": {"steps": 2, "batch_size": 2, "out_dir": str(tmp_path / "run")},
    }
    cfg = TrainConfig.from_dict(sections, base_dir=tmp_path)
    model, tok, _ = prepare(cfg, multi_process=False)
    examples = load_data(cfg, tok, model)[0]
    expected = [images.count_soft_tokens(tmp_path / f"{i}.png", 70, **SECOND) for i in range(2)]
    image_id = oracle.config.image_token_id
    assert [ex.prompt.count(image_id) for ex in examples] == expected
    assert all(torch.isfinite(torch.tensor(train(cfg, progress=False).losses)))


def _encoded(picture, fmt: str) -> bytes:
    buf = io.BytesIO()
    picture.save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_what_is_kept_of_a_decoded_image_is_its_target_size(fmt):
    """resize_image (what the server keeps of each image part) is the image at its target size, and its
    pixels are the processor's on the full-size decode: decoding is bounded by how many full-size images
    exist at once (server/media.py), not by decoding smaller (JPEG draft, reduce), which would change them."""
    data = _encoded(_picture(3000, 2000, seed=6), fmt)
    resized = images.resize_image(data, 280)
    assert resized.image.size == (960, 624) and resized.image.mode == "RGB"
    assert images.target_size(2000, 3000, 280) == (624, 960)
    ours, counts = images.preprocess([resized], 280)
    _same(ours, counts, _oracle(280)(images=[Image.open(io.BytesIO(data))], return_tensors="pt"))
    assert torch.equal(images.preprocess([data], 280)[0].values, ours.values)
    with pytest.raises(ValueError, match="was resized for"):  # kept for one budget, asked for another
        images.preprocess([resized], 70)
    rgb = _picture(64, 48)
    assert images.to_rgb(rgb) is rgb  # no copy of an image that is RGB already

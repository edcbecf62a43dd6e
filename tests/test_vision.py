"""The vision tower and image prompts against transformers 5.23.0 (tiny random checkpoints with a vision
tower, image blocks bidirectional as in the released model): soft tokens, the prefill, the denoiser's
logits after it and after a second canvas, for one image, two images of different sizes, a left-padded
batch with different image counts, and an image longer than the sliding window; exact-mode generation
gives transformers' token ids; a negative control shows the image-block mask matters."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import (
    TINY_IMAGE_IDS,
    fp32_logit_tolerance,
    fp32_tolerance,
    image_prompt,
    make_oracle_checkpoint,
    oracle_image_encode,
    random_pixels,
)

import dgemma
from dgemma.generation.loop import left_pad
from dgemma.runtime.runner import as_runner

pytest.importorskip("transformers")
IMAGE, BOI, EOI = TINY_IMAGE_IDS["image_token_id"], TINY_IMAGE_IDS["boi_token_id"], TINY_IMAGE_IDS["eoi_token_id"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("vision") / "ckpt"
    oracle = make_oracle_checkpoint(path, images=True, seed=3)
    return oracle, dgemma.load(path, dtype="fp32")


def _text(n: int, start: int) -> list[int]:
    return [3 + (start + 7 * i) % 490 for i in range(n)]


# name -> (per row: the prompt's parts, an int an image of that many soft tokens), the patch grids of the
# images in order (rows x columns of 16-pixel patches), patch rows per image (9 x the budget)
SCENARIOS = {
    "one_image": ([[_text(4, 0), 6, _text(3, 1)]], [(6, 9)], 72),
    "two_sizes": ([[_text(2, 2), 6, _text(2, 3), 1, _text(3, 4)]], [(6, 9), (3, 3)], 72),
    "padded_batch": (
        [[_text(3, 5), 6, _text(2, 6)], [_text(2, 7), 1, _text(1, 8), 4, _text(2, 9)]],
        [(6, 9), (3, 3), (6, 6)],
        72,
    ),
    "past_the_window": ([[_text(20, 10), 18, _text(4, 11)]], [(9, 18)], 162),  # sliding window 16
}


def _inputs(name: str):
    rows_parts, grids, rows = SCENARIOS[name]
    pixels, counts = random_pixels(grids, rows, seed=len(name))
    prompts = [image_prompt(parts, IMAGE, BOI, EOI) for parts in rows_parts]
    assert sum(p.count(IMAGE) for p in prompts) == sum(counts)
    ids, mask = left_pad(prompts, 0, "cpu")
    return prompts, ids, mask, pixels


@torch.no_grad()
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_image_prompts_match_transformers(pair, name):
    from transformers.cache_utils import DynamicCache

    oracle, model = pair
    _, ids, mask, pixels = _inputs(name)
    tol = fp32_logit_tolerance(model)
    # the soft tokens in the text embedding space
    ref_features = oracle.model.encoder.get_image_features(pixels.values, pixels.positions).pooler_output
    vision, text = oracle.config.vision_config, model.text_config
    # other kernels (SDPA here, eager attention there): fp32 rounding at the output's scale, by width and depth
    tol_features = fp32_tolerance(ref_features.abs().max().item(), vision.hidden_size, vision.num_hidden_layers + 1)
    torch.testing.assert_close(model.image_features(pixels), ref_features, rtol=0, atol=tol_features)
    # the prefill, then the canvas
    pkv = DynamicCache(config=oracle.config.text_config)
    ref_hidden = oracle_image_encode(oracle, ids, mask, pixels, pkv)
    c = model.config.canvas_length
    cache = model.new_cache(ids.shape[0], ids.shape[1] + 2 * c)
    hidden = model.encode(ids, cache, attention_mask=mask, pixels=pixels).hidden_states
    valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    depth = text.num_hidden_layers + vision.num_hidden_layers + 1
    tol_hidden = fp32_tolerance(ref_hidden.abs().max().item(), text.hidden_size, depth)
    torch.testing.assert_close(hidden[valid], ref_hidden[valid], rtol=0, atol=tol_hidden)
    g = torch.Generator().manual_seed(1)
    dec = {} if mask is None else {"decoder_attention_mask": torch.nn.functional.pad(mask, (0, c), value=1)}
    canvas = torch.randint(0, 500, (ids.shape[0], c), generator=g)
    ref = oracle(past_key_values=pkv, decoder_input_ids=canvas, **dec).logits
    torch.testing.assert_close(model.denoise(canvas, cache), ref, rtol=0, atol=tol)
    # a second canvas after committing the first: the image is read from the cache like any prefix
    committed = ref.argmax(-1)
    full = None if mask is None else torch.nn.functional.pad(mask, (0, c), value=1)
    oracle.model.encoder(input_ids=committed, past_key_values=pkv, **({} if full is None else {"attention_mask": full}))
    model.encode(committed, cache)
    canvas2 = torch.randint(0, 500, (ids.shape[0], c), generator=g)
    dec2 = {} if full is None else {"decoder_attention_mask": torch.nn.functional.pad(full, (0, c), value=1)}
    ref2 = oracle(past_key_values=pkv, decoder_input_ids=canvas2, **dec2).logits
    torch.testing.assert_close(model.denoise(canvas2, cache), ref2, rtol=0, atol=tol)


@torch.no_grad()
def test_without_the_image_block_mask_the_numbers_differ(pair):
    """Negative control: the same inputs with plain causal attention around the image (what transformers'
    encoder forward computes when the mask dict is not passed) are clearly different."""
    from transformers.cache_utils import DynamicCache

    oracle, model = pair
    _, ids, mask, pixels = _inputs("past_the_window")
    pkv = DynamicCache(config=oracle.config.text_config)
    ref = oracle_image_encode(oracle, ids, mask, pixels, pkv)
    model.text_config.use_bidirectional_attention = None
    try:
        causal = model.encode(ids, model.new_cache(1, ids.shape[1]), pixels=pixels).hidden_states
    finally:
        model.text_config.use_bidirectional_attention = "vision"
    assert (causal - ref).abs().max() > 1e-2


def test_exact_generation_with_images_gives_transformers_token_ids(pair):
    oracle, model = pair
    for name in ("two_sizes", "padded_batch"):
        prompts, ids, mask, pixels = _inputs(name)
        settings = dict(max_new_tokens=12, max_denoising_steps=4)
        extra = {} if mask is None else {"attention_mask": mask}
        torch.manual_seed(11)
        ref = oracle.generate(
            input_ids=ids,
            pixel_values=pixels.values,
            image_position_ids=pixels.positions,
            mm_token_type_ids=(ids == IMAGE).long(),
            eos_token_id=1,
            pad_token_id=0,
            **extra,
            **settings,
        ).sequences[:, ids.shape[1] :]
        ours = dgemma.generate(model, prompts, mode="exact", seed=11, stop_token_ids=[1], pixels=pixels, **settings)
        assert torch.equal(ours.sequences, ref), name


def test_image_input_errors_name_the_problem(pair):
    _, model = pair
    _, ids, _, pixels = _inputs("one_image")
    with pytest.raises(ValueError, match="no images were given"):
        model.encode(ids, model.new_cache(1, ids.shape[1]))
    few = image_prompt([_text(2, 0), 5], IMAGE, BOI, EOI)
    with pytest.raises(ValueError, match="5 image placeholder tokens but its images give 6"):
        model.encode(torch.tensor([few]), model.new_cache(1, len(few)), pixels=pixels)
    import dataclasses

    config = dataclasses.replace(dgemma.preset("tiny"), image_token_id=IMAGE)  # no vision_config: text only
    text_only = dgemma.build(config)
    with pytest.raises(ValueError, match="no vision tower"):
        text_only.encode(ids, text_only.new_cache(1, ids.shape[1]), pixels=pixels)


# A canvas may draw the image placeholder id (the denoiser can draw any token). transformers commits it as an
# ordinary token: its commits pass no pixels, so the encoder embeds the id's own row of the embedding table
# (times sqrt(M)) under the plain causal mask. dgemma must do the same, and refuse only prompts.
PLACEHOLDER_PROMPTS = {
    "text_prompt": [_text(9, 12)],
    "image_prompt": [_text(3, 13), 6, _text(2, 14)],  # the image's placeholders come with pixels
}


def _text_only(model):
    """The same text weights without a vision tower (as a text-only checkpoint loads), image id kept."""
    import dataclasses

    config = dataclasses.replace(model.config, vision_config=None)
    text_only = dgemma.build(config)
    tower = ("vision_tower.", "embed_vision.")
    text_only.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith(tower)})
    assert text_only.vision_tower is None and text_only.config.image_token_id == IMAGE
    return text_only


def _placeholder_prompt(name: str):
    """Token ids [1, T] of the prompt and its Pixels (None for a text prompt)."""
    prompt = image_prompt(PLACEHOLDER_PROMPTS[name], IMAGE, BOI, EOI)
    pixels = random_pixels([(6, 9)], 72, seed=2)[0] if IMAGE in prompt else None
    return prompt, pixels


@torch.no_grad()
@pytest.mark.parametrize(("tower", "name"), [(True, "text_prompt"), (False, "text_prompt"), (True, "image_prompt")])
def test_a_committed_canvas_holding_the_placeholder_matches_transformers(pair, tower, name):
    """The commit of a canvas holding the placeholder id, with no images, gives the oracle's hidden states,
    and the next canvas (placeholders in it too) its logits; the fast twin's commit gives the reference's."""
    from transformers.cache_utils import DynamicCache

    oracle, model = pair
    model = model if tower else _text_only(model)
    prompt, pixels = _placeholder_prompt(name)
    ids = torch.tensor([prompt])
    c = model.config.canvas_length
    committed = torch.tensor([[IMAGE, 7, IMAGE, IMAGE, 40, 3, 200, IMAGE]])[:, :c]
    canvas = torch.tensor([[9, IMAGE, 11, IMAGE, IMAGE, 300, 5, 6]])[:, :c]
    pkv = DynamicCache(config=oracle.config.text_config)
    if pixels is None:
        oracle.model.encoder(input_ids=ids, past_key_values=pkv)
    else:
        oracle_image_encode(oracle, ids, None, pixels, pkv)
    ref_hidden = oracle.model.encoder(input_ids=committed, past_key_values=pkv).last_hidden_state
    ref = oracle(past_key_values=pkv, decoder_input_ids=canvas).logits
    vision, text = oracle.config.vision_config, model.text_config
    depth = text.num_hidden_layers + vision.num_hidden_layers + 1
    tol_hidden = fp32_tolerance(ref_hidden.abs().max().item(), text.hidden_size, depth)
    tol = fp32_logit_tolerance(model)
    outputs = []
    for runner in (model, dgemma.accelerate(model)):
        cache = model.new_cache(1, ids.shape[1] + 2 * c)
        dgemma.Runner(model).encode(ids, cache, pixels=pixels)  # the prompt, on the reference modules
        run = as_runner(runner)
        hidden = run.encode(committed, cache, is_generated=True).hidden_states
        outputs.append((hidden, run.denoise(canvas, cache)))
    (hidden, logits), (fast_hidden, fast_logits) = outputs
    torch.testing.assert_close(hidden, ref_hidden, rtol=0, atol=tol_hidden)
    torch.testing.assert_close(logits, ref, rtol=0, atol=tol)
    torch.testing.assert_close(fast_hidden, hidden, rtol=0, atol=tol_hidden)
    torch.testing.assert_close(fast_logits, logits, rtol=0, atol=tol)


@contextlib.contextmanager
def _likely(token: int, *models, factor: float):
    """Make `token` likely under each model (its tied embedding row scaled; restored after)."""
    rows = [(m.model.decoder.embed_tokens if hasattr(m, "model") else m.embed_tokens).weight for m in models]
    saved = [w[token].clone() for w in rows]
    with torch.no_grad():
        for w in rows:
            w[token] *= factor
    try:
        yield
    finally:
        with torch.no_grad():
            for w, row in zip(rows, saved, strict=True):
                w[token] = row


@pytest.mark.parametrize("name", sorted(PLACEHOLDER_PROMPTS))
def test_exact_generation_commits_a_drawn_placeholder_as_transformers_does(pair, name):
    """With the placeholder made likely, canvases draw it, and exact mode commits them and goes on, giving
    transformers' token ids, after a text prompt and after a prompt with an image."""
    oracle, model = pair
    prompt, pixels = _placeholder_prompt(name)
    ids = torch.tensor([prompt])
    settings = dict(max_new_tokens=24, max_denoising_steps=4)
    images = {} if pixels is None else dict(pixel_values=pixels.values, image_position_ids=pixels.positions)
    if pixels is not None:
        images["mm_token_type_ids"] = (ids == IMAGE).long()
    with _likely(IMAGE, oracle, model, factor=12.0):
        torch.manual_seed(5)
        ref = oracle.generate(input_ids=ids, eos_token_id=1, pad_token_id=0, **images, **settings)
        ours = dgemma.generate(model, [prompt], mode="exact", seed=5, stop_token_ids=[1], pixels=pixels, **settings)
    ref = ref.sequences[:, ids.shape[1] :]
    assert torch.equal(ours.sequences, ref)
    c = model.config.canvas_length
    assert IMAGE in ours.sequences[0, :-c].tolist()  # a committed canvas held it
    assert len(ours.tokens[0]) == 24


def _forced(c: int) -> list:
    """allowed= for a first canvas that must hold the placeholder at positions 1, 2 and 5."""
    return [[{IMAGE} if i in (1, 2, 5) else None for i in range(c)]]


@pytest.mark.parametrize(("tower", "name"), [(True, "text_prompt"), (False, "text_prompt"), (True, "image_prompt")])
def test_fast_generation_commits_a_placeholder_and_goes_on(pair, tower, name):
    """Fast mode on the fast modules and on the reference ones: a first canvas restricted to the placeholder
    at some positions is committed and the next canvases are generated."""
    _, model = pair
    model = model if tower else _text_only(model)
    prompt, pixels = _placeholder_prompt(name)
    c = model.config.canvas_length
    for runner in (dgemma.accelerate(model), model):
        settings = dict(max_new_tokens=3 * c, max_denoising_steps=3, seed=1, stop_token_ids=[])
        result = dgemma.generate(runner, [prompt], pixels=pixels, allowed=_forced(c), **settings)
        tokens = result.tokens[0]
        assert len(tokens) == 3 * c and [tokens[i] for i in (1, 2, 5)] == [IMAGE] * 3


def test_an_engine_batch_goes_on_when_a_canvas_draws_the_placeholder(pair):
    """In a served batch, the request whose canvas holds the placeholder commits it, and the request beside
    it gets the tokens it gets alone."""
    from helpers import generation_request

    from dgemma.generation.engine import DoneEvent, Engine

    _, model = pair
    c = model.config.canvas_length
    other = (_text(7, 15), dict(seed=2, max_new_tokens=2 * c, max_denoising_steps=3, stop_token_ids=[]))
    alone = dgemma.generate(model, other[0], **other[1]).tokens
    runner = dgemma.accelerate(model)
    engine = Engine(runner, max_batch=4)
    try:
        settings = dict(seed=1, max_new_tokens=3 * c, max_denoising_steps=3, stop_token_ids=[])
        drawn = engine.submit(generation_request(engine.runner, _text(5, 16), settings, allowed=_forced(c)))
        beside = engine.submit(generation_request(engine.runner, other[0], dict(other[1])))
        results = []
        for request in (drawn, beside):
            event = request.events.get(timeout=120)
            while not isinstance(event, DoneEvent | Exception):
                event = request.events.get(timeout=120)
            results.append(event)
    finally:
        engine.close()
    assert not any(isinstance(r, Exception) for r in results), results
    first, second = (r.result for r in results)
    assert len(first.tokens[0]) == 3 * c and first.tokens[0][1] == IMAGE
    assert second.tokens == alone


def test_ar_decoding_feeds_back_a_drawn_placeholder(pair):
    """Token-by-token decoding may pick the placeholder id too; it is fed back as a generated token, not
    refused as a prompt without images."""
    from dgemma.ar import generate_ar

    _, model = pair
    with _likely(IMAGE, model, factor=12.0):
        tokens = generate_ar(model, _text(6, 17), 6, stop_token_ids=[]).tokens[0]
    assert len(tokens) == 6 and IMAGE in tokens[:-1]


def test_a_prompt_with_placeholders_and_no_images_is_still_refused(pair):
    """Only generated tokens may hold the placeholder without images: a prompt that does is refused, in
    both modes and on the fast modules, and a commit takes no images."""
    _, model = pair
    prompt = [5, 6, IMAGE, 7]
    for runner, mode in ((model, "exact"), (model, "fast"), (dgemma.accelerate(model), "fast")):
        with pytest.raises(ValueError, match="no images were given"):
            dgemma.generate(runner, prompt, mode=mode, max_new_tokens=4)
    _, pixels = _placeholder_prompt("image_prompt")
    with pytest.raises(ValueError, match="generated tokens carry no images"):
        model.encode(torch.tensor([prompt]), model.new_cache(1, 4), pixels=pixels, is_generated=True)


def test_parameter_counts_include_the_tower(pair):
    _, model = pair
    counts = dgemma.count_parameters(model.config)
    tower = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("vision_tower.", "embed_vision.")))
    assert counts["vision"] == tower > 0 and counts["total"] == sum(p.numel() for p in model.parameters())


@torch.no_grad()
def test_real_images_through_the_processor_match_transformers(pair):
    """Pictures preprocessed by dgemma.images (equal to transformers' Pillow processor, test_images.py) give
    the oracle's logits end to end."""
    from PIL import Image
    from transformers.cache_utils import DynamicCache

    from dgemma.images import preprocess

    oracle, model = pair
    g = torch.Generator().manual_seed(0)
    pictures = [
        Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())
        for h, w in ((90, 160), (300, 40))
    ]
    pixels, counts = preprocess(pictures, budget=70)
    prompt = image_prompt([_text(3, 0), counts[0], _text(2, 1), counts[1], _text(2, 2)], IMAGE, BOI, EOI)
    ids = torch.tensor([prompt])
    pkv = DynamicCache(config=oracle.config.text_config)
    oracle_image_encode(oracle, ids, None, pixels, pkv)
    cache = model.new_cache(1, ids.shape[1] + model.config.canvas_length)
    model.encode(ids, cache, pixels=pixels)
    canvas = torch.randint(0, 500, (1, model.config.canvas_length), generator=g)
    ref = oracle(past_key_values=pkv, decoder_input_ids=canvas).logits
    torch.testing.assert_close(model.denoise(canvas, cache), ref, rtol=0, atol=fp32_logit_tolerance(model))


def _png(path, w: int, h: int, seed: int):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()).save(path)
    return path


def test_generate_takes_images_from_the_command_line_and_the_api(vision_dir, tmp_path, capsys):
    """`dgemma generate --image A --image B` gives the tokens dgemma.generate gives for the same chat
    messages with image parts (images before the text, in the user's turn)."""
    import json

    from dgemma.checkpoints.tokenizer import chat_prompt
    from dgemma.cli import main

    a, b = _png(tmp_path / "a.png", 120, 80, 1), _png(tmp_path / "b.png", 40, 200, 2)
    flags = ["--max-new-tokens", "6", "--max-denoising-steps", "3", "--seed", "4", "--max-soft-tokens", "70"]
    args = ["generate", "-m", str(vision_dir), "-p", "what is this?", "--image", str(a), "--image", str(b), "--json"]
    assert main([*args, *flags]) == 0
    cli = json.loads(capsys.readouterr().out)
    tok = dgemma.Tokenizer.from_dir(vision_dir)
    model = dgemma.load(vision_dir)
    content = [{"type": "image", "image": a}, {"type": "image", "image": b}, {"type": "text", "text": "what is this?"}]
    ids, pixels = chat_prompt(tok, model.config, [{"role": "user", "content": content}], budget=70)
    api = dgemma.generate(dgemma.accelerate(model), ids, pixels=pixels, max_new_tokens=6, max_denoising_steps=3, seed=4)
    assert cli["text"] == tok.decode(api.tokens[0]) and cli["tokens"] == len(api.tokens[0])
    # a text prompt with one image token per image, through generate(images=)
    raw = dgemma.generate(model, "<|image|> hello", tokenizer=tok, images=[a], max_soft_tokens=70, max_new_tokens=4)
    assert len(raw.tokens[0]) == 4


def test_bad_images_on_the_command_line_are_errors_not_crashes(vision_dir, tmp_path, capsys):
    from dgemma.cli import main

    (tmp_path / "notes.txt").write_text("not a picture")
    args = ["generate", "-m", str(vision_dir), "-p", "x", "--max-new-tokens", "2"]
    assert main([*args, "--image", str(tmp_path / "notes.txt")]) == 2
    assert "not an image" in capsys.readouterr().err
    assert main([*args, "--image", str(tmp_path / "missing.png")]) == 2
    assert "cannot read" in capsys.readouterr().err
    picture = str(_png(tmp_path / "a.png", 10, 10, 0))
    assert main([*args, "--image", picture, "--ar"]) == 2
    assert "--ar" in capsys.readouterr().err
    assert main(["generate", "-p", "x", "--max-new-tokens", "2", "--image", picture]) == 2  # the shipped code model
    assert "no vision tower" in capsys.readouterr().err


def test_chat_with_an_image_keeps_it_across_turns(vision_dir, tmp_path, monkeypatch, capsys):
    """`dgemma chat --image A`: the image goes with the first turn; later turns reuse its cached keys, and a
    session that rebuilds its cache runs the image again from the pixels it kept."""
    import json

    from dgemma.checkpoints.tokenizer import chat_prompt
    from dgemma.cli import main
    from dgemma.generation.session import Session

    a = _png(tmp_path / "a.png", 90, 60, 3)
    lines = iter(["what is it?", "and now?", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    flags = ["--max-new-tokens", "4", "--max-denoising-steps", "2", "--seed", "1", "--max-soft-tokens", "70", "--json"]
    assert main(["chat", "-m", str(vision_dir), "--image", str(a), *flags]) == 0
    turns = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(turns) == 2
    tok, model = dgemma.Tokenizer.from_dir(vision_dir), dgemma.load(vision_dir)
    session = Session(model, max_length=256, tokenizer=tok)
    first = [{"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "hi"}]}]
    ids, pixels = chat_prompt(tok, model.config, first, 70)
    session.generate(ids, pixels=pixels, max_new_tokens=4, max_denoising_steps=2, seed=1)
    session.generate([*ids, 7, 8], max_new_tokens=4, max_denoising_steps=2, seed=1)  # continues: text only
    session.generate(ids[:-1], max_new_tokens=4, max_denoising_steps=2, seed=1)  # rebuilt: the image again


@torch.no_grad()
def test_frames_padded_beside_a_larger_image_keep_their_soft_tokens(pair):
    """Pixels.cat pads a video's budget-70 frames to an image's larger budget: padding rows are masked and
    pooled away, so each frame's soft tokens are those of the frame run alone (to rounding: other row counts)."""
    from PIL import Image

    from dgemma.images import preprocess
    from dgemma.model.vision import Pixels

    _, model = pair
    g = torch.Generator().manual_seed(2)
    frames = [
        Image.fromarray(torch.randint(0, 256, (60, 90, 3), generator=g, dtype=torch.uint8).numpy()) for _ in range(2)
    ]
    alone, counts = preprocess(frames, 70)
    image, image_counts = preprocess([frames[0]], 280)
    together = model.image_features(Pixels.cat([image, alone]))
    ref = model.image_features(alone)
    vision = model.vision_tower.config
    tol = fp32_tolerance(ref.abs().max().item(), vision.hidden_size, vision.num_hidden_layers + 1)
    torch.testing.assert_close(together[image_counts[0] :], ref, rtol=0, atol=tol)
    assert together.shape[0] == image_counts[0] + sum(counts)


def test_video_frames_from_the_command_line(vision_dir, tmp_path, capsys):
    import json

    from dgemma.cli import main

    frames = tmp_path / "frames"
    frames.mkdir()
    for k in range(3):
        _png(frames / f"{k:03d}.png", 64, 48, k)
    (frames / "notes.txt").write_text("not a frame")  # other files are passed over
    args = ["generate", "-m", str(vision_dir), "-p", "what happens?", "--video-frames", str(frames), "--fps", "2"]
    assert main([*args, "--max-new-tokens", "3", "--max-denoising-steps", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] <= 3
    assert main([*args, "--raw", "--max-new-tokens", "3"]) == 2
    assert "--raw" in capsys.readouterr().err


def _image_records(tmp_path, n: int = 8):
    """Chat records whose answer is the colour of a one-colour picture: learnable only by looking."""
    import json

    from PIL import Image

    (tmp_path / "pics").mkdir()
    colours = {"red": (220, 30, 30), "blue": (30, 30, 220)}
    with (tmp_path / "data.jsonl").open("w") as f:
        for i in range(n):
            name = list(colours)[i % 2]
            Image.new("RGB", (48 + 16 * i, 48), colours[name]).save(tmp_path / "pics" / f"{i}.png")
            user = [{"type": "image", "image": f"pics/{i}.png"}, {"type": "text", "text": "colour?"}]
            record = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": name}]}
            f.write(json.dumps({**record, "max_soft_tokens": 70}) + "\n")
    return tmp_path / "data.jsonl"


@pytest.mark.parametrize("lora", [False, True])
def test_training_with_images(vision_dir, tmp_path, lora):
    """dgemma train on chat records with images: the images reach the loss (a full fine-tune updates the
    tower; LoRA leaves it frozen), losses are finite and the run resumes exactly."""
    from dgemma.train.config import TrainConfig
    from dgemma.train.trainer import train

    data = _image_records(tmp_path)
    sections = {
        "model": {"path": str(vision_dir)},
        "data": {"train": str(data), "max_length": 160},
        "train": {"steps": 4, "batch_size": 2, "out_dir": str(tmp_path / "run"), "save_every": 2},
        "optim": {"lr": 1e-2, "warmup_steps": 1},
    }
    if lora:
        sections["lora"] = {"r": 4, "alpha": 8}
    cfg = TrainConfig.from_dict(sections, base_dir=tmp_path)
    result = train(cfg, progress=False)
    assert len(result.losses) == 4 and all(torch.isfinite(torch.tensor(result.losses)))
    before = dgemma.load(vision_dir).state_dict()["vision_tower.patch_embedder.input_proj.weight"]
    if not lora:
        after = dgemma.load(result.final_dir).state_dict()["vision_tower.patch_embedder.input_proj.weight"]
        assert not torch.equal(before, after)  # the gradient went through the placed soft tokens
    cfg.train.out_dir = str(tmp_path / "again")
    assert train(cfg, progress=False, stop_after=2).losses + train(cfg, progress=False).losses == result.losses


def test_training_records_with_bad_images_name_their_line(vision_dir, tmp_path):
    from dgemma.images import image_token_strings
    from dgemma.train.data import DataError, load_jsonl

    data = _image_records(tmp_path, n=2)
    tok, model = dgemma.Tokenizer.from_dir(vision_dir), dgemma.load(vision_dir)
    tokens = image_token_strings(tok, model.config)
    examples, _ = load_jsonl(data, tok, vocab_size=512, max_length=160, image_tokens=tokens)
    assert examples[0].images and examples[0].prompt.count(TINY_IMAGE_IDS["image_token_id"]) == 64  # 48x48, enlarged
    (tmp_path / "pics" / "1.png").write_bytes(b"broken")
    with pytest.raises(DataError, match=r"data.jsonl:2: .*not an image"):
        load_jsonl(data, tok, vocab_size=512, max_length=160, image_tokens=tokens)
    with pytest.raises(DataError, match=r"data.jsonl:1: .*no vision tower"):
        load_jsonl(data, tok, vocab_size=512, max_length=160)

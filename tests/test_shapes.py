"""The Shapes task and the vision-language model shipped with dgemma (dgemma/models/shapes, trained by
recipes/shapes-tiny.yaml): scenes are a function of their seed, the records are what training reads, and
the shipped model names held-out colours and shapes far above what a model that cannot see the picture
can."""

from __future__ import annotations

import json

import pytest
import torch

import dgemma
from dgemma.tasks import shapes


def test_scenes_and_records_are_deterministic_and_balanced(tmp_path):
    a, b = shapes.scene(17), shapes.scene(17)
    assert a[1:] == b[1:] and a[0].tobytes() == b[0].tobytes()
    kinds = [shapes.question_of(s) for s in range(400)]
    assert 150 < kinds.count("colour") < 250  # both questions, about equally
    firsts = [shapes.SPLITS[s][0] for s in ("train", "validation", "test")]
    ends = [first + shapes.SPLITS[s][1] for first, s in zip(firsts, ("train", "validation", "test"), strict=True)]
    assert ends[0] <= firsts[1] and ends[1] <= firsts[2]  # disjoint seeds
    record = shapes.record(3, "pics/3.png")
    assert record["messages"][0]["content"][0] == {"type": "image", "image": "pics/3.png"}
    assert record["messages"][1]["content"] in (*shapes.SHAPES, *shapes.COLOURS)


@pytest.mark.skipif(not (shapes.MODEL_DIR / "config.json").is_file(), reason="the shipped Shapes model")
def test_the_shipped_model_sees_the_colour_and_the_shape():
    """Held-out scenes: the shipped model names the colour and the shape of most of them, a blank picture
    gives chance (measured: benchmarks/shapes_eval.py, 100% and 78%; 40 scenes here, with wide margins for
    other CPUs' rounding: chance is 10 of 40 colours, 13 of 40 shapes)."""
    from PIL import Image

    model, tok = dgemma.load(shapes.MODEL_DIR), dgemma.Tokenizer.from_dir(shapes.MODEL_DIR)
    assert model.vision_tower is not None
    runner = dgemma.accelerate(model)
    first = shapes.SPLITS["test"][0]
    seen = {"colour": 0, "shape": 0}
    blank = dict(seen)
    with torch.no_grad():
        for seed in range(first, first + 40):
            image, shape, colour = shapes.scene(seed)
            empty = Image.new("RGB", image.size, image.getpixel((0, 0)))
            for kind, truth in (("colour", colour), ("shape", shape)):
                seen[kind] += shapes.answer(runner, tok, image, kind) == truth
                blank[kind] += shapes.answer(runner, tok, empty, kind) == truth
    assert seen["colour"] >= 32 and seen["shape"] >= 22 and max(blank.values()) <= 22, (seen, blank)


def test_the_data_script_writes_what_training_reads(tmp_path):
    from dgemma.images import GEMMA4_IMAGE_TOKENS
    from dgemma.train.data import load_jsonl

    path = shapes.write_split(tmp_path, "validation")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert (
        len(records) == shapes.SPLITS["validation"][1]
        and (tmp_path / records[0]["messages"][0]["content"][0]["image"]).is_file()
    )
    tok = shapes.make_tokenizer()
    examples, counts = load_jsonl(path, tok, vocab_size=512, max_length=128, image_tokens=GEMMA4_IMAGE_TOKENS)
    assert counts["records"] == len(records) and all(e.images for e in examples)


def test_a_recipe_builds_a_vision_tower_on_a_preset(tmp_path):
    """model.vision: the tower's fields; the image token ids come from the tokenizer; image blocks attend
    both ways. A tokenizer without image tokens is refused."""
    import torch

    from dgemma.train.config import TrainConfig
    from dgemma.train.trainer import build_model

    tok = shapes.make_tokenizer()
    tok.save(tmp_path / "tok")
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "position_embedding_size": 32,
    }
    data = {"train": "x.jsonl", "tokenizer": str(tmp_path / "tok")}
    sections = {"model": {"preset": "tiny", "vision": vision}, "data": data, "train": {"steps": 1}}
    cfg = TrainConfig.from_dict(sections, base_dir=tmp_path)
    model, _ = build_model(cfg, torch.device("cpu"))
    assert model.vision_tower is not None and model.text_config.use_bidirectional_attention == "vision"
    assert model.config.image_token_id == tok.token_to_id("<|image|>")
    from helpers import make_tokenizer

    make_tokenizer().save(tmp_path / "plain")
    cfg.data.tokenizer = str(tmp_path / "plain")
    with pytest.raises(ValueError, match="lacks the image tokens"):
        build_model(cfg, torch.device("cpu"))

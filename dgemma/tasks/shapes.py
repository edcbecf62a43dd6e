"""Shapes: a small vision-language task that can only be solved by looking at the picture.

A scene is one shape (circle, square or triangle) of one colour (red, green, blue or yellow), at a random
place and size on a light background, 64 x 64 pixels, drawn with Pillow. The question asks its colour or
its shape; the answer is one word. Every answer of a question is equally likely, so a model that cannot
see the image does no better than chance (the text-only baseline: 1/4 for colours, 1/3 for shapes).
Scenes are a function of their seed; the training, validation and test scenes use disjoint seeds.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from ..checkpoints.tokenizer import train_bpe

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (210, 40, 40), "green": (40, 160, 60), "blue": (40, 70, 210), "yellow": (220, 200, 40)}
QUESTIONS = {"colour": "What colour is the shape?", "shape": "What shape is it?"}
SIZE = 64
BUDGET = 70  # soft tokens per image (the smallest budget: the picture is simple)
SPLITS = {"train": (0, 4000), "validation": (100_000, 200), "test": (200_000, 400)}  # first seed, count
MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "shapes"


def scene(seed: int):
    """(PIL image, shape, colour) of one scene."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
    shade = rng.randint(215, 245)
    image = Image.new("RGB", (SIZE, SIZE), (shade, shade, shade))
    draw = ImageDraw.Draw(image)
    r = rng.randint(9, 20)
    cx, cy = rng.randint(r + 2, SIZE - r - 3), rng.randint(r + 2, SIZE - r - 3)
    box = (cx - r, cy - r, cx + r, cy + r)
    fill = tuple(min(255, max(0, c + rng.randint(-20, 20))) for c in COLOURS[colour])
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return image, shape, colour


def question_of(seed: int) -> str:
    """Which question a scene's record asks ("colour" or "shape"), also a function of the seed."""
    return "colour" if random.Random(seed * 7919 + 1).random() < 0.5 else "shape"


def record(seed: int, image_path: str) -> dict:
    """The chat record of one scene: the image, the question, and the one-word answer."""
    _, shape, colour = scene(seed)
    kind = question_of(seed)
    user = [{"type": "image", "image": image_path}, {"type": "text", "text": QUESTIONS[kind]}]
    answer = colour if kind == "colour" else shape
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}], "seed": seed}


def write_split(directory: Path, split: str) -> Path:
    """Draw a split's scenes into directory/pics/ and its records into directory/{split}.jsonl."""
    first, count = SPLITS[split]
    (directory / "pics").mkdir(parents=True, exist_ok=True)
    path = directory / f"{split}.jsonl"
    with path.open("w") as f:
        for seed in range(first, first + count):
            name = f"pics/{seed}.png"
            scene(seed)[0].save(directory / name)
            f.write(json.dumps({**record(seed, name), "max_soft_tokens": BUDGET}) + "\n")
    return path


def make_tokenizer():
    """A byte-level BPE over the task's words, with Gemma 4's image tokens and the chat template."""
    corpus = [*QUESTIONS.values(), *SHAPES, *COLOURS] * 50
    return train_bpe(corpus, 512, images=True)


def answer(runner, tokenizer, image, kind: str, seed: int = 0) -> str:
    """The model's one-word answer to a scene's question (kind: "colour" or "shape")."""
    return ask(runner, tokenizer, image, kind, seed)[0]


def ask(runner, tokenizer, image, kind: str, seed: int = 0):
    """(the one-word answer, the GenerationResult) of a scene's question."""
    from ..checkpoints.tokenizer import chat_prompt
    from ..generation.programs import generate

    messages = [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTIONS[kind]}]}
    ]
    ids, pixels = chat_prompt(tokenizer, runner.config, messages, BUDGET)
    result = generate(runner, ids, pixels=pixels, max_new_tokens=4, seed=seed)
    words = tokenizer.decode(result.tokens[0], skip_special_tokens=True).split()  # the end of turn is special
    return (words[0] if words else ""), result

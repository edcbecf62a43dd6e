"""Extract: a synthetic extraction task for structured output. A sentence about an order goes in, the
order as JSON valid against `SCHEMA` comes out.

Each example is a function of its seed: an order id, a customer (first and last name), a city, a
quantity, a colour, an item and the shipping (express or not), written in one of several phrasings that
put the facts in different orders. The training, validation and test sentences use disjoint seeds, so
the test orders (their combinations of names, places and numbers) are never seen in training. Answers
are compact JSON with the schema's keys in order, as dgemma.generate_json lays them out.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from ..checkpoints.tokenizer import train_bpe

FIRST = ("Ana", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kaya", "Liam",
         "Mara", "Nico", "Olga", "Pedro", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wen", "Yara")  # fmt: skip
LAST = ("Lopez", "Smith", "Okafor", "Rossi", "Novak", "Tanaka", "Silva", "Berg", "Dubois", "Kaur", "Meyer",
        "Haddad", "Costa", "Ivanova", "Moreau", "Nakamura", "Petrov", "Quist", "Reyes", "Schulz")  # fmt: skip
CITIES = ("Porto", "Lyon", "Osaka", "Lagos", "Quito", "Oslo", "Cork", "Bergen", "Kyoto", "Lima", "Turin",
          "Graz", "Leeds", "Nantes", "Malmo", "Tartu")  # fmt: skip
ITEMS = ("mug", "lamp", "chair", "kettle", "scarf", "notebook", "backpack", "teapot")
COLOURS = ("red", "blue", "green", "black", "white", "yellow")
PHRASES = (
    "Order {id}: {name} from {city} wants {qty} {colour} {items}, {ship}.",
    "{name} ({city}) ordered {qty} {colour} {items} - order {id}, {ship}.",
    "Please send {qty} {colour} {items} to {name} in {city}; {ship}. Ref {id}.",
    "Ref {id} - {qty} x {colour} {item} for {name}, {city}. {Ship}.",
    "{Ship} for order {id}: {qty} {colour} {items} going to {city} for {name}.",
    "New order {id} by {name}. Items: {qty} {colour} {items}. Ship to {city}, {ship}.",
)
SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1000, "maximum": 9999},
        "customer": {"type": "string", "minLength": 3, "maxLength": 20},
        "city": {"type": "string", "minLength": 3, "maxLength": 10},
        "item": {"enum": list(ITEMS)},
        "colour": {"enum": list(COLOURS)},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 12},
        "express": {"type": "boolean"},
    },
    "required": ["order_id", "customer", "city", "item", "colour", "quantity", "express"],
    "additionalProperties": False,
}
INSTRUCTION = "Extract the order as JSON."
SPLITS = {"train": (0, 20000), "validation": (1_000_000, 300), "test": (2_000_000, 500)}  # first seed, count
MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "extract"


def example(seed: int) -> tuple[str, dict]:
    """(sentence, the order it states) of one seed."""
    rng = random.Random(seed)
    order = {
        "order_id": rng.randint(1000, 9999),
        "customer": f"{rng.choice(FIRST)} {rng.choice(LAST)}",
        "city": rng.choice(CITIES),
        "item": rng.choice(ITEMS),
        "colour": rng.choice(COLOURS),
        "quantity": rng.randint(1, 12),
        "express": rng.random() < 0.5,
    }
    ship = "express shipping" if order["express"] else "standard shipping"
    item = order["item"]
    plural = item if order["quantity"] == 1 else item + ("es" if item.endswith(("sh", "ch")) else "s")
    text = rng.choice(PHRASES).format(
        id=order["order_id"], name=order["customer"], city=order["city"], qty=order["quantity"],
        colour=order["colour"], item=item, items=plural, ship=ship, Ship=ship.capitalize(),
    )  # fmt: skip
    return text, order


def answer(order: dict) -> str:
    """The order as compact JSON in the schema's key order (what generate_json writes)."""
    return json.dumps({k: order[k] for k in SCHEMA["properties"]}, separators=(",", ":"))


def messages(sentence: str) -> list[dict]:
    """The user turn that asks for the extraction."""
    return [{"role": "user", "content": f"{INSTRUCTION}\n{sentence}"}]


def write_split(directory: Path, split: str) -> Path:
    """A split's chat records (the answer in the assistant turn) into directory/{split}.jsonl."""
    first, count = SPLITS[split]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{split}.jsonl"
    with path.open("w") as f:
        for seed in range(first, first + count):
            sentence, order = example(seed)
            record = {"messages": [*messages(sentence), {"role": "assistant", "content": answer(order)}]}
            f.write(json.dumps({**record, "seed": seed}) + "\n")
    return path


def make_tokenizer(vocab_size: int = 768):
    """A byte-level BPE over the task's sentences and answers, with the chat template."""
    corpus = []
    for seed in range(3000):
        sentence, order = example(seed)
        corpus += [f"{INSTRUCTION}\n{sentence}", answer(order)]
    return train_bpe(corpus, vocab_size)

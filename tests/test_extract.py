"""The Extract task: examples are functions of their seeds, answers validate against the schema, splits are
disjoint; the shipped extraction model writes held-out orders as valid JSON with most fields right."""

from __future__ import annotations

import json

import jsonschema
import pytest

import dgemma
from dgemma.tasks import extract


def test_examples_state_their_orders_and_answers_validate():
    for seed in range(200):
        sentence, order = extract.example(seed)
        assert extract.example(seed) == (sentence, order)
        for key in ("order_id", "customer", "city", "colour", "quantity"):
            assert str(order[key]) in sentence
        value = json.loads(extract.answer(order))
        jsonschema.validate(value, extract.SCHEMA)
        assert list(value) == list(extract.SCHEMA["properties"]) and value == order


def test_splits_use_disjoint_seeds(tmp_path):
    spans = [range(first, first + n) for first, n in extract.SPLITS.values()]
    assert all(not set(a) & set(b) for i, a in enumerate(spans) for b in spans[i + 1 :])
    path = extract.write_split(tmp_path, "validation")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == extract.SPLITS["validation"][1]
    assert records[0]["messages"][1]["content"] == extract.answer(extract.example(records[0]["seed"])[1])


@pytest.mark.skipif(not (extract.MODEL_DIR / "model.safetensors").is_file(), reason="the model is not shipped")
def test_the_shipped_model_extracts_held_out_orders():
    from dgemma.generation.programs import generate_json

    model = dgemma.load(extract.MODEL_DIR, dtype="fp32")
    tok = dgemma.Tokenizer.from_dir(extract.MODEL_DIR)
    first = extract.SPLITS["test"][0]
    right = total = 0
    for i in range(12):
        sentence, truth = extract.example(first + i)
        prompt = tok.apply_chat_template(extract.messages(sentence), add_generation_prompt=True)
        out = generate_json(model, prompt, extract.SCHEMA, tokenizer=tok, seed=i, max_denoising_steps=8)
        jsonschema.validate(out.value, extract.SCHEMA)  # every constrained answer is valid: by construction
        text = tok.decode(dgemma.generate(model, prompt, seed=i, max_new_tokens=96).tokens[0])
        try:
            free = json.loads(text[text.index("{") : text.rindex("}") + 1])
        except ValueError:
            free = {}
        right += sum(free.get(k) == truth[k] for k in truth) if isinstance(free, dict) else 0
        total += len(truth)
    # free answers: 57.5% of fields on 200 orders (docs/structured.md); an untrained model gets none
    assert right / total > 0.35, right / total


@pytest.mark.skipif(not (extract.MODEL_DIR / "model.safetensors").is_file(), reason="the model is not shipped")
def test_the_server_sizes_json_answers_by_a_draft_as_the_python_api_does():
    pytest.importorskip("uvicorn")
    import openai
    from live_server import KEY, LiveServer

    from dgemma.generation.programs import generate_json
    from dgemma.server.app import create_app

    model = dgemma.load(extract.MODEL_DIR, dtype="fp32")
    tok = dgemma.Tokenizer.from_dir(extract.MODEL_DIR)
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": extract.SCHEMA, "strict": True}}
    first, keys = extract.SPLITS["test"][0], list(extract.SCHEMA["properties"])
    same = right = 0
    with LiveServer(create_app(model, tok, model_name="extract", api_key=KEY)) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0)
        for i in range(8):
            sentence, truth = extract.example(first + i)
            r = client.chat.completions.create(
                model="extract", messages=extract.messages(sentence), response_format=fmt, seed=i,
                extra_body={"max_denoising_steps": 8},
            )  # fmt: skip
            served = json.loads(r.choices[0].message.content)
            jsonschema.validate(served, extract.SCHEMA)
            prompt = tok.apply_chat_template(extract.messages(sentence), add_generation_prompt=True)
            local = generate_json(model, prompt, extract.SCHEMA, tokenizer=tok, seed=i, max_denoising_steps=8)
            same += served == local.value
            right += sum(served[k] == truth[k] for k in keys)
    # the engine's batched steps and generate agree to fp32 rounding, not to the bit: a near-tie may flip
    assert same >= 6, same
    # sized by a draft: 58% of fields on 200 orders (docs/structured.md); by the schema's budgets alone, 14%
    assert right / (8 * len(keys)) > 0.4, right

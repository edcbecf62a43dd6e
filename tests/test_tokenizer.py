"""Tokenizer and chat template: identical text and ids to transformers' rendering of the same files."""

from __future__ import annotations

import json

import pytest
from helpers import make_tokenizer

from dgemma import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Write a haiku about rain."}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "hi"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": [{"type": "text", "text": "and 3+3?"}]},
    ],
    [{"role": "developer", "content": "rules"}, {"role": "user", "content": "Ünïcödé ✓ 🚀"}],
]

# Exercises what real templates use: namespace, loop controls, tojson, raise_exception, generation blocks.
FEATURE_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}\n"
    "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}\n"
    "{% if loop.index > 5 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}\n"
    "<{{ m['role'] }}>{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] | trim }}{% endif %}\n"
    "{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}{{ ns.n }}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tok = make_tokenizer(vocab_size=400)
    tok.save(d)
    return d


@pytest.fixture(scope="module")
def hf(saved):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(saved)


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("thinking", [None, False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_rendering_matches_transformers(saved, hf, conversation, thinking, add_generation_prompt):
    tok = Tokenizer.from_dir(saved)
    messages = CONVERSATIONS[conversation]
    extra = {} if thinking is None else {"enable_thinking": thinking}
    ours = tok.render_chat(messages, add_generation_prompt=add_generation_prompt, **extra)
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
    assert ours == theirs
    ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
    assert ids == hf(theirs, add_special_tokens=False)["input_ids"]


def test_template_shape(saved):
    tok = Tokenizer.from_dir(saved)
    text = tok.render_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], enable_thinking=True)
    assert text == "<bos><|turn>system\n<|think|>S<turn|>\n<|turn>user\nU<turn|>\n<|turn>model\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "U"}])
    assert ids[0] == tok.bos_token_id == 2 and tok.token_to_id("<|turn>") in ids


def test_template_features_match_transformers(saved, hf, tmp_path):
    (tmp_path / "tok").mkdir()
    for f in saved.iterdir():
        (tmp_path / "tok" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "tok" / "chat_template.jinja").write_text(FEATURE_TEMPLATE)
    from transformers import AutoTokenizer

    theirs_tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    ours_tok = Tokenizer.from_dir(tmp_path / "tok")
    messages = [{"role": "user", "content": f"q{i} "} for i in range(7)] + [{"role": "assistant", "content": "a"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "é <b>"}}]
    assert ours_tok.render_chat(messages, tools=tools) == theirs_tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    with pytest.raises(ValueError, match="no tools here"):
        ours_tok.render_chat([{"role": "tool", "content": "x"}])


def test_encode_decode_round_trip(saved):
    tok = Tokenizer.from_dir(saved)
    text = "def f(x):\n    return x ** 2  # ünïcode ✓"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert (tok.eos_token_id, tok.pad_token_id) == (1, 0)
    assert tok.vocab_size == 400


def test_config_json_template_and_named_templates(saved, tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((saved / "tokenizer.json").read_bytes())
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": {"content": "<bos>"}, "chat_template": [{"name": "default", "template": "X{{ bos_token }}"}]}
        )
    )
    assert Tokenizer.from_dir(d).render_chat([{"role": "user", "content": "hi"}]) == "X<bos>"


def test_errors(saved, tmp_path):
    tok = Tokenizer.from_dir(saved)
    with pytest.raises(ValueError, match="non-empty list"):
        tok.render_chat([])
    with pytest.raises(ValueError, match="image_url content"):  # OpenAI's shape is the server's to read
        tok.render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}])
    with pytest.raises(ValueError, match=r"has an image or video: use dgemma\.chat_prompt"):  # ids alone lose it
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image", "image": "x.png"}]}])
    with pytest.raises(ValueError, match="must be 'user', 'assistant' or 'tool'"):
        tok.render_chat([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
    with pytest.raises(ValueError, match="string 'role'"):
        tok.render_chat([{"content": "no role"}])
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="not a valid tokenizers file"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((saved / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).render_chat([{"role": "user", "content": "hi"}])
    (tmp_path / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(ValueError, match="does not compile"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize(
    "text, message",
    [
        ("\ud800", "character 0 is a lone surrogate U+D800"),  # what a JSON "\ud800" escape decodes to
        ("ab\udcff", "character 2 is a lone surrogate U+DCFF (the byte 0xff"),  # argv bytes via surrogateescape
        ("x\udfff\ud800", "character 1 is a lone surrogate U+DFFF"),  # the first bad character is named
    ],
)
def test_encode_refuses_text_that_is_not_valid_unicode(text, message):
    tok = make_tokenizer(vocab_size=400)
    with pytest.raises(ValueError) as e:
        tok.encode(text)
    assert f"the text is not valid Unicode: {message}" in str(e.value)
    with pytest.raises(ValueError, match="not valid Unicode"):  # chat messages go through encode too
        tok.apply_chat_template([{"role": "user", "content": text}])
    assert tok.decode(tok.encode("Ünïcödé ✓ 🚀 \U0010ffff")) == "Ünïcödé ✓ 🚀 \U0010ffff"  # astral characters are fine


def test_template_errors_from_values_of_the_wrong_shape_are_value_errors():
    """A tool or a call whose values the template cannot take (a name that is not a string, a function
    that is not an object, nesting past the recursion limit) is a ValueError, as a template error is."""
    tok = make_tokenizer(vocab_size=400)  # the shipped Gemma 4-style template, tools and all
    user = [{"role": "user", "content": "x"}]
    deep: object = "leaf"
    for _ in range(2000):
        deep = [deep]
    bad_tools = [
        [{"function": {"name": 5}}],
        [{"type": "function", "function": "f"}],
        [{"name": "f", "description": deep}],
    ]
    for tools in bad_tools:
        with pytest.raises(ValueError, match="chat template"):
            tok.render_chat(user, tools=tools)
    call = {"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": ["f"], "arguments": {}}}]}
    with pytest.raises(ValueError, match="chat template"):
        tok.render_chat([*user, call])

"""Tokenizer and chat template of a checkpoint directory.

Reads `tokenizer.json` (the `tokenizers` format), the special tokens named in `tokenizer_config.json`,
and the chat template from `chat_template.jinja` or `tokenizer_config.json`'s `chat_template`. Chat
messages are rendered the way Hugging Face renders them (a sandboxed Jinja environment with
trim_blocks / lstrip_blocks, `raise_exception`, `strftime_now`, a JSON `tojson` and `{% generation %}`
blocks), so the text is what the checkpoint's template produces there.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from .. import images
from ..model.vision import Pixels
from .gguf_file import gguf_path, read_tokenizer

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; it renders its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's API)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment chat templates are written for."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not compile (line {e.lineno}): {e.message}") from e


TEXT_ONLY_ROLES = ("system", "developer", "tool")  # roles whose content templates read as one string


def _parts_text(i: int, role: str, parts: list) -> str:
    """The text of a text-only role's content parts, one part a line (OpenAI takes parts in every role;
    templates read these roles' content as a string, and would otherwise write the list's repr)."""
    texts = []
    for part in parts:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"message {i}: a {role} message holds text parts only (got {kind!r})")
        texts.append(part["text"])
    return "\n".join(texts)


def _check_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {i} must be a dict with a string 'role' (got {m!r})")
        content = m.get("content")
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("image_url", "audio"):  # images come as {"type": "image", "image": ...}
                    raise ValueError(
                        f"message {i} has {kind} content; dgemma takes text, image and video (frames) parts"
                    )
            if m["role"] in TEXT_ONLY_ROLES:
                m = {**m, "content": _parts_text(i, m["role"], content)}
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"message {i}: content must be a string or a list of parts (got {type(content).__name__})")
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:  # templates read one of several names for the same thing
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def check_unicode(text: str, what: str = "the text") -> str:
    """Return `text` if it is valid Unicode, else raise a ValueError naming the first bad character.

    A Python string can hold lone surrogates (U+D800-U+DFFF) that no UTF-8 text contains: bytes that are not
    UTF-8 become U+DC80-U+DCFF when read with errors="surrogateescape" (command-line arguments, and stdin
    in a C locale), and JSON "\\ud800" escapes decode to them. The tokenizer cannot encode them.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = ord(text[e.start])
        origin = f" (the byte 0x{bad - 0xDC00:02x}, which is not UTF-8)" if 0xDC80 <= bad <= 0xDCFF else ""
        raise ValueError(
            f"{what} is not valid Unicode: character {e.start} is a lone surrogate U+{bad:04X}{origin}; give UTF-8 text"
        ) from None
    return text


class Tokenizer:
    """Text <-> token ids, special tokens, and the chat template, for one checkpoint."""

    def __init__(
        self, tokenizer: _HFTokenizer, special_tokens: dict[str, str] | None = None, chat_template: str | None = None
    ):
        self._tok = tokenizer
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self._compiled = compile_chat_template(chat_template) if chat_template else None

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and the chat template from a checkpoint directory
        (a GGUF file, or a directory with one .gguf and no tokenizer.json: `from_gguf`)."""
        directory = Path(path)
        gguf = gguf_path(directory) if not (directory / "tokenizer.json").is_file() else None
        if gguf is not None:
            return cls.from_gguf(gguf)
        tj = directory / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"{tj} not found: dgemma needs the tokenizer in tokenizers' JSON format")
        try:
            tok = _HFTokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(f"{tj} is not a valid tokenizers file: {e}") from e
        config: dict[str, Any] = {}
        tc = directory / "tokenizer_config.json"
        if tc.is_file():
            try:
                config = json.loads(tc.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{tc} is not valid JSON: {e}") from e
        special = {}
        for key in _SPECIAL_KEYS:
            value = config.get(key)
            if isinstance(value, dict):  # the older AddedToken form
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        template = None
        jinja_file = directory / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        elif isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
        elif isinstance(config.get("chat_template"), list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in config["chat_template"] if isinstance(t, dict)}
            template = named.get("default")
        return cls(tok, special, template)

    def save(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into `path`."""
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(directory / "tokenizer.json"))
        config = {**self.special_tokens, "tokenizer_class": "PreTrainedTokenizerFast"}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        if self.chat_template:
            (directory / "chat_template.jinja").write_text(self.chat_template)

    def to_json(self) -> str:
        """The tokenizer as tokenizers' JSON (what tokenizer.json holds)."""
        return self._tok.to_str()

    def vocab(self) -> dict[str, int]:
        """Every token (added ones too) with its id."""
        return self._tok.get_vocab(with_added_tokens=True)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        """The tokenizer of a GGUF file (dgemma.checkpoints.gguf_file.read_tokenizer); without one in the file, the
        tokenizer.json (and chat template) of the file's directory."""
        path = Path(path)
        parts = read_tokenizer(path)
        if parts is not None:
            source, special, template = parts
            return cls(_HFTokenizer.from_str(source), special, template)
        if (path.parent / "tokenizer.json").is_file():
            return cls.from_dir(path.parent)
        raise ValueError(
            f"{path} has neither tokenizer.huggingface.json nor a Gemma SentencePiece vocabulary, the forms "
            "dgemma reads. Put the model's tokenizer.json (and chat template) beside the file"
        )

    # -- ids --------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token's vocabulary entry holds: a text of more characters than
        `max_token_chars * n` cannot fit in n tokens (the server refuses such prompts before tokenising)."""
        return max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    @functools.cached_property
    def token_texts(self) -> list[str]:
        """The text each token id decodes to in the middle of a text (index = id): what a constrained
        position holding that token adds to the output. Decoded after an anchor token, so that decoders
        which treat a text's first token specially (a leading space stripped) do not; a byte-level piece
        that is only part of a character decodes to U+FFFD."""
        anchor = self._tok.encode("a", add_special_tokens=False).ids[:1]
        skip = len(self._tok.decode(anchor))
        texts = self._tok.decode_batch([[*anchor, i] for i in range(self.vocab_size)], skip_special_tokens=False)
        return [t[skip:] for t in texts]

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special (control) tokens: never part of generated text a constraint builds."""
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of one id (not decoded text: byte-level pieces stay as stored)."""
        return self._tok.id_to_token(token_id)

    def _special_id(self, key: str) -> int | None:
        token = self.special_tokens.get(key)
        return None if token is None else self._tok.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; a ValueError when it is not valid Unicode (see `check_unicode`)."""
        return self._tok.encode(check_unicode(text), add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- chat -------------------------------------------------------------------------------------------
    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text the checkpoint's chat template makes of `messages`.

        `enable_thinking` is passed to the template only when given (templates may default it either way).
        """
        if self._compiled is None:
            raise ValueError(
                "this tokenizer has no chat template (no chat_template.jinja and no chat_template "
                "in tokenizer_config.json); pass raw text instead"
            )
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        try:
            return self._compiled.render(
                messages=_check_messages(messages),
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
                **kwargs,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template rejected these messages: {e}") from e
        except (TypeError, AttributeError, RecursionError) as e:  # values of the wrong type, or nested too deep
            what = f"{type(e).__name__}: {e}"
            raise ValueError(f"the chat template cannot render these messages or tools ({what})") from e

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat (the template writes any BOS itself, so none is added). Messages
        with images go through chat_prompt (below), which returns their pixels too."""
        for i, m in enumerate(messages if isinstance(messages, list) else []):
            parts = m.get("content") if isinstance(m, dict) else None
            if isinstance(parts, list) and any(
                isinstance(p, dict) and p.get("type") in ("image", "video") for p in parts
            ):
                raise ValueError(
                    f"message {i} has an image or video: use dgemma.chat_prompt(tokenizer, model.config, "
                    "messages), which gives the token ids and the images' pixels"
                )
        return self.encode(self.render_chat(messages, **kwargs), add_special_tokens=False)


# ------------------------------------------------------------------------------------------------
# Tokenizers for the small models dgemma trains (dgemma/tasks) and for tests

SPECIAL_TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<|turn>",
    "<turn|>",
    "<|think|>",
    "<|channel>",
    "<channel|>",
]  # ids 0..9, as Gemma 4 lays its specials out
IMAGE_TOKENS = ("<|image>", "<|image|>", "<image|>")  # dgemma.images.GEMMA4_IMAGE_TOKENS
TEMPLATE_PATH = Path(__file__).parent.parent / "templates" / "gemma4_chat.jinja"


# ------------------------------------------------------------------------------------------------
# Chat messages with images and videos: their placeholders expanded (dgemma/images.py preprocesses)


def media_of(messages: list[dict]) -> list[tuple[str, object, float | None]]:
    """The images and videos of chat messages in order: ("image", source, None) for every
    {"type": "image", "image": ...} part, ("video", [frames...], fps) for every
    {"type": "video", "video": [frame, ...], "fps": 1.0} part (frames are images)."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image":
                if part.get("image") is None:
                    raise ValueError(f"message {i} part {j}: an image part needs an 'image' (path, bytes or PIL image)")
                found.append(("image", part["image"], None))
            elif kind == "video":
                frames, fps = part.get("video"), part.get("fps", 1.0)
                if not isinstance(frames, list | tuple) or not frames:
                    raise ValueError(f"message {i} part {j}: a video part needs 'video', a non-empty list of frames")
                if isinstance(fps, bool) or not isinstance(fps, int | float) or not 0 < fps <= 60:
                    raise ValueError(f"message {i} part {j}: fps must be a number in (0, 60] (got {fps!r})")
                found.append(("video", list(frames), float(fps)))
    return found


def chat_prompt(tokenizer, config, messages: list[dict], budget: int = images.DEFAULT_BUDGET, **template_kwargs):
    """Token ids of chat messages rendered by the checkpoint's template, image and video parts included,
    and their Pixels (None without any): images at `budget`, video frames at VIDEO_FRAME_BUDGET, both cut as
    the checkpoint's vision_config says."""
    found = media_of(messages)
    text = tokenizer.render_chat(messages, **template_kwargs)
    if not found:
        return tokenizer.encode(text, add_special_tokens=False), None
    tokens = images.image_token_strings(tokenizer, config)
    cut = images.geometry(config)
    groups, pieces = [], []
    rest = text
    for kind, source, fps in found:
        marker = tokens[1] if kind == "image" else images.VIDEO_MARKER
        head, sep, rest = rest.partition(marker)
        if not sep:
            raise ValueError(f"the chat template wrote fewer {kind} tokens than the messages have {kind}s")
        if kind == "image":
            pixels, counts = images.preprocess([source], budget, **cut)
            pieces += [head, images.expand_image_tokens(marker, counts, tokens)]
        else:
            pixels, counts = images.preprocess(source, images.VIDEO_FRAME_BUDGET, what="video frame", **cut)
            pieces += [head, images.frames_text(counts, fps, tokens)]
        groups.append(pixels)
    if tokens[1] in rest or images.VIDEO_MARKER in rest:
        raise ValueError("the prompt has more image or video tokens than the messages have images and videos")
    ids = tokenizer.encode("".join(pieces) + rest, add_special_tokens=False)  # the template wrote BOS
    return ids, Pixels.cat(groups)


def train_bpe(corpus: list[str], vocab_size: int, *, images: bool = False) -> Tokenizer:
    """A byte-level BPE Tokenizer trained on `corpus`, with Gemma 4-style specials (ids 0..9) and dgemma's
    chat template; with `images`, Gemma 4's image tokens take the last three ids."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = _HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(IMAGE_TOKENS) if images else vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    if images:
        tok.add_special_tokens(list(IMAGE_TOKENS))
    special = {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
    }
    return Tokenizer(tok, special, TEMPLATE_PATH.read_text())

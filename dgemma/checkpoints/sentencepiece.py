"""A Gemma tokenizer rebuilt from the SentencePiece vocabulary a llama.cpp GGUF stores (no tokenizer.json).

A GGUF of Gemma 1-3 (`tokenizer.ggml.model` "llama") lists the pieces, their types and scores, but no merges.
The tokenizer it describes is SentencePiece BPE, which `tokenizers` runs as a BPE model once the merges are
known. They follow from the vocabulary: every way of cutting a piece into two pieces of the vocabulary is a
merge, ranked by where the whole piece sits in the file (Gemma's scores do not give its merge order; the file
order does), and, for one piece, the longer left part first. Pieces made only of spaces are stored with
real spaces but looked up as U+2581 (the text's spaces become U+2581 before the model sees them), so they
are respelled first. Control pieces become special added tokens, user-defined ones (the runs of newlines,
`[multimodal]`) plain added tokens, so they are matched whole.

This is what transformers' GGUF reader builds for Gemma (the project's oracle; tests/test_sentencepiece.py
checks ids and text against it on the real Gemma 3 270M vocabulary). Written here because the dgemma package
never imports transformers, and the `sentencepiece` library cannot read a GGUF's vocabulary.
"""

from __future__ import annotations

import json

SPACE = "\u2581"
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3", "gemma3n")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types (1 normal, 2 unknown, 5 unused, 6 byte)
# The longest piece a vocabulary may hold. Rebuilding the merges tries every two-piece cut of a piece, which
# costs the square of its length: a 1 MB piece alone would take hours. Gemma 3's 262,144 pieces are at most
# 31 characters long (a run of spaces), so 256 leaves ample room for any real SentencePiece vocabulary.
MAX_PIECE_CHARS = 256


def respelled(pieces: list[str]) -> list[str]:
    """The pieces as the model looks them up: a piece of spaces only as that many U+2581."""
    return [SPACE * len(p) if p and not p.strip(" ") else p for p in pieces]


def merges_from_vocab(pieces: list[str]) -> list[tuple[str, str]]:
    """SentencePiece BPE's merges implied by a vocabulary in rank order: each piece's two-piece cuts, the
    pieces in file order (a repeated piece at its last place), the longer left part first within one."""
    rank = {p: i for i, p in enumerate(pieces)}
    merges = []
    for piece in sorted(rank, key=rank.__getitem__):
        merges += [
            (piece[:k], piece[k:]) for k in range(len(piece) - 1, 0, -1) if piece[:k] in rank and piece[k:] in rank
        ]
    return merges


def gemma_tokenizer_json(
    pieces: list[str], types: list[int], *, unk_id: int, bos_id: int | None, add_bos: bool = True
) -> str:
    """The tokenizers JSON (tokenizer.json) of a Gemma SentencePiece vocabulary: `pieces` and their llama.cpp
    `types` in id order, the unknown and BOS ids, and whether encoding puts BOS first."""
    if len(pieces) != len(types):
        raise ValueError(f"the file lists {len(pieces)} tokens but {len(types)} token types")
    longest = max(range(len(pieces)), key=lambda i: len(pieces[i]), default=0)
    if pieces and len(pieces[longest]) > MAX_PIECE_CHARS:
        raise ValueError(
            f"token {longest} ({pieces[longest][:20]!r}...) is {len(pieces[longest])} characters long; a "
            f"SentencePiece vocabulary's pieces are at most {MAX_PIECE_CHARS}"
        )
    for name, i in (("unknown", unk_id), ("bos", bos_id)):
        if i is not None and not 0 <= i < len(pieces):
            raise ValueError(f"the {name} token id {i} is outside the vocabulary of {len(pieces)}")
    spelled = respelled(pieces)
    vocab = {p: i for i, p in enumerate(spelled)}
    added = [
        {"id": vocab[p], "content": p, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": kind == _CONTROL}
        for p, kind in zip(pieces, types, strict=True)
        if kind == _CONTROL or (kind == _USER_DEFINED and p in vocab)
    ]  # fmt: skip
    added.sort(key=lambda t: t["id"])
    post = None
    if add_bos and bos_id is not None:
        bos = spelled[bos_id]
        post = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
        }  # fmt: skip
    document = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
        "pre_tokenizer": None,  # the whole text is one word: SentencePiece does not split before merging
        "post_processor": post,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": spelled[unk_id], "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": [list(m) for m in merges_from_vocab(spelled)]},
    }  # fmt: skip
    return json.dumps(document, ensure_ascii=False)

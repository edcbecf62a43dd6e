"""Choices: the answer is one of given options, chosen by the encoder's log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..editing import continuation_logprobs, end_of_text_ids
from ..generate import prompt_rows
from ..runtime.runner import Runner, as_runner

# ------------------------------------------------------------------------------------------------
# Choices: the answer is one of given options


MAX_OPTIONS = 64


@dataclass
class Chosen:
    index: int  # of the option chosen
    option: str | list[int]
    scores: list[float]  # per option: the encoder's log-probability of it and the end of text after it


def choose(model: Runner | Any, prompt, options: list, *, tokenizer=None, whole: bool = True) -> Chosen:
    """The option (text, with `tokenizer`, or token ids) the model most likely answers `prompt` (one row)
    with: each is scored by the encoder's summed next-token log-probability of its tokens and of the
    end-of-text token after them (so that an option is scored as the whole answer, not as the start of a
    longer one; `whole=False`: as the start of the answer, without it), all options in one batch."""
    runner = as_runner(model)
    rows = prompt_rows(prompt, tokenizer)
    if len(rows) != 1:
        raise ValueError("choose takes one prompt")
    if not isinstance(options, list) or not 0 < len(options) <= MAX_OPTIONS:
        raise ValueError(f"options must be a list of 1 to {MAX_OPTIONS} options")
    ids = [_option_ids(o, tokenizer, runner.model.text_config.vocab_size, i) for i, o in enumerate(options)]
    end = end_of_text_ids(runner.model)[:1] if whole else []
    scores = [float(lp.sum()) for lp in continuation_logprobs(runner, rows[0], [o + end for o in ids])]
    best = max(range(len(options)), key=scores.__getitem__)
    return Chosen(best, options[best], scores)


def _option_ids(option, tokenizer, vocab: int, i: int) -> list[int]:
    if isinstance(option, str):
        if tokenizer is None:
            raise ValueError("text options need a tokenizer")
        ids = tokenizer.encode(option, add_special_tokens=False)
    else:
        ids = list(option)
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
        raise ValueError(f"option {i} must be a non-empty text or a list of token ids in [0, {vocab})")
    return ids

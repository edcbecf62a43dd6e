"""Log-probabilities in the OpenAI shapes: a completion's legacy `logprobs` block (tokens, token_logprobs,
top_logprobs, text_offset) and a chat choice's `logprobs.content` list.

Where the numbers come from (docs/structured.md): a prompt's tokens (completions with `echo`) are scored
by the causal encoder, each given the tokens before it (the Score task of dgemma.generation.programs; the
first token has none); generated tokens by the denoiser at the last step of the canvas that wrote them, before
temperature (dgemma.generate's `logprobs`): the distribution the committed argmax was read from, not a
left-to-right probability.
"""

from __future__ import annotations


def legacy(tokenizer, tokens: list[int], logprobs: list, tops: list, start: int = 0) -> dict:
    """A completion's `logprobs`: each token's text, its log-probability, its alternatives as
    {text: log-probability} (None where there is none), and where its text starts (from `start`)."""
    texts = tokenizer.token_texts
    words = [texts[t] for t in tokens]
    offsets, at = [], start
    for w in words:
        offsets.append(at)
        at += len(w)
    top = [None if t is None else {texts[i]: v for i, v in t} for t in tops]
    return {"tokens": words, "token_logprobs": list(logprobs), "top_logprobs": top, "text_offset": offsets}


def join(a: dict | None, b: dict) -> dict:
    """Two legacy blocks one after the other (the echoed prompt, then the completion)."""
    if a is None:
        return b
    return {key: a[key] + b[key] for key in b}


def chat(tokenizer, tokens: list[int], logprobs: list[float], tops: list, k: int) -> dict:
    """A chat choice's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    texts = tokenizer.token_texts

    def entry(token: int, value: float) -> dict:
        text = texts[token]
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    content = [
        {**entry(t, v), "top_logprobs": [entry(i, lp) for i, lp in top[:k]]}
        for t, v, top in zip(tokens, logprobs, tops, strict=True)
    ]
    return {"content": content, "refusal": None}

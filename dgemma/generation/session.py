"""A conversation whose prompts and committed canvases are kept between turns (`dgemma.Session`)."""

from __future__ import annotations

from collections.abc import Iterator

from ..model.kv_cache import PrefixCache
from ..model.model import DiffusionGemma
from ..runtime.runner import Runner, as_runner
from .engine import DoneEvent
from .loop import Event
from .programs import stream
from .sampling import SamplingParams


class Session:
    """A conversation (batch of one) whose turns reuse what earlier turns encoded.

    Each turn takes the whole conversation as token ids (typically the chat template's rendering). The
    session's prefix cache (dgemma/model/kv_cache.py, the one a server's engine uses) holds every turn's
    prompt and committed canvases: a turn loads the longest prefix it holds and encodes only the rest,
    so a template that rewrites past turns (drops past thoughts, say) costs only what changed. `pixels`
    are the images of the whole conversation in order (dgemma.chat_prompt gives both); a turn without
    them reuses the last ones given. `max_length` bounds the positions a turn uses (prompt and answer);
    `prefix_cache` may be shared with other sessions (default: one of the session's own, bounded by
    kv_cache.DEFAULT_SHARE of the memory free when it is made).
    """

    def __init__(
        self,
        model: DiffusionGemma | Runner,
        max_length: int | None = None,
        tokenizer=None,
        prefix_cache: PrefixCache | None = None,
    ):
        self.runner = as_runner(model)
        self.model = model = self.runner.model
        self.tokenizer = tokenizer
        self.max_length = max_length or min(model.text_config.max_position_embeddings, 8192)
        self.prefix = PrefixCache.for_model(model) if prefix_cache is None else prefix_cache
        self.pixels = None  # the conversation's images (vision.Pixels), as last given
        self.cached_tokens = 0  # of the last turn's prompt, the positions loaded instead of encoded

    def stream(
        self, conversation: list[int], params: SamplingParams | None = None, *, pixels=None, **overrides
    ) -> Iterator[Event]:
        if not conversation or not all(isinstance(t, int) for t in conversation):
            raise ValueError("the conversation must be a non-empty list of token ids (one row)")
        self.pixels = pixels if pixels is not None else self.pixels
        images = self.pixels if self.model.config.image_token_id in conversation else None
        before = self.prefix.stats.cached_tokens
        kw = dict(tokenizer=self.tokenizer, pixels=images, prefix=self.prefix, context=self.max_length)
        for event in stream(self.runner, conversation, params, **kw, **overrides):
            if isinstance(event, DoneEvent):
                self.cached_tokens = self.prefix.stats.cached_tokens - before
            yield event

    def generate(self, conversation: list[int], params: SamplingParams | None = None, **overrides):
        for event in self.stream(conversation, params, **overrides):
            if isinstance(event, DoneEvent):
                return event.result
        raise AssertionError("stream ended without a DoneEvent")

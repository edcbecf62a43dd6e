"""A conversation whose KV cache is kept between turns (`dgemma.Session`)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..model.model import DiffusionGemma
from ..model.vision import Pixels, image_blocks
from ..runtime.runner import Runner, as_runner
from .engine import DoneEvent
from .loop import Event
from .programs import stream
from .sampling import SamplingParams


class Session:
    """A conversation (batch of one) whose KV cache is kept between turns.

    Each turn takes the whole conversation as token ids (typically the chat template's rendering); only
    the part the cache does not hold yet is encoded. If the conversation no longer extends what is cached
    (for example a template that drops past thoughts), the cache is rebuilt from the start. `pixels` are
    the images of the whole conversation in order (dgemma.chat_prompt gives both); a turn without
    them reuses the last ones given, and only the images of the part encoded are run.
    """

    def __init__(self, model: DiffusionGemma | Runner, max_length: int | None = None, tokenizer=None):
        self.runner = as_runner(model)
        self.model = model = self.runner.model
        self.tokenizer = tokenizer
        self.max_length = max_length or min(model.text_config.max_position_embeddings, 8192)
        self.cache = model.new_cache(1, self.max_length)
        self.cached: list[int] = []  # the token ids whose keys/values are in the cache, in order
        self.pixels = None  # the conversation's images (vision.Pixels), as last given

    def stream(
        self, conversation: list[int], params: SamplingParams | None = None, *, pixels=None, **overrides
    ) -> Iterator[Event]:
        if not conversation or not all(isinstance(t, int) for t in conversation):
            raise ValueError("the conversation must be a non-empty list of token ids (one row)")
        self.pixels = pixels if pixels is not None else self.pixels
        n = len(self.cached)
        if conversation[:n] != self.cached or len(conversation) == n:
            self.cache.reset()
            self.cached, n = [], 0
        new = conversation[n:]
        kw = dict(cache=self.cache, tokenizer=self.tokenizer, pixels=self._images_after(n, new), **overrides)
        for event in stream(self.runner, new, params, **kw):
            if isinstance(event, DoneEvent):
                c = self.model.config.canvas_length
                # every canvas but the last was committed through the encoder
                self.cached = conversation + event.result.sequences[0, :-c].tolist()
                assert len(self.cached) == self.cache.length, "the session lost track of its cache"
            yield event

    def _images_after(self, n: int, new: list[int]):
        """The Pixels of the images whose placeholders lie in `new` (those before it are in the cache)."""
        image = self.model.config.image_token_id
        if self.pixels is None or image is None or image not in new:
            return None
        before = int(image_blocks(torch.tensor([self.cached[:n] or [0]]) == image).max()) + 1
        return Pixels(self.pixels.values[before:], self.pixels.positions[before:])

    def generate(self, conversation: list[int], params: SamplingParams | None = None, **overrides):
        for event in self.stream(conversation, params, **overrides):
            if isinstance(event, DoneEvent):
                return event.result
        raise AssertionError("stream ended without a DoneEvent")

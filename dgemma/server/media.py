"""A chat request's image parts -> images ready for chat_prompt, with the decoded pixels bounded.

data: URLs only; sizes read from the headers and bounded per request, then each image decoded at full size
on threads of its own within a process-wide pixel budget and resized at once. Limits and reasons:
docs/vision.md ("How the code is laid out") and docs/server.md ("Image memory").
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

from .. import images
from ..runtime.cpu import release_freed_memory
from .protocol import ApiError

MAX_REQUEST_PIXELS = 100_000_000  # decoded pixels of one request's images together (8 photos of 12 MP)
MAX_DECODING_PIXELS = 64_000_000  # decoded pixels across the server at once (~256 MB as Pillow holds RGB)
DECODE_THREADS = 2  # each thread that allocates gets a malloc arena of its own: few threads, few arenas
TRIM_AFTER_PIXELS = 4_000_000  # decoded since the last trim before one is worth its milliseconds
TRIM_DELAY_S = 2.0  # and once more this long after the last decode: its request's tensors are freed by then


class PixelBudget:
    """Decoded pixels held at once across threads. `hold(n)` waits, first come first served, until n more
    fit (an image larger than the whole budget waits for all of it). When the last holder lets go after at
    least `trim_after` pixels, the memory the decodes freed goes back to the kernel."""

    def __init__(self, total: int, trim_after: int = TRIM_AFTER_PIXELS, trim_delay: float = TRIM_DELAY_S):
        self.total, self.trim_after, self.trim_delay = total, trim_after, trim_delay
        self.held = self.peak = 0  # pixels held now, and the most held at once
        self._since_trim = 0
        self._timer: threading.Timer | None = None
        self._turn = threading.Condition()
        self._tickets = itertools.count()
        self._serving = 0

    @contextlib.contextmanager
    def hold(self, pixels: int):
        pixels = min(pixels, self.total)
        with self._turn:
            ticket = next(self._tickets)
            self._turn.wait_for(lambda: self._serving == ticket and self.held + pixels <= self.total)
            self._serving += 1
            self.held += pixels
            self.peak = max(self.peak, self.held)
            self._turn.notify_all()
        try:
            yield
        finally:
            with self._turn:
                self.held -= pixels
                self._since_trim += pixels
                trim = self.held == 0 and self._since_trim >= self.trim_after
                if trim:
                    self._since_trim = 0
                self._turn.notify_all()
            if trim:
                release_freed_memory()  # what the decodes freed
                self._trim_later()  # and what their requests free once prefilled (pixel tensors, activations)

    def _trim_later(self) -> None:
        with self._turn:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(self.trim_delay, release_freed_memory)
            self._timer.daemon = True
            self._timer.start()


DECODING = PixelBudget(MAX_DECODING_PIXELS)  # the process's: every server in it shares the memory


class ImagePartError(ValueError):
    """An image part that cannot be taken (a 400 naming `part`)."""

    def __init__(self, part: str, message: str):
        super().__init__(message)
        self.part = part


async def decode_image_parts(model, body, messages: list[dict]) -> list[dict]:
    """`messages` (the request's messages as dicts) with each image_url part of `body` replaced by
    {"type": "image", "image": images.Resized}, cut for `model`'s tower at the request's max_soft_tokens.
    A bad image, a model without a vision tower, or more decoded pixels than a request may have is a 400
    naming the part (messages.i.content.j)."""
    wanted = [(i, j, url) for i, m in enumerate(body.messages) for j, url in m.image_urls()]
    if not wanted:
        return messages
    parts = [f"messages.{i}.content.{j}" for i, j, _ in wanted]
    if model.vision_tower is None:
        raise ApiError(400, "this model reads text only (its checkpoint has no vision tower)", parts[0])
    budget = body.max_soft_tokens or images.DEFAULT_BUDGET
    cut = images.geometry(model.config)
    try:
        datas = await _on_decode_threads(_read, parts, [url for _, _, url in wanted])
        for (i, j, _), part, data in zip(wanted, parts, datas, strict=True):
            resized = await _on_decode_threads(_decode, part, data, budget, cut)
            messages[i]["content"][j] = {"type": "image", "image": resized}
    except ImagePartError as e:
        raise ApiError(400, str(e), e.part) from None  # not `from e`: its frames hold the image
    return messages


@functools.cache
def _decode_threads() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="dgemma-decode")


async def _on_decode_threads(fn, *args):
    return await asyncio.wrap_future(_decode_threads().submit(fn, *args))


def _read(parts: list[str], urls: list[str]) -> list[bytes]:
    """Each part's data: URL as bytes, its header read and checked, and the request's decoded pixels
    counted: all before any image is decoded."""
    datas, total = [], 0
    for part, url in zip(parts, urls, strict=True):
        try:
            data = base64.b64decode(url[url.index(",") + 1 :], validate=True)
        except (binascii.Error, ValueError):
            raise ImagePartError(part, f"{part}: the data: URL is not valid base64") from None
        try:
            width, height = images.peek(data, part).size
        except ValueError as e:
            raise ImagePartError(part, str(e)) from None
        total += width * height
        if total > MAX_REQUEST_PIXELS:
            raise ImagePartError(
                part,
                f"{part}: the request's images have {total:,} pixels up to this one, more than the "
                f"{MAX_REQUEST_PIXELS:,} one request may have decoded (send smaller images or fewer)",
            )
        datas.append(data)
    return datas


def _decode(part: str, data: bytes, budget: int, cut: dict[str, int]) -> images.Resized:
    """One image decoded within the process's budget and resized at once; the decoded pixels are released
    before the budget is given back."""
    try:
        image = images.peek(data, part)
        width, height = image.size
        with DECODING.hold(width * height):
            try:
                resized = images.resize_image(images.decode(image, part), budget, part, **cut)
            except ValueError:
                image.close()
                raise
            if resized.image is not image:  # already at its target size: what is kept
                image.close()  # frees the decoded pixels now, not whenever the last reference goes
    except ValueError as e:
        raise ImagePartError(part, str(e)) from None
    return resized

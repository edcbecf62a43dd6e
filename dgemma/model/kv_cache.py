"""A preallocated, fixed-shape KV cache: `encode` writes it, `denoise` reads it.

Per layer, keys and values live in buffers allocated once:

- full-attention layers: [B, Hkv, max_length, D], slot p holds absolute position p;
- sliding-window layers: [B, Hkv, W - 1, D], right-aligned: the last slot holds the newest position.
  A causal query sees itself and the W - 1 positions before it, so W - 1 cached positions are all a
  later call can need. This is also exactly what the reference's canvas queries see on sliding layers:
  the last W - 1 cached positions plus the whole canvas.

Rows of a batch share positions (position = index in the padded sequence, as in the reference);
`valid[b, p]` is False where row b has left padding at position p, and every mask hides those keys.
The cache can be reused across turns: each `encode` appends after what is there.

Training uses `keep_all=True`: sliding layers then keep every position too, so that `prefix(n)` can show
a denoising pass exactly the keys an earlier point of the sequence had (the window ending at position n).

The prefix cache (PrefixCache, below) reads every position a request encoded and writes a stored prefix
into a new cache: `keep_history()` makes the sliding layers also keep every position they are
given, in a history beside their ring (the ring, what denoising reads, is unchanged); `kv_range` reads
positions back and `load_prefix` writes a prefix into an empty cache.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .config import FULL, SLIDING, LayerSpec, TextConfig
from .vision import Pixels, image_blocks


class DenoiseCache(Protocol):
    """What `DiffusionGemma.denoise` reads from a cache. KVCache, its `rows` / `prefix` views and StackedCache
    all have it; nothing outside this module reads a cache's private state."""

    batch_size: int
    is_sliding: list[bool]  # per layer

    @property
    def device(self) -> torch.device: ...

    def prepare_denoise(self, batch_size: int, canvas_length: int) -> tuple[torch.Tensor, dict]:
        """Canvas positions [B, C] and the attention mask per layer type (None: nothing to hide)."""
        ...

    def with_prefix(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's cached keys and values with the canvas's `k`, `v` after them."""
        ...


def canvas_mask(prefix_valid: torch.Tensor, canvas_length: int) -> torch.Tensor:
    """The bidirectional mask [B, 1, C, S + C] of a canvas after cached keys whose validity is
    `prefix_valid` [B, S]: every canvas query sees the valid keys and the whole canvas."""
    canvas = prefix_valid.new_ones(prefix_valid.shape[0], canvas_length)
    return torch.cat([prefix_valid, canvas], dim=1)[:, None, None, :].expand(-1, 1, canvas_length, -1)


class KVCache:
    """Fixed-shape keys/values for every layer, plus which positions of each row are real tokens."""

    def __init__(
        self,
        config: TextConfig,
        batch_size: int,
        max_length: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        keep_all: bool = False,
        layers: Sequence[LayerSpec] | None = None,
    ):
        """`layers`: the config's per-layer values, when the caller holds them already (a model does)."""
        if batch_size <= 0 or max_length <= 0:
            raise ValueError(f"batch_size and max_length must be positive (got {batch_size}, {max_length})")
        self.batch_size = batch_size
        self.max_length = max_length
        self.window = config.sliding_window
        self.keep_all = keep_all
        self.length = 0  # positions written so far (shared by all rows)
        self.valid = torch.zeros(batch_size, max_length, dtype=torch.bool, device=device)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.is_sliding: list[bool] = []
        for spec in config.layers if layers is None else layers:
            sliding = spec.layer_type == SLIDING
            ring = sliding and not keep_all
            slots = min(self.window - 1, max_length) if ring else max_length
            shape = (batch_size, spec.num_key_value_heads, slots, spec.head_dim)
            self.keys.append(torch.zeros(shape, dtype=dtype, device=device))
            self.values.append(torch.zeros(shape, dtype=dtype, device=device))
            self.is_sliding.append(sliding)
        self._pending = 0  # tokens of the encode call in progress
        self.has_padding = False  # whether any written position is padding (decides if denoise needs masks)
        self.row_index: torch.Tensor | None = None  # set on read-only row views (see rows())
        self._read_only = False  # row and prefix views
        self._denoise_memo: tuple | None = None  # (key, result) of prepare_denoise while the cache is unchanged
        self.version = 0  # counts writes and resets: a copy of the cache taken at one version is still its content
        self.history: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None  # see keep_history()

    @property
    def device(self) -> torch.device:
        return self.valid.device

    def nbytes(self) -> int:
        held = sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values, strict=True))
        return held + sum(k.nbytes + v.nbytes for k, v in filter(None, self.history or []))

    def _is_ring(self, i: int) -> bool:
        return self.is_sliding[i] and not self.keep_all

    def keep_history(self) -> None:
        """Keep every position each sliding ring is given, in a history of `max_length` slots beside the
        ring, so that `kv_range` can read any written position (what a prefix cache stores). Before the
        first write only; a no-op without rings."""
        if self.length or self._read_only:
            raise ValueError("keep_history() is for a new cache, before anything is written")
        if self.history is not None:
            return
        self.history = []
        for i, k in enumerate(self.keys):
            shape = (*k.shape[:2], self.max_length, k.shape[3])
            self.history.append((k.new_zeros(shape), k.new_zeros(shape)) if self._is_ring(i) else None)

    def kv_range(self, i: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values [B, Hkv, end - start, D] of written positions [start, end) (a ring
        layer's from the history `keep_history` keeps)."""
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"positions [{start}, {end}) are outside the {self.length} written")
        if not self._is_ring(i):
            return self.keys[i][:, :, start:end], self.values[i][:, :, start:end]
        if self.history is None:
            raise ValueError("a sliding ring keeps only its window (keep_history() keeps every position)")
        k, v = self.history[i]
        return k[:, :, start:end], v[:, :, start:end]

    def load_prefix(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Write a prefix into this empty cache: per layer, keys and values [Hkv, n, D] of positions
        [0, n) of one sequence, the same for every row (what a prefix cache stored). Each ring takes its
        window's last positions, and its history (if kept) all of them."""
        if self.length or self._read_only:
            raise ValueError("load_prefix() writes an empty cache")
        n = keys[0].shape[1]
        if n > self.max_length:
            raise ValueError(f"a prefix of {n} positions does not fit a cache of {self.max_length}")
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            if not self._is_ring(i):
                self.keys[i][:, :, :n] = k
                self.values[i][:, :, :n] = v
                continue
            slots = self.keys[i].shape[2]
            m = min(n, slots)
            self.keys[i][:, :, slots - m :] = k[:, n - m :]
            self.values[i][:, :, slots - m :] = v[:, n - m :]
            if self.history is not None:
                self.history[i][0][:, :, :n] = k
                self.history[i][1][:, :, :n] = v
        self.valid[:, :n] = True
        self.length = n
        self._denoise_memo = None
        self.version += 1

    def reset(self) -> None:
        """Forget everything (the buffers are kept and overwritten by the next encode)."""
        self.length = 0
        self.has_padding = False
        self._denoise_memo = None
        self.version += 1
        self.valid.zero_()

    def rows(self, index: torch.Tensor) -> KVCache:
        """A read-only view of some rows (for denoising part of a batch); the buffers are shared, not copied."""
        view = copy.copy(self)
        base = self.row_index
        view.row_index = index if base is None else base[index]
        view._read_only = True
        view.batch_size = int(index.numel())
        view.valid = self.valid[index]
        view._denoise_memo = None
        return view

    def prefix(self, length: int) -> KVCache:
        """A read-only view of the first `length` positions, as the cache was when it held only those
        (needs `keep_all`: a sliding ring has already forgotten the keys an earlier window needs)."""
        if not self.keep_all:
            raise ValueError("prefix views need a cache made with keep_all=True")
        if not 0 <= length <= self.length:
            raise ValueError(f"prefix length {length} is outside the {self.length} written positions")
        view = copy.copy(self)
        view.length = length
        view._denoise_memo = None
        view._read_only = True
        return view

    def pinned(self) -> KVCache:
        """A view that writes where this cache writes now, whatever its length later: an encoder layer
        recomputed in the backward pass (gradient checkpointing, after `commit`) writes the same keys to
        the same slots again. Needs `keep_all` (a sliding ring's writes depend on what it held)."""
        if not self.keep_all:
            raise ValueError("recomputing encoder layers needs a cache made with keep_all=True")
        view = copy.copy(self)
        view._denoise_memo = None
        return view

    def check_batch(self, batch_size: int) -> None:
        """A ValueError unless a call's batch has this cache's number of rows."""
        if batch_size != self.batch_size:
            raise ValueError(f"batch of {batch_size} rows, but the KV cache was made for {self.batch_size}")

    # -- positions and masks, built once per call and shared by all layers of a type ------------------
    def num_cached(self, layer_sliding: bool) -> int:
        """How many cached positions a layer of this kind attends to (a sliding layer: its window's)."""
        return min(self.length, self.window - 1) if layer_sliding else self.length

    def prefix_positions(self, sliding: bool) -> torch.Tensor:
        """The absolute positions of those cached keys, oldest first."""
        n = self.num_cached(sliding)
        return torch.arange(self.length - n, self.length, device=self.device)

    def prepare_encode(
        self,
        batch_size: int,
        num_tokens: int,
        attention_mask: torch.Tensor | None,
        blocks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
        """Mark the new positions' validity; return their positions [T] and the causal masks [B, 1, T, S].

        `blocks` [B, T] (vision.image_blocks): new tokens with the same block id >= 0 (one image) also see
        each other, both ways and beyond the sliding window, on every layer type."""
        self.check_batch(batch_size)
        assert not self._read_only, "a view of the cache is read-only"
        self._denoise_memo = None
        self.version += 1
        start, end = self.length, self.length + num_tokens
        if end > self.max_length:
            raise ValueError(
                f"the KV cache holds {self.max_length} positions; {self.length} are used and "
                f"{num_tokens} more do not fit (make the cache larger)"
            )
        if attention_mask is None:
            self.valid[:, start:end] = True
        else:
            if attention_mask.shape != (self.batch_size, num_tokens):
                raise ValueError(
                    f"attention_mask must have shape {(self.batch_size, num_tokens)} "
                    f"(got {tuple(attention_mask.shape)})"
                )
            self.valid[:, start:end] = attention_mask.to(device=self.device, dtype=torch.bool)
            self.has_padding = self.has_padding or not bool(self.valid[:, start:end].all())
        self._pending = num_tokens
        q = torch.arange(start, end, device=self.device)
        same = None  # new tokens of one image, [B, T, T]: the same for every layer type
        if blocks is not None:
            blocks = blocks.to(self.device)
            same = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)
        masks: dict[str, torch.Tensor | None] = {}
        for layer_type, sliding in ((SLIDING, True), (FULL, False)):
            k = torch.cat([self.prefix_positions(sliding), q])  # [S]
            allowed = (k[None, :] <= q[:, None]) & self.valid[:, k][:, None, :]  # [B, T, S]
            if sliding:
                allowed &= (q[:, None] - k[None, :]) < self.window
            # A padded query sees nothing real; let it see itself so softmax stays finite (its output is unused).
            allowed |= (k[None, :] == q[:, None])[None] & ~self.valid[:, q][:, :, None]
            if same is not None:
                allowed[:, :, -num_tokens:] |= same
            masks[layer_type] = allowed[:, None]
        return q, masks

    def prepare_denoise(
        self, batch_size: int, canvas_length: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
        """Positions of a canvas placed after the cache, and its bidirectional masks (None: no padding).

        The result is remembered until the cache changes: every step of a canvas reuses it.
        """
        self.check_batch(batch_size)
        key = (self.length, batch_size, canvas_length)
        if self._denoise_memo is not None and self._denoise_memo[0] == key:
            return self._denoise_memo[1]
        q = torch.arange(self.length, self.length + canvas_length, device=self.device)
        masks: dict[str, torch.Tensor | None] = {}
        for layer_type, sliding in ((SLIDING, True), (FULL, False)):
            if not self.has_padding:  # every key is visible: no mask, no device sync
                masks[layer_type] = None
                continue
            masks[layer_type] = canvas_mask(self.valid[:, self.prefix_positions(sliding)], canvas_length)
        self._denoise_memo = (key, (q, masks))
        return q, masks

    # -- per-layer access (called from inside the attention of layer i) ------------------------------
    def update(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode: store the new k/v [B, Hkv, T, D]; return the keys/values to attend over [B, Hkv, S, D]."""
        assert not self._read_only, "a view of the cache is read-only"
        t = k.shape[2]
        if not self.is_sliding[i] or self.keep_all:
            end = self.length + t
            self.keys[i][:, :, self.length : end] = k
            self.values[i][:, :, self.length : end] = v
            start = end - t - self.num_cached(self.is_sliding[i])
            return self.keys[i][:, :, start:end], self.values[i][:, :, start:end]
        if self.history is not None:
            self.history[i][0][:, :, self.length : self.length + t] = k
            self.history[i][1][:, :, self.length : self.length + t] = v
        keys, values = self.with_prefix(i, k, v)
        slots = self.keys[i].shape[2]
        m = min(keys.shape[2], slots)  # right-align the newest m positions
        self.keys[i][:, :, slots - m :] = keys[:, :, -m:]
        self.values[i][:, :, slots - m :] = values[:, :, -m:]
        return keys, values

    def prefix_kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached keys/values layer i's canvas queries see, [B, Hkv, n, D] (oldest first)."""
        n = self.num_cached(self.is_sliding[i])
        ring = self.is_sliding[i] and not self.keep_all
        start = self.keys[i].shape[2] - n if ring else self.length - n
        past_k, past_v = self.keys[i][:, :, start : start + n], self.values[i][:, :, start : start + n]
        if self.row_index is not None:
            past_k, past_v = past_k.index_select(0, self.row_index), past_v.index_select(0, self.row_index)
        return past_k, past_v

    def with_prefix(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Denoise: [cached prefix ; k/v] without writing anything."""
        past_k, past_v = self.prefix_kv(i)
        return torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)

    def commit(self, num_tokens: int) -> None:
        """Called by encode after all layers wrote their keys: the new positions become part of the prefix."""
        assert num_tokens == self._pending, "commit must follow prepare_encode of the same length"
        self.length += num_tokens
        self._pending = 0


class StackedCache:
    """Several caches (say, one per server request, each at its own length) read as one batch by `denoise`.

    Each row's canvas sits at its own positions (its cache's length onward); prefixes of different lengths
    are left-padded to the longest with masked zeros. Read-only, like every view used for denoising.
    """

    def __init__(self, caches: list[KVCache]):
        if not caches:
            raise ValueError("StackedCache needs at least one cache")
        self.caches = caches
        self.batch_size = sum(c.batch_size for c in caches)
        self.is_sliding = caches[0].is_sliding
        self.device = caches[0].device
        self._longest: dict[bool, int] = {}

    def prepare_denoise(self, batch_size: int, canvas_length: int):
        if batch_size != self.batch_size:
            raise ValueError(f"batch of {batch_size} rows, but the stacked caches hold {self.batch_size}")
        offsets = torch.arange(canvas_length, device=self.device)
        positions = torch.cat([(c.length + offsets).expand(c.batch_size, -1) for c in self.caches])  # [B, C]
        masks = {}
        for layer_type, sliding in ((SLIDING, True), (FULL, False)):
            longest = max(c.num_cached(sliding) for c in self.caches)
            self._longest[sliding] = longest
            rows = []
            for c in self.caches:
                prefix_valid = c.valid[:, c.prefix_positions(sliding)]
                rows.append(
                    torch.cat([prefix_valid.new_zeros(c.batch_size, longest - c.num_cached(sliding)), prefix_valid], 1)
                )
            prefix_valid = torch.cat(rows)  # [B, longest], left-padded
            masks[layer_type] = None if bool(prefix_valid.all()) else canvas_mask(prefix_valid, canvas_length)
        return positions, masks

    def with_prefix(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        longest = self._longest[self.is_sliding[i]]
        b, h, t, d = k.shape
        keys = k.new_zeros(b, h, longest + t, d)
        values = v.new_zeros(b, h, longest + t, d)
        row = 0
        for c in self.caches:
            past_k, past_v = c.prefix_kv(i)
            n = past_k.shape[2]
            keys[row : row + c.batch_size, :, longest - n : longest] = past_k
            values[row : row + c.batch_size, :, longest - n : longest] = past_v
            row += c.batch_size
        keys[:, :, longest:] = k
        values[:, :, longest:] = v
        return keys, values


class EncodeStack:
    """Caches at one length (one per server request, say) written by one encode of as many new tokens each:
    the prompts of equal length of several requests, or their commits. Positions and masks are each
    cache's own, stacked; each row's keys and values are written into its own cache. (Caches at
    different lengths would need other positions per row: those are encoded apart.)"""

    def __init__(self, caches: list[KVCache]):
        if not caches or len({c.length for c in caches}) != 1:
            raise ValueError("an encode stack needs caches at one length")
        self.caches = caches
        self.batch_size = sum(c.batch_size for c in caches)
        self.length = caches[0].length
        self.keep_all = False  # each cache keeps its own; a stack is never recomputed (no gradients)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(x, [c.batch_size for c in self.caches])

    def prepare_encode(self, batch_size: int, num_tokens: int, attention_mask=None, blocks=None):
        if batch_size != self.batch_size:
            raise ValueError(f"batch of {batch_size} rows, but the stacked caches hold {self.batch_size}")
        if blocks is not None:
            raise ValueError("prompts with images are encoded one request at a time")
        given = self._split(attention_mask) if attention_mask is not None else [None] * len(self.caches)
        parts = [c.prepare_encode(c.batch_size, num_tokens, m)[1] for c, m in zip(self.caches, given, strict=True)]
        positions = torch.arange(self.length, self.length + num_tokens, device=self.caches[0].device)
        return positions, {kind: torch.cat([p[kind] for p in parts]) for kind in parts[0]}

    def update(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = [c.update(i, kk, vv) for c, kk, vv in zip(self.caches, self._split(k), self._split(v), strict=True)]
        return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])

    def commit(self, num_tokens: int) -> None:
        for c in self.caches:
            c.commit(num_tokens)


# ------------------------------------------------------------------------------------------------
# The prefix cache: the causal encoder's keys and values of prompts and committed canvases, kept after a
# request ends and loaded into the next request that starts with the same tokens (docs/server.md, "Prefix
# cache").
#
#     call = prefix.admit(call, reuse)    # before a prompt's encode: load the longest stored prefix, encode the rest
#     prefix.keep(reuse)                   # after every encode: store the blocks it completed
#
# Positions are stored in blocks of `block_size` tokens. A block is found by its parent block and its
# tokens (a dict keyed by both, compared exactly: no hash a client could collide), so blocks form a tree of
# shared prefixes; a prompt matches block by block from the root. Image placeholders are keyed by their
# image's pixels (a digest), so two prompts with the same text and other images share nothing after the
# first image; a match never ends inside an image (its tokens see each other both ways). A block holds every
# layer's keys and values of its positions, sliding layers included: a cache of a request that may be stored
# keeps its sliding layers' history (KVCache.keep_history), so any block boundary is a point to resume at.
#
# The store is bounded by bytes. When a block does not fit, the least recently used blocks are evicted,
# leaves first (a prefix is used whenever a longer one is, so the oldest block is always a leaf). A hit is
# copied into the request's own cache: a running request holds no stored block, so eviction never touches
# what it reads, and a request reads nothing but the keys its own tokens would have made.
#
# Blocks, not a token-granular radix tree: the match is the same up to `block_size - 1` tokens, and a block
# is one allocation per layer, evicted whole, with its bytes known (BENCHMARKS.md, "Prefix cache").
# Only fast-mode programs take part: exact mode (transformers' numbers) encodes every prompt whole.


class Encode(Protocol):
    """What the store reads of an encode (engine.EncodeCall, which imports this module)."""

    ids: torch.Tensor
    cache: KVCache
    attention_mask: torch.Tensor | None
    pixels: Any
    is_generated: bool


BLOCK_SIZE = 16  # tokens per block (vLLM's default page); benchmarks/reuse.py measures others
DEFAULT_SHARE = 0.1  # of the memory free at start, what the store may hold by default


@dataclass(eq=False)
class Block:
    """`block_size` positions of one sequence: every layer's keys and values [Hkv, n, D], and its place in
    the tree (`parent`, the number of `children`)."""

    id: int
    parent: Block | None
    tokens: tuple
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    nbytes: int
    children: int = 0


@dataclass
class Reuse:
    """One program's part in a prefix cache: the keys of what its cache holds (None: it does not take
    part), the keys of the encode in flight, and how many prompt positions came from the store."""

    keys: list | None = field(default_factory=list)
    pending: list | None = None
    cache: KVCache | None = None
    cached: int = 0


@dataclass
class PrefixStats:
    lookups: int = 0  # prompts looked up
    hits: int = 0  # prompts that found a stored prefix
    prompt_tokens: int = 0  # positions of the prompts looked up
    cached_tokens: int = 0  # of those, the positions loaded from the store
    evictions: int = 0  # blocks evicted
    stored_blocks: int = 0  # blocks ever stored
    peak_bytes: int = 0  # the most bytes ever held (never above the bound)


def image_digests(pixels: Pixels | None) -> list[str]:
    """One digest per image of `pixels` (its patches and their positions), what its placeholders are keyed by."""
    if pixels is None:
        return []
    out = []
    for values, positions in zip(pixels.values, pixels.positions, strict=True):
        h = hashlib.blake2b(digest_size=16)
        h.update(values.detach().cpu().float().contiguous().numpy().tobytes())
        h.update(positions.detach().cpu().long().contiguous().numpy().tobytes())
        out.append(h.hexdigest())
    return out


def pixels_after(pixels: Pixels | None, ids: list[int], start: int, image_token_id: int | None) -> Pixels | None:
    """The Pixels of the images whose placeholders lie in `ids[start:]` (a match never ends inside an
    image, so those are the last images of `pixels`)."""
    if pixels is None or image_token_id is None or image_token_id not in ids[start:]:
        return None
    before = 0 if start == 0 else int(image_blocks(torch.tensor([ids[:start]]) == image_token_id).max()) + 1
    return Pixels(pixels.values[before:], pixels.positions[before:])


class PrefixCache:
    """Stored prefixes of one model's sequences, at most `max_bytes` of keys and values (the section's comment)."""

    def __init__(self, max_bytes: int, block_size: int = BLOCK_SIZE, image_token_id: int | None = None):
        if max_bytes < 0 or block_size <= 0:
            raise ValueError("max_bytes must be >= 0 and block_size > 0")
        self.max_bytes, self.block_size, self.image_token_id = max_bytes, block_size, image_token_id
        self.nbytes = 0
        self.stats = PrefixStats()
        self._blocks: dict[tuple, Block] = {}  # (parent id, tokens) -> block
        self._lru: OrderedDict[int, Block] = OrderedDict()  # least recently used first
        self._ids = itertools.count(1)

    @classmethod
    def for_model(cls, model, max_bytes: int | None = None, block_size: int = BLOCK_SIZE) -> PrefixCache:
        """A store for `model`'s sequences; `max_bytes` None: DEFAULT_SHARE of the memory free now."""
        if max_bytes is None:
            max_bytes = default_bytes(model.device)
        return cls(max_bytes, block_size, model.config.image_token_id)

    @property
    def blocks(self) -> int:
        return len(self._lru)

    # -- keys --------------------------------------------------------------------------------------------
    def keys_of(self, call: Encode) -> list | None:
        """The keys of an encode's positions (token ids; an image placeholder's, its image's digest), or
        None when its rows differ or are padded (such a cache is not stored)."""
        ids = call.ids
        if call.attention_mask is not None or (ids.shape[0] > 1 and not bool((ids == ids[:1]).all())):
            return None
        row = ids[0].tolist()
        image = self.image_token_id
        if call.is_generated or call.pixels is None:
            return row
        if image is None:
            return None  # images, and no way to tell their placeholders: not stored (PrefixCache.for_model knows)
        if image not in row:
            return row
        digests = image_digests(call.pixels)
        which = image_blocks(torch.tensor([row]) == image)[0].tolist()
        if max(which) >= len(digests):
            return None  # more images than pixels: the encode will refuse it
        return [("image", digests[g]) if g >= 0 else t for t, g in zip(row, which, strict=True)]

    def _image_start(self, keys: list, n: int) -> int:
        """`n`, or the start of the image whose placeholders it falls inside."""
        while 0 < n < len(keys) and isinstance(keys[n], tuple) and keys[n - 1] == keys[n]:
            n -= 1
        return n

    # -- match and load ------------------------------------------------------------------------------
    def _stored(self, keys: list) -> list[Block]:
        """The stored blocks of the longest prefix of `keys`, in whole blocks."""
        bs, out = self.block_size, []
        for start in range(0, len(keys) - bs + 1, bs):
            block = self._blocks.get(_key(out[-1] if out else None, tuple(keys[start : start + bs])))
            if block is None:
                break
            out.append(block)
        return out

    def match(self, keys: list) -> list[Block]:
        """The stored blocks of the longest prefix of `keys` to load (whole blocks, not ending inside an image)."""
        out = self._stored(keys)
        return out[: self._image_start(keys, len(out) * self.block_size) // self.block_size]

    def admit(self, call: Encode, reuse: Reuse) -> Encode | None:
        """A prompt's encode with its longest stored prefix loaded into its cache: the encode of the rest,
        or None when the store held it all. Other encodes (commits, a program not taking part) as they are."""
        reuse.pending = None if reuse.keys is None else self.keys_of(call)
        if reuse.pending is None or not self.max_bytes:
            reuse.keys = None
            return call
        cache = call.cache
        if call.is_generated or cache.length or len(reuse.keys):
            return call
        cache.keep_history()
        reuse.cache = cache
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(reuse.pending)
        blocks = self.match(reuse.pending)
        if not blocks:
            return call
        self._touch(blocks)
        n = len(blocks) * self.block_size
        layers = range(len(blocks[0].keys))
        cache.load_prefix(
            [torch.cat([b.keys[i] for b in blocks], dim=1) for i in layers],
            [torch.cat([b.values[i] for b in blocks], dim=1) for i in layers],
        )
        self.stats.hits += 1
        self.stats.cached_tokens += n
        reuse.cached = n
        reuse.keys.extend(reuse.pending[:n])
        reuse.pending = reuse.pending[n:]
        if not reuse.pending:
            return None
        pixels = pixels_after(call.pixels, call.ids[0].tolist(), n, self.image_token_id)
        return dataclasses.replace(call, ids=call.ids[:, n:], pixels=pixels)

    # -- store ---------------------------------------------------------------------------------------
    def keep(self, reuse: Reuse) -> None:
        """After an encode `admit` saw: its keys join the program's, and the blocks they complete are stored."""
        if reuse.keys is None or reuse.pending is None or reuse.cache is None:
            reuse.keys = None
            return
        reuse.keys.extend(reuse.pending)
        reuse.pending = None
        if len(reuse.keys) != reuse.cache.length:  # the program wrote its cache some other way
            reuse.keys = None
            return
        self._store(reuse.keys, reuse.cache)

    def _store(self, keys: list, cache: KVCache) -> None:
        """Store the blocks of `keys` (the cache's positions) that are not stored yet."""
        bs, chain = self.block_size, self._stored(keys)
        self._touch(chain)  # the newest now: what is evicted to make room is older, and a leaf
        for start in range(len(chain) * bs, len(keys) - bs + 1, bs):
            block = self._new_block(chain[-1] if chain else None, tuple(keys[start : start + bs]), cache, start, chain)
            if block is None:
                break
            chain.append(block)
        self._touch(chain)

    def _new_block(self, parent: Block | None, tokens: tuple, cache: KVCache, start: int, chain: list):
        """A block of the cache's positions [start, start + block_size) under `parent`, stored if room can be
        made without evicting `chain` (the blocks being stored); else None."""
        end = start + self.block_size
        keys, values = [], []
        for i in range(len(cache.keys)):
            k, v = cache.kv_range(i, start, end)
            keys.append(k[0].clone())
            values.append(v[0].clone())
        nbytes = sum(t.nbytes for t in keys + values)
        if not self._make_room(nbytes, chain):
            return None
        block = Block(next(self._ids), parent, tokens, keys, values, nbytes)
        self._blocks[_key(parent, tokens)] = block
        self._lru[block.id] = block
        if parent is not None:
            parent.children += 1
        self.nbytes += nbytes
        self.stats.stored_blocks += 1
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.nbytes)
        return block

    def _make_room(self, nbytes: int, chain: list[Block]) -> bool:
        """Evict least recently used leaves until `nbytes` more fit; False if only `chain` is left to evict."""
        keep = {b.id for b in chain}
        while self.nbytes + nbytes > self.max_bytes:
            oldest = next(iter(self._lru.values()), None)
            if oldest is None or oldest.id in keep:
                return False
            self._evict(oldest)
        return True

    def _evict(self, block: Block) -> None:
        assert block.children == 0, "only leaves are evicted"
        del self._lru[block.id]
        del self._blocks[_key(block.parent, block.tokens)]
        if block.parent is not None:
            block.parent.children -= 1
        self.nbytes -= block.nbytes
        self.stats.evictions += 1

    def _touch(self, chain: list[Block]) -> None:
        """Mark a chain used now, its deepest block first, so that a parent is never older than its children."""
        for block in reversed(chain):
            self._lru.move_to_end(block.id)


def _key(parent: Block | None, tokens: tuple) -> tuple:
    """A block's place in the store: its parent (0: the root) and its tokens, compared exactly."""
    return (0 if parent is None else parent.id, tokens)


def default_bytes(device: torch.device) -> int:
    """DEFAULT_SHARE of the memory free on `device` now (a GPU's free memory, or the host's available RAM)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            free = 8 << 30
    return int(free * DEFAULT_SHARE)

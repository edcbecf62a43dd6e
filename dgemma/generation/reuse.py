"""The prefix cache: the causal encoder's keys and values of prompts and committed canvases, kept after a
request ends and loaded into the next request that starts with the same tokens (docs/server.md, "Prefix
cache").

    call = prefix.admit(call, reuse)    # before a prompt's encode: load the longest stored prefix, encode the rest
    prefix.keep(reuse)                   # after every encode: store the blocks it completed

Positions are stored in blocks of `block_size` tokens. A block is found by its parent block and its
tokens (a dict keyed by both, compared exactly: no hash a client could collide), so blocks form a tree of
shared prefixes; a prompt matches block by block from the root. Image placeholders are keyed by their
image's pixels (a digest), so two prompts with the same text and other images share nothing after the
first image; a match never ends inside an image (its tokens see each other both ways). A block holds every
layer's keys and values of its positions, sliding layers included: a cache of a request that may be stored
keeps its sliding layers' history (KVCache.keep_history), so any block boundary is a point to resume at.

The store is bounded by bytes. When a block does not fit, the least recently used blocks are evicted,
leaves first (a prefix is used whenever a longer one is, so the oldest block is always a leaf). A hit is
copied into the request's own cache: a running request holds no stored block, so eviction never touches
what it reads, and a request reads nothing but the keys its own tokens would have made.

Blocks, not a token-granular radix tree: the match is the same up to `block_size - 1` tokens, and a block
is one allocation per layer, evicted whole, with its bytes known (BENCHMARKS.md, "Prefix cache").
Only fast-mode programs take part: exact mode (transformers' numbers) encodes every prompt whole.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..model.kv_cache import KVCache
from ..model.vision import Pixels, image_blocks


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
    """Stored prefixes of one model's sequences, at most `max_bytes` of keys and values (module doc)."""

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
    def match(self, keys: list) -> list[Block]:
        """The stored blocks of the longest prefix of `keys` (whole blocks, not ending inside an image)."""
        bs, out = self.block_size, []
        for start in range(0, len(keys) - bs + 1, bs):
            block = self._blocks.get(_key(out[-1] if out else None, tuple(keys[start : start + bs])))
            if block is None:
                break
            out.append(block)
        cut = self._image_start(keys, len(out) * bs) // bs
        return out[:cut]

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
        bs, chain = self.block_size, []
        starts = range(0, len(keys) - bs + 1, bs)
        for start in starts:  # what is stored already
            block = self._blocks.get(_key(chain[-1] if chain else None, tuple(keys[start : start + bs])))
            if block is None:
                break
            chain.append(block)
        self._touch(chain)  # the newest now: what is evicted to make room is older, and a leaf
        for start in starts[len(chain) :]:
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

    def clear(self) -> None:
        """Drop every stored block."""
        self._blocks.clear()
        self._lru.clear()
        self.nbytes = 0


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

"""A denoising step with fixed shapes, replayed from a CUDA graph (docs/speed.md, "The fast paths").

A lone cache is read through `StaticCacheView` (every slot attended under a mask, the canvas position a
one-element tensor), so every canvas of a generation replays one graph. A server batch (StackedCache) is
copied into the fixed buffers of a `StaticStack` and replays the graph of its (rows, slots) bucket: one
graph per batch size, as nano-vllm captures them. Calls it cannot serve go to the ordinary denoise; on a
CPU the same static steps run without graphs (`capture=False`), which is how the tests check them.
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..model.config import FULL, SLIDING
from ..model.kv_cache import KVCache, StackedCache, canvas_mask
from ..model.model import DiffusionGemma


class StaticCacheView:
    """A denoise-only view of a KVCache whose shapes do not depend on how much of it is written.

    Full-attention layers attend over all `max_length` slots, sliding layers over all ring slots; a
    mask shows a canvas query exactly the keys the ordinary path would give it (written, not padding),
    plus the whole canvas. `length` is a one-element tensor: set it before each step.
    """

    def __init__(self, cache: KVCache, length: torch.Tensor):
        self.cache = cache
        self.length = length

    def prepare_denoise(self, batch_size: int, canvas_length: int):
        cache = self.cache
        cache.check_batch(batch_size)
        device = cache.device
        offsets = torch.arange(canvas_length, device=device)
        positions = self.length + offsets  # [C]
        masks = {}
        for layer_type, sliding in ((SLIDING, True), (FULL, False)):
            slots = self._slots(sliding)
            if slots is None:
                masks[layer_type] = None
                continue
            j = torch.arange(slots, device=device)
            # Slot j of a sliding ring holds position length - slots + j (right-aligned); a full layer's
            # slot j holds position j.
            pos = self.length - slots + j if sliding else j
            written = (pos >= 0) & (pos < self.length)
            valid = cache.valid[:, pos.clamp(0, cache.max_length - 1)] & written  # [B, slots]
            masks[layer_type] = canvas_mask(valid, canvas_length)
        return positions, masks

    def _slots(self, sliding: bool) -> int | None:
        for i, is_sliding in enumerate(self.cache.is_sliding):
            if is_sliding == sliding:
                return self.cache.keys[i].shape[2]
        return None

    def with_prefix(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([self.cache.keys[i], k], dim=2), torch.cat([self.cache.values[i], v], dim=2)


def bucket(n: int, least: int = 1) -> int:
    """The power of two at or above max(n, least): the batch sizes and prefix lengths graphs are made for."""
    return 1 << (max(n, least) - 1).bit_length()


class StaticStack:
    """Fixed buffers that the caches of a server batch are copied into, so that its step has fixed shapes.

    Per layer, keys and values [rows, Hkv, slots, D] (a sliding layer: its window's W - 1 slots); each
    cache's prefix is right-aligned, and `valid` masks every slot it does not fill. `view(rows, slots)` is
    the last `slots` slots of the first `rows` rows: fixed addresses, so one graph per such bucket."""

    def __init__(self, like: KVCache, rows: int, slots: int):
        self.rows, self.slots, self.ring = rows, slots, like.window - 1
        self.is_sliding = like.is_sliding
        layers = zip(like.keys, like.is_sliding, strict=True)
        self.keys = [k.new_zeros(rows, k.shape[1], self._width(s), k.shape[3]) for k, s in layers]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.valid = {s: torch.zeros(rows, self._width(s), dtype=torch.bool, device=like.device) for s in (True, False)}
        self.lengths = torch.zeros(rows, dtype=torch.long, device=like.device)
        self.loaded: tuple | None = None  # what the buffers hold: (rows, slots, ((cache, version), ...))
        self.loads = 0

    def _width(self, sliding: bool, slots: int | None = None) -> int:
        slots = self.slots if slots is None else slots
        return min(slots, self.ring) if sliding else slots

    def holds(self, rows: int, slots: int) -> bool:
        """Whether these buffers can take a batch of `rows` rows and `slots` prefix slots (the caches are all
        the one model's: their layers have these buffers' shapes)."""
        return rows <= self.rows and slots <= self.slots

    def load(self, caches: list[KVCache], rows: int, slots: int) -> None:
        """Copy the caches' prefixes in (rows beyond theirs up to `rows` are padding), unless already there."""
        key = (rows, slots, tuple((c, c.version) for c in caches))
        if self.loaded == key:
            return
        for sliding in (True, False):
            self.valid[sliding][:rows] = False
        self.lengths[:rows] = 0
        row = 0
        for c in caches:
            end = row + c.batch_size
            for i in range(len(self.keys)):
                past_k, past_v = c.prefix_kv(i)
                n = past_k.shape[2]
                self.keys[i][row:end, :, self.keys[i].shape[2] - n :] = past_k
                self.values[i][row:end, :, self.keys[i].shape[2] - n :] = past_v
            for sliding in (True, False):
                width = self.valid[sliding].shape[1]
                n = c.num_cached(sliding)
                self.valid[sliding][row:end, width - n :] = c.valid[:, c.prefix_positions(sliding)]
            self.lengths[row:end] = c.length
            row = end
        self.loaded = key
        self.loads += 1

    def view(self, rows: int, slots: int) -> StaticStackView:
        return StaticStackView(self, rows, slots)


class StaticStackView:
    """The denoise-only cache of a StaticStack bucket: rows [:rows], the last `slots` slots (fewer on a
    sliding layer whose window is shorter). Positions come from the stack's `lengths`, a tensor."""

    def __init__(self, stack: StaticStack, rows: int, slots: int):
        self.batch_size, self.is_sliding = rows, stack.is_sliding
        self.device = stack.lengths.device

        def last(t: torch.Tensor, width: int) -> torch.Tensor:
            return t[:rows, :, t.shape[2] - width :] if t.dim() == 4 else t[:rows, t.shape[1] - width :]

        widths = [stack._width(s, slots) for s in stack.is_sliding]
        self.keys = [last(k, w) for k, w in zip(stack.keys, widths, strict=True)]
        self.values = [last(v, w) for v, w in zip(stack.values, widths, strict=True)]
        self.valid = {s: last(v, stack._width(s, slots)) for s, v in stack.valid.items()}
        self.lengths = stack.lengths[:rows]

    def prepare_denoise(self, batch_size: int, canvas_length: int):
        if batch_size != self.batch_size:
            raise ValueError(f"batch of {batch_size} rows, but the static stack holds {self.batch_size}")
        positions = self.lengths[:, None] + torch.arange(canvas_length, device=self.device)  # [B, C]
        types = ((SLIDING, True), (FULL, False))
        masks = {layer_type: canvas_mask(self.valid[sliding], canvas_length) for layer_type, sliding in types}
        return positions, masks

    def with_prefix(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([self.keys[i], k], dim=2), torch.cat([self.values[i], v], dim=2)


@dataclass
class _Entry:
    cache: weakref.ref | None  # a lone cache's graph (None: a batch bucket's, which reads `view`)
    ids: torch.Tensor
    soft: torch.Tensor | None
    length: torch.Tensor | None = None
    view: StaticStackView | None = None
    out: torch.Tensor | None = None
    graph: object | None = None


class GraphedDenoise:
    """model.denoise, replayed from captured graphs: one per (lone cache, batch, canvas length, signal or
    not), and for server batches one per (rows, slots) bucket of a StaticStack.

    A call copies its inputs into the graph's fixed buffers, sets the cache length (or loads the stack)
    and replays; the logits are returned as a fresh tensor (or written into `out`). At most `max_graphs`
    graphs are kept (least recently used dropped).
    """

    def __init__(self, model: DiffusionGemma, *, capture: bool | None = None, max_graphs: int = 16):
        self.model = model
        self.capture = model.device.type == "cuda" if capture is None else capture
        self.max_graphs = max_graphs
        self.entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self.stack: StaticStack | None = None
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.replays = 0
        self.fallbacks = 0

    def release(self) -> None:
        """Drop every captured graph and its buffers."""
        self.entries.clear()
        self.stack = None

    def _serves(self, caches: list, canvas_ids: torch.Tensor) -> bool:
        plain = all(type(c) is KVCache and c.row_index is None and not c.keep_all for c in caches)
        return plain and not torch.is_grad_enabled() and canvas_ids.device == caches[0].device

    def __call__(
        self,
        canvas_ids: torch.Tensor,
        cache,
        self_conditioning: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        caches = cache.caches if type(cache) is StackedCache else [cache]
        if not self._serves(caches, canvas_ids):
            self.fallbacks += 1
            return self.model.denoise(canvas_ids, cache, self_conditioning, out=out)
        if type(cache) is StackedCache:
            return self._stacked(canvas_ids, cache.caches, self_conditioning, out)
        soft = self_conditioning
        key = (id(cache), tuple(canvas_ids.shape), None if soft is None else (soft.dtype, tuple(soft.shape)))
        entry = self.entries.get(key)
        if entry is None or entry.cache() is not cache:
            entry = _Entry(weakref.ref(cache), canvas_ids.clone(), None if soft is None else soft.clone())
            entry.length = torch.tensor(cache.length, device=cache.device)
            self._record(key, entry, cache)
        self.entries.move_to_end(key)
        entry.length.fill_(cache.length)
        return self._replay(entry, canvas_ids, soft, out, cache)

    def _stacked(self, canvas_ids: torch.Tensor, caches: list[KVCache], soft, out) -> torch.Tensor:
        """A server batch: its caches loaded into the StaticStack, the graph of its bucket replayed."""
        rows, c = canvas_ids.shape
        b, slots = bucket(rows), bucket(max(x.length for x in caches), 16)
        if self.stack is None or not self.stack.holds(b, slots):
            grown = (b, slots) if self.stack is None else (max(b, self.stack.rows), max(slots, self.stack.slots))
            for key in [k for k in self.entries if k[0] == "stack"]:  # their views read the old buffers
                del self.entries[key]
            self.stack = None  # freed before the larger buffers are made
            self.stack = StaticStack(caches[0], *grown)
        self.stack.load(caches, b, slots)
        key = ("stack", b, slots, c, None if soft is None else soft.dtype)
        entry = self.entries.get(key)
        if entry is None:
            ids = canvas_ids.new_zeros(b, c)
            pad = None if soft is None else soft.new_zeros(b, c, soft.shape[2])
            entry = _Entry(None, ids, pad, view=self.stack.view(b, slots))
            self._record(key, entry, None)
        self.entries.move_to_end(key)
        return self._replay(entry, canvas_ids, soft, out, None)

    def _replay(self, entry: _Entry, canvas_ids, soft, out, cache) -> torch.Tensor:
        """Copy a call's inputs into `entry`'s buffers, replay (or run) its step: the logits of its rows."""
        rows = canvas_ids.shape[0]
        entry.ids[:rows].copy_(canvas_ids)
        if soft is not None:
            entry.soft[:rows].copy_(soft)
        if entry.graph is not None:
            entry.graph.replay()
            self.replays += 1
            logits = entry.out[:rows]
        else:
            logits = self._run(entry, cache)[:rows]
        if out is not None:
            return out.copy_(logits)
        return logits.clone() if entry.graph is not None or rows < entry.ids.shape[0] else logits

    def _run(self, entry: _Entry, cache: KVCache | None) -> torch.Tensor:
        view = entry.view if entry.view is not None else StaticCacheView(cache, entry.length)
        return self.model.denoise(entry.ids, view, entry.soft)

    def _record(self, key: tuple, entry: _Entry, cache: KVCache | None) -> None:
        """Keep `entry` (dropping the least recently used beyond max_graphs) and capture its step."""
        while len(self.entries) >= self.max_graphs:
            self.entries.popitem(last=False)
        self.entries[key] = entry
        if not self.capture:
            return
        # Warm up on a side stream (lazy initialisations must not be recorded), then record one step.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run(entry, cache)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                entry.out = self._run(entry, cache)
        except RuntimeError as e:  # something in the step synchronises with the host: run it eagerly
            warnings.warn(f"CUDA graph capture failed, denoising without graphs: {e}", stacklevel=4)
            self.capture = False
            return
        entry.graph = graph

"""A denoising step with fixed shapes, replayed from a CUDA graph.

At batch 1 a step of the real model launches thousands of small kernels; on a fast GPU launching them
costs as much as running them. A CUDA graph records the step once and replays it with one launch. That
needs a step whose shapes and memory addresses never change, so the step here reads the KV cache
through `StaticCacheView`: every cached slot is attended (slots not yet written, or padding, are masked
out) and where the canvas sits comes from a one-element tensor, not a Python int. Every canvas of a
generation then runs the same graph, whatever the prompt length.

A `Runner` made fast on CUDA (dgemma/runtime/runner.py) answers its fast-mode denoising calls through a
`GraphedDenoise` of its fast twin. Calls it cannot serve (training, row subsets of a batch, stacked caches
of a server batch, CPU tensors) go to the twin's ordinary denoise.
On CPU the same static step runs without the graph (`capture=False`), which is how the tests compare it
with the reference.
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..config import FULL, SLIDING
from ..kv_cache import KVCache
from ..model import DiffusionGemma


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
        canvas_valid = torch.ones(batch_size, canvas_length, dtype=torch.bool, device=device)
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
            allowed = torch.cat([valid, canvas_valid], dim=1)
            masks[layer_type] = allowed[:, None, None, :].expand(-1, 1, canvas_length, -1)
        return positions, masks

    def _slots(self, sliding: bool) -> int | None:
        for i, is_sliding in enumerate(self.cache.is_sliding):
            if is_sliding == sliding:
                return self.cache.keys[i].shape[2]
        return None

    def with_prefix(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([self.cache.keys[i], k], dim=2), torch.cat([self.cache.values[i], v], dim=2)


@dataclass
class _Entry:
    cache: weakref.ref
    ids: torch.Tensor
    soft: torch.Tensor | None
    length: torch.Tensor
    out: torch.Tensor | None = None
    graph: object | None = None


class GraphedDenoise:
    """model.denoise, replayed from one captured graph per (cache, batch, canvas length, signal or not).

    A call copies its inputs into the graph's fixed buffers, sets the cache length and replays; the logits
    are returned as a fresh tensor. At most `max_graphs` graphs are kept (least recently used dropped).
    """

    def __init__(self, model: DiffusionGemma, *, capture: bool | None = None, max_graphs: int = 8):
        self.model = model
        self.capture = model.device.type == "cuda" if capture is None else capture
        self.max_graphs = max_graphs
        self.entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.replays = 0
        self.fallbacks = 0

    def release(self) -> None:
        """Drop every captured graph and its buffers."""
        self.entries.clear()

    def _serves(self, cache, canvas_ids) -> bool:
        return (
            type(cache) is KVCache
            and cache.row_index is None
            and not cache.keep_all
            and not torch.is_grad_enabled()
            and canvas_ids.device == cache.device
        )

    def __call__(
        self,
        canvas_ids: torch.Tensor,
        cache,
        self_conditioning: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self._serves(cache, canvas_ids):
            self.fallbacks += 1
            return self.model.denoise(canvas_ids, cache, self_conditioning, out=out)
        soft = self_conditioning
        key = (id(cache), tuple(canvas_ids.shape), None if soft is None else (soft.dtype, tuple(soft.shape)))
        entry = self.entries.get(key)
        if entry is None or entry.cache() is not cache:
            entry = self._record(key, cache, canvas_ids, soft)
        self.entries.move_to_end(key)
        entry.length.fill_(cache.length)
        entry.ids.copy_(canvas_ids)
        if soft is not None:
            entry.soft.copy_(soft)
        if entry.graph is not None:
            entry.graph.replay()
            self.replays += 1
            return entry.out.clone() if out is None else out.copy_(entry.out)
        return self._run(entry, cache, out)

    def _run(self, entry: _Entry, cache: KVCache, out: torch.Tensor | None = None) -> torch.Tensor:
        view = StaticCacheView(cache, entry.length)
        return self.model.denoise(entry.ids, view, entry.soft, out=out)

    def _record(self, key: tuple, cache: KVCache, canvas_ids: torch.Tensor, soft: torch.Tensor | None) -> _Entry:
        while len(self.entries) >= self.max_graphs:
            self.entries.popitem(last=False)
        entry = _Entry(
            cache=weakref.ref(cache),
            ids=canvas_ids.clone(),
            soft=None if soft is None else soft.clone(),
            length=torch.tensor(cache.length, device=cache.device),
        )
        self.entries[key] = entry
        if not self.capture:
            return entry
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
            warnings.warn(f"CUDA graph capture failed, denoising without graphs: {e}", stacklevel=3)
            self.capture = False
            return entry
        entry.graph = graph
        return entry

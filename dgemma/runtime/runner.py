"""The forward passes generation runs: `Runner.encode` and `Runner.denoise` (docs/speed.md, "The fast paths").

    runner = dgemma.accelerate(model)   # the fast twin (runtime/fast.py), CUDA graphs on CUDA; compile=True too
    dgemma.generate(runner, prompt)     # wherever a model goes: generate, Engine, create_app

A bare model passed where a runner goes is `Runner(model)`, the reference modules; exact-mode requests are
answered by `runner.reference`, so they keep transformers' numbers whatever runner serves them.
"""

from __future__ import annotations

import torch

from ..generation.sampling import CanvasStats, canvas_stats, chunk_columns
from ..model.kv_cache import DenoiseCache, KVCache
from ..model.model import DiffusionGemma, EncodeOutput
from .cpu import reuse_freed_memory
from .fast import capturable, fast_twin
from .graphs import GraphedDenoise


class Runner:
    """Runs `encode` / `denoise` for generation: on the fast twin if it has one, else on the reference
    modules. `compile` applies to the twin's denoising and text encoding passes (and, on a
    CPU, to the sampler's statistics where the vocabulary is one chunk: `canvas_stats`), `graphs`
    (default: on CUDA when the step can be captured) to its denoising pass; `grouped` to its experts
    (see dgemma.runtime.fast.fast_twin)."""

    def __init__(
        self,
        model: DiffusionGemma,
        *,
        fast: bool = False,
        compile: bool = False,
        grouped: bool | None = None,
        graphs: bool | None = None,
    ):
        if not isinstance(model, DiffusionGemma):
            raise TypeError(f"a Runner runs a DiffusionGemma (got {type(model).__name__})")
        if not fast and (compile or graphs or grouped):
            raise ValueError("compile, graphs and grouped apply to the fast modules: pass fast=True")
        self.model = model
        if model.device.type == "cpu":
            reuse_freed_memory()  # else every step faults its freed temporaries in again (dgemma/runtime/cpu.py)
        self.fast = fast_twin(model, grouped=grouped) if fast else None
        self.compiled = compile and fast
        self.graphs: GraphedDenoise | None = None
        self._fast_denoise = None if self.fast is None else self.fast.denoise
        self._fast_encode = None if self.fast is None else self.fast.encode
        self._canvas_stats = canvas_stats
        self._reference = None if fast else self
        if self.compiled:
            # Experts that loop over a data-dependent split break the graph once per layer; allow one
            # compiled variant per layer instead of falling back to eager after the default 8.
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, 4 * model.text_config.num_hidden_layers)
            # On a CPU the compiled graph's wrapper is C++ rather than Python: a toy's step is mostly that
            # wrapper's per-call work (BENCHMARKS.md, "On the machine kind": 23% faster on tiny).
            options = {"cpp_wrapper": True} if model.device.type == "cpu" else None
            self._fast_denoise = torch.compile(self.fast.denoise, options=options)
            self._fast_encode = torch.compile(self.fast.encode, options=options)
            if model.device.type == "cpu":  # measured there (BENCHMARKS.md), not on a GPU
                self._canvas_stats = torch.compile(canvas_stats, options=options)
        elif self.fast is not None and (capturable(self.fast) if graphs is None else graphs):
            self.graphs = GraphedDenoise(self.fast)
            self._fast_denoise = self.graphs

    # What callers read to prepare inputs, as on the model itself.
    @property
    def config(self):
        return self.model.config

    @property
    def text_config(self):
        return self.model.text_config

    @property
    def generation_config(self):
        return self.model.generation_config

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def new_cache(self, batch_size: int, max_length: int, **kwargs) -> KVCache:
        """`DiffusionGemma.new_cache`."""
        return self.model.new_cache(batch_size, max_length, **kwargs)

    @property
    def modules(self) -> DiffusionGemma:
        """The model whose modules this runner runs: the fast twin if it has one, else the reference."""
        return self.model if self.fast is None else self.fast

    @property
    def reference(self) -> Runner:
        """The Runner of the reference modules (this one if it has no twin): what exact mode runs on."""
        if self._reference is None:
            self._reference = Runner(self.model)
        return self._reference

    def encode(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        attention_mask: torch.Tensor | None = None,
        *,
        return_logits: bool = False,
        pixels=None,
        is_generated: bool = False,
    ) -> EncodeOutput:
        """`DiffusionGemma.encode` (`is_generated`: a commit of generated tokens,
        which may hold the image placeholder id); with `compile`, the twin's text encodes (prompts and
        commits) run compiled: dynamo recompiles once their lengths vary, then treats them as dynamic, and
        the id check runs eagerly. Encodes with images run eagerly."""
        kw = dict(return_logits=return_logits, is_generated=is_generated)
        if self._fast_encode is None or pixels is not None:
            return self.modules.encode(input_ids, cache, attention_mask, pixels=pixels, **kw)
        return self._fast_encode(input_ids, cache, attention_mask, **kw)

    def denoise(
        self,
        canvas_ids: torch.Tensor,
        cache: DenoiseCache,
        self_conditioning: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`DiffusionGemma.denoise`: the twin's (compiled or graphed) if there is one, else the reference's;
        the logits are written into `out` if given."""
        if self._fast_denoise is None:
            return self.model.denoise(canvas_ids, cache, self_conditioning, out=out)
        return self._fast_denoise(canvas_ids, cache, self_conditioning, out=out)

    def canvas_stats(
        self, logits: torch.Tensor, embedding: torch.Tensor | None = None, embed_scale: torch.Tensor | None = None
    ) -> CanvasStats:
        """`sampling.canvas_stats` of a fast step's logits; with `compile` on a CPU, compiled where the
        whole vocabulary is one 1 MB chunk: a toy's ~20 small operations, bound by their overhead, become
        a fused kernel and a matmul. Longer rows keep the chunked eager pass, whose products already run
        near the matmul rate and whose loop would only lengthen the compile."""
        b, c, v = logits.shape
        if chunk_columns(b * c, v, logits.device) >= v:
            return self._canvas_stats(logits, embedding, embed_scale)
        return canvas_stats(logits, embedding, embed_scale)

    def writes_in_place(self) -> bool:
        """Whether `denoise(..., out=)` writes the logits straight into `out` (the fast twin's LM head), so
        that a caller's reused buffer saves an allocation; the reference modules copy them there, which
        would only add a copy."""
        return self.fast is not None

    def release(self) -> None:
        """Drop the captured CUDA graphs and their buffers (they are recorded again when needed)."""
        if self.graphs is not None:
            self.graphs.release()

    def __repr__(self) -> str:
        kernels = "reference" if self.fast is None else "fast"
        head = f"Runner(kernels={kernels}, compile={self.compiled}, graphs={self.graphs is not None})"
        return f"{head}\n{self.modules}"


def accelerate(
    model: DiffusionGemma, *, compile: bool = False, grouped: bool | None = None, graphs: bool | None = None
) -> Runner:
    """A Runner of `model` with the fast modules; pass it where a model goes (`dgemma.generate(runner,
    ...)`, `Engine(runner)`, `create_app(runner, ...)`). `model` itself is not changed."""
    return Runner(model, fast=True, compile=compile, grouped=grouped, graphs=graphs)


def as_runner(model: DiffusionGemma | Runner) -> Runner:
    """`model` if it is a Runner, else a Runner of its reference modules."""
    return model if isinstance(model, Runner) else Runner(model)

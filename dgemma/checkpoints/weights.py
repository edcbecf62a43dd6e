"""Hugging Face checkpoints <-> dgemma models: safetensors only, memory-mapped, strictly validated.

A checkpoint directory holds `config.json`, optionally `generation_config.json`, and either
`model.safetensors` or shards listed in `model.safetensors.index.json`. Names follow transformers'
`DiffusionGemmaForBlockDiffusion`:

    model.decoder.<name>                              -> <name> in dgemma (the shared stack)
    model.encoder.language_model.layers.N.layer_scalar -> layers.N.encoder_layer_scalar
    model.encoder.language_model.<name>               -> a tied copy of model.decoder.<name> (checked equal)
    lm_head.weight                                    -> tied to embed_tokens.weight (checked equal)
    model.encoder.vision_tower.* / embed_vision.*     -> vision_tower.* / embed_vision.* (dgemma/model/vision.py)

transformers stores each tied tensor once (under the decoder's name); other writers may store both
sides in full. Both layouts load. `save` writes the transformers layout, which transformers loads too.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..model.config import DiffusionGemmaConfig, GenerationConfig
from ..model.model import DiffusionGemma, Experts
from ..quant import (
    QuantSpec,
    Spec,
    check_mode,
    describe_spec,
    describe_specs,
    fused_amax,
    fused_group,
    quantized_buffer_names,
    quantized_weight_names,
    specs_of,
    swap_modules,
    targets,
)
from ..quant.formats import quantized_buffers
from .compressed_tensors import CompressedSource, is_compressed_tensors
from .gguf_file import GGUFSource, gguf_path
from .gguf_file import read_config as read_gguf_config
from .modelopt import ModelOptSource, check_modelopt, compressed_tensors_config, modelopt_config
from .names import DEC, ENC, VISION, VISION_ROOT, hf_name, hf_state_dict
from .vllm_export import export

_ENC_SCALAR = re.compile(r"^model\.encoder\.language_model\.layers\.(\d+)\.layer_scalar$")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """'bf16' / 'bfloat16' / torch.bfloat16 -> torch.bfloat16; None or 'auto' -> None (keep the stored dtype)."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


# ------------------------------------------------------------------------------------------------
# Reading


def _refuse_pickle(path: Path) -> None:
    raise ValueError(
        f"{path} is a pickle file; dgemma loads safetensors only, because unpickling a file can run "
        "arbitrary code. Convert it once in a trusted environment (e.g. transformers' save_pretrained "
        "with safe_serialization=True) and load the model.safetensors it writes."
    )


def _weight_files(directory: Path) -> list[Path]:
    if directory.is_file():
        if directory.suffix in _PICKLE_SUFFIXES:
            _refuse_pickle(directory)
        raise ValueError(f"{directory} is a file; pass the checkpoint directory that holds config.json")
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e}") from e
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index.name} lists shards that are missing from {directory}: {missing}")
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    pickles = sorted(p for p in directory.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        _refuse_pickle(pickles[0])
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {directory}")


class TensorSource:
    """Lazy, memory-mapped access to every tensor of a checkpoint, by HF name."""

    def __init__(self, files: list[Path]):
        self._handles = {}
        self.where: dict[str, Path] = {}
        for f in files:
            try:
                h = safe_open(str(f), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise ValueError(f"{f} is not a readable safetensors file: {e}") from e
            self._handles[f] = h
            for name in h.keys():  # noqa: SIM118 (safe_open has no __iter__)
                self.where[name] = f

    def names(self) -> list[str]:
        return list(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.where[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype's safetensors name ("BF16", "F8_E4M3", ...), read from the header."""
        return self._handles[self.where[name]].get_slice(name).get_dtype()

    def get(self, name: str) -> torch.Tensor:
        return self._handles[self.where[name]].get_tensor(name)

    def take(self, name: str) -> torch.Tensor:
        """The tensor through a mapping of its own, released (with the pages read through it) as soon as
        the tensor is, not when the checkpoint is closed."""
        with safe_open(str(self.where[name]), framework="pt", device="cpu") as h:
            return h.get_tensor(name)


def _map_names(hf_names: list[str]) -> tuple[dict[str, str], dict[str, str], list[str], list[str]]:
    """Split checkpoint names into: ours <- primary HF name; tied copies (HF name -> ours); the vision
    tower's names (also in primary); unknown."""
    primary: dict[str, str] = {}
    tied: dict[str, str] = {}
    vision: list[str] = []
    unknown: list[str] = []
    for name in hf_names:
        if name.startswith(VISION):
            vision.append(name)
            primary[name[len(VISION_ROOT) :]] = name
        elif (m := _ENC_SCALAR.match(name)) is not None:
            primary[f"layers.{m.group(1)}.encoder_layer_scalar"] = name
        elif name.startswith(DEC):
            primary[name[len(DEC) :]] = name
        elif name.startswith(ENC):
            tied[name] = name[len(ENC) :]
        elif name == "lm_head.weight":
            tied[name] = "embed_tokens.weight"
        else:
            unknown.append(name)
    # A checkpoint may store a tied tensor only on the encoder side; then that copy is the primary.
    for hf, ours in list(tied.items()):
        if ours not in primary and hf != "lm_head.weight":
            primary[ours] = hf
            del tied[hf]
    return primary, tied, vision, unknown


def load(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = "auto",
    device: torch.device | str = "cpu",
    verify_tied: bool = True,
    progress: bool = False,
    quant: str | QuantSpec | None = None,
    group_size: int = 64,
) -> DiffusionGemma:
    """Load a Hugging Face-format DiffusionGemma checkpoint directory into a dgemma model.

    With `quant` ('int8', 'int4', 'fp8' or 'nvfp4'; `group_size` for int4; or a QuantSpec) the policy's layers
    (dgemma.quant) are quantized as they are read, tensor by tensor (the stacked experts expert by
    expert), so the full precision model is never in memory. A checkpoint that is already quantized
    loads quantized as stored: one written by dgemma (`config.json` has a `quantization` block), or a
    compressed-tensors one (a `quantization_config`: FP8, int4/int8, NVFP4; compressed_tensors.py here), or
    NVIDIA ModelOpt NVFP4 (modelopt.py).
    `path` may also be a GGUF file of llama.cpp's DiffusionGemma conversion (or a directory holding one):
    dgemma/checkpoints/gguf_file.py.

    The model is built on the meta device and filled tensor by tensor from the memory-mapped safetensors,
    so the weights are never held twice. `dtype` is float32 / bfloat16 / float16 (or 'fp32', 'bf16', ...),
    or 'auto' to keep the stored dtype. Missing, unexpected or wrongly shaped tensors raise one
    ValueError that names them all. With `verify_tied`, tied copies stored twice are checked equal (this
    reads both copies). With `progress`, a one-line progress report goes to stderr.
    """
    directory = Path(path)
    config, generation, source, stored = _open(directory)
    primary, tied, vision, unknown = _map_names(source.names())
    unknown += getattr(source, "unknown", [])
    if config.vision_config is not None and not vision:
        warnings.warn(f"{directory}: config.json has a vision_config but the checkpoint no vision tower; loading it "
                      "as a text-only model", stacklevel=2)  # fmt: skip
        config.vision_config = None
    with torch.device("meta"):
        model = DiffusionGemma(config)
    specs = _stored_specs(model, stored, source)
    spec = _quantize_on_load(directory, quant, group_size, specs, stored, source)
    if specs:  # the checkpoint holds codes and scales: validate against the quantized layout
        with torch.device("meta"):
            swap_modules(model, specs, empty=True)
    _check_names(directory, model, source, primary, tied, unknown)
    target = resolve_dtype(dtype) or _stored_dtype(source, primary)
    if spec:  # quantize on load: the full-precision layout was validated above
        with torch.device("meta"):
            swap_modules(model, dict.fromkeys(targets(model), spec), empty=True)
    report = _Progress(len(primary), f"loading {directory.name}") if progress else None
    state = _read_state(model, source, primary, device, target, spec, report)
    if verify_tied:
        _check_tied(source, tied, primary, state, device)
    model.load_state_dict(state, strict=True, assign=True)
    if spec:
        model.quantization = describe_spec(spec)
    elif specs:
        model.quantization = stored if stored else describe_specs(specs)
    model.generation_config = generation
    model.notice = read_notice(directory)
    model.eval()
    return model


def read_notice(directory: Path) -> str | None:
    """The NOTICE file of a checkpoint directory (the license terms its weights carry, such as the Gemma
    Terms of Use of a model derived from Gemma), or None; `save` writes it again beside every copy."""
    path = directory / "NOTICE"
    return path.read_text(errors="replace") if directory.is_dir() and path.is_file() else None


def write_notice(directory: Path, notice: str | None) -> None:
    """Write `notice` (read_notice's) as the NOTICE of checkpoint directory `directory`; nothing when None."""
    if notice:
        atomic_write_bytes(directory / "NOTICE", notice.encode())


def _stored_dtype(source, primary: dict) -> torch.dtype:
    """dtype "auto": the embedding's stored dtype (float32 for one a model does not run in)."""
    stored = source.get(primary["embed_tokens.weight"]).dtype
    return stored if stored in _DTYPE_NAMES else torch.float32


def _write_shards(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> None:
    """The tensors in files of at most `max_shard_bytes` (with an index when there are several), each
    written atomically; the files of the other layout are removed."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        atomic_save_tensors(shards[0], out / "model.safetensors", meta)
        (out / "model.safetensors.index.json").unlink(missing_ok=True)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        atomic_save_tensors(shard, out / fname, meta)
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    atomic_write_bytes(out / "model.safetensors.index.json", json.dumps(index, indent=2).encode())
    (out / "model.safetensors").unlink(missing_ok=True)


def _quantize_on_load(directory: Path, quant, group_size: int, specs, stored, source) -> QuantSpec | None:
    """The QuantSpec to quantize with as the tensors are read: `quant`'s, or None for a checkpoint that is
    already quantized (as asked, or a ValueError naming how it is stored)."""
    spec = quant if isinstance(quant, QuantSpec) or quant is None else QuantSpec.of(quant, group_size)
    if specs and spec:
        as_stored = stored["mode"] if stored else "gguf" if isinstance(source, GGUFSource) else "compressed-tensors"
        if spec.mode != as_stored:
            raise ValueError(f"{directory} is already quantized as {as_stored}; it cannot load as {spec.mode}")
        return None
    return spec


def _check_tied(source, tied: dict, primary: dict, state: dict, device) -> None:
    """Tied copies stored twice must hold the same values as the copy read."""
    for hf, ours in tied.items():
        if not torch.equal(source.get(hf).to(device=device, dtype=state[ours].dtype), state[ours]):
            raise ValueError(
                f"{hf} is stored as a tied copy of {primary[ours]} but its values differ; "
                "DiffusionGemma shares these weights between encoder and decoder"
            )


def _open(directory: Path):
    """A checkpoint's config, generation config, tensor source (a GGUF file through GGUFSource,
    compressed-tensors files through CompressedSource) and dgemma `quantization` block, if any."""
    gguf = gguf_path(directory)
    if gguf is not None:
        config, generation = read_gguf_config(gguf)
        with torch.device("meta"):  # the modules that may keep Q8_0 / Q4_0 weights as they are
            modules = DiffusionGemma(config).named_modules()
            keep = {n for n, m in modules if type(m) is nn.Linear or isinstance(m, Experts)}
        return config, generation, GGUFSource(gguf, keep), None
    source = TensorSource(_weight_files(directory))
    config, generation = DiffusionGemmaConfig.from_file(directory), GenerationConfig.from_file(directory)
    raw = json.loads((directory / "config.json").read_text())
    experts = config.text_config.num_experts or 0
    if is_compressed_tensors(raw):
        return config, generation, CompressedSource(source, raw["quantization_config"], experts), None
    if (block := modelopt_config(directory, raw)) is not None:  # NVIDIA's NVFP4, read as compressed-tensors
        kv_cache = check_modelopt(block, f"{directory.name}'s ModelOpt quantization config")
        ct = compressed_tensors_config()
        return config, generation, CompressedSource(ModelOptSource(source, kv_cache), ct, experts), None
    return config, generation, source, _stored_quantization(directory)


def _stored_specs(model: DiffusionGemma, stored: dict | None, source) -> dict[str, Spec]:
    """The specs of the modules a checkpoint stores quantized, by our module names."""
    if stored:
        return specs_of(stored, model)
    if not isinstance(source, CompressedSource | GGUFSource):
        return {}
    specs: dict[str, Spec] = {}
    for hf, spec in source.specs.items():
        ours = _module_of(hf)
        if ours is None:
            raise ValueError(f"{hf}: a quantized module dgemma does not know")
        if specs.get(ours, spec) != spec:
            raise ValueError(f"{hf} is quantized differently from its tied copy")
        module = model.get_submodule(ours)
        if not (type(module) is nn.Linear or isinstance(module, Experts)):
            raise ValueError(f"{hf}: dgemma keeps linear layers and experts quantized, not a {type(module).__name__}")
        specs[ours] = spec
    return specs


def _module_of(hf_module: str) -> str | None:
    """Our name of a checkpoint module (either side of the tied encoder/decoder)."""
    for prefix in (DEC, ENC):
        if hf_module.startswith(prefix):
            return hf_module[len(prefix) :]
    return None


def _check_names(directory: Path, model: DiffusionGemma, source, primary: dict, tied: dict, unknown: list) -> None:
    """One ValueError naming every missing, unexpected and wrongly shaped tensor of a checkpoint."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing = sorted(set(expected) - set(primary))
    unexpected = sorted(unknown + [primary[n] for n in set(primary) - set(expected)])
    unexpected += sorted(hf for hf, ours in tied.items() if ours not in expected)
    wrong_shape = [
        f"{primary[n]}: checkpoint {source.shape(primary[n])}, model {expected[n]}"
        for n in sorted(set(primary) & set(expected))
        if source.shape(primary[n]) != expected[n]
    ]
    wrong_shape += [
        f"{hf}: checkpoint {source.shape(hf)}, model {expected[ours]}"
        for hf, ours in sorted(tied.items())
        if ours in expected and source.shape(hf) != expected[ours]
    ]
    if missing or unexpected or wrong_shape:
        parts = []
        if missing:
            parts.append(f"missing tensors ({len(missing)}): " + _listing([hf_name(n) for n in missing], ", "))
        if unexpected:
            parts.append(f"unexpected tensors ({len(unexpected)}): " + _listing(unexpected, ", "))
        if wrong_shape:
            parts.append(f"wrong shapes ({len(wrong_shape)}): " + _listing(wrong_shape, "; "))
        described = "the model its GGUF metadata describes" if isinstance(source, GGUFSource) else "its config.json"
        raise ValueError(f"checkpoint {directory} does not match {described}: " + " | ".join(parts))


def _read_state(model, source, primary: dict, device, target, quantize: QuantSpec | None, report) -> dict:
    """Every tensor of the model, read (and, with `quantize`, quantized as that spec) one by one."""
    to_quantize = quantized_weight_names(model) if quantize else set()
    stored = set() if quantize else quantized_buffer_names(model)
    codes = {n: model.get_buffer(n).dtype for n in quantized_weight_names(model)} if not quantize else {}
    state = {}
    group_amax: dict[tuple[str, ...], torch.Tensor] = {}
    for ours, hf in primary.items():
        if ours in to_quantize:
            # through a mapping of its own: the bf16 pages read are released with the tensor, instead of
            # staying resident until every view of the checkpoint's mapping (the model's norms) is gone
            tensor = source.take(hf)
            amax = _fused_amax(source, primary, ours, group_amax) if quantize.mode == "nvfp4" else None
            for suffix, t in quantized_buffers(tensor, quantize, amax).items():
                state[ours + suffix] = t.to(device)
            nbytes = tensor.nbytes
            del tensor
        elif ours in stored:  # stored codes and scales: as they are
            state[ours] = source.get(hf).to(device=device)
            if ours in codes and state[ours].dtype != codes[ours]:  # e.g. fp8 codes under an int8 config
                raise ValueError(
                    f"{hf}: the quantization config says {codes[ours]} codes, but they are {state[ours].dtype}"
                )
            nbytes = state[ours].nbytes
        else:
            state[ours] = source.get(hf).to(device=device, dtype=target)
            nbytes = state[ours].nbytes
        if report:
            report.step(nbytes)
    if report:
        report.done()
    return state


def _fused_amax(source, primary: dict, ours: str, cache: dict) -> torch.Tensor | None:
    """dgemma.quant.fused_amax of the Linear weight `ours`, its group's weights read from the checkpoint
    once per group."""
    module = ours.removesuffix(".weight")
    group = tuple(fused_group(module))
    if group not in cache:
        cache[group] = fused_amax(module, lambda m: source.get(primary[w]) if (w := f"{m}.weight") in primary else None)
    return cache[group]


def _stored_quantization(directory: Path) -> dict | None:
    """The `quantization` block of a checkpoint's config.json (written by `save` for quantized models)."""
    path = directory / "config.json" if directory.is_dir() else directory.parent / "config.json"
    block = json.loads(path.read_text()).get("quantization") if path.is_file() else None
    if block is None:
        return None
    if not isinstance(block, dict) or block.get("quant_method") != "dgemma" or "mode" not in block:
        raise ValueError(f"{path}: a 'quantization' block must be one written by dgemma (got {block!r})")
    if block["mode"] != "per-module":
        check_mode(block["mode"])
    return block


class _Progress:
    """A dependency-free progress line on stderr: tensors done, GB read, elapsed seconds."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.count, self.nbytes = total, label, 0, 0
        self.start = self.last = time.monotonic()

    def step(self, nbytes: int) -> None:
        self.count += 1
        self.nbytes += nbytes
        now = time.monotonic()
        if now - self.last > 0.5 or self.count == self.total:
            self.last = now
            print(
                f"\r{self.label}: {self.count}/{self.total} tensors, {self.nbytes / 1e9:.2f} GB, "
                f"{now - self.start:.0f} s",
                end="",
                file=sys.stderr,
                flush=True,
            )

    def done(self) -> None:
        print(file=sys.stderr, flush=True)


def _listing(items: list[str], sep: str, limit: int = 12) -> str:
    more = f"{sep}... (+{len(items) - limit} more)" if len(items) > limit else ""
    return sep.join(items[:limit]) + more


# ------------------------------------------------------------------------------------------------
# Writing


def _file_mode() -> int:
    """The mode open() would give a new file (0666 less the umask): mkstemp's own is 0600, private."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a crash leaves the old file or the new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.chmod(tmp, _file_mode())
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """A safetensors file written as atomic_write_bytes writes: whole or not at all."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.chmod(tmp, _file_mode())  # after: safetensors writes the file anew
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


FORMATS = ("dgemma", "compressed-tensors")


def save(
    model: DiffusionGemma,
    path: str | os.PathLike,
    *,
    max_shard_bytes: int = 5 * 2**30,
    generation_config: GenerationConfig | None = None,
    format: str = "dgemma",
    input_ranges: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write `model` as a Hugging Face checkpoint directory (config, safetensors, optional index).

    `format`: "dgemma" (transformers' layout; a quantized model's codes and scales under dgemma's names,
    described by a `quantization` block) or "compressed-tensors" (a quantized model as vLLM and the
    compressed-tensors library read it: dgemma/checkpoints/vllm_export.py; with `input_ranges`, the calibrated input
    ranges of dgemma.quant.calibrate.input_amax, an NVFP4 model is written W4A4). Every file is written to a
    temporary name and renamed into place, so a crash leaves either the old file or the new one, never a
    torn one. The weight files go first and config.json last. The model's `notice` (the NOTICE it was loaded
    with: the license its weights carry) is written beside them.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown checkpoint format {format!r}; choose one of {', '.join(FORMATS)}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    quantization_config = None
    if input_ranges is not None and format != "compressed-tensors":
        raise ValueError("calibrated input ranges (W4A4) are written in the compressed-tensors format only")
    if format == "compressed-tensors":
        named, quantization_config = export(model, input_ranges)
    else:
        named = dict(hf_state_dict(model))
    _write_shards({name: t.detach().to("cpu").contiguous() for name, t in named.items()}, out, max_shard_bytes)
    gen = generation_config or getattr(model, "generation_config", None)
    if gen is not None:
        atomic_write_bytes(out / "generation_config.json", json.dumps(gen.to_dict(), indent=2).encode())
    write_notice(out, getattr(model, "notice", None))  # weights derived from licensed ones carry the license on
    config = model.config.to_dict()
    config["dtype"] = _DTYPE_NAMES.get(model.dtype, "float32")
    if quantization_config:
        config["quantization_config"] = quantization_config
    elif getattr(model, "quantization", None):
        config["quantization"] = model.quantization
    atomic_write_bytes(out / "config.json", json.dumps(config, indent=2).encode())
    return out

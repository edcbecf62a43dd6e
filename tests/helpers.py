"""Small random checkpoints and tokenizers for tests and benchmarks (no downloads).

`make_oracle_checkpoint` builds a tiny `DiffusionGemmaForBlockDiffusion` with transformers (the
numerical oracle, a test dependency), gives every weight a non-trivial random value (norm weights,
router scales and the separate encoder/decoder layer scalars included, so each trap is exercised),
and saves it with `save_pretrained`. `make_tokenizer` trains a small byte-level BPE tokenizer with
Gemma 4-style special tokens and dgemma's chat template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dgemma.checkpoints.tokenizer import IMAGE_TOKENS, SPECIAL_TOKENS, TEMPLATE_PATH, train_bpe  # noqa: F401 (the tests' names)

TINY_VISION = dict(
    model_type="gemma4_vision",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
)


def tiny_text_kwargs(**overrides: Any) -> dict[str, Any]:
    """transformers DiffusionGemmaTextConfig arguments: dgemma's `tiny` preset with `overrides`, as
    dgemma writes them to config.json (so every oracle checkpoint also checks that transformers reads it)."""
    import dataclasses

    from dgemma.model.presets import preset

    text = dataclasses.replace(preset("tiny").text_config, layer_types=None, **overrides)
    kw = text.to_dict()
    kw.pop("model_type")
    return kw


@torch.no_grad()
def randomize_oracle(model, seed: int = 0, dense: bool = False) -> None:
    """Give a transformers DiffusionGemma model non-trivial weights everywhere.

    With `dense`, every expert's down_proj is zero: the MoE branch then adds exactly zero, which makes the
    oracle equal to a dense-only dgemma model with the same other weights.
    """
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        elif name.endswith("per_expert_scale"):
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
        else:  # norm weights and the router scale
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        if dense and "experts.down_proj" in name:
            p.zero_()
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(0.6 + 0.8 * torch.rand(b.shape, generator=g))


# Gemma 4's image tokens (begin, placeholder, end), and their ids in the tiny vision checkpoints: the last
# three of the 512-token vocabulary, where make_tokenizer(images=True) puts them.

TINY_IMAGE_IDS = {"boi_token_id": 509, "image_token_id": 510, "eoi_token_id": 511}


def make_oracle_model(
    *, dense: bool = False, seed: int = 0, canvas_length: int = 8, images: bool = False, **text_overrides: Any
):
    """A randomised tiny transformers DiffusionGemmaForBlockDiffusion (fp32, eval mode). With `images`, its
    image tokens lie in the tiny vocabulary (TINY_IMAGE_IDS) and image blocks attend both ways, as in the
    released model (use_bidirectional_attention "vision")."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DiffusionGemmaTextConfig

    if images:
        text_overrides.setdefault("use_bidirectional_attention", "vision")
    text = DiffusionGemmaTextConfig(**tiny_text_kwargs(**text_overrides))
    ids = TINY_IMAGE_IDS if images else {}
    config = DiffusionGemmaConfig(text_config=text, vision_config=TINY_VISION, canvas_length=canvas_length, **ids)
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    randomize_oracle(model, seed=seed, dense=dense)
    return model


def make_oracle_checkpoint(path: str | Path, **kwargs: Any):
    """Save a randomised tiny oracle model with `save_pretrained`; returns the oracle model."""
    model = make_oracle_model(**kwargs)
    model.save_pretrained(str(path))
    return model


def oracle_from_config(config, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """A transformers DiffusionGemmaForBlockDiffusion of any dgemma config (a preset, say), built directly on
    `device` in `dtype` with transformers' own random initialisation, and a tiny vision tower."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DiffusionGemmaTextConfig

    text = config.text_config.to_dict()
    text.pop("model_type")
    hf = DiffusionGemmaConfig(
        text_config=DiffusionGemmaTextConfig(**text), vision_config=TINY_VISION, canvas_length=config.canvas_length
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DiffusionGemmaForBlockDiffusion(hf)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def model_sharing_oracle_weights(oracle, config):
    """A dgemma model whose tensors *are* the oracle's (no copy): the same weights in both engines, for
    side-by-side speed measurements of models too large to hold twice."""
    from dgemma.checkpoints.names import ENC, hf_name
    from dgemma.model.model import DiffusionGemma

    theirs = oracle.state_dict()
    with torch.device("meta"):
        model = DiffusionGemma(config)
    state = {}
    for name in model.state_dict():
        hf = hf_name(name)
        state[name] = theirs[hf] if hf in theirs else theirs[ENC + name]
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def load_quiet(path: str | Path, **kwargs: Any):
    """dgemma.load without the expected notice about the tiny vision tower of oracle checkpoints."""
    import warnings

    from dgemma.checkpoints.weights import load

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*vision tower.*")
        return load(path, **kwargs)


# A fixed corpus for test tokenizers: the same text on every machine and at every commit (dgemma's own
# sources, used before, changed the tokenizer, and so every random model's output, with each edit).
_CORPUS_TEXT = (
    "def class return import from as if elif else for while in not and or is None True False with try except "
    "finally raise yield lambda pass break continue global assert del self cls args kwargs value values total "
    "count index item items key keys result results name names path file files text line lines data list dict "
    "set tuple int float str bytes bool len range print open read write append extend sort sorted sum min max "
    "model token tokens canvas step steps cache layer layers batch size shape tensor torch x y z a b c i j k n "
    "( ) [ ] { } : , . = + - * / % < > == != <= >= += -> # ' \" \n \t 0 1 2 3 4 5 6 7 8 9 10 16 32 64 256"
)
_CORPUS_WORDS = _CORPUS_TEXT.split(" ")


def _tokenizer_corpus(words: int = 20_000, seed: int = 0) -> list[str]:
    """Python-flavoured text drawn from a fixed word list with a fixed seed."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(_CORPUS_WORDS) for _ in range(200)) for _ in range(words // 200)]


def make_tokenizer(vocab_size: int = 512, corpus: list[str] | None = None, *, images: bool = False):
    """A test tokenizer: `dgemma.checkpoints.tokenizer.train_bpe` on a fixed corpus (or `corpus`). With
    `images`, Gemma 4's image tokens take the last three ids (TINY_IMAGE_IDS for a vocabulary of 512)."""
    return train_bpe(_tokenizer_corpus() if corpus is None else corpus, vocab_size, images=images)


# ------------------------------------------------------------------------------------------------
# Side-by-side runs against the oracle (used by tests/test_parity.py and benchmarks/parity.py)


def _valid_kv_diff(ours_k: torch.Tensor, theirs_k: torch.Tensor, valid: torch.Tensor) -> float:
    """Max |diff| over positions that are real tokens in every row ([B, H, S, D] aligned on the right)."""
    s = theirs_k.shape[2]
    ours_k = ours_k[:, :, -s:]
    keep = valid[:, -s:][:, None, :, None]
    return (ours_k.float() - theirs_k.float()).abs().masked_fill(~keep, 0).max().item()


@torch.no_grad()
def _cache_diff(cache, pkv, valid: torch.Tensor) -> float:
    """Max |diff| of the cached keys and values at valid positions, dgemma's cache vs the oracle's."""

    def written(tensors: list[torch.Tensor], i: int) -> torch.Tensor:
        return tensors[i] if cache.is_sliding[i] else tensors[i][:, :, : cache.length]

    return max(
        max(
            _valid_kv_diff(written(cache.keys, i), layer.keys, valid),
            _valid_kv_diff(written(cache.values, i), layer.values, valid),
        )
        for i, layer in enumerate(pkv.layers)
    )


def parity_case(oracle, model, *, prompt_lengths: list[int], commit: bool, seed: int = 0) -> dict[str, float]:
    """Run one scenario through the oracle and dgemma with the same inputs; return max |diff| per quantity.

    Rows of `prompt_lengths` are left-padded to the longest. Checks: encoder hidden states and KV cache
    after the prompt, denoise logits without and with self-conditioning, and, with `commit`, the same
    after committing the argmax canvas through the encoder and denoising a second canvas.
    """
    from transformers.cache_utils import DynamicCache

    g = torch.Generator().manual_seed(seed)
    vocab = model.text_config.vocab_size
    c = model.config.canvas_length
    b, t = len(prompt_lengths), max(prompt_lengths)
    ids = torch.randint(3, vocab, (b, t), generator=g)
    mask = torch.zeros(b, t, dtype=torch.long)
    for row, n in enumerate(prompt_lengths):
        mask[row, t - n :] = 1
    padded = bool((mask == 0).any())
    canvas = torch.randint(0, vocab, (b, c), generator=g)
    dtype = model.dtype
    out: dict[str, float] = {}

    pkv = DynamicCache(config=oracle.config.text_config)
    enc_kw = {"attention_mask": mask} if padded else {}
    ref_enc = oracle.model.encoder(input_ids=ids, past_key_values=pkv, **enc_kw).last_hidden_state
    cache = model.new_cache(b, t + 2 * c)
    enc = model.encode(ids, cache, attention_mask=mask if padded else None)
    valid = mask.bool()
    out["prefill_hidden"] = (enc.hidden_states.float() - ref_enc.float()).abs()[valid].max().item()
    out["prefill_kv"] = _cache_diff(cache, pkv, valid)

    def dec_mask(extra: int) -> dict:
        return {"decoder_attention_mask": torch.nn.functional.pad(mask, (0, extra), value=1)} if padded else {}

    ref = oracle(past_key_values=pkv, decoder_input_ids=canvas, **dec_mask(c)).logits
    ours = model.denoise(canvas, cache)
    out["logits"] = (ours - ref).abs().max().item()
    sc = (ref / 0.6).to(dtype)  # processed logits of a "previous step", in the embedding dtype
    ref_sc = oracle(past_key_values=pkv, decoder_input_ids=canvas, self_conditioning_logits=sc, **dec_mask(c)).logits
    out["logits_sc"] = (model.denoise(canvas, cache, model.soft_embedding(sc)) - ref_sc).abs().max().item()
    if not commit:
        return out

    committed = ref.argmax(-1)
    full_mask = torch.nn.functional.pad(mask, (0, c), value=1)
    enc_kw = {"attention_mask": full_mask} if padded else {}
    ref_enc2 = oracle.model.encoder(input_ids=committed, past_key_values=pkv, **enc_kw).last_hidden_state
    enc2 = model.encode(committed, cache)
    out["commit_hidden"] = (enc2.hidden_states.float() - ref_enc2.float()).abs().max().item()
    canvas2 = torch.randint(0, vocab, (b, c), generator=g)
    mask = full_mask
    ref2 = oracle(past_key_values=pkv, decoder_input_ids=canvas2, **dec_mask(c)).logits
    out["logits_canvas2"] = (model.denoise(canvas2, cache) - ref2).abs().max().item()
    sc2 = (ref2 / 0.5).to(dtype)
    ref2_sc = oracle(past_key_values=pkv, decoder_input_ids=canvas2, self_conditioning_logits=sc2, **dec_mask(c)).logits
    out["logits_canvas2_sc"] = (model.denoise(canvas2, cache, model.soft_embedding(sc2)) - ref2_sc).abs().max().item()
    return out


def parity_scenarios(window: int) -> dict[str, tuple[list[int], bool]]:
    """name -> (prompt lengths per row, commit a canvas and denoise a second one), sized to the window."""
    return {
        "short_prompt": ([window // 2 + 2], False),
        "long_prompt": ([5 * window // 2], False),  # longer than the sliding window
        "second_canvas": ([3 * window // 4], True),
        "batch_left_padding": ([5 * window // 2, 5 * window // 3], True),
    }


PARITY_SCENARIOS = parity_scenarios(16)  # for the tiny checkpoints (sliding window 16)

MEDIUM_TEXT = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    global_head_dim=64,
    num_global_key_value_heads=2,
    sliding_window=64,
    num_experts=16,
    top_k_experts=4,
    moe_intermediate_size=128,
)


def fp32_tolerance(scale: float, hidden_size: int, num_layers: int) -> float:
    """How far two correct fp32 computations of one random-weight model may disagree (another BLAS kernel,
    batch shape or buffer alignment) on outputs of magnitude `scale` after `num_layers` layers.

    The rounding errors of an M-term fp32 sum add up like sqrt(M) * eps of its scale, in any summation
    order; through these random layers they grow about sqrt(2)x per layer; 16x covers the spread over
    inputs. Measured by benchmarks/parity.py (its one-ulp column: every weight moved by one ulp), the logits
    move by up to 5e-5 (tiny: 6 layers, M = 64) and 1.5e-3 (medium: 12 layers, M = 256), 3-5x below this
    bound. Rounding that flips a top-k routing choice is not covered: random MoE models deeper than about
    16 layers hit such flips.
    """
    return 16 * torch.finfo(torch.float32).eps * scale * hidden_size**0.5 * 2 ** (num_layers / 2)


@torch.no_grad()
def fp32_tolerances(model) -> tuple[float, float]:
    """`fp32_tolerance` at a dgemma model's depth and width for (its denoise logits, its hidden states and
    KV cache), each at its own scale: the max |value| after a short random prompt and one canvas."""
    g = torch.Generator().manual_seed(0)
    text, c = model.text_config, model.config.canvas_length
    cache = model.new_cache(1, 16 + c)
    hidden = model.encode(torch.randint(3, text.vocab_size, (1, 16), generator=g), cache).hidden_states
    logits = model.denoise(torch.randint(0, text.vocab_size, (1, c), generator=g), cache)
    states = [hidden, *cache.keys, *cache.values]  # unwritten cache slots are zeros: no effect on the max
    scales = logits.abs().max().item(), max(t.abs().max().item() for t in states)
    return tuple(fp32_tolerance(s, text.hidden_size, text.num_hidden_layers) for s in scales)


def fp32_logit_tolerance(model) -> float:
    """`fp32_tolerance` for a dgemma model's denoise logits (see `fp32_tolerances`)."""
    return fp32_tolerances(model)[0]


def dense_checkpoint_from_oracle(src: str | Path, dst: str | Path) -> Path:
    """Rewrite an oracle checkpoint whose experts add zero as a dense-only dgemma checkpoint."""
    import json

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    moe_parts = (".router.", ".experts.", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2")
    tensors = {
        k: v
        for k, v in load_file(str(src / "model.safetensors")).items()
        if not any(p in k for p in moe_parts)
        and not k.startswith("model.encoder.vision_tower")
        and not k.startswith("model.encoder.embed_vision")
    }
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["text_config"].update(num_experts=None, top_k_experts=None, moe_intermediate_size=None)
    config.pop("vision_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


@torch.no_grad()
def make_copy_model(model, sharpness: float = 10.0):
    """Turn a dgemma model into one that predicts each canvas position's own input token, confidently.

    Every layer's and the self-conditioning block's output projections are zeroed, so the final hidden state
    is the normalised input embedding and the tied head scores the input token highest. A random canvas is
    then already a fixed point: drafts are stable from the first step, which exercises stopping and early
    commit deterministically. Returns the model (changed in place).
    """
    for layer in model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        if layer.experts is not None:
            layer.experts.down_proj.zero_()
    model.self_conditioning.down_proj.weight.zero_()
    model.embed_tokens.weight.mul_(sharpness)
    return model


# ------------------------------------------------------------------------------------------------
# Images, side by side with the oracle


def random_pixels(grids: list[tuple[int, int]], rows: int, seed: int = 0, patch_pixels: int = 768):
    """Random patches of images of (rows x columns) patch grids (multiples of 3), padded to `rows` patch
    rows each as the processor pads them: a vision.Pixels, and each image's soft-token count."""
    from dgemma.model.vision import Pixels

    g = torch.Generator().manual_seed(seed)
    values = torch.zeros(len(grids), rows, patch_pixels)
    positions = torch.full((len(grids), rows, 2), -1, dtype=torch.long)
    for i, (h, w) in enumerate(grids):
        n = h * w
        values[i, :n] = torch.rand(n, patch_pixels, generator=g)
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        positions[i, :n] = torch.stack([xs.reshape(-1), ys.reshape(-1)], -1)
    return Pixels(values, positions), [h * w // 9 for h, w in grids]


def image_prompt(parts: list[int | list[int]], image_id: int, boi: int, eoi: int) -> list[int]:
    """Token ids of a prompt: each int in `parts` an image of that many soft tokens (boi, placeholders,
    eoi), each list text ids."""
    out: list[int] = []
    for part in parts:
        out += [boi, *[image_id] * part, eoi] if isinstance(part, int) else part
    return out


@torch.no_grad()
def oracle_image_encode(oracle, ids: torch.Tensor, mask: torch.Tensor | None, pixels, pkv):
    """The oracle's prefill with images as its `generate` runs it: the mask dict built with the image
    blocks (mm_token_type_ids) and passed in (the encoder's own forward drops it)."""
    enc = oracle.model.encoder
    b, t = ids.shape
    positions = torch.arange(t)[None].expand(b, -1)
    mm = (ids == oracle.config.image_token_id).long()
    masks = enc.create_masks_for_generate(
        config=oracle.config,
        inputs_embeds=torch.empty(b, t, 0),
        attention_mask=mask,
        past_key_values=pkv,
        position_ids=positions,
        mm_token_type_ids=mm,
    )
    return enc(
        input_ids=ids,
        pixel_values=pixels.values,
        image_position_ids=pixels.positions,
        attention_mask=masks,
        position_ids=positions,
        past_key_values=pkv,
        mm_token_type_ids=mm,
    ).last_hidden_state


def generation_request(
    runner, prompt, params: dict | object, *, want_drafts: bool = False, timeout=None, check=True, **kwargs
) -> object:
    """An EngineRequest of `dgemma.generate`'s task (`kwargs`: pins, allowed, logprobs, pixels), checked."""
    from dgemma.generation.engine import EngineRequest
    from dgemma.generation.programs import Generate
    from dgemma.generation.sampling import SamplingParams

    params = SamplingParams(**params) if isinstance(params, dict) else params
    rows = prompt if prompt and isinstance(prompt[0], list) else [prompt]
    task = Generate(rows, params, **kwargs)
    if check:  # else a request the engine must refuse on its own (the task's check would have)
        task = task.check(runner.model)
    else:
        task = Generate(rows, params.resolve(runner.generation_config, runner.text_config.eos_token_ids))
    return EngineRequest(task.program(runner.model, runner.canvas_stats), want_drafts=want_drafts, timeout=timeout)


def generate_steps(runner, prompt, **settings):
    """The canvas loop's generator of `dgemma.generate(runner, prompt, **settings)`, checked (a test that
    answers its calls itself)."""
    from dgemma.generation.programs import Generate
    from dgemma.generation.sampling import SamplingParams

    rows = prompt if prompt and isinstance(prompt[0], list) else [prompt]
    given = {k: settings.pop(k) for k in ("pins", "allowed", "logprobs", "pixels") if k in settings}
    task = Generate(rows, SamplingParams(**settings), **given).check(runner.model)
    return task.steps(runner.model, runner.canvas_stats)


def request_result(request, timeout: float = 120):
    """The result of an engine request, read from its events (what it raised, raised here)."""
    from dgemma.generation.engine import DoneEvent

    while True:
        event = request.events.get(timeout=timeout)
        if isinstance(event, Exception):
            raise event
        if isinstance(event, DoneEvent):
            return event.result

"""DiffusionGemma's text architecture, read top to bottom.

One Gemma 4 transformer stack (attention + a dense GeGLU MLP + a routed mixture of experts in every
layer) runs in two modes over shared weights:

- `encode`: causal attention over new tokens (the prompt, or a finished canvas being committed). It
  writes their keys and values into the KV cache and returns hidden states (and, when asked, the
  next-token logits of the autoregressive head).
- `denoise`: bidirectional attention of a canvas over [cached prefix ; canvas]. It reads the cache and
  never writes it, and returns softcapped fp32 logits for every canvas position. The canvas input is
  self-conditioned on the previous step's (processed) logits.

The two modes differ only in the attention mask, in whether the cache is written, in the per-layer
`layer_scalar` (the encoder and the decoder each have their own), and in the self-conditioning block
at the decoder's input. The denoising loop itself lives in generate.py, not here.

Parameter names are those of the Hugging Face checkpoint's decoder (`model.decoder.` stripped), so
loading is a renaming of prefixes; see weights.py.

Shape legend: B batch, T tokens in this call, S key positions (cached prefix + this call),
H query heads, Hkv KV heads, D head dim, M hidden size, E experts, K active experts, V vocab, N = B*T.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import DiffusionGemmaConfig, GenerationConfig, LayerSpec, TextConfig
from .kv_cache import DenoiseCache, KVCache
from .layers import RMSNorm, gelu_tanh
from .vision import VisionConfig, VisionEmbedder, VisionTower, image_blocks


def embed_scale(hidden_size: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """sqrt(M) as an fp32 scalar rounded to `dtype`, as the reference does (sqrt(3072) is 55.5 in bf16)."""
    # torch.full, not torch.tensor: no host-to-device copy, so a CUDA graph can record it.
    return torch.full((), hidden_size**0.5, dtype=torch.float32, device=device).to(dtype)


# ------------------------------------------------------------------------------------------------
# Rotary position embedding


def rope_inv_freq(spec: LayerSpec, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies [D/2] of one layer type.

    Sliding layers: standard RoPE over the whole head. Global layers: "proportional" RoPE, where only
    the first `partial_rotary_factor` of the frequency pairs rotate (exponents still taken against the
    full head dim) and the remaining pairs get frequency 0, i.e. the identity.
    """
    d = spec.head_dim
    num_rotated = int(spec.partial_rotary_factor * d // 2) if spec.rope_type == "proportional" else d // 2
    exponents = torch.arange(0, 2 * num_rotated, 2, dtype=torch.int64, device=device).float() / d
    inv_freq = 1.0 / (spec.rope_theta**exponents)
    return torch.cat([inv_freq, inv_freq.new_zeros(d // 2 - num_rotated)])


def rope_cos_sin(spec: LayerSpec, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, D] (or [B, T, D]) for absolute `positions` [T] (or per row, [B, T]), computed in fp32
    and cast to the activation dtype."""
    freqs = positions.float()[..., None] * rope_inv_freq(spec, positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] by the half-split convention: pairs are (i, i + D/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


# ------------------------------------------------------------------------------------------------
# Attention


class Attention(nn.Module):
    """Gemma 4 attention: q/k RMSNorm before RoPE, v_norm without weight, scale 1.0, GQA.

    Global layers have no v_proj: the values are the raw k_proj output (before k_norm and RoPE). A model
    adapted from Gemma 3 has values of its own there, no v_norm and its scale (`query_pre_attn_scalar`).
    """

    def __init__(self, config: TextConfig, layer_idx: int):
        super().__init__()
        spec = config.layer(layer_idx)
        self.layer_idx = layer_idx
        self.spec = spec
        h, d, bias = config.hidden_size, spec.head_dim, config.attention_bias
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, spec.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, spec.num_key_value_heads * d, bias=bias) if spec.has_v_proj else None
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.v_norm = RMSNorm(d, config.rms_norm_eps, with_scale=False) if config.use_value_norm else None
        scalar = config.query_pre_attn_scalar
        self.scale = 1.0 if scalar is None else scalar**-0.5  # Gemma 4: 1.0 (q and k are normed)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, M]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache,
        mask: torch.Tensor | None,  # [B, 1, T, S] bool, True = may attend; None = attend to all
        writes_cache: bool,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        d = self.spec.head_dim
        cos, sin = cos_sin
        q = apply_rope(self.q_norm(self.q_proj(x).view(b, t, -1, d)), cos, sin)
        k_raw = self.k_proj(x).view(b, t, -1, d)
        v = self.v_proj(x).view(b, t, -1, d) if self.v_proj is not None else k_raw
        k = apply_rope(self.k_norm(k_raw), cos, sin)
        v = self.v_norm(v) if self.v_norm is not None else v
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H(kv), T, D]
        if writes_cache:
            keys, values = cache.update(self.layer_idx, k, v)  # [B, Hkv, S, D]
        else:
            keys, values = cache.with_prefix(self.layer_idx, k, v)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=q.shape[1] != keys.shape[1]
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


# ------------------------------------------------------------------------------------------------
# Feed-forward: a dense GeGLU MLP and a routed mixture of experts, side by side


class MLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Chooses K of E experts per token from the *raw* residual (not a normed input).

    rms-normalise (no weight) -> * scale * M^-0.5 -> proj -> softmax (fp32) -> top-k -> renormalise the
    k weights to sum 1 -> multiply by the chosen experts' per_expert_scale.
    """

    def __init__(self, config: TextConfig):
        super().__init__()
        self.top_k = config.top_k_experts
        self.root_size = config.hidden_size**-0.5
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))

    def forward(self, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # r [N, M]
        h = self.norm(r) * self.scale * self.root_size
        probs = torch.softmax(self.proj(h), dim=-1, dtype=torch.float32)  # [N, E]
        weights, index = torch.topk(probs, self.top_k, dim=-1)  # [N, K]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[index], index


class Experts(nn.Module):
    """E GeGLU experts stored stacked: gate_up_proj [E, 2I, M] (gate rows, then up), down_proj [E, M, I].

    This is the plain reference computation (one matmul pair per expert hit); faster grouped kernels
    are applied from outside and tested against it.
    """

    def __init__(self, config: TextConfig):
        super().__init__()
        e, m, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, m))
        self.down_proj = nn.Parameter(torch.empty(e, m, i))

    # -- one expert's weight, by name (the interface QuantExperts shares: LoRA and merging use it) ---------
    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """[E, out, in] of gate_up_proj and down_proj."""
        return {"gate_up_proj": tuple(self.gate_up_proj.shape), "down_proj": tuple(self.down_proj.shape)}

    def linear(self, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
        """x through expert `e`'s weight `name` (x W_e^T)."""
        return F.linear(x, getattr(self, name)[e])

    def expert(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `e`'s weight `name` in `dtype`."""
        return getattr(self, name)[e].to(dtype)

    def set_expert(self, name: str, e: int, w: torch.Tensor) -> None:
        """Overwrite expert `e`'s weight `name` with `w` [out, in] (a LoRA merge)."""
        weight = getattr(self, name)
        with torch.no_grad():
            weight[e] = w.to(weight.dtype)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        # Each (token, slot) output is weighted in fp32 and the K slots are summed in fp32, then cast
        # back: more accurate in bf16 than accumulating in place, and what the reference does.
        n, k = index.shape
        slots = x.new_zeros(n, k, x.shape[-1], dtype=torch.float32)  # [N, K, M]
        for e in torch.unique(index).tolist():
            token, slot = torch.where(index == e)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            slots[token, slot] = F.linear(gelu_tanh(gate) * up, self.down_proj[e]) * weights[token, slot, None]
        return slots.sum(dim=1).to(x.dtype)


class DecoderLayer(nn.Module):
    """One Gemma 4 layer. Both modes share every weight but `layer_scalar` (decoder) / `encoder_layer_scalar`."""

    def __init__(self, config: TextConfig, layer_idx: int):
        super().__init__()
        m, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(m, config.intermediate_size)
        self.input_layernorm = RMSNorm(m, eps)
        self.post_attention_layernorm = RMSNorm(m, eps)
        self.pre_feedforward_layernorm = RMSNorm(m, eps)
        self.post_feedforward_layernorm = RMSNorm(m, eps)
        self.post_feedforward_layernorm_1 = RMSNorm(m, eps) if config.mlp_post_norm or config.has_experts else None
        if config.has_experts:
            self.router = Router(config)
            self.experts = Experts(config)
            self.pre_feedforward_layernorm_2 = RMSNorm(m, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(m, eps)
        else:
            self.router = self.experts = None
        self.register_buffer("layer_scalar", torch.ones(1))
        self.register_buffer("encoder_layer_scalar", torch.ones(1))

    def forward(
        self, x: torch.Tensor, cos_sin, cache: KVCache, mask: torch.Tensor | None, is_encoder: bool
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos_sin, cache, mask, writes_cache=is_encoder)
        r = x + self.post_attention_layernorm(h)
        ff = self.mlp(self.pre_feedforward_layernorm(r))
        ff = ff if self.post_feedforward_layernorm_1 is None else self.post_feedforward_layernorm_1(ff)
        if self.experts is not None:
            flat = r.reshape(-1, r.shape[-1])
            weights, index = self.router(flat)
            moe = self.experts(self.pre_feedforward_layernorm_2(flat), weights, index)
            ff = ff + self.post_feedforward_layernorm_2(moe.view_as(r))
        out = r + self.post_feedforward_layernorm(ff)
        return out * (self.encoder_layer_scalar if is_encoder else self.layer_scalar)


class SelfConditioning(nn.Module):
    """Adds a GeGLU transform of the previous step's soft embedding to the canvas embedding, then
    normalises (post_norm has no weight). It applies on every denoising step, the first one included."""

    def __init__(self, config: TextConfig):
        super().__init__()
        m = config.hidden_size
        self.pre_norm = RMSNorm(m, config.rms_norm_eps)
        self.post_norm = RMSNorm(m, config.rms_norm_eps, with_scale=False)
        self.gate_proj = nn.Linear(m, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(m, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, m, bias=False)

    def forward(self, embeds: torch.Tensor, soft_embeds: torch.Tensor | None) -> torch.Tensor:
        if soft_embeds is not None:
            s = self.pre_norm(soft_embeds)
            embeds = embeds + self.down_proj(gelu_tanh(self.gate_proj(s)) * self.up_proj(s))
        # With no signal the MLP would add exactly zero (every op maps 0 to 0), so it is skipped.
        return self.post_norm(embeds)


class LMHead(nn.Module):
    """The tied LM head: hidden states [..., M] times the token embedding [V, M] transposed, cast to fp32,
    then the final softcap tanh(x / c) * c. It holds no weight (the embedding is passed in), so it adds
    nothing to the state dict; the fast twin swaps in a chunked version (dgemma/runtime/fast.py). The cap c is
    read from the config at each call (`final_logit_softcapping`; None: no cap)."""

    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config

    @property
    def softcap(self) -> float | None:
        return self.config.final_logit_softcapping

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The logits [..., V] fp32; with `out` (fp32, that shape), written there and returned."""
        logits = F.linear(hidden, weight).float()
        cap = self.softcap
        if cap is not None and torch.is_grad_enabled():
            logits = torch.tanh(logits / cap) * cap
        elif cap is not None:  # the same values in place: no extra [B, T, V] fp32 temporaries at inference
            logits.div_(cap).tanh_().mul_(cap)
        return logits if out is None else out.copy_(logits)

    def extra_repr(self) -> str:
        return f"softcap={self.softcap}"


# ------------------------------------------------------------------------------------------------


@dataclass
class EncodeOutput:
    hidden_states: torch.Tensor  # [B, T, M], after the final norm
    logits: torch.Tensor | None  # [B, T, V] fp32 softcapped next-token logits, when asked for


class DiffusionGemma(nn.Module):
    """The DiffusionGemma text model with its two verbs, `encode` and `denoise`."""

    def __init__(self, config: DiffusionGemmaConfig):
        super().__init__()
        self.config = config
        t = config.text_config
        self.text_config = t
        self.generation_config = GenerationConfig()
        self.notice: str | None = None  # the checkpoint's NOTICE (license terms), written again by every save
        self.embed_tokens = nn.Embedding(t.vocab_size, t.hidden_size, padding_idx=t.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(t, i) for i in range(t.num_hidden_layers))
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps)
        self.head = LMHead(t)  # no weight of its own: tied to embed_tokens
        self.self_conditioning = SelfConditioning(t)
        self.vision_tower = self.embed_vision = None  # a text-only checkpoint has neither
        if config.vision_config is not None:
            vision = VisionConfig.from_dict(config.vision_config)
            self.vision_tower = VisionTower(vision)
            self.embed_vision = VisionEmbedder(vision, t.hidden_size)
        self._specs = {lt: t.layer(i) for i, lt in enumerate(t.layer_types)}  # one LayerSpec per layer type
        self.layer_specs = [self._specs[lt] for lt in t.layer_types]  # per layer: what a new cache is shaped by
        # Recompute layers in the backward pass instead of keeping their activations (training). Encoder
        # layers write the KV cache: they are recomputed through a pinned view of a keep_all cache, which
        # writes the same keys to the same slots again (otherwise they are not recomputed).
        self.gradient_checkpointing = False

    # -- pieces shared by both verbs -----------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def embed_scale(self, dtype: torch.dtype) -> torch.Tensor:
        return embed_scale(self.text_config.hidden_size, dtype, self.device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids) * self.embed_scale(self.dtype)

    def lm_head(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tied LM head: fp32 softcapped logits [B, T, V] (see LMHead), written into `out` if given."""
        return self.head(hidden, self.embed_tokens.weight, out)

    def _run_layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        masks: dict[str, torch.Tensor | None],
        is_encoder: bool,
    ) -> torch.Tensor:
        cos_sin = {lt: rope_cos_sin(spec, positions, x.dtype) for lt, spec in self._specs.items()}
        recompute = self.gradient_checkpointing and torch.is_grad_enabled()
        if recompute and is_encoder:
            recompute = cache.keep_all
            cache = cache.pinned() if recompute else cache
        for layer, lt in zip(self.layers, self.text_config.layer_types, strict=True):
            if recompute:
                x = checkpoint(layer, x, cos_sin[lt], cache, masks[lt], is_encoder, use_reentrant=False)
            else:
                x = layer(x, cos_sin[lt], cache, masks[lt], is_encoder)
        return self.norm(x)

    # -- the two verbs -----------------------------------------------------------------------------
    def encode(
        self,
        input_ids: torch.Tensor,  # [B, T]
        cache: KVCache,
        attention_mask: torch.Tensor | None = None,  # [B, T], 0 marks (left) padding
        *,
        return_logits: bool = False,
        pixels=None,  # vision.Pixels of the images whose placeholders input_ids holds, in order
        is_generated: bool = False,  # input_ids are the model's own tokens (a committed canvas), not a prompt
    ) -> EncodeOutput:
        """Causal pass over new tokens at positions cache.length ...; appends their keys/values to `cache`.

        With `pixels`, the images' soft tokens replace the embeddings at the image placeholders (row-major
        through the batch), and with use_bidirectional_attention "vision" each image's placeholders also
        see each other both ways, on every layer. A prompt holding placeholders without `pixels` is refused;
        generated tokens (`is_generated`: a commit) never carry images, and a placeholder id among them is
        embedded as any other token, as the reference's commits do."""
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(
                f"input_ids must have shape [batch, tokens] with tokens > 0 (got {tuple(input_ids.shape)})"
            )
        if is_generated and pixels is not None:
            raise ValueError("generated tokens carry no images: pass pixels= with the prompt that holds them")
        self._check_ids(input_ids, with_images=pixels is not None, is_prompt=not is_generated)
        x, blocks = self.embed(input_ids), None
        if pixels is not None:
            x, blocks = self._place_images(input_ids, x, pixels)
        positions, masks = cache.prepare_encode(*input_ids.shape, attention_mask, blocks=blocks)
        hidden = self._run_layers(x, positions, cache, masks, is_encoder=True)
        cache.commit(input_ids.shape[1])
        return EncodeOutput(hidden, self.lm_head(hidden) if return_logits else None)

    def check_vision(self) -> None:
        """Refuse images for a checkpoint without a vision tower."""
        if self.vision_tower is None:
            raise ValueError("this checkpoint has no vision tower (config.json has no vision_config): text only")

    def image_features(self, pixels) -> torch.Tensor:
        """The soft tokens of images in the text embedding space [tokens, M] (vision.py)."""
        self.check_vision()
        pixels = pixels.to(self.device)
        return self.embed_vision(self.vision_tower(pixels.values.to(self.dtype), pixels.positions))

    def _place_images(self, input_ids: torch.Tensor, x: torch.Tensor, pixels):
        """The embeddings with image soft tokens at the placeholders, and the image blocks for the mask."""
        is_image = input_ids == self.config.image_token_id
        features = self.image_features(pixels)
        placeholders = int(is_image.sum())
        if placeholders != features.shape[0]:
            raise ValueError(
                f"the prompt has {placeholders} image placeholder tokens but its images give "
                f"{features.shape[0]} soft tokens"
            )
        x = x.masked_scatter(is_image[..., None], features.to(x.dtype))  # no sqrt(M) scaling: as the reference
        vision_blocks = self.text_config.use_bidirectional_attention == "vision"
        return x, image_blocks(is_image) if vision_blocks else None

    def soft_embedding(self, logits: torch.Tensor) -> torch.Tensor:
        """Self-conditioning input from logits [B, T, V]: softmax (fp32) @ embedding * sqrt(M) -> [B, T, M]."""
        w = self.embed_tokens.weight
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(w.dtype)
        return (probs @ w) * self.embed_scale(w.dtype)

    def denoise(
        self,
        canvas_ids: torch.Tensor,  # [B, T] canvas tokens
        cache: DenoiseCache,  # a KVCache, a view of one, or a StackedCache
        self_conditioning: torch.Tensor | None = None,  # [B, T, M] soft_embedding(previous processed logits)
        *,
        out: torch.Tensor | None = None,  # [B, T, V] fp32: write the logits here (a buffer reused by the caller)
    ) -> torch.Tensor:
        """Bidirectional pass of a canvas over [cached prefix ; canvas]; returns fp32 logits [B, T, V].

        The cache is read, never written. `self_conditioning` is the previous step's signal as its soft
        embedding (`soft_embedding(logits)`); None is the first step's, exactly zero (as is a row of zeros:
        training zeroes the signal of some rows that way). The drivers of canvas loops (generate.drive, the
        server's engine) pass `out`, the previous step's logits buffer: on a CPU a fresh [B, T, V]
        allocation costs page faults every step.
        """
        return self.lm_head(self.denoise_hidden(canvas_ids, cache, self_conditioning), out)

    def denoise_hidden(
        self, canvas_ids: torch.Tensor, cache: DenoiseCache, self_conditioning: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`denoise` before the LM head: the final normalised hidden states [B, T, M] (training takes the
        logits from them a chunk of positions at a time, never [B, T, V] at once)."""
        x = self.self_conditioning(self.embed(canvas_ids), self_conditioning)
        positions, masks = cache.prepare_denoise(*canvas_ids.shape)
        return self._run_layers(x, positions, cache, masks, is_encoder=False)

    # -- helpers -------------------------------------------------------------------------------------
    def new_cache(
        self,
        batch_size: int,
        max_length: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        keep_all: bool = False,
    ) -> KVCache:
        """A preallocated KV cache for `batch_size` rows of up to `max_length` positions (see KVCache)."""
        return KVCache(
            self.text_config,
            batch_size,
            max_length,
            dtype=dtype or self.dtype,
            device=device or self.device,
            keep_all=keep_all,
            layers=self.layer_specs,
        )

    @torch.compiler.disable  # it reads the ids back to the host: in a compiled encode it runs eagerly, unguarded
    def _check_ids(self, ids: torch.Tensor, with_images: bool = False, is_prompt: bool = True) -> None:
        """Refuse ids outside the vocabulary, and a prompt with image placeholders but no images (generated
        tokens may hold the placeholder id: the denoiser can draw any token)."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"token ids must be an integer tensor (got {ids.dtype})")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.text_config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.text_config.vocab_size}) (got {lo}..{hi})")
        image_id = self.config.image_token_id
        if with_images and image_id is None:
            raise ValueError("images need an image_token_id in config.json")
        placeholders = is_prompt and not with_images and image_id is not None and image_id < self.text_config.vocab_size
        if placeholders and bool((ids == image_id).any()):
            raise ValueError(
                f"input contains image placeholder tokens (id {image_id}) but no images were given (pass pixels=)"
            )

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Random initialisation (normal(0, initializer_range) matrices, unit norms and scales)."""
        std = self.text_config.initializer_range
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std, generator=generator)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
        if self.embed_tokens.padding_idx is not None:
            self.embed_tokens.weight[self.embed_tokens.padding_idx].zero_()
        for layer in self.layers:
            layer.layer_scalar.fill_(1.0)
            layer.encoder_layer_scalar.fill_(1.0)


def build(
    config: DiffusionGemmaConfig,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int | None = 0,
) -> DiffusionGemma:
    """A randomly initialised model (on `device` = "meta", an empty shell that allocates nothing)."""
    with torch.device(device):
        model = DiffusionGemma(config)
    if str(device) != "meta":
        gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        model.init_weights(gen)
    return model.to(dtype)

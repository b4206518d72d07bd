"""A plain-torch Llama/Qwen2 causal LM, because importing transformers costs seconds of a cold start.

It matches transformers' sdpa path to float32 rounding, with the same parameter
names, and takes the subset of its call signature the engine and gpu/graphs.py use.
StaticKV is preallocated so a CUDA graph can capture the decode step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from warmup_agent.engines.torch.native_config import NativeConfig


@dataclass
class NativeOutput:
    logits: Any            # [batch, tokens, vocab]
    past_key_values: Any   # DynamicKV | StaticKV | None


class DynamicKV:
    """Keys and values of every layer, grown by concatenation."""

    def __init__(self, layers: int) -> None:
        self.keys: list[Any] = [None] * layers
        self.values: list[Any] = [None] * layers

    def length(self) -> int:
        return 0 if self.keys[0] is None else int(self.keys[0].shape[2])

    def update(self, layer: int, k: Any, v: Any, positions: Any) -> tuple[Any, Any]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class StaticKV:
    """Keys and values preallocated and written in place, so a decode step can be captured."""

    def __init__(self, cfg: NativeConfig, batch: int, max_len: int, dtype: Any, device: Any) -> None:
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.max_len = max_len
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]

    def update(self, layer: int, k: Any, v: Any, positions: Any) -> tuple[Any, Any]:
        self.keys[layer].index_copy_(2, positions, k)
        self.values[layer].index_copy_(2, positions, v)
        return self.keys[layer], self.values[layer]

    def reset(self) -> None:
        for t in self.keys + self.values:
            t.zero_()


def inv_freq(cfg: NativeConfig, device: Any) -> Any:
    """Rotary inverse frequencies in float32, as transformers computes them (default or llama3)."""
    dim = cfg.head_dim
    freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
    if cfg.rope_llama3 is None:
        return freq
    factor, low, high, old_len = cfg.rope_llama3
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > old_len / low, freq / factor, freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: Any) -> Any:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _repeat_kv(x: Any, groups: int) -> Any:
    """[b, kv_heads, s, d] -> [b, kv_heads * groups, s, d]."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


class Linear(nn.Linear):
    """nn.Linear without random init: every weight comes from the checkpoint, and init
    on meta is not free (it imports torch._dynamo)."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """nn.Embedding without its random initialisation (see Linear)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Any) -> Any:
        # Cast back before the weight, as transformers does.
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: NativeConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.head_dim = layer, cfg.head_dim
        self.groups = cfg.num_heads // cfg.num_kv_heads
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x: Any, cos: Any, sin: Any, mask: Any, cache: Any, positions: Any) -> Any:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(self.layer, k, v, positions)
        # mask None: plain causal (or one new token); else True where attention is allowed.
        out = F.scaled_dot_product_attention(q, _repeat_kv(k, self.groups), _repeat_kv(v, self.groups),
                                             attn_mask=mask, is_causal=mask is None and t > 1,
                                             scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: NativeConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: Any) -> Any:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: NativeConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Any, cos: Any, sin: Any, mask: Any, cache: Any, positions: Any) -> Any:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """`model.*` of the checkpoint: embeddings, decoder layers, final norm."""

    def __init__(self, cfg: NativeConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _padding_mask(attention_mask: Any, past: int, t: int, device: Any) -> Any:
    """[b, 1, t, past + t] causal, non-padding mask; a query always sees itself, so padding rows are not NaN."""
    q_pos = torch.arange(past, past + t, device=device)
    k_idx = torch.arange(past + t, device=device)
    allowed = (k_idx[None, :] <= q_pos[:, None])[None]                  # [1, t, kv]: causal
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, :past + t].bool()     # [b, t, kv]
    return (allowed | (k_idx[None, :] == q_pos[:, None]))[:, None]


class NativeCausalLM(nn.Module):
    """Llama / Qwen2 causal LM; parameter names as transformers names them."""

    def __init__(self, cfg: NativeConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._inv_freq: dict[str, Any] = {}   # by device; not a buffer, so a meta build loses nothing
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output projection when tie_word_embeddings."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_static_cache(self, batch: int, max_len: int) -> StaticKV:
        w = self.lm_head.weight
        return StaticKV(self.config, batch, max_len, w.dtype, w.device)

    def _rope(self, positions: Any, dtype: Any) -> tuple[Any, Any]:
        """cos, sin [1, 1, t, head_dim]: float32 angles, cast to the model dtype."""
        key = str(positions.device)
        if key not in self._inv_freq:
            self._inv_freq[key] = inv_freq(self.config, positions.device)
        freqs = positions[:, None].float() * self._inv_freq[key][None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[None, None], emb.sin().to(dtype)[None, None]

    def forward(self, input_ids: Any, attention_mask: Any = None, past_key_values: Any = None,
                cache_position: Any = None, use_cache: bool = False, logits_at: Any = None,
                **_: Any) -> NativeOutput:
        """`logits_at`: positions whose logits to compute (a padded prefill needs one), else all."""
        x = self.model.embed_tokens(input_ids)
        t = input_ids.shape[1]
        cache = past_key_values
        if isinstance(cache, StaticKV):
            # Positions from a device tensor, so a captured graph replays with new ones.
            positions = cache_position
            mask = (torch.arange(cache.max_len, device=x.device)[None, :] <= positions[:, None])[None, None]
        else:
            if cache is None and use_cache:
                cache = DynamicKV(len(self.model.layers))
            past = cache.length() if cache is not None else 0
            positions = torch.arange(past, past + t, device=x.device)
            padded = attention_mask is not None and not bool(attention_mask.all())
            # As transformers' sdpa path: no mask when causality alone decides.
            mask = _padding_mask(attention_mask, past, t, x.device) if padded or (past and t > 1) else None
        cos, sin = self._rope(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask, cache, positions)
        if logits_at is not None:
            x = x.index_select(1, logits_at)
        logits = self.lm_head(self.model.norm(x))
        return NativeOutput(logits=logits, past_key_values=cache)


def build_skeleton(cfg: NativeConfig, dtype: Any) -> tuple[NativeCausalLM, dict, set]:
    """(model on the meta device, expected shapes by name, tied names)."""
    with torch.device("meta"):
        model = NativeCausalLM(cfg).to(dtype)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    return model, expected, tied

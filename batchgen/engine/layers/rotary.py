"""Rotary position embedding tables (Llama 3, linear and YaRN frequency scaling) and the pairwise layout.

Every kernel rotates in the rotate-half (neox) layout. Models trained with pairwise rotation
(GPT-J, or DeepSeek's complex pairs) permute the rotated rows of their q and k projections at load
with :func:`pairwise_to_half_order`: q.k is unchanged when both sides are permuted alike.
"""
from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies (head_dim / 2,) in float32, after the model's rope scaling."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if not scaling:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(f"unsupported rope scaling {kind!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3: long wavelengths are divided by ``factor``, short ones kept, the middle band interpolated."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(dim: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original context are
    interpolated (divided by ``factor``), those turning more than ``beta_fast`` times kept, a linear
    ramp between (transformers' rule, ``truncate`` rounding the ramp's ends outwards)."""
    factor, old_len = float(s["factor"]), float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolation = 1 - ramp
    return 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor YaRN applies to cos and sin (so to q.k twice); 1 for the other kinds."""
    if not scaling or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    return _yarn_mscale(factor)


def yarn_softmax_scale(scaling: dict | None) -> float:
    """DeepSeek's multiplier of the softmax scale under scaled rope: mscale(factor, mscale_all_dim)^2."""
    if not scaling or not scaling.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2


def pairwise_to_half_order(rotary_dim: int) -> torch.Tensor:
    """The even dims, then the odd ones: pairwise rotation of x equals rotate-half rotation of x[order]."""
    return torch.cat((torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)))


def cos_sin_cache(head_dim: int, theta: float, scaling: dict | None, max_positions: int,
                  device: torch.device | None = None) -> torch.Tensor:
    """Rows ``[cos | sin]`` (head_dim / 2 each) for positions 0..max_positions-1, float32."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    factor = rope_attention_factor(scaling)
    return (table if factor == 1.0 else table * factor).to(device)

"""Rotary position embedding tables, including Llama 3, linear and LongRoPE (Phi-3) frequency scaling."""
from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, max_positions: int | None = None
                  ) -> torch.Tensor:
    """Inverse frequencies (head_dim / 2,) in float32, after the model's rope scaling for a context of
    ``max_positions`` tokens."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if not scaling:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "longrope":
        return _longrope_inv_freq(inv_freq, scaling, max_positions)
    if kind == "frequency_factors":  # llama.cpp's rope_freqs tensor (Llama 3 scaling, precomputed)
        return _divided(inv_freq, scaling["factors"])
    raise ValueError(f"unsupported rope scaling {kind!r}")


def _divided(inv_freq: torch.Tensor, factors: list[float]) -> torch.Tensor:
    """Each inverse frequency divided by its own factor."""
    divisors = torch.tensor(factors, dtype=torch.float32)
    if divisors.shape != inv_freq.shape:
        raise ValueError(f"{divisors.numel()} rope factors for {inv_freq.numel()} rotary frequencies")
    return inv_freq / divisors


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


def _longrope_inv_freq(inv_freq: torch.Tensor, s: dict, max_positions: int | None) -> torch.Tensor:
    """LongRoPE: each frequency divided by its own factor, the long ones when the context exceeds the
    original one. transformers switches per forward pass (on the sequence's length); one table for the
    engine's whole context (as vLLM and llama.cpp do) keeps the cached keys of a sequence consistent."""
    long = max_positions is not None and max_positions > int(s["original_max_position_embeddings"])
    return _divided(inv_freq, s["long_factor" if long else "short_factor"])


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor cos and sin are multiplied by (LongRoPE's, from its context extension factor)."""
    if not scaling or scaling["rope_type"] != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, original = float(scaling.get("factor") or 1.0), int(scaling["original_max_position_embeddings"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def cos_sin_cache(head_dim: int, theta: float, scaling: dict | None, max_positions: int,
                  device: torch.device | None = None) -> torch.Tensor:
    """Rows ``[cos | sin]`` (head_dim / 2 each) for positions 0..max_positions-1, float32."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, max_positions)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return (torch.cat((freqs.cos(), freqs.sin()), dim=-1) * rope_attention_factor(scaling)).to(device)

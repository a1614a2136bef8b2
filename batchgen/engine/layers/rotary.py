"""Rotary position embedding tables: the rope scalings (linear, Llama 3, LongRoPE, llama.cpp's precomputed
factors, YaRN) side by side, and the pairwise layout.

Each scaling is one ``RopeScaling`` in ``SCALINGS``: how it changes the inverse frequencies and the factor
it multiplies cos and sin by. Every kernel rotates in the rotate-half (neox) layout. Models trained with
pairwise rotation (GPT-J, or DeepSeek's complex pairs) permute the rotated rows of their q and k
projections at load with :func:`pairwise_to_half_order`: q.k is unchanged when both sides are permuted alike.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

# (unscaled inverse frequencies, rotary dims, base, scaling dict, context length) -> scaled ones
InvFreqRule = Callable[[torch.Tensor, int, float, dict, "int | None"], torch.Tensor]


@dataclass(frozen=True)
class RopeScaling:
    """One ``rope_type``: its inverse frequencies and the factor on cos and sin (so on q.k twice)."""

    inv_freq: InvFreqRule
    attention_factor: Callable[[dict], float] = lambda scaling: 1.0


def _divided(inv_freq: torch.Tensor, factors: list[float]) -> torch.Tensor:
    """Each inverse frequency divided by its own factor."""
    divisors = torch.tensor(factors, dtype=torch.float32)
    if divisors.shape != inv_freq.shape:
        raise ValueError(f"{divisors.numel()} rope factors for {inv_freq.numel()} rotary frequencies")
    return inv_freq / divisors


def _llama3_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, s: dict, _: int | None) -> torch.Tensor:
    """Llama 3: long wavelengths are divided by ``factor``, short ones kept, the middle band interpolated."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _longrope_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, s: dict,
                       max_positions: int | None) -> torch.Tensor:
    """LongRoPE: each frequency divided by its own factor, the long ones when the context exceeds the
    original one. transformers switches per forward pass (on the sequence's length); one table for the
    engine's whole context (as vLLM and llama.cpp do) keeps the cached keys of a sequence consistent."""
    return _divided(inv_freq, s[f"{rope_context(s, max_positions)}_factor"])


def rope_context(scaling: dict | None, max_positions: int | None) -> str | None:
    """What a scaling's table takes from the engine's context (None: nothing): LongRoPE's factor set, "long"
    once the context exceeds the original one, else "short". Cached keys hold it, so the prefix store keys on it."""
    if not scaling or scaling.get("rope_type") != "longrope":
        return None
    long = max_positions is not None and max_positions > int(scaling["original_max_position_embeddings"])
    return "long" if long else "short"


def _longrope_attention_factor(s: dict) -> float:
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor, original = float(s.get("factor") or 1.0), int(s["original_max_position_embeddings"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, s: dict, _: int | None) -> torch.Tensor:
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


def _yarn_attention_factor(s: dict) -> float:
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor, mscale, mscale_all_dim = float(s["factor"]), s.get("mscale"), s.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    return _yarn_mscale(factor)


SCALINGS: dict[str, RopeScaling] = {
    "linear": RopeScaling(lambda inv_freq, dim, theta, s, n: inv_freq / float(s["factor"])),
    "llama3": RopeScaling(_llama3_inv_freq),
    "longrope": RopeScaling(_longrope_inv_freq, _longrope_attention_factor),
    # llama.cpp's rope_freqs tensor (Llama 3 scaling, precomputed) from GGUF files
    "frequency_factors": RopeScaling(lambda inv_freq, dim, theta, s, n: _divided(inv_freq, s["factors"])),
    "yarn": RopeScaling(_yarn_inv_freq, _yarn_attention_factor),
}


def _scaling(scaling: dict) -> RopeScaling:
    kind = scaling["rope_type"]
    if kind not in SCALINGS:
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return SCALINGS[kind]


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, max_positions: int | None = None
                  ) -> torch.Tensor:
    """Inverse frequencies (head_dim / 2,) in float32, after the model's rope scaling for a context of
    ``max_positions`` tokens."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if not scaling:
        return inv_freq
    return _scaling(scaling).inv_freq(inv_freq, head_dim, theta, scaling, max_positions)


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor cos and sin are multiplied by (LongRoPE's and YaRN's; 1 for the other kinds)."""
    return _scaling(scaling).attention_factor(scaling) if scaling else 1.0


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
    """Rows ``[cos | sin]`` (head_dim / 2 each) for positions 0..max_positions-1, float32, on ``device`` (default:
    torch's current one, e.g. a model's while it is being built)."""
    target = device if device is not None else torch.get_default_device()
    with torch.device("cpu"):
        inv_freq = rope_inv_freq(head_dim, theta, scaling, max_positions)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # rounded as HF's are
    # cos and sin in float64 by numpy, rounded once to float32. On an AMX machine torch's threaded float32 cos,
    # as the table's first transcendental call after the CPU kernels load, returned one thread's half of the
    # table up to 1.5e-4 off in about 1 of 5-15 fresh processes (recomputing it at once was right), enough to
    # move greedy logprobs by 1e-3 from run to run.
    angles = freqs.double().numpy()
    table = torch.from_numpy(np.concatenate((np.cos(angles), np.sin(angles)), axis=-1)).float()
    factor = rope_attention_factor(scaling)
    return (table if factor == 1.0 else table * factor).to(target)

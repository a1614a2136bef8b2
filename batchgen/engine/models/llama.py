"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over packed tokens and a paged KV cache."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from batchgen.engine.config import ModelConfig
from batchgen.engine.layers.attention import Attention, AttentionMetadata
from batchgen.engine.layers.ops import KernelSet
from batchgen.engine.layers.rotary import cos_sin_cache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: KernelSet):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.kernels = eps, kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out, residual_out = self.kernels.rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, residual_out)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: KernelSet):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels)
        self.qk_norm = cfg.qk_norm
        self.attn = Attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, kernels.attention)
        self.kernels = kernels

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))

    def project(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """qkv rows for x, with q/k normed (Qwen3) and rotated."""
        qkv = self.qkv_proj(x)
        q, k, _ = self.split_heads(qkv)
        if self.qk_norm:
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        self.kernels.apply_rotary(q, k, positions, cos_sin)
        return qkv


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: KernelSet):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Token-wise work runs in chunks of ``chunk_tokens`` rows so activations stay in cache on CPU;
    attention sees the whole step."""

    def __init__(self, cfg: ModelConfig, kernels: KernelSet, chunk_tokens: int):
        super().__init__()
        self.self_attn = SelfAttention(cfg, kernels)
        self.mlp = MLP(cfg, kernels)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.chunk_tokens = chunk_tokens

    def forward(self, x, residual, positions, cos_sin, meta):
        attn = self.self_attn
        chunks = [slice(s, s + self.chunk_tokens) for s in range(0, x.shape[0], self.chunk_tokens)]
        new_residual = torch.empty_like(x)
        qkv = x.new_empty(x.shape[0], attn.q_size + 2 * attn.kv_size)
        for c in chunks:
            if residual is None:
                h, new_residual[c] = self.input_layernorm(x[c]), x[c]
            else:
                h, new_residual[c] = self.input_layernorm(x[c], residual[c])
            qkv[c] = attn.project(h, positions[c], cos_sin)
        o = attn.attn(*attn.split_heads(qkv), meta).flatten(1)
        out = torch.empty_like(x)
        for c in chunks:
            h, new_residual[c] = self.post_attention_layernorm(attn.o_proj(o[c]), new_residual[c])
            out[c] = self.mlp(h)
        return out, new_residual


class LlamaForCausalLM(nn.Module):
    """Computes hidden states for packed tokens; logits only for the rows the caller asks for."""

    # HF checkpoint projections that live inside our fused ones: name -> (fused name, shard index)
    fused_shards = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, kernels: KernelSet, max_positions: int, chunk_tokens: int = 1024):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, kernels, chunk_tokens) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("cos_sin", cos_sin_cache(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                                      max_positions), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_indices: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.cos_sin, meta)
        # Only the rows that produce a next token go through the final norm and the vocabulary matmul.
        x = self.norm(x[logits_indices], residual[logits_indices])[0]
        return self.lm_head(x)

    def shard_sizes(self, fused: str) -> list[int]:
        c = self.cfg
        if fused == "qkv_proj":
            return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        return [c.intermediate_size, c.intermediate_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies Hugging Face named tensors into the (fused) parameters; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
                continue
            parts = name.split(".")
            shard = next((p for p in parts if p in self.fused_shards), None)
            if shard is not None:
                fused, index = self.fused_shards[shard]
                name = name.replace(shard, fused)
                offset = sum(self.shard_sizes(fused)[:index])
                target = params[name].data.narrow(0, offset, tensor.shape[0])
                loaded.add(f"{name}#{index}")
            elif name in params:
                target = params[name].data
                loaded.add(name)
            else:
                raise ValueError(f"unexpected weight {hf_name!r} for {self.cfg.architecture}")
            if target.shape != tensor.shape:
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)}")
            target.copy_(tensor)
        self._check_all_loaded(params, loaded)

    def _check_all_loaded(self, params: dict, loaded: set[str]) -> None:
        missing = []
        for name in params:
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            fused = next((f for f in ("qkv_proj", "gate_up_proj") if f in name), None)
            if fused:
                shards = len(self.shard_sizes(fused))
                missing += [f"{name}#{i}" for i in range(shards) if f"{name}#{i}" not in loaded]
            elif name not in loaded:
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))

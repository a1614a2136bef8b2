"""The decoder-only model every architecture builds on: layers, checkpoint loading, KV layout, FLOP profile.

A model file subclasses ``CausalLM`` and says how to build each layer's attention and MLP
(``make_attention``, ``make_mlp``) and how checkpoint names map onto its parameters
(``weight_rules``); the runner, the cache allocator and the FLOP counter ask it, never its name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Sequence

import torch
from torch import nn

from batchgen.engine.backends.interface import AttentionMetadata
from batchgen.engine.config import ModelConfig
from batchgen.engine.core.kv_cache import KVLayout
from batchgen.engine.layers.linear import (
    ParallelLMHead, VocabParallelEmbedding, default_weight_loader, matmul_params,
)
from batchgen.engine.backends.interface import KernelSet
from batchgen.engine.layers.norm import RMSNorm
from batchgen.engine.layers.rotary import cos_sin_cache
from batchgen.engine.loading.model_source import Weight
from batchgen.engine.parallel.context import SINGLE_PROCESS, ParallelContext


@dataclass(frozen=True)
class WeightRule:
    """Checkpoint names matching ``pattern`` are rewritten with ``target`` (a ``re`` template) and load as
    shard ``shard`` of that parameter; a named group ``expert`` makes the shard ``(expert index, shard)``."""

    pattern: str
    target: str
    shard: Any = None

    def apply(self, name: str) -> tuple[str, Any] | None:
        m = re.search(self.pattern, name)
        if m is None:
            return None
        shard = (int(m["expert"]), self.shard) if "expert" in m.groupdict() else self.shard
        return name[: m.start()] + m.expand(self.target) + name[m.end():], shard


@dataclass(frozen=True)
class CheckpointNames:
    """How an architecture's Hugging Face checkpoints name a layer's mixture of experts: its weight rules read
    them, and the GGUF loader maps llama.cpp's tensor names onto them."""

    moe_module: str = "mlp"
    expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    shared_expert: str = "shared_expert"


def expert_rules(module: str = "mlp", names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 target: str = "mlp") -> tuple[WeightRule, ...]:
    """Per-expert checkpoint tensors ``{module}.experts.{e}.{gate|up|down name}.weight`` stacked into
    ``{target}.experts.gate_up_proj`` / ``down_proj`` (see ``FusedMoE``)."""
    params = ("gate_up_proj", "gate_up_proj", "down_proj")
    return tuple(WeightRule(rf"\.{module}\.experts\.(?P<expert>\d+)\.{name}\.weight$",
                            f".{target}.experts.{param}", shard)
                 for name, param, shard in zip(names, params, ("gate", "up", "down")))


@dataclass(frozen=True)
class ModelProfile:
    """Parameter and FLOP facts of a built model, for MFU accounting, memory sizing and the logs."""

    total_params: int  # every parameter, embeddings included (tied ones once)
    active_params: int  # matmul weights one token passes through in the layers: attention, dense MLPs,
    #                     routers, its top-k routed and the shared experts (no embedding, no LM head)
    lm_head_params: int
    attention_flops_per_key: int  # QK^T + PV FLOPs of one query and one key, summed over full-attention layers
    activation_values_per_token: int  # widest per-token intermediate of an MLP or MoE layer
    fp8_active_params: int = 0  # the part of active_params multiplied in FP8 (FP8 weights kept as such)
    weight_format: str = ""  # the weights as they run: a dtype, or the checkpoint's FP8 format and how it runs
    # (window, FLOPs per key summed over the layers with that sliding window): they see at most window keys
    windowed_attention_flops: tuple[tuple[int, int], ...] = ()

    def summary(self) -> str:
        return f"{_count(self.total_params)} parameters, {_count(self.active_params)} active per token"


def _count(n: int) -> str:
    return next((f"{n / scale:.3g}{unit}" for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")) if n >= scale),
                str(n))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then an MLP (dense or mixture of experts).

    The attention half runs on the whole step; the MLP half in chunks of ``chunk_tokens`` rows on CPU (its
    wide activations would not stay in cache), except an MLP that is ``step_wide`` (one that exchanges
    tokens with other replicas: every rank must make the same calls, even on a step with no tokens).
    ``self_attn`` provides ``project(h, positions, cos_sin)`` (rows of ``project_width`` values per
    token), ``attend(rows, meta)`` and ``o_proj``. The layer returns its output and the residual stream
    before they are added: the next norm adds them (fused). ``mlp_input`` and ``mlp_output`` are where
    a layer with more norms (Gemma's) puts them.
    """

    norm_class: ClassVar[type[nn.Module]] = RMSNorm

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, cfg: ModelConfig, kernels: KernelSet,
                 chunk_tokens: int):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.post_attention_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.chunk_tokens = chunk_tokens

    def forward(self, x, residual, positions, cos_sin, meta):
        if x.shape[0] == 0:  # a replica's idle step: nothing to attend, but the MLP joins the exchange
            return self.mlp(x), x
        attn = self.self_attn
        if residual is None:  # the first layer: the residual stream starts as the embeddings
            h, new_residual = self.input_layernorm(x), x
        else:
            h, new_residual = self.input_layernorm(x, residual)
        o = attn.attend(attn.project(h, positions, cos_sin), meta)
        if x.shape[0] <= self.chunk_tokens:
            h, new_residual = self.mlp_input(attn.o_proj(o), new_residual)
            return self.mlp_output(self.mlp(h)), new_residual
        step_wide = getattr(self.mlp, "step_wide", False)
        if new_residual is x:  # written chunk by chunk below
            new_residual = x.clone()
        out = torch.empty_like(x)
        for c in (slice(s, s + self.chunk_tokens) for s in range(0, x.shape[0], self.chunk_tokens)):
            h, new_residual[c] = self.mlp_input(attn.o_proj(o[c]), new_residual[c])
            out[c] = h if step_wide else self.mlp_output(self.mlp(h))
        return (self.mlp_output(self.mlp(out)) if step_wide else out), new_residual

    def mlp_input(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP input, residual) for one chunk, from the attention output and the residual before it."""
        return self.post_attention_layernorm(attn_out, residual)

    def mlp_output(self, mlp_out: torch.Tensor) -> torch.Tensor:
        """The layer's output from its MLP's."""
        return mlp_out


class CausalLM(nn.Module):
    """Computes hidden states for packed tokens; logits only for the rows the caller asks for."""

    # Defaults for config.json keys this architecture's transformers class defaults differently.
    config_defaults: ClassVar[dict[str, Any]] = {}
    # The MLP activations (config.json's hidden_activation / hidden_act) this architecture implements.
    activations: ClassVar[tuple[str, ...]] = ("silu",)
    # Checkpoint name -> (parameter, shard); the first matching rule wins, unmatched names load as-is.
    weight_rules: ClassVar[tuple[WeightRule, ...]] = ()
    checkpoint_names: ClassVar[CheckpointNames] = CheckpointNames()
    decoder_layer: ClassVar[type[DecoderLayer]] = DecoderLayer
    # The kinds of step whose forward can be replayed from a CUDA graph (fixed shapes, no host sizing).
    graph_step_kinds: ClassVar[tuple[str, ...]] = ("decode", "mixed")
    # Whether forward keeps the last hidden state (before the final norm) of every row, for a proposer that
    # drafts from them (DeepSeek's MTP layer); ``take_hidden_states`` hands them over once.
    keep_hidden_states: bool = False
    hidden_states: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig, kernels: KernelSet, max_positions: int, chunk_tokens: int = 1024,
                 parallel: ParallelContext = SINGLE_PROCESS):
        super().__init__()
        self.cfg, self.kernels, self.parallel = cfg, kernels, parallel
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=parallel.tp)
        self.layers = nn.ModuleList(
            self.decoder_layer(self.make_attention(i), self.make_mlp(i), cfg, kernels, chunk_tokens)
            for i in range(cfg.num_layers))
        self.norm = self.decoder_layer.norm_class(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp=parallel.tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("cos_sin", self.rotary_table(max_positions), persistent=False)

    @classmethod
    def hf_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """The config.json dict in the shape ``ModelConfig`` parses, under ``config_defaults``."""
        return {**cls.config_defaults, **cfg}

    def sliding_window(self, layer: int) -> int | None:
        """How many of the latest keys layer ``layer`` attends to (None: all). config.json's
        ``layer_types`` says which layers are local when it is there, else ``is_local``."""
        window, types = self.cfg.sliding_window, self.cfg.hf.get("layer_types")
        local = types[layer] == "sliding_attention" if types else self.is_local(layer)
        return window if local else None

    def is_local(self, layer: int) -> bool:
        """Whether layer ``layer`` is a sliding-window layer when the model has a window (default: all)."""
        return True

    def make_attention(self, layer: int) -> nn.Module:
        """Layer ``layer``'s attention, built for ``self.parallel.tp`` (its heads split over the ranks)."""
        raise NotImplementedError

    def make_mlp(self, layer: int) -> nn.Module:
        raise NotImplementedError

    def rotary_table(self, max_positions: int) -> torch.Tensor:
        c = self.cfg
        return cos_sin_cache(c.rotary_dim, c.rope_theta, c.rope_scaling, max_positions)

    def layer_cos_sin(self, layer: int) -> torch.Tensor:
        """The rotary table of layer ``layer`` (one for all layers unless a model says otherwise)."""
        return self.cos_sin

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_indices: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, self.layer_cos_sin(i), meta)
        if self.keep_hidden_states:
            self.hidden_states = x + residual
        # Only the rows that produce a next token go through the final norm and the vocabulary matmul.
        # Under tensor parallelism only the first rank gets the logits of the whole vocabulary.
        x = self.norm(x[logits_indices], residual[logits_indices])[0]
        return self.compute_logits(x)

    def take_hidden_states(self) -> torch.Tensor | None:
        """The latest forward's hidden states (with ``keep_hidden_states``), no longer kept here."""
        hidden, self.hidden_states = self.hidden_states, None
        return hidden

    # ---- checkpoint loading ------------------------------------------------------------------------
    def checkpoint_target(self, hf_name: str) -> tuple[str, Any] | None:
        """The (parameter name, shard id) a checkpoint tensor loads into, or None to skip it.

        A quantized weight's scale goes where its weight goes, to the parameter named ``<weight>_scale``.
        """
        role = self.cfg.quantization.tensor_role(hf_name) if self.cfg.quantization else None
        if role == "unused":
            return None
        if role == "scale":
            target = self.checkpoint_target(hf_name.rsplit(".", 1)[0] + ".weight")
            return None if target is None else (target[0] + "_scale", target[1])
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
            return None
        return next((hit for rule in self.weight_rules if (hit := rule.apply(name))), (name, None))

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        """Hands each checkpoint tensor to its parameter's weight loader; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, Any]] = set()
        for hf_name, tensor in weights:
            target = self.checkpoint_target(hf_name)
            if target is None:
                continue
            name, shard = target
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {self.cfg.architecture}")
            param = params[name]
            try:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard)
            except ValueError as exc:
                raise ValueError(f"weight {hf_name!r}: {exc}") from None
            loaded.add((name, shard))
        missing = missing_weights(params, loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}"
                             + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))

    # ---- what the runner and the FLOP counter ask --------------------------------------------------
    def cache_layers(self) -> list[nn.Module]:
        """The decoder layers' modules that keep state in the paged cache, in order (a proposer's layers,
        such as DeepSeek's MTP layer, keep their own)."""
        return [m for m in self.layers.modules() if callable(getattr(m, "cache_token_shapes", None))]

    def kv_layout(self) -> KVLayout:
        layers = self.cache_layers()
        windows = [getattr(layer, "sliding_window", None) for layer in layers]
        return KVLayout(tuple(tuple(layer.cache_token_shapes()) for layer in layers),
                        window=max(windows) if windows and None not in windows else None)

    def proposer_kv_layout(self) -> KVLayout:
        """What the model's drafting layers outside ``layers`` (DeepSeek's MTP layer) keep per token in their own
        paged cache, which the KV budget counts too: nothing by default."""
        return KVLayout(())

    def bind_kv_cache(self, caches: Sequence[Sequence[torch.Tensor]]) -> None:
        layers = self.cache_layers()
        if len(caches) != len(layers):
            raise ValueError(f"{len(caches)} cache layers allocated for {len(layers)} attention layers")
        for layer, tensors in zip(layers, caches):
            layer.bind_cache(tensors)

    def profile(self) -> ModelProfile:
        widths = [m.activation_values_per_token() for m in self.modules()
                  if callable(getattr(m, "activation_values_per_token", None))]
        fp8 = matmul_params(self.layers, fp8_only=True)
        windowed: dict[int, int] = {}
        for layer in self.cache_layers():
            if getattr(layer, "sliding_window", None) is not None:
                windowed[layer.sliding_window] = windowed.get(layer.sliding_window, 0) + layer.flops_per_key()
        return ModelProfile(
            total_params=sum(p.numel() for p in self.parameters() if not hasattr(p, "group")),  # scales aside
            active_params=matmul_params(self.layers),
            lm_head_params=self.lm_head.num_embeddings * self.lm_head.embedding_dim,
            attention_flops_per_key=sum(layer.flops_per_key() for layer in self.cache_layers()
                                        if getattr(layer, "sliding_window", None) is None),
            activation_values_per_token=max(widths, default=self.cfg.hidden_size),
            fp8_active_params=fp8,
            weight_format=self.weight_format(fp8 > 0),
            windowed_attention_flops=tuple(sorted(windowed.items())),
        )

    def weight_format(self, runs_fp8: bool) -> str:
        """The weights' dtype, or the checkpoint's FP8 format and whether it runs in FP8 or dequantized."""
        dtype = str(self.embed_tokens.weight.dtype).removeprefix("torch.")
        if self.cfg.quantization is None:
            return dtype
        return f"{self.cfg.quantization.describe()}, " + ("run in FP8" if runs_fp8 else f"dequantized to {dtype}")


def missing_weights(params: dict[str, nn.Parameter], loaded: set[tuple[str, Any]]) -> list[str]:
    """Parameters (or shards of fused ones) that no checkpoint tensor set."""
    missing = []
    for name, param in params.items():
        if (name, None) in loaded:
            continue
        shards = getattr(param, "shard_ids", ())
        if not shards:
            missing.append(name)
        missing += [f"{name}[{_shard_name(s)}]" for s in shards if (name, s) not in loaded]
    return missing


def _shard_name(shard: Any) -> str:
    return f"expert {shard[0]} {shard[1]}" if isinstance(shard, tuple) else str(shard)

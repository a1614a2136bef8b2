"""Loads a GGUF file as a ModelSource: HF-style config, lazily dequantized HF-named weights, tokenizer."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from batchgen.engine.loading.gguf.arch import GGUFArch, gguf_arch
from batchgen.engine.loading.gguf.metadata import as_int, field_value, gguf_fields
from batchgen.engine.loading.gguf.tokenizer import tokenizer_from_gguf
from batchgen.engine.loading.model_source import ModelSource
from batchgen.engine.models.base import CheckpointNames
from batchgen.engine.models.registry import architecture_of, gguf_architecture

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# The router and the shared expert ({shared}), under the layer's MoE module ({moe}).
_MOE_LAYER_NAMES = {
    "ffn_gate_inp.weight": "{moe}.gate.weight",
    "exp_probs_b.bias": "{moe}.gate.e_score_correction_bias",
    "ffn_gate_inp_shexp.weight": "{moe}.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "{moe}.{shared}.gate_proj.weight",
    "ffn_up_shexp.weight": "{moe}.{shared}.up_proj.weight",
    "ffn_down_shexp.weight": "{moe}.{shared}.down_proj.weight",
}
# Routing llama.cpp hard-codes for an architecture when the file does not say (expert_weights_norm).
_GGUF_DEFAULTS = {"qwen3moe": {"norm_topk_prob": True}}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight")
_SPLIT_KV_B = re.compile(r"blk\.(\d+)\.attn_(k|v)_b\.weight")


def hf_tensor_name(gguf_name: str, names: CheckpointNames = CheckpointNames(), arch: GGUFArch = GGUFArch()
                   ) -> str | None:
    """The HF parameter name for a GGUF tensor name (MoE parts named as the model class declares), or None for
    tensors HF models do not have."""
    if gguf_name in arch.config_tensors:
        return None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    layer_names = {**_LAYER_NAMES, **arch.layer_names}
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}"
    if m and m.group(2) in _MOE_LAYER_NAMES:
        name = _MOE_LAYER_NAMES[m.group(2)].format(moe=names.moe_module, shared=names.shared_expert)
        return f"model.layers.{m.group(1)}.{name}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known Hugging Face equivalent")


def expert_tensors(gguf_name: str, stacked: torch.Tensor, names: CheckpointNames) -> list[tuple[str, torch.Tensor]]:
    """HF per-expert tensors from a GGUF stacked expert tensor (E, I, H) / (E, H, I) / gate|up (E, 2I, H)."""
    layer, proj = _EXPERTS.fullmatch(gguf_name).groups()
    moe, (gate, up, down) = names.moe_module, names.expert_projections
    if proj == "gate_up":
        halves = {gate: stacked[:, : stacked.shape[1] // 2], up: stacked[:, stacked.shape[1] // 2:]}
    else:
        halves = {{"gate": gate, "up": up, "down": down}[proj]: stacked}
    return [(f"model.layers.{layer}.{moe}.experts.{e}.{name}.weight", part[e])
            for name, part in halves.items() for e in range(stacked.shape[0])]


def gguf_config(fields: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict:
    """An HF ``config.json``-style dict from GGUF metadata (and tensor shapes)."""
    arch = field_value(fields, "general.architecture")

    def get(key: str, default: Any = None) -> Any:
        return field_value(fields, f"{arch}.{key}", default)

    registered = gguf_architecture(arch, has_experts=bool(as_int(get("expert_count"), "expert_count")))
    layout = gguf_arch(arch)
    model_type = registered.model_type

    hidden = as_int(get("embedding_length"), "embedding_length")
    heads = as_int(get("attention.head_count"), "attention.head_count")
    kv_heads = as_int(get("attention.head_count_kv", heads), "attention.head_count_kv")
    head_dim = as_int(get("attention.key_length"), "attention.key_length") or hidden // heads
    embed = tensors["token_embd.weight"]
    config: dict[str, Any] = {
        "architectures": [registered.name],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": as_int(get("feed_forward_length"), "feed_forward_length"),
        "num_hidden_layers": as_int(get("block_count"), "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": as_int(get("context_length", 2048), "context_length"),
        "vocab_size": int(embed.shape[-1]),  # GGUF shapes list the fastest-varying dimension first
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    rope_dims = get("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        config["partial_rotary_factor"] = int(rope_dims) / head_dim
    scaling = get("rope.scaling.type")
    if scaling and scaling != "none":
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(get("rope.scaling.factor", 1.0))}
        original = get("rope.scaling.original_context_length")
        if original is not None:
            config["rope_scaling"]["original_max_position_embeddings"] = int(original)
    if model_type not in ("qwen2", "qwen2_moe"):  # these always have q/k/v biases; others say so in the config
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if registered.moe:
        config.update(_GGUF_DEFAULTS.get(arch, {}))
        config.update(_moe_config(get, tensors, config["num_hidden_layers"]))
    if layout.config is not None:
        config.update(layout.config(get, tensors, config))
    for key, meta in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        value = field_value(fields, f"tokenizer.ggml.{meta}")
        if value is not None:
            config[key] = int(value)
    return config


def _moe_config(get: Any, tensors: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """HF config keys of the experts: counts, sizes (from metadata, else tensor shapes), dense layers."""
    def size(key: str, tensor: str) -> int | None:  # a GGUF shape lists the fastest dimension first
        value = as_int(get(key), key)
        return value if value is not None or tensor not in tensors else int(tensors[tensor].shape[1])

    config: dict[str, Any] = {"num_experts": as_int(get("expert_count"), "expert_count"),
                              "num_experts_per_tok": as_int(get("expert_used_count"), "expert_used_count")}
    sparse = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    first = sparse[0] if sparse else 0
    expert_size = size("expert_feed_forward_length", f"blk.{first}.ffn_up_exps.weight")
    if expert_size is not None:
        config["moe_intermediate_size"] = expert_size
    shared_size = size("expert_shared_feed_forward_length", f"blk.{first}.ffn_up_shexp.weight")
    if shared_size:
        config["shared_expert_intermediate_size"] = shared_size
    norm = get("expert_weights_norm")
    if norm is not None:
        config["norm_topk_prob"] = bool(norm)
    config["mlp_only_layers"] = [i for i in range(num_layers) if i not in sparse]
    return config


def _merge_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """kv_b_proj (H * (nope + v), rank) from llama.cpp's split attn_k_b (H, rank, nope), attn_v_b (H, v, rank)."""
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).flatten(0, 1)


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's Q/K row interleaving (its rotary pairs adjacent dims, HF's pairs halves)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize_tensor(tensor: Any) -> torch.Tensor:
    """A GGUF reader tensor as float32 torch, in HF (row-major, slowest dimension first) shape.

    Every type the installed ``gguf`` package dequantizes loads (F16/BF16, Q4_0 ... Q8_0, the K-quants,
    the IQ and TQ types, MXFP4, ...), and F64; any other names its type in the error.
    """
    import gguf

    qtype, types = tensor.tensor_type, gguf.GGMLQuantizationType
    if qtype in (types.I8, types.I16, types.I32, types.I64):
        raise ValueError(f"GGUF tensor {tensor.name!r} has integer type {qtype.name}; expected float weights")
    try:
        array = tensor.data if qtype == types.F64 else gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError as exc:
        raise ValueError(f"GGUF tensor {tensor.name!r} uses type {qtype.name}, which the gguf package "
                         f"cannot dequantize ({exc})") from None
    shape = [int(d) for d in reversed(tensor.shape)]
    return torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))


def iter_gguf_weights(reader: Any, config: dict, arch: GGUFArch) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(hf_name, float32 tensor)``, dequantizing one tensor at a time (stacked experts split per expert)."""
    names = architecture_of(config).model_class().checkpoint_names
    split_kv_b: dict[str, dict[str, torch.Tensor]] = {}  # layer -> its attn_k_b / attn_v_b, until both are read
    for tensor in reader.tensors:
        if _EXPERTS.fullmatch(tensor.name):
            yield from expert_tensors(tensor.name, dequantize_tensor(tensor), names)
            continue
        if m := _SPLIT_KV_B.fullmatch(tensor.name):
            pair = split_kv_b.setdefault(m[1], {})
            pair[m[2]] = dequantize_tensor(tensor)
            if len(pair) == 2:
                yield f"model.layers.{m[1]}.self_attn.kv_b_proj.weight", _merge_kv_b(pair["k"], pair["v"])
                del split_kv_b[m[1]]
            continue
        name = hf_tensor_name(tensor.name, names, arch)
        if name is None:
            continue
        weight = dequantize_tensor(tensor)
        if arch.permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = _unpermute(weight, config["num_attention_heads"])
        elif arch.permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = _unpermute(weight, config["num_key_value_heads"])
        elif arch.norm_offset and name.endswith("norm.weight"):
            weight = weight - arch.norm_offset
        elif name.endswith("shared_expert_gate.weight"):  # llama.cpp stores the (1, H) gate as (H,)
            weight = weight.reshape(1, -1)
        yield name, weight
    if split_kv_b:
        raise ValueError(f"GGUF layers {sorted(split_kv_b)} have only one of attn_k_b and attn_v_b")


def load_gguf(path: str) -> ModelSource:
    """Reads a GGUF file's metadata now; weights are dequantized when iterated."""
    import gguf

    if not Path(path).is_file():
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    split = re.search(r"-(\d{5})-of-(\d{5})\.gguf$", path)
    if split and split.group(2) != "00001":
        raise ValueError(f"{path} is one of {int(split.group(2))} parts of a split GGUF, which batchgen does not "
                         f"read: merge them into one file (llama-gguf-split --merge)")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - numpy and gguf errors alike, none naming the file
        raise ValueError(f"cannot read GGUF file {path}: truncated or corrupt ({type(e).__name__}: {e})") from None
    fields = gguf_fields(reader)
    config = gguf_config(fields, {t.name: t for t in reader.tensors})
    layout = gguf_arch(field_value(fields, "general.architecture"))
    tokenizer = tokenizer_from_gguf(reader)
    eos_ids = tokenizer.eos_token_ids or ([config["eos_token_id"]] if "eos_token_id" in config else [])
    return ModelSource(config=config, weights=lambda: iter_gguf_weights(reader, config, layout),
                       tokenizer=tokenizer,
                       generation_config={"eos_token_id": eos_ids} if eos_ids else {},
                       name=str(field_value(fields, "general.name", Path(path).stem)))

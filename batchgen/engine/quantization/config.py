"""A checkpoint's ``quantization_config`` parsed into what the loader needs, or a clear error.

Supported: FP8 (e4m3) weights with one float32 scale per 128x128 block (``quant_method: fp8`` with
``weight_block_size: [128, 128]``, DeepSeek-V3 / Qwen3-FP8 style, ``weight_scale_inv`` tensors),
per output channel (``fbgemm_fp8``, compressed-tensors ``strategy: channel``, ``weight_scale``
(N, 1)) or per tensor (``quant_method: fp8`` without blocks, compressed-tensors ``strategy: tensor``,
ModelOpt FP8; ``weight_scale`` scalars). Activations are always quantized dynamically per token and
128 columns, so a checkpoint's static ``input_scale`` tensors are read past. Anything else
(gptq, awq, bitsandbytes, int8/int4 compressed-tensors, other block sizes, e5m2) is refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchgen.engine.models.errors import UnsupportedModelError

# EngineConfig.fp8_weights: "auto": FP8 compute where the device has FP8 tensor cores and the kernel set an FP8
# GEMM, else dequantize at load; "fp8": always keep FP8 (needs the Triton kernel set; on CPU under the Triton
# interpreter, for tests); "dequantize": always dequantize to the model dtype.
FP8_WEIGHTS_MODES = ("auto", "fp8", "dequantize")

BLOCK = "block"  # one scale per 128x128 block
CHANNEL = "channel"  # one scale per output row
TENSOR = "tensor"  # one scale per tensor (per fused shard, per expert projection)
SUPPORTED = ("fp8 (128x128 blocks or per tensor), fbgemm_fp8, compressed-tensors FP8 (tensor, channel or "
             "128x128 block weights), modelopt FP8")
# Per-layer tensors of quantized checkpoints the engine does not use: static activation scales (it
# quantizes activations dynamically) and FP8 KV-cache scales (its cache is in the model dtype).
UNUSED_SUFFIXES = ("input_scale", "input_scale_ub", "output_scale", "k_scale", "v_scale")


class UnsupportedQuantizationError(UnsupportedModelError):
    """The checkpoint is quantized in a way the engine does not load."""


@dataclass(frozen=True)
class QuantizationConfig:
    """FP8 weights: the scale layout, the checkpoint's name for the scale tensors, what it leaves unquantized."""

    method: str  # quant_method as the checkpoint names it
    scheme: str  # BLOCK, CHANNEL or TENSOR
    scale_suffix: str  # "weight_scale_inv" (blocks) or "weight_scale"
    ignored: tuple[str, ...] = ()  # modules_to_not_convert / ignored_layers / ignore, as written
    static_activations: bool = False  # the checkpoint has input_scale tensors (read past)

    @property
    def block(self) -> bool:
        return self.scheme == BLOCK

    def describe(self) -> str:
        return {BLOCK: "fp8 e4m3, 128x128 block scales", CHANNEL: "fp8 e4m3, per-channel scales",
                TENSOR: "fp8 e4m3, per-tensor scales"}[self.scheme]

    def tensor_role(self, name: str) -> str | None:
        """"scale" for a weight's scale tensor, "unused" for tensors to skip, None for anything else."""
        suffix = name.rsplit(".", 1)[-1]
        if suffix in (self.scale_suffix, "weight_scale", "weight_scale_inv"):
            return "scale"
        return "unused" if suffix in UNUSED_SUFFIXES else None


def parse_quantization(hf_config: dict[str, Any]) -> QuantizationConfig | None:
    """The checkpoint's quantization (config.json ``quantization_config``), None when it has none."""
    q = hf_config.get("quantization_config") or hf_config.get("compression_config")
    if not q:
        return None
    method = str(q.get("quant_method") or q.get("quantization", {}).get("quant_algo") or "unknown").lower()
    parse = _PARSERS.get(method)
    if parse is None:
        raise UnsupportedQuantizationError(
            f"quantization method {method!r} is not supported; supported: {SUPPORTED}. Use an unquantized "
            "(bf16/fp16) checkpoint or an FP8 one")
    return parse(q, method)


def _fail(method: str, what: str) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(f"{method} checkpoint with {what} is not supported; supported: {SUPPORTED}")


def _ignored(q: dict[str, Any]) -> tuple[str, ...]:
    return tuple(q.get("modules_to_not_convert") or q.get("ignored_layers") or q.get("ignore") or ())


def _check_block(method: str, block: Any) -> None:
    if list(block) != [128, 128]:
        raise _fail(method, f"weight blocks {list(block)} (only 128x128)")


def _fp8(q: dict[str, Any], method: str) -> QuantizationConfig:
    """HF FineGrainedFP8 / DeepSeek-V3 (``weight_block_size``) and vLLM's serialized per-tensor fp8."""
    fmt = str(q.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise _fail(method, f"fmt {fmt!r} (only e4m3)")
    activations = q.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise _fail(method, f"activation_scheme {activations!r}")
    block = q.get("weight_block_size")
    if block is not None:
        _check_block(method, block)
    scheme, suffix = (BLOCK, "weight_scale_inv") if block else (TENSOR, "weight_scale")
    return QuantizationConfig(method, scheme, suffix, _ignored(q), activations == "static")


def _fbgemm_fp8(q: dict[str, Any], method: str) -> QuantizationConfig:
    return QuantizationConfig(method, CHANNEL, "weight_scale", _ignored(q))


def _modelopt(q: dict[str, Any], method: str) -> QuantizationConfig:
    algo = str(q.get("quant_algo") or q.get("quantization", {}).get("quant_algo") or "").upper()
    if algo != "FP8":
        raise _fail(method, f"quant_algo {algo or None!r} (only FP8)")
    return QuantizationConfig(method, TENSOR, "weight_scale", _ignored(q), static_activations=True)


def _compressed_tensors(q: dict[str, Any], method: str) -> QuantizationConfig:
    """compressed-tensors ``float-quantized`` FP8: every config group 8-bit float weights, one strategy."""
    if q.get("sparsity_config"):
        raise _fail(method, "a sparsity_config")
    groups = list((q.get("config_groups") or {}).values())
    if not groups:
        raise _fail(method, "no config_groups")
    schemes, static = set(), False
    for group in groups:
        w = group.get("weights") or {}
        if w.get("num_bits") != 8 or w.get("type") != "float":
            raise _fail(method, f"{w.get('num_bits')}-bit {w.get('type')} weights (format "
                                f"{q.get('format')!r}; only 8-bit float)")
        strategy = w.get("strategy")
        if strategy == BLOCK:
            _check_block(method, w.get("block_structure") or ())
        elif strategy not in (CHANNEL, TENSOR):
            raise _fail(method, f"weight strategy {strategy!r}")
        schemes.add(strategy)
        acts = group.get("input_activations") or {}
        if acts and (acts.get("num_bits") != 8 or acts.get("type") != "float"):
            raise _fail(method, f"{acts.get('num_bits')}-bit {acts.get('type')} activations")
        static |= bool(acts) and not acts.get("dynamic", False)
    if len(schemes) > 1:
        raise _fail(method, f"mixed weight strategies {sorted(schemes)}")
    scheme = schemes.pop()
    return QuantizationConfig(method, scheme, "weight_scale", _ignored(q), static)


_PARSERS = {"fp8": _fp8, "fbgemm_fp8": _fbgemm_fp8, "compressed-tensors": _compressed_tensors,
            "modelopt": _modelopt}

"""Writes FP8 checkpoints in the Hugging Face layouts from unquantized weights (for benchmarks and tests).

Quantized: the 2-D projection weights (``*_proj.weight``, Mixtral's ``experts.N.w1/w2/w3.weight``);
embeddings, ``lm_head``, norms and routers (``mlp.gate.weight``) stay as they are, as in DeepSeek-V3's
and Qwen3's FP8 releases.

    python -m batchgen.engine.quantization.checkpoint SRC_FOLDER DST_FOLDER [--scheme block|channel|tensor]
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
import torch

from batchgen.engine.backends.triton.fp8.format import WEIGHT_BLOCK, quantize_fp8
from batchgen.engine.quantization.config import BLOCK, CHANNEL, TENSOR

_QUANTIZED = re.compile(r"(_proj|\.w[123])\.weight$")
SCHEMES = (BLOCK, CHANNEL, TENSOR)


def is_quantized_weight(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and _QUANTIZED.search(name) is not None and tensor.is_floating_point()


def quantize_tensor(name: str, tensor: torch.Tensor, scheme: str = BLOCK) -> dict[str, torch.Tensor]:
    """``{name: tensor}``, or the FP8 weight and its scale under the checkpoint names of ``scheme``.

    block: ``weight_scale_inv`` (ceil(N/128), ceil(K/128)) (DeepSeek-V3); channel: ``weight_scale``
    (N, 1) (fbgemm / compressed-tensors); tensor: ``weight_scale`` scalar (vLLM's fp8).
    """
    if not is_quantized_weight(name, tensor):
        return {name: tensor}
    n, k = tensor.shape
    group = {BLOCK: WEIGHT_BLOCK, CHANNEL: (1, k), TENSOR: (n, k)}[scheme]
    q, scale = quantize_fp8(tensor, group)
    if scheme == BLOCK:
        return {name: q, name + "_scale_inv": scale}
    return {name: q, name + "_scale": scale if scheme == CHANNEL else scale.reshape(())}


def quantization_config(scheme: str = BLOCK) -> dict:
    """The ``quantization_config`` of a checkpoint written by ``quantize_tensor`` with ``scheme``."""
    if scheme == BLOCK:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    if scheme == CHANNEL:
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}
    return {"quant_method": "fp8", "activation_scheme": "dynamic"}


def convert_folder(src: str | Path, dst: str | Path, scheme: str = BLOCK, device: str = "cpu") -> Path:
    """An FP8 copy of the Hugging Face folder ``src`` (config, safetensors, tokenizer files) in ``dst``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for file in sorted(src.glob("*.safetensors")):  # one shard in memory at a time
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                quantized = quantize_tensor(name, f.get_tensor(name).to(device), scheme)
                tensors.update({k: v.cpu().contiguous() for k, v in quantized.items()})
        save_file(tensors, str(dst / file.name))
        weight_map.update(dict.fromkeys(tensors, file.name))
    if (src / "model.safetensors.index.json").is_file():
        (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(scheme)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(path, dst / path.name)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--scheme", choices=SCHEMES, default=BLOCK)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    print(f"wrote {convert_folder(args.src, args.dst, args.scheme, args.device)}")


if __name__ == "__main__":
    main()

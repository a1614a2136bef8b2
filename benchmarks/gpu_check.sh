#!/usr/bin/env bash
# One GPU check: the Triton kernel tests compiled for the device, then `batchgen bench` on random-weight
# models: Llama ~1B and ~8B in bf16, the 8B in FP8 (128x128 block scales), and, when
# benchmarks/random_deepseek.py exists, a DeepSeek-V3-shaped MoE in bf16 and FP8. Each model runs once:
# 64 prompts x 2,048 tokens, then 128 tokens each decoded at batch 64 (CUDA graphs), which gives both the
# prefill and the decode figures; the 1B also runs without CUDA graphs. One table at the end: prefill
# tok/s, decode tok/s and prefill MFU (FP8 matmuls against the FP8 peak) per model and weight format.
#
# Time on one H200, on paper: kernel tests <= 3 min (capped); writing the random models ~5 s (1B),
# ~30 s (8B bf16, 16 GB), ~30 s (8B FP8, 8 GB); a bench run ~15-40 s: loading (~10 s for the 8B), Triton
# JIT compiles (first run of a kernel set only; cached on disk after), ~50 CUDA graph captures, 131K
# prompt tokens (~5 s for the 8B at 50 % MFU) and 127 decode steps (~2 s). About 6.5 min without the
# DeepSeek model, which leaves its two runs ~1.5 min (its writer sizes it).
# Results go to $OUT (default /tmp/gpu_check). TRITON_INTERPRET is set to 0 rather than unset:
# tests/conftest.py defaults it to 1.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to torch" >&2
    exit 1
fi
export TRITON_INTERPRET=0
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
rm -f "$out"/bench-*.json
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
timeout 180 python -m pytest -q tests/test_kernels.py tests/test_triton_model.py tests/test_fp8.py "$@" 2>&1 \
    | tail -5 | tee "$out/kernels.txt" || true

bench() {  # bench NAME FOLDER [extra bench options]
    local name=$1 folder=$2
    shift 2
    batchgen bench --model "$folder" --device cuda --num-prompts 64 --input-len 2048 --output-len 128 \
        --output-json "$out/bench-$name.json" "$@" > "$out/bench-$name.log"
    echo "== $name"
    head -22 "$out/bench-$name.log"
}

python benchmarks/random_llama.py --size 1b --out /tmp/llama-1b
bench llama-1b-bf16 /tmp/llama-1b
bench llama-1b-bf16-no-graphs /tmp/llama-1b --cuda-graphs off
rm -rf /tmp/llama-1b
for format in bf16 fp8; do
    python benchmarks/random_llama.py --size 8b --out "/tmp/llama-8b-$format" $([ "$format" = fp8 ] && echo --fp8)
    bench "llama-8b-$format" "/tmp/llama-8b-$format"
    rm -rf "/tmp/llama-8b-$format"
done
if [ -f benchmarks/random_deepseek.py ]; then
    python benchmarks/random_deepseek.py --out /tmp/deepseek
    python -m batchgen.engine.quantization.checkpoint /tmp/deepseek /tmp/deepseek-fp8
    bench deepseek-bf16 /tmp/deepseek
    bench deepseek-fp8 /tmp/deepseek-fp8
    rm -rf /tmp/deepseek /tmp/deepseek-fp8
else
    echo "gpu_check: no benchmarks/random_deepseek.py, DeepSeek-shaped runs skipped"
fi

python - "$out" <<'EOF' | tee "$out/table.txt"
import json, pathlib, sys

rows = sorted(pathlib.Path(sys.argv[1]).glob("bench-*.json"), key=lambda p: p.stat().st_mtime)
print(f"{'run':<26} {'weights':<44} {'prefill tok/s':>13} {'decode tok/s':>12} {'prefill MFU':>11}")
for path in rows:
    r = json.loads(path.read_text())
    mfu = r.get("prefill_mfu_vs_gpu_peak")
    print(f"{path.stem.removeprefix('bench-'):<26} {r['weight_format']:<44} {r['prefill_tokens_per_s'] or 0:>13,.0f} "
          f"{r['decode_tokens_per_s'] or 0:>12,.0f} {'' if mfu is None else f'{mfu:.1%}':>11}")
EOF

#!/usr/bin/env bash
# One GPU check: the Triton kernel tests compiled for the device, then prefill-only `batchgen bench`
# on random-weight Llama models of ~1B and ~8B parameters (8 prompts x 2K tokens, 64 x 8K tokens),
# and decode at batch 64 with and without CUDA graphs and overlapped scheduling (a table of decode
# tok/s and the host's share of a step); then prefill on a random DeepSeek-V3-shaped
# mixture of experts (latent attention, 64 routed + 1 shared experts, top-6; 2.9B parameters, 0.3B
# active), and a table of the prefill runs side by side (MFU on active parameters). FP8: the 8B and the
# DeepSeek-V3-shaped model also run as FP8 checkpoints (128x128 block scales, weights kept FP8 on sm_89+),
# 64 prompts x 2K tokens each, in the same table (its weight_format column; MFU of FP8 matmuls against
# the FP8 peak).
# With more than one GPU: the 8B model with tensor parallel and data parallel over all of them, and a
# random Qwen3-MoE model with data + expert parallel (DEP) and with tensor parallel; each prints
# communication next to compute per step.
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
ngpu=$(python -c "import torch; print(torch.cuda.device_count())")

# parallel_runs MODEL FLAGS...: prefill (64 x 2K tokens) and decode (batch 64 per replica) for each set of flags.
parallel_runs() {
    local model=$1; shift
    for flags in "$@"; do
        local tag=${flags// /}
        batchgen bench --model "$model" --device cuda --num-prompts 64 --input-len 2048 $flags \
            --output-json "$out/bench-$(basename "$model")-prefill$tag.json" | head -16
        batchgen bench --model "$model" --device cuda --num-prompts $((64 * ngpu)) --input-len 512 \
            --output-len 128 $flags --output-json "$out/bench-$(basename "$model")-decode$tag.json" | head -16
    done
}
timeout 300 python -m pytest -q tests/test_kernels.py tests/test_mla.py tests/test_triton_model.py tests/test_fp8.py "$@" 2>&1 | tail -5 | tee "$out/kernels.txt" || true
for size in 1b 8b; do
    python benchmarks/random_llama.py --size "$size" --out "/tmp/llama-$size"
    batchgen bench --model "/tmp/llama-$size" --device cuda --num-prompts 8 --input-len 2048 \
        --output-json "$out/bench-$size-8x2k.json" | head -12
    batchgen bench --model "/tmp/llama-$size" --device cuda --num-prompts 64 --input-len 8192 \
        --max-num-batched-tokens 8192 --output-json "$out/bench-$size-64x8k.json" | head -12
    # Decode: CUDA graphs and overlapped scheduling on (the defaults), graphs off, overlap off.
    for run in graphs-auto:"--cuda-graphs auto" graphs-off:"--cuda-graphs off" overlap-off:"--overlap-schedule off"; do
        batchgen bench --model "/tmp/llama-$size" --device cuda --num-prompts 64 --input-len 512 \
            --output-len 128 ${run#*:} --output-json "$out/bench-$size-decode-${run%%:*}.json" | head -12
    done
    python benchmarks/bench_table.py --decode "$out"/bench-$size-decode-*.json | tee "$out/decode-$size.txt"
    if [ "$size" = 8b ] && [ "$ngpu" -gt 1 ]; then
        parallel_runs "/tmp/llama-$size" "--tensor-parallel-size $ngpu" "--data-parallel-size $ngpu"
    fi
    rm -rf "/tmp/llama-$size"
done
python benchmarks/random_llama.py --size 8b --fp8 --out /tmp/llama-8b-fp8
batchgen bench --model /tmp/llama-8b-fp8 --device cuda --num-prompts 64 --input-len 2048 \
    --output-json "$out/bench-8b-fp8-64x2k.json" | head -12
rm -rf /tmp/llama-8b-fp8
if [ "$ngpu" -gt 1 ]; then
    python benchmarks/random_llama.py --size moe --out /tmp/qwen3-moe
    parallel_runs /tmp/qwen3-moe "--data-parallel-size $ngpu --enable-expert-parallel" "--tensor-parallel-size $ngpu"
    rm -rf /tmp/qwen3-moe
fi
python benchmarks/random_deepseek.py --size v3-small --out /tmp/deepseek-v3-small
batchgen bench --model /tmp/deepseek-v3-small --device cuda --num-prompts 32 --input-len 2048 \
    --output-json "$out/bench-deepseek-v3-small-32x2k.json" | head -12
python -m batchgen.engine.quantization.checkpoint /tmp/deepseek-v3-small /tmp/deepseek-v3-small-fp8
batchgen bench --model /tmp/deepseek-v3-small-fp8 --device cuda --num-prompts 32 --input-len 2048 \
    --output-json "$out/bench-deepseek-v3-small-fp8-32x2k.json" | head -12
rm -rf /tmp/deepseek-v3-small /tmp/deepseek-v3-small-fp8
python benchmarks/bench_table.py "$out"/bench-*k.json | tee "$out/prefill.txt"

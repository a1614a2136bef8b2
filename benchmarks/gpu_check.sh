#!/usr/bin/env bash
# The GPU check in stages that fit one device window (benchmarks/gpu_check.py has the plan):
#   correctness (<= 4 min: kernel and model tests on CUDA, graph capture of every size), then the headline
#   figures (<= 3 min: Llama-3-8B-shaped prefill 64x2K and 8x8K with MFU, decode at batch 64 with graphs and
#   overlap on/off, DeepSeek-V3-shaped MoE prefill in bf16 and FP8), then extras (<= 1 min: 8B FP8, 1B).
#
#   bash benchmarks/gpu_check.sh --dry-run        # the plan, stage by stage, with expected seconds
#   OUT=/tmp/gpu_check bash benchmarks/gpu_check.sh [STAGE ...]
#
# Each stage runs in its own process under its own time limit and writes every result to $OUT as it
# finishes, so a stage cut short still returns what it finished; a failed stage does not stop the next.
# Random checkpoints are drawn on the device while they load (no weight files). TRITON_INTERPRET is set
# to 0 rather than unset: tests/conftest.py defaults it to 1.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
if [ "${1:-}" = "--dry-run" ]; then
    exec "$py" benchmarks/gpu_check.py --dry-run
fi
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to torch" >&2
    exit 1
fi
export TRITON_INTERPRET=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
"$py" benchmarks/gpu_check.py --dry-run | tee "$out/plan.txt"
for stage in "${@:-correctness headline extras}"; do
    for s in $stage; do
        limit=$("$py" benchmarks/gpu_check.py --stage "$s" --limit)
        timeout -k 10 "$limit" "$py" benchmarks/gpu_check.py --stage "$s" --out "$out" 2>&1 | tee -a "$out/$s.log"
        echo "stage $s: exit ${PIPESTATUS[0]}" | tee -a "$out/stages.txt"
    done
done
ls "$out"/bench-*.json >/dev/null 2>&1 && "$py" benchmarks/bench_table.py "$out"/bench-*.json | tee "$out/table.txt"
ls "$out"/bench-*decode*.json >/dev/null 2>&1 && "$py" benchmarks/bench_table.py --decode "$out"/bench-*decode*.json \
    | tee "$out/decode.txt"
exit 0

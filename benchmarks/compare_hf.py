"""Prefill throughput of batchgen against HF transformers on the same weights and prompts, in one run.

    python benchmarks/compare_hf.py [--model smollm2-135m-instruct] [--num-prompts 32] [--repeats 3]

Prompts are cut from the real documents in jobs/data (lengths log-uniform in 100..2000 tokens, so
skewed short like document collections). HF runs in batches of 8 sorted by length (left padding,
logits for the last position only) and one prompt at a time (no padding); batchgen runs the whole set
with max_tokens=1. Medians over --repeats runs; the next-token agreement checks both compute the same.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from batchgen.bench.flops import measure_matmul_flops
from batchgen.bench.workload import from_documents
from batchgen.engine import LLM, SamplingParams
from batchgen.engine.hub import resolve_model_path

DATA = Path(__file__).resolve().parent.parent / "jobs" / "data" / "articles.jsonl"


def hf_model(path: str, dtype: torch.dtype):
    """A plain (unquantized) HF model with the GGUF's weights, or the HF folder's."""
    from transformers import AutoModelForCausalLM

    p = Path(path)
    if p.suffix != ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype).eval()
    packed = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    config = packed.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(packed.state_dict(), strict=False)
    plain.tie_weights()
    return plain.to(dtype).eval()


@torch.inference_mode()
def hf_sorted_batches(model, prompts: list[list[int]], batch_size: int, pad_id: int) -> list[int]:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    next_tokens = [0] * len(prompts)
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1).logits
        for row, i in enumerate(idx):
            next_tokens[i] = int(logits[row, -1].argmax())
    return next_tokens


@torch.inference_mode()
def hf_one_at_a_time(model, prompts: list[list[int]]) -> list[int]:
    return [int(model(input_ids=torch.tensor([p]), logits_to_keep=1).logits[0, -1].argmax()) for p in prompts]


def timed(fn, repeats: int):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--lengths", default="100:2000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--skip-single", action="store_true", help="skip HF one-prompt-at-a-time")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)

    path = resolve_model_path(args.model)
    llm = LLM(path, dtype=args.dtype, device="cpu", max_num_batched_tokens=args.max_batch_tokens,
              enable_prefix_caching=False)  # repeats must not hit the cache
    texts = [json.loads(line)["text"] for line in DATA.read_text().splitlines() if line.strip()]
    prompts = from_documents(texts, llm.tokenizer, args.num_prompts, args.lengths).prompts
    tokens = sum(map(len, prompts))
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(prompts[:2], params)  # warm-up
    ours_s, outs = timed(lambda: llm.generate(prompts, params), args.repeats)
    ours_next = [o.token_ids[0] for o in outs]

    model = hf_model(path, dtype)
    pad = llm.tokenizer.pad_token_id or 0
    hf_sorted_batches(model, prompts[:2], 8, pad)  # warm-up
    sorted_s, sorted_next = timed(lambda: hf_sorted_batches(model, prompts, 8, pad), args.repeats)
    single_s, single_next = (None, None) if args.skip_single else \
        timed(lambda: hf_one_at_a_time(model, prompts), args.repeats)

    matmul = measure_matmul_flops(dtype, torch.device("cpu"))
    roofline = matmul / (2 * llm.engine.executor.profile.active_params)
    result = {
        "model": args.model, "dtype": args.dtype, "prompts": len(prompts), "prompt_tokens": tokens,
        "min_len": min(map(len, prompts)), "max_len": max(map(len, prompts)), "repeats": args.repeats,
        "batchgen_tok_s": round(tokens / ours_s, 1),
        "hf_sorted_batch8_tok_s": round(tokens / sorted_s, 1),
        "hf_one_at_a_time_tok_s": round(tokens / single_s, 1) if single_s else None,
        "ratio_vs_hf_sorted_batch8": round(sorted_s / ours_s, 2),
        "ratio_vs_hf_one_at_a_time": round(single_s / ours_s, 2) if single_s else None,
        "matmul_gflops_measured": round(matmul / 1e9, 1),
        "roofline_tok_s": round(roofline, 1),
        "batchgen_over_roofline": round(tokens / ours_s / roofline, 3),
        "next_token_agreement_vs_hf": round(sum(a == b for a, b in zip(ours_next, sorted_next)) / len(prompts), 3),
    }
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:>{width}}: {value}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

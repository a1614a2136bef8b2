"""Prefill throughput of batchgen against HF transformers on the same weights and prompts, in one run.

    python benchmarks/compare_hf.py [--model smollm2-135m-instruct] [--num-prompts 32] [--repeats 3]

Prompts are cut from the real documents in jobs/data (lengths log-uniform in 100..2000 tokens, so
skewed short like document collections). batchgen runs the whole set with max_tokens=1 at its default
dtype "auto" (--dtype to pick one). HF runs in batches of 8 sorted by length (left padding, logits for
the last position only) and one prompt at a time (no padding), in bf16 and in fp32: its best dtype on
this machine is the one a user would pick, and batchgen is compared with that. Medians over --repeats
runs; the next-token agreement with HF (same dtype as batchgen) checks both compute the same.

Both dtypes' matmul rates are measured, and the roofline counts the linear layers (logits for the last
position only) and the causal attention matmuls (QK^T and PV of the positions computed) at the rate of
the dtype batchgen ran in.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from batchgen.engine.flops import attention_flops
from batchgen.engine.matmul_rate import measure_matmul_flops
from batchgen.bench.workload import from_documents
from batchgen.engine import LLM, SamplingParams
from batchgen.engine.loading.hub import resolve_model_path

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


def roofline_tok_s(profile, prompts: list[list[int]], matmul_flops: float, with_attention: bool) -> float:
    """Prompt tokens/s if every counted FLOP ran at the measured matmul rate (``profile``: the model's)."""
    tokens = sum(map(len, prompts))
    flops = 2 * profile.active_params * tokens + 2 * profile.lm_head_params * len(prompts)
    if with_attention:
        flops += sum(attention_flops(profile, 0, len(p)) for p in prompts)
    return tokens * matmul_flops / flops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--lengths", default="100:2000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="batchgen's dtype (default: auto)")
    ap.add_argument("--hf-dtypes", nargs="+", default=["bfloat16", "float32"],
                    help="HF dtypes to try; the fastest is HF's figure")
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--skip-single", action="store_true", help="skip HF one-prompt-at-a-time")
    ap.add_argument("--output-json")
    args = ap.parse_args()

    path = resolve_model_path(args.model)
    llm = LLM(path, dtype=args.dtype, device="cpu", max_num_batched_tokens=args.max_batch_tokens,
              enable_prefix_caching=False)  # repeats must not hit the cache
    ours_dtype = llm.config.dtype_choice
    texts = [json.loads(line)["text"] for line in DATA.read_text().splitlines() if line.strip()]
    prompts = from_documents(texts, llm.tokenizer, args.num_prompts, args.lengths).prompts
    tokens = sum(map(len, prompts))
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(prompts[:2], params)  # warm-up
    ours_s, outs = timed(lambda: llm.generate(prompts, params), args.repeats)
    ours_next = [o.token_ids[0] for o in outs]

    pad = llm.tokenizer.pad_token_id or 0
    hf: dict[str, dict] = {}
    base = hf_model(path, torch.float32)
    for name in args.hf_dtypes:
        model = base if name == "float32" else copy.deepcopy(base).to(getattr(torch, name))
        hf_sorted_batches(model, prompts[:2], 8, pad)  # warm-up
        sorted_s, sorted_next = timed(lambda: hf_sorted_batches(model, prompts, 8, pad), args.repeats)
        single_s = None if args.skip_single else timed(lambda: hf_one_at_a_time(model, prompts), args.repeats)[0]
        best = min(s for s in (sorted_s, single_s) if s is not None)
        hf[name] = {"sorted_s": sorted_s, "single_s": single_s, "best_s": best, "next": sorted_next}
    hf_dtype = min(hf, key=lambda name: hf[name]["best_s"])
    best_hf = hf[hf_dtype]
    agree_with = ours_dtype.name if ours_dtype.name in hf else hf_dtype

    device = torch.device("cpu")
    rates = {name: measure_matmul_flops(getattr(torch, name), device) for name in ("bfloat16", "float32")}
    cfg = llm.profile()
    roof_linear = roofline_tok_s(cfg, prompts, rates[ours_dtype.name] if ours_dtype.name in rates
                                 else measure_matmul_flops(ours_dtype.torch_dtype, device), False)
    roof_attn = roof_linear * roofline_tok_s(cfg, prompts, 1.0, True) / roofline_tok_s(cfg, prompts, 1.0, False)
    ours_tps = tokens / ours_s
    result = {
        "model": args.model, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(), "prompts": len(prompts), "prompt_tokens": tokens,
        "min_len": min(map(len, prompts)), "max_len": max(map(len, prompts)), "repeats": args.repeats,
        "batchgen_dtype": ours_dtype.name, "batchgen_dtype_reason": ours_dtype.reason,
        "batchgen_tok_s": round(ours_tps, 1),
        **{f"hf_{name}_sorted_batch8_tok_s": round(tokens / r["sorted_s"], 1) for name, r in hf.items()},
        **{f"hf_{name}_one_at_a_time_tok_s": round(tokens / r["single_s"], 1) if r["single_s"] else None
           for name, r in hf.items()},
        "hf_best_dtype": hf_dtype,
        "hf_best_tok_s": round(tokens / best_hf["best_s"], 1),
        "ratio_vs_hf_best": round(best_hf["best_s"] / ours_s, 2),
        "ratio_vs_hf_best_sorted_batch8": round(best_hf["sorted_s"] / ours_s, 2),
        **{f"matmul_gflops_{name}": round(rate / 1e9, 1) for name, rate in rates.items()},
        "roofline_linear_tok_s": round(roof_linear, 1),
        "roofline_with_attention_tok_s": round(roof_attn, 1),
        "batchgen_over_roofline_linear": round(ours_tps / roof_linear, 3),
        "batchgen_over_roofline_with_attention": round(ours_tps / roof_attn, 3),
        f"next_token_agreement_vs_hf_{agree_with}": round(
            sum(a == b for a, b in zip(ours_next, hf[agree_with]["next"], strict=True)) / len(prompts), 3),
    }
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:>{width}}: {value}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

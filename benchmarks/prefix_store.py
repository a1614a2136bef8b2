"""Job A, then job B over the same documents with a new question: what the prefix KV store saves B.

    python benchmarks/prefix_store.py [--model smollm2-135m-instruct] [--docs jobs/data/articles.jsonl]
                                      [--copies 1] [--max-tokens 8] [--dtype float32]

Each job runs in a fresh process. Modes:
  cold   B alone, nothing cached (the baseline);
  host   A then B in one process, a device KV cache too small for A's documents and a host tier that
         holds them (``prefix_cache_host_bytes``): B's prefixes come back from host memory;
  local  A, then B in a new process, with ``prefix_cache_store`` on a local folder;
  s3     the same on s3:// (a local moto server).
Prints B's prompt tokens computed, the share served by each tier, B's generate wall time and prefill time,
and their ratio to cold, with the store's read rate.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTION_A = "Summarize the text above in two sentences."
QUESTION_B = "Which people, places and dates does the text above name?"


def prompts(tokenizer, docs: str, copies: int, question: str) -> list[list[int]]:
    texts = [json.loads(line)["text"] for line in Path(docs).read_text().splitlines() if line.strip()]
    return [tokenizer.encode(f"Document {c}.{i}:\n{t}\n\n{question}") for c in range(copies)
            for i, t in enumerate(texts)]


def worker(args: argparse.Namespace) -> None:
    """One job (or A then B, for the host mode) in this process; prints B's figures as JSON."""
    import torch

    from batchgen.engine import LLM, SamplingParams

    options = json.loads(args.options)
    llm = LLM(args.model, dtype=args.dtype, device="cpu", **options)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    jobs = {"A": [QUESTION_A], "B": [QUESTION_B], "AB": [QUESTION_A, QUESTION_B]}[args.job]
    for question in jobs:
        llm.engine.reset_metrics()
        batch = prompts(llm.tokenizer, args.docs, args.copies, question)
        start = time.perf_counter()
        outs = llm.generate(batch, params)
        wall = time.perf_counter() - start
    llm.close()
    m = llm.engine.metrics
    print(json.dumps({"wall_s": wall, "prompt_tokens": sum(len(p) for p in batch), "metrics": m.as_dict(),
                      "cached": sum(o.num_cached_tokens for o in outs), "cpu": torch.backends.cpu.get_cpu_capability(),
                      "tokens": [o.token_ids for o in outs]}))


def run_job(args: argparse.Namespace, job: str, options: dict, env: dict | None = None) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--job", job, "--options", json.dumps(options), "--model",
           args.model, "--docs", args.docs, "--copies", str(args.copies), "--max-tokens", str(args.max_tokens),
           "--dtype", args.dtype]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=ROOT,
                         timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"job {job} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def moto_env() -> tuple[dict, object]:
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket="kvstore")
    return env, server


def host_mode_options(args: argparse.Namespace, base: dict) -> dict:
    """A device cache that holds about two documents, and a host tier that holds all of them."""
    from batchgen.engine.loading.loader import load_model_source
    from batchgen.engine.models.registry import model_config

    cfg = model_config(load_model_source(args.model, weights=False).config)
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    return {**base, "kv_cache_memory": per_token * 1600, "prefix_cache_host_bytes": per_token * 40000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--docs", default=str(ROOT / "jobs" / "data" / "articles.jsonl"))
    ap.add_argument("--copies", type=int, default=1, help="Repeat the documents (under new names).")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--modes", default="cold,local,s3,host")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--job", default="B", help=argparse.SUPPRESS)
    ap.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    base = {"max_num_batched_tokens": 2048}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            if mode == "cold":
                results[mode] = run_job(args, "B", base)
            elif mode == "host":
                results[mode] = run_job(args, "AB", host_mode_options(args, base))
            elif mode == "local":
                options = {**base, "prefix_cache_store": f"{tmp}/kv"}
                run_job(args, "A", options)
                results[mode] = run_job(args, "B", options)
            elif mode == "s3":
                env, server = moto_env()
                try:
                    options = {**base, "prefix_cache_store": "s3://kvstore/prefix/"}
                    run_job(args, "A", options, env)
                    results[mode] = run_job(args, "B", options, env)
                finally:
                    server.stop()
            print(json.dumps({mode: {k: v for k, v in results[mode].items() if k != "tokens"}}), flush=True)
    report(results)


def report(results: dict[str, dict]) -> None:
    cold = results.get("cold")
    first = next(iter(results.values()))
    print(f"CPU capability: {first['cpu']}; B: {first['prompt_tokens']} prompt tokens")
    print(f"{'mode':6} {'computed':>9} {'host':>6} {'store':>6} {'wall s':>7} {'x cold':>7} {'prefill s':>9} "
          f"{'x cold':>7} {'read MB/s':>9}  same tokens as cold")
    for mode, r in results.items():
        m = r["metrics"]
        read_rate = m["prefix_store_bytes_read"] / m["prefix_store_load_time_s"] / 1e6 \
            if m["prefix_store_load_time_s"] else 0.0
        ratio = f"{cold['wall_s'] / r['wall_s']:.2f}" if cold else "-"
        pratio = f"{cold['metrics']['prefill_time_s'] / m['prefill_time_s']:.2f}" if cold and m["prefill_time_s"] else "-"
        same = r["tokens"] == cold["tokens"] if cold else "-"
        print(f"{mode:6} {m['prompt_tokens_computed']:>9} {m['prefix_cache_host_hits']:>6} "
              f"{m['prefix_cache_store_hits']:>6} {r['wall_s']:>7.2f} {ratio:>7} {m['prefill_time_s']:>9.2f} "
              f"{pratio:>7} {read_rate:>9.0f}  {same}")


if __name__ == "__main__":
    main()

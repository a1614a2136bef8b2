"""Speculation off vs each method on SmolLM2, over three workloads and three batch sizes, side by side.

    python benchmarks/speculative.py [--quick] [--methods ngram,suffix] [--batch-sizes 1,8,64] [--repeats 1]

Workloads (jobs/data/articles.jsonl's documents, chat-templated, greedy):
  copy       "Repeat the text below verbatim." over the first ~500 characters of each document;
  summarize  "Summarize the text below in three sentences." over the first ~1500 characters;
  extract    jobs/extract.yaml's prompt and JSON schema (grammar rows: see docs/speculative.md).
For each batch size (max_num_seqs) the workload has max(4, min(2 x batch, 64)) prompts (documents cycled).
Each workload runs under every method back to back on one engine (a fresh speculator each time, no prefix
cache), so that a machine shared with other work loads them alike. Prints output tok/s, the ratio to spec off, acceptance rate, mean accepted length, the share of decoding
sequence-steps the cost model let draft, and whether the outputs equal spec off's (they must: greedy).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"


def documents() -> list[str]:
    lines = (ROOT / "jobs/data/articles.jsonl").read_text().splitlines()
    return [json.loads(line)["text"] for line in lines if line.strip()]


def extract_job() -> tuple[str, str, dict, int]:
    job = yaml.safe_load((ROOT / "jobs/extract.yaml").read_text())
    return job["prompt"]["system"], job["prompt"]["template"], job["sampling"]["json_schema"], \
        job["sampling"]["max_tokens"]


def workload(name: str, tokenizer, count: int, max_tokens: int):
    """(prompts as token ids, SamplingParams) for ``count`` requests of the workload."""
    from batchgen.engine import SamplingParams

    docs = documents()
    schema, system = None, None
    if name == "extract":
        system, template, schema, max_tokens = extract_job()
    prompts = []
    for i in range(count):
        doc = docs[i % len(docs)]
        if name == "copy":
            user = f"Repeat the text below verbatim.\n\n{doc[:500]}"
        elif name == "summarize":
            user = f"Summarize the text below in three sentences.\n\n{doc[:1500]}"
        else:
            user = template.replace("{{ text }}", doc)
        if i >= len(docs):
            user = f"(Request {i}.) {user}"
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        prompts.append(tokenizer.apply_chat_template(messages))
    return prompts, SamplingParams(max_tokens=max_tokens, temperature=0, json_schema=schema)


def run(batch: int, names: list[str], methods: list[str], args) -> dict[tuple[str, str], dict]:
    """One engine at this max_num_seqs; each workload runs under every method back to back (so that they
    share the machine's load), each with a fresh speculator (no proposer state from an earlier run), best
    wall time of ``args.repeats``. Figures per (method, workload)."""
    from batchgen.engine import LLM, SamplingParams
    from batchgen.engine.speculative.config import SpeculativeConfig
    from batchgen.engine.speculative.speculator import Speculator

    # No prefix cache: every method runs the same prompts on this engine, and a later one would find the
    # earlier ones' prompt KV cached (a faster prefill that is not speculation's).
    llm = LLM(MODEL, dtype=args.dtype, device="cpu", max_num_seqs=batch, enable_prefix_caching=False)
    engine = llm.engine
    llm.generate([llm.tokenizer.encode("Warm up the engine, please.")], SamplingParams(max_tokens=8, temperature=0))
    results: dict[tuple[str, str], dict] = {}
    for name in names:
        count = max(2, batch) if args.quick else max(4, min(2 * batch, 64))
        prompts, params = workload(name, llm.tokenizer, count, args.max_tokens)
        for _ in range(args.repeats):
            for method in methods:
                config = SpeculativeConfig.from_dict(
                    {"method": method, "num_speculative_tokens": args.k} if method != "off" else {})
                engine.speculator = Speculator(config, engine.max_model_len, engine.model_config.vocab_size) \
                    if config is not None else None
                engine.reset_metrics()
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                wall = time.perf_counter() - start
                tokens = sum(len(o.token_ids) for o in outs)
                print(f"  {name} batch {batch} {method}: {tokens / wall:.1f} tok/s ({wall:.1f} s)", file=sys.stderr,
                      flush=True)
                best = results.get((method, name))
                if best is None or wall < best["wall_s"]:
                    figures = llm.metrics(wall)
                    results[(method, name)] = {"tok_s": tokens / wall, "wall_s": wall, "tokens": tokens,
                                               "outputs": [o.token_ids for o in outs],
                                               "spec": (figures.get("speculative") or {}).get(method)}
    llm.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer prompts and tokens, batch sizes 1 and 8")
    parser.add_argument("--methods", default="ngram,suffix", help="comma-separated speculative methods")
    parser.add_argument("--batch-sizes", default=None, help="max_num_seqs values (default 1,8,64)")
    parser.add_argument("--workloads", default="copy,summarize,extract")
    parser.add_argument("--max-tokens", type=int, default=None, help="output tokens (default 96; extract: its job's)")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each measurement (the fastest counts)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    import torch

    args.max_tokens = args.max_tokens or (48 if args.quick else 96)
    sizes = [int(b) for b in (args.batch_sizes or ("1,8" if args.quick else "1,8,64")).split(",")]
    names = args.workloads.split(",")
    methods = ["off"] + args.methods.split(",")
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
          f"dtype {args.dtype}, {MODEL}, num_speculative_tokens {args.k}")
    table = {}
    for b in sizes:
        for (m, name), r in run(b, names, methods, args).items():
            table.setdefault((m, b), {})[name] = r
    header = f"{'workload':<10} {'batch':>5} {'method':<7} {'tok/s':>8} {'ratio':>6} {'accept':>7} " \
             f"{'mean len':>8} {'drafting':>8} {'same':>5}"
    print(header)
    print("-" * len(header))
    rows = []
    for name in names:
        for b in sizes:
            base = table[("off", b)][name]
            for m in methods:
                r = table[(m, b)][name]
                s = r["spec"] or {}
                row = {"workload": name, "batch": b, "method": m, "tok_s": round(r["tok_s"], 1),
                       "ratio": round(r["tok_s"] / base["tok_s"], 3), "acceptance_rate": s.get("acceptance_rate"),
                       "mean_accepted_length": s.get("mean_accepted_length"),
                       "drafting_share": s.get("drafting_share"), "same_as_off": r["outputs"] == base["outputs"]}
                rows.append(row)
                fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
                print(f"{name:<10} {b:>5} {m:<7} {row['tok_s']:>8.1f} {row['ratio']:>6.2f} "
                      f"{fmt(row['acceptance_rate']):>7} {fmt(row['mean_accepted_length']):>8} "
                      f"{fmt(row['drafting_share']):>8} {'yes' if row['same_as_off'] else 'NO':>5}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu_capability": torch.backends.cpu.get_cpu_capability(),
                                               "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

"""The GPU check in stages that fit one device window (15 minutes all told, 10 per command).

    python benchmarks/gpu_check.py --dry-run                 # the plan, stage by stage, and its total
    python benchmarks/gpu_check.py --stage correctness --out $OUT

Stages run in order, each in its own process under its own time limit (gpu_check.sh): correctness first
(the kernel and model tests on CUDA, graph capture of every size), then the headline figures, then extras.
Every run writes its JSON to the output folder as soon as it finishes, so a stage cut short by its limit
still returns what it finished. Checkpoints are random and built on the device, in memory: a config and a
tokenizer are written, the loader is handed weights drawn on the GPU (no safetensors files to write).
The expected seconds are those of the first run on one H200, a fresh machine compiling every Triton kernel
cold (docs/gpu-readiness.md), rounded up; each is printed before its step.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))  # random_llama / random_deepseek beside this file

WINDOW_S = 600  # one command's limit; the plan of all stages must fit it


@dataclass(frozen=True)
class Run:
    """One step of a stage: ``expected_s`` on paper, and what it does (given the output folder)."""

    name: str
    expected_s: int
    action: Callable[[Path], None]


@dataclass(frozen=True)
class Stage:
    name: str
    limit_s: int  # the stage's process is stopped here
    runs: list[Run] = field(default_factory=list)

    @property
    def expected_s(self) -> int:
        return sum(r.expected_s for r in self.runs)


# --- checkpoints in memory ---------------------------------------------------------------------

@contextlib.contextmanager
def random_checkpoint(folder: Path, cfg: dict, shapes: dict[str, tuple[int, ...]], fp8: bool = False,
                      device: str = "cuda") -> Iterator[str]:
    """A model folder whose weights the loader draws on ``device`` while it loads (std 0.02, norms 1)."""
    import torch
    from random_llama import write_tokenizer

    from batchgen.engine.loading import loader
    from batchgen.engine.quantization.checkpoint import quantization_config, quantize_tensor

    folder.mkdir(parents=True, exist_ok=True)
    if fp8:
        cfg = {**cfg, "quantization_config": quantization_config("block")}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "model.safetensors").write_bytes(b"")  # the loader asks for a file; it never reads it
    write_tokenizer(folder)

    def weights(files):
        gen = torch.Generator(device=device).manual_seed(0)
        for name, shape in shapes.items():
            t = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
            t = t.fill_(1.0) if name.endswith("norm.weight") else t
            yield from (quantize_tensor(name, t, "block") if fp8 else {name: t}).items()

    real = loader.iter_safetensors
    loader.iter_safetensors = weights
    try:
        yield str(folder)
    finally:
        loader.iter_safetensors = real


def llama(size: str) -> tuple[dict, dict]:
    from random_llama import BASE, SIZES, shapes

    cfg = {**BASE, **SIZES[size]}
    return cfg, shapes(cfg)


def deepseek(size: str) -> tuple[dict, dict]:
    from random_deepseek import config, shapes

    cfg = config(size)
    return cfg, shapes(cfg)


# --- runs ------------------------------------------------------------------------------------------

def bench_runs(model: tuple[dict, dict], tag: str, runs: list[tuple[str, dict, int, str]], fp8: bool = False,
               **engine) -> Callable[[Path], None]:
    """One engine (one load, one graph capture) for several workloads (name, bench options, prompts,
    lengths); each result goes to out/bench-TAG-NAME.json as soon as it is measured."""

    def action(out: Path) -> None:
        import dataclasses

        from batchgen.bench.runner import BenchConfig, make_llm, run_bench
        from batchgen.bench.workload import synthetic
        from batchgen.engine.config import EngineConfig

        with random_checkpoint(out / "models" / tag, *model, fp8=fp8) as path:
            cfg = BenchConfig(engine=EngineConfig(model=path, dtype="bfloat16", device="cuda", **engine))
            with make_llm(cfg) as llm:
                for name, options, num_prompts, length in runs:
                    run_cfg = dataclasses.replace(cfg, **options)
                    workload = synthetic(num_prompts, length, llm.engine.model_config.vocab_size)
                    result = run_bench(llm, workload, run_cfg)
                    (out / f"bench-{tag}-{name}.json").write_text(json.dumps(result, indent=2) + "\n")
                    print(f"  {tag}-{name}: {result['prompt_tokens_per_s']} prompt tok/s, "
                          f"{result.get('decode_tokens_per_s')} decode tok/s, mfu {result.get('mfu')}")
    return action


def pytest_run(*args: str) -> Callable[[Path], None]:
    def action(out: Path) -> None:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", *args], capture_output=True, text=True,
                              env={**os.environ, "TRITON_INTERPRET": "0"})
        (out / "tests.txt").open("a").write(proc.stdout[-20000:] + proc.stderr[-5000:])
        print("  " + (proc.stdout.strip().splitlines() or ["(no output)"])[-1])
    return action


PREFILL = {"output_len": 1}
DECODE = {"output_len": 128}


def plan() -> list[Stage]:
    return [
        Stage("correctness", 240, [
            Run("kernels", 140, pytest_run("-x", "tests/test_kernels.py", "tests/test_mla.py", "tests/test_fp8.py",
                                          "-m", "not slow")),
            # Tiny random models of every architecture (DeepSeek-V3's latent attention included) against the
            # torch backend and HF transformers, and captured graphs of every size against eager steps.
            Run("models-and-graphs", 45, pytest_run("-x", "tests/test_triton_model.py", "tests/test_deepseek.py",
                                                     "tests/test_models.py")),
        ]),
        Stage("headline", 180, [
            Run("llama-8b", 30, bench_runs(llama("8b"), "8b", [
                ("64x2k", PREFILL, 64, "2048"), ("8x8k", PREFILL, 8, "8192"),
                ("decode", DECODE, 64, "512")])),
            Run("llama-8b-eager-decode", 15, bench_runs(llama("8b"), "8b", [("decode-graphs-off", DECODE, 64, "512")],
                                                         cuda_graphs="off")),
            Run("llama-8b-no-overlap", 10, bench_runs(llama("8b"), "8b", [("decode-overlap-off", DECODE, 64, "512")],
                                                       overlap_schedule="off")),
            Run("deepseek-v3-moe", 20, bench_runs(deepseek("v3-small"), "deepseek-v3-small",
                                                  [("32x2k", PREFILL, 32, "2048")])),
            Run("deepseek-v3-moe-fp8", 20, bench_runs(deepseek("v3-small"), "deepseek-v3-small-fp8",
                                                      [("32x2k", PREFILL, 32, "2048")], fp8=True)),
        ]),
        Stage("extras", 60, [
            Run("llama-8b-fp8", 12, bench_runs(llama("8b"), "8b-fp8", [("64x2k", PREFILL, 64, "2048")], fp8=True)),
            Run("llama-1b", 12, bench_runs(llama("1b"), "1b", [("64x2k", PREFILL, 64, "2048"),
                                                               ("decode", DECODE, 64, "512")])),
        ]),
    ]


def print_plan(stages: list[Stage]) -> int:
    total = 0
    for stage in stages:
        total += stage.limit_s
        print(f"stage {stage.name}: expected {stage.expected_s} s, stopped at {stage.limit_s} s")
        for r in stage.runs:
            print(f"  {r.name}: ~{r.expected_s} s")
    print(f"all stages: at most {total} s of a {WINDOW_S} s window")
    return total


def release_device_memory() -> None:
    import gc

    import torch

    gc.collect()  # an exception's traceback holds the failed run's frames, its engine among them
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_stage(stage: Stage, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    print(f"stage {stage.name}: expected {stage.expected_s} s (limit {stage.limit_s} s)", flush=True)
    for r in stage.runs:
        print(f"{r.name}: expected ~{r.expected_s} s", flush=True)
        start = time.perf_counter()
        try:
            r.action(out)
            status = "ok"
        except Exception as exc:  # noqa: BLE001 - one failed run must not cost the stage's other figures
            status = f"failed: {type(exc).__name__}: {exc}"
        took = time.perf_counter() - start
        release_device_memory()  # a run that failed half-way must not leave its KV cache to the next one
        with (out / "runs.jsonl").open("a") as f:
            f.write(json.dumps({"stage": stage.name, "run": r.name, "expected_s": r.expected_s,
                                "took_s": round(took, 1), "status": status}) + "\n")
        print(f"{r.name}: {status} in {took:.0f} s", flush=True)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--stage", help="run this stage")
    ap.add_argument("--limit", action="store_true", help="print the stage's time limit in seconds and exit")
    ap.add_argument("--out", default="/tmp/gpu_check")
    args = ap.parse_args(argv)
    stages = {s.name: s for s in plan()}
    if args.dry_run:
        sys.exit(0 if print_plan(list(stages.values())) <= WINDOW_S else 1)
    if args.stage not in stages:
        sys.exit(f"--stage must be one of {', '.join(stages)}")
    if args.limit:
        print(stages[args.stage].limit_s)
        return
    run_stage(stages[args.stage], Path(args.out))


if __name__ == "__main__":
    main(sys.argv[1:])

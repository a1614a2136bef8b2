"""Several devices on CPU (gloo, 2 worker processes): tensor, data and expert parallel against one process,
worker failures, and a tensor-parallel job from the command line."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import yaml
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.engine import LLM, SamplingParams
from batchgen.engine.executor import StepInput
from batchgen.engine.executor.multiproc import WorkerError
from batchgen.engine.sampling.structured import structured_available
from batchgen.pipeline.runner import run_job
from batchgen.pipeline.spec import spec_from_dict
from tests.engine_helpers import TEXT
from tests.job_helpers import check_output, records, spec_dict, write_jsonl

BUDGET = 48  # tokens per step: long prompts prefill in chunks, next to other sequences' decodes
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True)
SAMPLED = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True, logprobs=True)


def make_llm(path: Path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=BUDGET, kv_cache_memory=1 << 22,
               distributed_timeout_s=60, **kw)


def workload(llm: LLM) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts sharing a prefix (prefix-cache hits), some longer than a step's budget (chunked prefill);
    greedy and seeded sampling, and a grammar's bitmask when xgrammar is installed."""
    tok = llm.tokenizer
    shared = tok.encode("Instruction: summarize carefully. " * 4)
    prompts = [shared + tok.encode(f" doc {i}: " + "fox " * (2 * i)) for i in range(4)]
    prompts += [tok.encode(f"{i}: " + TEXT * r) for i, r in enumerate((1, 2))]
    assert max(map(len, prompts)) > 2 * BUDGET
    params = [GREEDY, SAMPLED] * 3
    if structured_available():
        prompts.append(tok.encode("Answer: "))
        params.append(SamplingParams(max_tokens=8, temperature=0, regex="(fox|dog)+", logprobs=True))
    return prompts, params


def assert_same_outputs(reference: list, got: list) -> None:
    assert len(got) == len(reference)
    for ref, out in zip(reference, got):
        assert out.token_ids == ref.token_ids
        assert len(out.logprobs) == len(ref.logprobs) > 0
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref.logprobs)) <= 1e-4


def assert_gone(pids: list[int]) -> None:
    """Every worker has exited and been reaped: no process is left behind."""
    assert pids and not [p for p in pids if psutil.pid_exists(p)]


def spawned_children() -> list[psutil.Process]:
    """Worker processes this test process started that are still running."""
    alive = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "spawn_main" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def shared_memory() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("arch,expert_parallel", [
    ("llama", False), ("qwen2-moe", False), ("gemma2", False),
    pytest.param("qwen3-moe", True, marks=pytest.mark.slow)])
def test_tensor_parallel_equals_one_device(tiny_model_factory, arch, expert_parallel):
    """Experts split by their features over the ranks, or (expert parallel) whole experts on each rank;
    Gemma 2's soft caps, windows and GeGLU on split heads and a split vocabulary."""
    path = tiny_model_factory(arch)
    single = make_llm(path)
    prompts, params = workload(single)
    expected = single.generate(prompts, params)
    shm = shared_memory()
    llm = make_llm(path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    pids = llm.engine.executor.pids
    outs = llm.generate(prompts, params)
    assert_same_outputs(expected, outs)
    m = llm.engine.metrics
    assert m.prefix_cache_hits > 0 and m.comm_time_s > 0
    # Half the KV heads per rank: the same memory budget holds twice the blocks (one more where the budget
    # leaves a remainder of at least half a block).
    assert llm.engine.executor.num_blocks // 2 == single.engine.executor.num_blocks
    assert llm.profile() == single.profile()
    if arch == "llama":  # a worker that raises fails the step with its rank and error, and everything stops
        bad = StepInput(input_ids=[1], query_lens=[1], context_lens=[1], block_tables=[[10 ** 6]])
        with pytest.raises(WorkerError, match=r"worker rank [01] failed while running a step: \w+Error"):
            llm.engine.executor.execute([bad])
        with pytest.raises(WorkerError, match="stopped after an earlier failure"):
            llm.generate(prompts[:1], GREEDY)
    llm.close()
    assert_gone(pids)
    assert shared_memory() <= shm


@pytest.mark.timeout(240)
@pytest.mark.parametrize("arch,tp,dp", [("deepseek-v2", 2, 1), ("deepseek-v3", 1, 2)])
def test_latent_attention_model_split_over_devices_equals_one_device(tiny_model_factory, arch, tp, dp):
    """DeepSeek-V2 with its heads split (the latent rows cached whole on each rank) and each expert's
    features split; DeepSeek-V3 over two replicas with its experts split between them (the all-to-all
    exchange: a token goes only to the replicas that hold its experts)."""
    path = tiny_model_factory(arch)
    single = make_llm(path)
    prompts, params = workload(single)
    expected = single.generate(prompts, params)
    with make_llm(path, tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=dp > 1) as llm:
        pids = llm.engine.executor.pids
        assert_same_outputs(expected, llm.generate(prompts, params))
        assert llm.engine.metrics.comm_time_s > 0
        assert llm.profile() == single.profile()
        if tp > 1:  # every rank caches every token's whole latent row: the same blocks as one device
            assert llm.engine.executor.num_blocks == single.engine.executor.num_blocks
    assert_gone(pids)


@pytest.mark.timeout(240)
def test_data_parallel_dense_splits_the_work_and_a_killed_worker_fails_fast(tiny_model):
    single = make_llm(tiny_model)
    prompts, params = workload(single)
    expected = single.generate(prompts, params)
    llm = make_llm(tiny_model, data_parallel_size=2)
    pids = llm.engine.executor.pids
    assert_same_outputs(expected, llm.generate(prompts, params))
    replica_tokens = llm.engine.metrics.replica_tokens
    assert len(replica_tokens) == 2 and min(replica_tokens) > 0
    assert sum(replica_tokens) == llm.engine.metrics.tokens_computed
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker rank 1 died \(killed by SIGKILL"):
        llm.generate(prompts, params)
    assert time.monotonic() - start < 30
    assert_gone(pids)


@pytest.mark.timeout(240)
def test_data_parallel_with_expert_parallel_equals_one_device(tiny_model_factory):
    path = tiny_model_factory("qwen2-moe")
    single = make_llm(path)
    prompts, params = workload(single)
    expected = single.generate(prompts, params)
    # One long request and short ones: a replica runs out of work early and keeps serving the exchange.
    prompts.append(single.tokenizer.encode("long " + TEXT * 3))
    params.append(SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=True))
    expected.append(single.generate(prompts[-1:], params[-1])[0])
    with make_llm(path, data_parallel_size=2, enable_expert_parallel=True) as llm:
        pids = llm.engine.executor.pids
        idle = []
        llm.engine.step_listeners.append(lambda r: idle.append(0 in r.replica_tokens))
        assert_same_outputs(expected, llm.generate(prompts, params))
        assert any(idle), "some step should have run with one replica idle"
        assert min(llm.engine.metrics.replica_tokens) > 0
    assert_gone(pids)


@pytest.mark.timeout(300)
def test_tensor_parallel_job_resumes_after_a_worker_dies(tiny_model, tmp_path):
    inputs = write_jsonl(tmp_path / "in.jsonl", records(8))
    data = spec_dict(tiny_model, inputs, tmp_path / "out", engine={"max_num_seqs": 2, "max_num_batched_tokens": 256},
                     output={"rows_per_part": 2})
    data["engine"]["tensor_parallel_size"] = 2
    spec = spec_from_dict(data)
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", max_num_batched_tokens=256, max_num_seqs=2,
              tensor_parallel_size=2, distributed_timeout_s=60)
    pids = llm.engine.executor.pids
    steps = []

    def kill_after_some_rows(record) -> None:
        steps.append(record)
        if len(steps) == 16:
            os.kill(pids[1], signal.SIGKILL)

    llm.engine.step_listeners.append(kill_after_some_rows)
    with pytest.raises(WorkerError, match="worker rank 1 died"):
        run_job(spec, llm=llm, quiet=True)
    assert_gone(pids)
    committed = [json.loads(p.read_text()) for p in (tmp_path / "out" / "_manifest").glob("*.json")]
    assert committed, "the rows finished before the failure are committed"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(main, ["run", str(tmp_path / "job.yaml"), "--quiet"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert not spawned_children(), "the job stops the workers it started"
    stats = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    rows = check_output(tmp_path / "out", stats, [f"r{i}" for i in range(8)])
    assert stats["ok_rows"] == 8 and stats["resumed"]
    reference = spec_from_dict({**data, "engine": {**data["engine"], "tensor_parallel_size": 1},
                                "output": {**data["output"], "path": str(tmp_path / "ref")}})
    ref_stats = run_job(reference, quiet=True)
    expected = check_output(tmp_path / "ref", ref_stats, [f"r{i}" for i in range(8)])
    assert {r["id"]: r["output"] for r in rows} == {r["id"]: r["output"] for r in expected}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_with_data_and_expert_parallel_prints_communication(tiny_model_factory, tmp_path):
    path = tiny_model_factory("qwen3-moe")
    out = tmp_path / "bench.json"
    args = ["bench", "--model", str(path), "--num-prompts", "6", "--input-len", "40", "--output-len", "4",
            "--dtype", "float32", "--device", "cpu", "--data-parallel-size", "2", "--enable-expert-parallel",
            "--output-json", str(out)]
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert "comm_ms_per_step" in res.output and "compute_ms_per_step" in res.output
    assert r["data_parallel_size"] == 2 and r["enable_expert_parallel"] and r["output_tokens"] == 6 * 4
    assert r["comm_ms_per_step"] > 0 and r["compute_ms_per_step"] > 0 and r["steps"] > 0
    assert len(r["replica_tokens"]) == 2 and min(r["replica_tokens"]) > 0
    single = LLM(str(path), dtype="float32", device="cpu").profile()
    assert r["active_params"] == single.active_params and r["total_params"] == single.total_params

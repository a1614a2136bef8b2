"""Telemetry: bounded time buckets, exclusive stage times, engine step records against the real engine,
the step estimate against the real scheduler, row counts and the progress bar's total."""
from __future__ import annotations

import gzip
import json
import random
import threading

import numpy as np
import pytest

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.core.metrics import EngineMetrics, StepRecord
from batchgen.io import count_rows, read_rows
from batchgen.pipeline.runner import run_job
from batchgen.pipeline.steps import estimate_steps
from batchgen.pipeline.telemetry import (
    BUCKET_FIELDS, MAX_BUCKETS, TELEMETRY_MAX_BYTES, StageClock, Telemetry, TimeBuckets,
)
from batchgen.pipeline.rows import ResultRow, error_row
from tests.engine_helpers import TEXT
from tests.job_helpers import make_spec, records, tiny_llm, write_jsonl, write_parquet  # noqa: F401


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_telemetry_stays_bounded_on_a_long_job():
    """A 10-hour job of 300,000 engine steps and a million rows: at most MAX_BUCKETS buckets, a JSON
    file under TELEMETRY_MAX_BYTES, and every counter's total kept exactly through the merges."""
    clock = FakeClock()
    tel = Telemetry(token_budget=8192, start=0.0, clock=clock)
    rng = random.Random(0)
    steps, rows, hours = 300_000, 1_000_000, 10
    expected = dict.fromkeys(("prefill", "decode", "generated"), 0)
    ok_row, bad_row = ResultRow("a", {}, "text", 10, 2, "stop"), error_row("b", {}, "x", "y")
    for i in range(steps):
        prefill, decode = rng.randrange(0, 8000), rng.randrange(1, 256)
        expected["prefill"] += prefill
        expected["decode"] += decode
        expected["generated"] += decode
        tel.on_step(StepRecord(start_s=i * hours * 3600 / steps, duration_s=0.1, num_seqs=decode,
                               prefill_tokens=prefill, decode_tokens=decode, sampled_tokens=decode,
                               token_budget=8192))
    for i in range(rows):
        clock.now = i * hours * 3600 / rows
        tel.on_row(bad_row if i % 100 == 0 else ok_row)
    doc = json.dumps(tel.to_dict()).encode()
    columns = tel.to_dict()["time_buckets"]["columns"]
    assert set(columns) == set(BUCKET_FIELDS)
    assert MAX_BUCKETS // 2 <= len(columns["steps"]) <= MAX_BUCKETS
    assert len(doc) < TELEMETRY_MAX_BYTES, len(doc)
    assert sum(columns["steps"]) == steps and sum(columns["rows"]) == rows
    assert sum(columns["error_rows"]) == rows // 100
    assert sum(columns["prefill_tokens"]) == expected["prefill"] == tel.metrics.prompt_tokens_computed
    assert sum(columns["generated_tokens"]) == expected["generated"] == tel.metrics.tokens_generated
    print(f"telemetry.json for {steps} steps over {hours} h: {len(doc) / 1024:.1f} KiB")


@pytest.mark.parametrize("step_s", [47.6, 3.0, 0.05])
def test_throughput_chart_shows_the_true_rate_of_long_steps(step_s):
    """Prefill at 344 tok/s in back-to-back steps, long (a whole token budget per step, as on a slow CPU) or
    short: the chart's rate in every bucket the steps cover whole is 344, never a spike where a step ends."""
    from batchgen.report.charts import throughput_series

    rate, budget = 344.0, 16384
    tel = Telemetry(token_budget=budget, start=0.0, clock=FakeClock())
    tokens = round(rate * step_s)
    steps = int(600 / step_s)
    for i in range(steps):
        tel.on_step(StepRecord(start_s=i * step_s, duration_s=step_s, num_seqs=4, prefill_tokens=tokens,
                               decode_tokens=0, sampled_tokens=4, token_budget=budget))
    doc = json.loads(json.dumps(tel.to_dict()))
    t, rates, _ = throughput_series(doc)
    assert sum(doc["time_buckets"]["columns"]["prefill_tokens"]) == steps * tokens  # exact totals
    assert sum(doc["time_buckets"]["columns"]["steps"]) == steps
    inside = rates["prompt"][: np.flatnonzero(rates["prompt"])[-1]]  # all but the bucket where the job ends
    true = tokens / step_s
    assert len(inside) > 10 and abs(inside - true).max() <= 0.01 * true, (inside.min(), inside.max())
    assert rates["prompt"].max() <= 1.01 * true


def test_time_buckets_merge_neighbours():
    b = TimeBuckets(["n"], max_buckets=4, width_s=1.0)
    for t in (0.5, 1.5, 2.5, 3.5):
        b.add(t, {"n": 1})
    assert b.columns["n"] == [1, 1, 1, 1] and b.width_s == 1.0
    b.add(4.2, {"n": 10})  # past the last bucket: buckets become 2 s wide
    assert b.width_s == 2.0 and b.columns["n"] == [2, 2, 10]
    b.add(17.0, {"n": 1})  # 8 s wide: [0, 8) and [16, 24)
    assert b.width_s == 8.0 and b.columns["n"] == [14, 0, 1]


def test_time_buckets_from_several_processes_add_up():
    """Ray replicas each keep their own buckets from the job's start; the driver adds them up."""
    rng = random.Random(3)
    events = [(rng.uniform(0, 90), rng.randint(1, 5)) for _ in range(400)]
    whole = TimeBuckets(["n"], max_buckets=8)
    shares = [TimeBuckets(["n"], max_buckets=8) for _ in range(3)]
    for i, (t, n) in enumerate(events):
        whole.add(t, {"n": n})
        shares[1 + i % 2 if t > 30 else 0].add(t, {"n": n})  # one share sees only the first 30 s: finer buckets
    assert len({s.width_s for s in shares}) > 1
    merged = TimeBuckets(["n"], max_buckets=8)
    for share in shares:
        merged.merge(TimeBuckets.from_dict(share.to_dict()))
    assert merged.width_s == whole.width_s and merged.columns == whole.columns

    tel, other = Telemetry(512, clock=FakeClock()), Telemetry(512, clock=FakeClock())
    record = StepRecord(start_s=0.0, duration_s=0.5, num_seqs=2, prefill_tokens=30, decode_tokens=0,
                        sampled_tokens=2, token_budget=512)
    tel.on_step(record)
    other.on_step(record)
    other.stages.add("engine", 2.0)
    tel.absorb(json.loads(json.dumps(other.state())))  # as it crosses processes
    assert tel.metrics.prompt_tokens_computed == 60 and tel.metrics.prefill_steps == 2
    assert tel.stages.seconds["engine"] == 2.0 and sum(tel.buckets.columns["steps"]) == 2


def test_stage_clock_counts_exclusive_time_per_thread():
    clock = FakeClock()
    stages = StageClock(clock)

    def slow_items():
        for i in range(3):
            clock.now += 2.0  # producing an item takes 2 s of "read"
            yield i

    with stages.measure("engine"):
        clock.now += 1.0
        for _ in stages.timed(slow_items(), "read"):
            with stages.measure("write"):
                clock.now += 0.5
        clock.now += 1.0
    assert stages.seconds["read"] == 6.0
    assert stages.seconds["write"] == 1.5
    assert stages.seconds["engine"] == 2.0  # 9.5 s in all, less the nested stages

    other = threading.Thread(target=lambda: stages.add("render_tokenize", 3.0))
    other.start()
    other.join()
    assert stages.seconds["render_tokenize"] == 3.0 and stages.seconds["engine"] == 2.0


def test_step_records_add_up_to_the_requests(tiny_model):
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", max_num_batched_tokens=64, max_num_seqs=4,
              kv_cache_memory=64 << 20)
    records: list[StepRecord] = []
    llm.engine.step_listeners.append(records.append)
    shared = llm.tokenizer.encode(TEXT)[:40]
    prompts = [shared + llm.tokenizer.encode(f" item {i} " + "fox " * i) for i in range(7)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(outs) == len(prompts)
    total = EngineMetrics()
    for r in records:
        total.add_step(r)
        assert 0 < r.num_tokens <= r.token_budget == 64 and r.num_seqs <= 4
    assert total == llm.engine.metrics
    assert total.prompt_tokens_computed == sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in outs)
    assert total.tokens_generated == sum(len(o.token_ids) for o in outs) == 35
    assert total.prefix_cache_queries == sum(len(p) for p in prompts)
    assert total.prefix_cache_hits == sum(o.num_cached_tokens for o in outs) > 0
    assert total.tokens_computed == total.prompt_tokens_computed + 35 - len(outs)  # the last token is not fed back


@pytest.mark.parametrize("budget,seqs,max_tokens,lengths", [
    (64, 4, 5, (3, 100)), (512, 8, 6, (10, 60)), (128, 8, 1, (5, 300)), (32, 3, 9, (1, 90)),
])
def test_step_estimate_equals_the_engine(tiny_model, budget, seqs, max_tokens, lengths):
    """Without EOS, preemption or prefix hits, the estimate is exactly what the scheduler does."""
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", max_num_batched_tokens=budget, max_num_seqs=seqs,
              kv_cache_memory=64 << 20, enable_prefix_caching=False)
    rng = random.Random(budget)
    prompts = [[rng.randrange(5, 300) for _ in range(rng.randint(*lengths))] for _ in range(17)]
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    m, est = llm.engine.metrics, estimate_steps(map(len, prompts), max_tokens, budget, seqs)
    assert m.preemptions == 0
    assert (est.prefill_steps, est.decode_steps) == (m.prefill_steps, m.decode_steps)
    assert (est.prompt_tokens, est.decode_step_tokens) == (m.prompt_tokens_computed, m.decode_tokens)


def test_count_rows_equals_rows_read(tmp_path):
    lines = ['{"id": 1}', "", "   ", '{"id": 2}', "not json", "\u00a0\u3000", '{"id": 3}']
    plain = tmp_path / "a.jsonl"
    plain.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode())  # a BOM, no final newline
    packed = tmp_path / "b.jsonl.gz"
    packed.write_bytes(gzip.compress(("\n".join(lines) + "\n\n").encode()))
    parquet = write_parquet(tmp_path / "c.parquet", records(11))
    files = [str(plain), str(packed), str(parquet)]
    assert count_rows(files) == len(list(read_rows(files))) == 4 + 4 + 11
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(InterruptedError):
        count_rows([str(plain)], cancel=cancel)


def test_job_writes_telemetry_matching_its_stats(tmp_path, tiny_model, tiny_llm):
    recs = records(12)
    recs[4]["text"] = None
    inp = write_jsonl(tmp_path / "in.jsonl", recs)
    out = tmp_path / "out"
    stats = run_job(make_spec(tiny_model, inp, out), llm=tiny_llm, quiet=True)
    tel = json.loads((out / "telemetry.json").read_text())
    columns, engine = tel["time_buckets"]["columns"], stats["engine"]
    assert sum(columns["rows"]) == stats["rows"] == 12 and sum(columns["error_rows"]) == 1
    assert sum(columns["steps"]) == engine["steps"] == engine["prefill_steps"] + engine["decode_steps"] > 0
    assert sum(columns["generated_tokens"]) == engine["tokens_generated"] == stats["completion_tokens"]
    assert sum(columns["prefill_tokens"]) == engine["prompt_tokens_computed"] \
        == stats["prompt_tokens"] - stats["cached_prompt_tokens"]
    assert engine["prefix_cache_hits"] == stats["cached_prompt_tokens"]
    assert 0 < engine["token_budget_utilization"] <= 1 and engine["token_budget"] == 512
    assert engine["padding_share"] == 0 and engine["mfu"] is None and engine["achieved_tflops"] > 0
    assert set(tel["stages_s"]) == {"startup", "read", "render_tokenize", "queue_wait", "engine", "write"}
    assert all(v >= 0 for v in tel["stages_s"].values()) and tel["stages_s"]["engine"] > 0
    assert tel["stages_s"]["engine"] <= stats["generate_s"] + 1e-3  # measured inside the generation
    assert not tiny_llm.engine.step_listeners  # the job's listener is gone


def test_replicas_speculative_figures_reach_the_drivers_totals():
    """A Ray replica's step records carry its speculation counts, not the method or the cost model's fit:
    those come from its engine, cross with the telemetry, and name the merged per-method figures."""
    from batchgen.engine.flops import engine_figures

    driver = Telemetry(512, clock=FakeClock())
    for drafted, accepted in ((8, 6), (4, 1)):
        replica = Telemetry(512, clock=FakeClock())
        replica.on_step(StepRecord(start_s=0.0, duration_s=0.1, num_seqs=2, prefill_tokens=0, decode_tokens=2 + drafted,
                                   sampled_tokens=2 + accepted, token_budget=512, spec_draft_rows=2,
                                   spec_draft_tokens=drafted, spec_accepted_tokens=accepted))
        engine = EngineMetrics()
        engine.spec_method, engine.spec_policy = "ngram", {"cost_fitted": True}
        replica.metrics.adopt_states(engine.states())
        driver.absorb(json.loads(json.dumps(replica.state())))
    figures = engine_figures(driver.metrics, 1.0, 512)["speculative"]
    assert list(figures) == ["ngram"]
    assert figures["ngram"]["proposed_tokens"] == 12 and figures["ngram"]["accepted_tokens"] == 7
    assert figures["ngram"]["acceptance_rate"] == round(7 / 12, 4) and figures["ngram"]["cost_fitted"] is True

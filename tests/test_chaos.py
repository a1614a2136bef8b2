"""Chaos: `batchgen run` killed with SIGKILL at seeded random moments, S3 faults while parts upload and while
the model downloads, and two runs started on one output. After every fault a rerun ends with every input
row exactly once, the same rows as an uninterrupted run, and _SUCCESS.

Each kill test prints one line to quote: ``chaos <store>: K/K kills survived, 0 rows lost, 0 rows
duplicated``; ``CHAOS_ROUNDS=n`` in the environment runs n rounds of 10 seeded kills instead of one. The
killed processes are forked by tests/chaos_zygote.py, which imports batchgen once.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from batchgen.io import read_output
from batchgen.io.manifest import SUCCESS, load_entries
from batchgen.io.paths import filesystem
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.runner import run_job
from batchgen.pipeline.spec import spec_from_dict
from tests.chaos_zygote import Zygote
from tests.job_helpers import records, spec_dict, tiny_llm, write_jsonl  # noqa: F401  (fixture)
from tests.s3_server import BUCKET, faulty_s3, moto_server, s3, s3_proxy  # noqa: F401  (fixtures)

ROWS_A, ROWS_B, ROWS_PER_PART = 24, 16, 4
TOTAL = ROWS_A + ROWS_B
ERROR_ROWS = 2
PARTS = -(-TOTAL // ROWS_PER_PART)
KILLS = 10
ROUNDS = int(os.environ.get("CHAOS_ROUNDS", "1"))
# (crash point, how many times the job reaches it): the count of each kill is drawn from 1..n
PHASES = {
    "read_row": TOTAL,                 # reading
    "generate": TOTAL - ERROR_ROWS,    # generating
    "part.before": PARTS,              # a part is about to be uploaded
    "store.temp": 2 * PARTS + 2,       # local disk: a part, entry or stats file is half way to its name
    "part.after": PARTS,               # a part is uploaded, its manifest entry is not
    "manifest.after": PARTS,           # the manifest entry is written
    "stats.before": 1,                 # every part is committed, stats.json is not written
    "stats.after": 1,                  # stats.json is written, _SUCCESS is not
}


def chaos_inputs() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    a, b = records(ROWS_A, "a"), records(ROWS_B, "b")
    a[5]["text"] = b[7]["text"] = None  # error rows are committed exactly once too
    return a, b


def chaos_job(model: Path, inputs: list[str], out: str, **extra: Any) -> dict[str, Any]:
    return spec_dict(model, inputs, out, output={"rows_per_part": ROWS_PER_PART}, sampling={"max_tokens": 4},
                     batching={"sort_window": 16},
                     engine={"max_num_batched_tokens": 512, "max_num_seqs": 8, "kv_cache_memory": 64 << 20}, **extra)


def by_id(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in rows}


@pytest.fixture(scope="module")
def reference(tiny_model, tiny_llm, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """The rows of an uninterrupted run."""
    folder = tmp_path_factory.mktemp("reference")
    a, b = chaos_inputs()
    inputs = [str(write_jsonl(folder / "a.jsonl", a)), str(write_jsonl(folder / "b.jsonl", b))]
    run_job(spec_from_dict(chaos_job(tiny_model, inputs, str(folder / "out"))), llm=tiny_llm, quiet=True)
    rows = read_output(str(folder / "out"))
    assert len(rows) == TOTAL and sum(r["error"] is not None for r in rows) == ERROR_ROWS
    return by_id(rows)


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    try:
        yield z
    finally:
        z.close()


@dataclass
class Kill:
    point: str | None  # None: a plain time-based kill
    count: int = 0
    delay_s: float = 0.0

    def __str__(self) -> str:
        return f"{self.point}:{self.count}" if self.point else f"timed+{self.delay_s * 1000:.0f}ms"


def schedule(seed: int, points: list[str]) -> list[Kill]:
    """One kill per crash point, at a random count, then time-based kills, in a seeded random order."""
    rng = random.Random(seed)
    plan = [Kill(p, rng.randint(1, PHASES[p])) for p in points]
    plan += [Kill(None, delay_s=rng.uniform(0.0, 0.1)) for _ in range(KILLS - len(plan))]
    rng.shuffle(plan)
    return plan


@dataclass
class Store:
    """An output location on local disk or S3, read the way a rerun would see it."""

    inputs: list[str]
    base: str
    options: dict[str, Any] | None

    def committed_ids(self, out: str) -> list[str]:
        fs, root = filesystem(out, self.options)
        entries, _ = load_entries(fs, root.rstrip("/"))
        return [i for n in sorted(entries) for i in entries[n].row_ids]

    def complete(self, out: str) -> bool:
        fs, root = filesystem(out, self.options)
        fs.invalidate_cache()
        return fs.exists(f"{root.rstrip('/')}/{SUCCESS}")


def wait_for_a_part(store: Store, out: str, zygote: Zygote, pid: int, log: Path) -> None:
    deadline = time.monotonic() + 120
    while not store.committed_ids(out):
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)


def run_until_killed(store: Store, name: str, kill: Kill, tiny_model: Path, zygote, tmp_path: Path) -> tuple[str, Path]:
    """Starts the job and kills it as ``kill`` says; returns its output location and job file. A timed
    kill that arrives after a fast machine already finished the job (exited, or wrote _SUCCESS and was
    killed on its way out) is retried sooner, on a fresh output."""
    for attempt in range(6):
        out = f"{store.base}/{name}-{attempt}"
        job = tmp_path / f"{name}-{attempt}.yaml"
        job.write_text(yaml.safe_dump(chaos_job(tiny_model, store.inputs, out, storage_options=store.options or {})))
        log = tmp_path / f"{name}-{attempt}.log"
        env = {"BATCHGEN_CRASH_AT": str(kill)} if kill.point else {}
        pid = zygote.start(["run", str(job), "--quiet"], str(log), env)
        if kill.point is None:
            wait_for_a_part(store, out, zygote, pid, log)
            time.sleep(kill.delay_s / 2**attempt)
            os.kill(pid, signal.SIGKILL)
        status = zygote.wait(pid)
        if kill.point is None and status in (0, -signal.SIGKILL) and store.complete(out):
            continue
        assert status == -signal.SIGKILL, f"{kill}: exit {status}\n{log.read_text()}"
        return out, job
    raise AssertionError(f"{kill}: the job always finished before the kill")


def kill_and_rerun(store: Store, name: str, seed: int, points: list[str], tiny_model: Path, tiny_llm, zygote,
                   reference, tmp_path: Path, capsys) -> None:
    plan = [k for r in range(ROUNDS) for k in schedule(seed + 1000 * r, points)]
    assert {k.point for k in plan} >= set(points) and len(plan) == KILLS * ROUNDS
    survived, lost, duplicated = 0, 0, 0
    for i, kill in enumerate(plan):
        out, job = run_until_killed(store, f"kill-{i}", kill, tiny_model, zygote, tmp_path)
        first = store.committed_ids(out)
        assert len(first) == len(set(first)) and set(first) <= set(reference), kill
        assert not store.complete(out), kill

        stats = run_job(spec_from_dict(yaml.safe_load(job.read_text())), llm=tiny_llm, quiet=True)
        rows = read_output(out, store.options)
        ids = Counter(r["id"] for r in rows)
        lost += len(set(reference) - set(ids))
        duplicated += sum(n - 1 for n in ids.values())
        ok = (by_id(rows) == reference and len(rows) == TOTAL and store.complete(out)
              and stats["rows"] == TOTAL and stats["this_run"]["rows"] == TOTAL - len(first))
        survived += ok
        assert ok, f"{kill}: {len(rows)} rows, {len(ids)} ids, committed before the rerun: {len(first)}"
    with capsys.disabled():
        print(f"\nchaos {name}: {survived}/{len(plan)} kills survived, {lost} rows lost, {duplicated} rows "
              f"duplicated\n  kills at: {', '.join(map(str, plan))}")
    assert (survived, lost, duplicated) == (len(plan), 0, 0)


@pytest.mark.timeout(600)
def test_kill_9_local(tmp_path, tiny_model, tiny_llm, zygote, reference, capsys):
    a, b = chaos_inputs()
    inputs = [str(write_jsonl(tmp_path / "in" / "a.jsonl", a)), str(write_jsonl(tmp_path / "in" / "b.jsonl", b))]
    store = Store(inputs, str(tmp_path / "out"), None)
    kill_and_rerun(store, "local", 13, list(PHASES), tiny_model, tiny_llm, zygote, reference, tmp_path, capsys)


@pytest.mark.timeout(600)
def test_kill_9_s3(s3, tmp_path, tiny_model, tiny_llm, zygote, reference, capsys):  # noqa: F811
    a, b = chaos_inputs()
    client = s3.client()
    for name, recs in (("a.jsonl", a), ("b.jsonl", b)):
        client.put_object(Bucket=BUCKET, Key=f"in/{name}", Body="".join(json.dumps(r) + "\n" for r in recs))
    store = Store([s3.url("in/a.jsonl"), s3.url("in/b.jsonl")], s3.url("out"), s3.storage_options)
    points = [p for p in PHASES if p != "store.temp"]  # S3 has no temp files: one PUT per object
    kill_and_rerun(store, "s3", 31, points, tiny_model, tiny_llm, zygote, reference, tmp_path, capsys)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["local", "s3"])
def test_two_runs_on_one_output_exactly_one_proceeds(where, tmp_path, tiny_model, tiny_llm, zygote, reference,
                                                    request):
    a, b = chaos_inputs()
    if where == "local":
        inputs = [str(write_jsonl(tmp_path / "a.jsonl", a)), str(write_jsonl(tmp_path / "b.jsonl", b))]
        out, opts = str(tmp_path / "out"), None
    else:
        env = request.getfixturevalue("s3")
        for name, recs in (("a.jsonl", a), ("b.jsonl", b)):
            env.client().put_object(Bucket=BUCKET, Key=f"in/{name}", Body="".join(json.dumps(r) + "\n" for r in recs))
        inputs, out, opts = [env.url("in/a.jsonl"), env.url("in/b.jsonl")], env.url("out"), env.storage_options
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(chaos_job(tiny_model, inputs, out, storage_options=opts or {})))
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    pids = [zygote.start(["run", str(job), "--quiet"], str(log)) for log in logs]
    statuses = [zygote.wait(pid) for pid in pids]
    assert sorted(statuses) == [0, 1], [log.read_text() for log in logs]
    winner, loser = (0, 1) if statuses[0] == 0 else (1, 0)
    refused = logs[loser].read_text()
    assert f"is being written by another run: host {socket.gethostname()} pid {pids[winner]} since" in refused
    assert refused.count("\n") == 1 and "Traceback" not in refused
    assert by_id(read_output(out, opts)) == reference


# ---- S3 faults ------------------------------------------------------------------------------------------

FAULTS = ["reset", "reset_mid_response", "slowdown", "error500"]


def faulty_job(env, tiny_model, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    """A job on S3 through the fault proxy, with the default storage options: batchgen's retries are the only ones."""
    a, b = chaos_inputs()
    client = env.client()
    for name, recs in (("a.jsonl", a), ("b.jsonl", b)):
        client.put_object(Bucket=BUCKET, Key=f"in/{name}", Body="".join(json.dumps(r) + "\n" for r in recs))
    return chaos_job(tiny_model, [env.url("in/a.jsonl"), env.url("in/b.jsonl")], env.url("out"),
                     storage_options=env.storage_options, **extra)


@pytest.fixture
def no_backoff(monkeypatch):
    monkeypatch.setattr("batchgen.io.retry._sleep", lambda s: None)


@pytest.mark.parametrize("kind", FAULTS)
def test_part_upload_faults_are_retried(kind, faulty_s3, tiny_model, tiny_llm, reference, tmp_path, no_backoff):  # noqa: F811
    data = faulty_job(faulty_s3, tiny_model, tmp_path)
    faulty_s3.proxy.inject(kind, 2, "PUT", "part-")
    run_job(spec_from_dict(data), llm=tiny_llm, quiet=True)
    assert faulty_s3.proxy.injected[kind] == 2
    assert by_id(read_output(data["output"]["path"], data["storage_options"])) == reference


def test_part_upload_outage_fails_clearly_and_a_retry_completes(faulty_s3, tiny_model, tiny_llm, reference,  # noqa: F811
                                                                tmp_path, no_backoff):
    data = faulty_job(faulty_s3, tiny_model, tmp_path)
    spec, out = spec_from_dict(data), data["output"]["path"]
    faulty_s3.proxy.inject("error500", 10**6, "PUT", "part-00002")
    with pytest.raises(JobError, match=r"cannot write part-00002\.parquet in s3://batchgen-bucket/out: OSError"):
        run_job(spec, quiet=True)  # its own engine: the failed job leaves requests in the engine it used
    store = Store([], "", data["storage_options"])
    assert len(store.committed_ids(out)) == 2 * ROWS_PER_PART and not store.complete(out)
    faulty_s3.proxy.clear()  # the outage ends; the same command resumes
    stats = run_job(spec, llm=tiny_llm, quiet=True)
    assert stats["this_run"]["rows"] == TOTAL - 2 * ROWS_PER_PART
    assert by_id(read_output(out, data["storage_options"])) == reference


def upload_model(env, tiny_model: Path) -> str:
    for file in tiny_model.iterdir():
        env.client().upload_file(str(file), BUCKET, f"models/tiny/{file.name}")
    return env.url("models/tiny")


@pytest.mark.parametrize("kind", FAULTS)
def test_model_download_faults_are_retried(kind, faulty_s3, tiny_model, reference, tmp_path, monkeypatch,  # noqa: F811
                                           no_backoff):
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    data = faulty_job(faulty_s3, tiny_model, tmp_path)
    data["model"]["path"] = upload_model(faulty_s3, tiny_model)
    faulty_s3.proxy.inject(kind, 2, "GET", "models/")
    run_job(spec_from_dict(data), quiet=True)  # loads the model it downloaded
    assert faulty_s3.proxy.injected[kind] == 2
    assert by_id(read_output(data["output"]["path"], data["storage_options"])) == reference


def test_model_download_outage_fails_clearly_and_a_retry_completes(faulty_s3, tiny_model, reference, tmp_path,  # noqa: F811
                                                                   monkeypatch, no_backoff):
    cache = tmp_path / "cache"
    monkeypatch.setenv("BATCHGEN_CACHE", str(cache))
    data = faulty_job(faulty_s3, tiny_model, tmp_path)
    data["model"]["path"] = upload_model(faulty_s3, tiny_model)
    faulty_s3.proxy.inject("error500", 10**6, "GET", "model.safetensors")
    with pytest.raises(JobError, match=r"cannot load model s3://batchgen-bucket/models/tiny: cannot download "
                                       r"s3://batchgen-bucket/models/tiny: "):
        run_job(spec_from_dict(data), quiet=True)
    assert [p.name for p in cache.rglob("*") if p.is_file()] == [".lock"]  # no partial download left
    faulty_s3.proxy.clear()
    run_job(spec_from_dict(data), quiet=True)
    assert by_id(read_output(data["output"]["path"], data["storage_options"])) == reference

"""Jobs on Ray (``executor: ray``): two engine replicas on a local Ray cluster give the local executor's rows,
lose and repeat no row when a replica's process is killed, resume under Ray or locally, and read and write S3.

One Ray cluster serves the whole session (8 logical CPUs on any machine, so the replicas never starve the read
and prepare tasks; a capped object store; no dashboard, no token auth); it is shut down at the end.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from batchgen.io import read_output
from batchgen.io.manifest import PartId, entry_ids
from batchgen.pipeline.errors import JobError, JobInterrupted
from batchgen.pipeline.executors.ray_extra import RAY_EXTRA_HINT
from batchgen.pipeline.plan import plan_job
from batchgen.pipeline.runner import run_job
from batchgen.pipeline.spec import spec_from_dict
from batchgen.report.data import load_report_data
from tests.job_helpers import (  # noqa: F401  (fixtures)
    by_id, check_output, engine_calls, records, spec_dict, tiny_llm, write_jsonl, write_parquet,
)
from tests.s3_server import HOST, moto_server, s3  # noqa: F401  (fixtures)

ray = pytest.importorskip("ray", reason=RAY_EXTRA_HINT)

from batchgen.pipeline.executors.ray import replica_resources  # noqa: E402
from batchgen.pipeline.executors.ray_board import (  # noqa: E402
    BoardNews, JobBoard, ReplicaInfo, WindowTicket, board_name,
)
from batchgen.pipeline.executors.ray_shards import plan_shards  # noqa: E402
from batchgen.pipeline.stages import RowIds  # noqa: E402
from batchgen.pipeline.stats import Counts  # noqa: E402

RAY_PART = re.compile(r"^part-r[0-9a-f]+-s\d{5}-w\d{5}-\d{5}\.(parquet|jsonl)$")


def descendants(pid: int) -> set[int]:
    """Every process started, directly or not, by ``pid``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def alive(pids: set[int]) -> set[int]:
    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[:1] != ["Z"]
        except OSError:
            return False

    return {p for p in pids if running(p)}


@pytest.fixture(scope="session")
def ray_cluster():
    env = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "NO_PROXY": HOST}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    ray.init(num_cpus=8, object_store_memory=200 << 20, include_dashboard=False, logging_level="WARNING")
    try:
        yield
    finally:
        started = {p for p in descendants(os.getpid()) if b"ray" in cmdline(p)}  # the cluster, workers included
        ray.shutdown()
        deadline = time.monotonic() + 20
        while alive(started) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in alive(started):  # a worker that did not notice its raylet go
            os.kill(pid, signal.SIGKILL)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def job_inputs(folder: Path, scale: int = 1) -> tuple[list[str], list[str]]:
    """Two JSONL files of ``scale`` x (24, 14) rows; an error row, and an id of the first file repeated in the
    second. (files, output ids)"""
    a, b = records(24 * scale, "r"), records(14 * scale, "b")
    a[5]["text"] = None
    b.append(dict(a[3]))
    files = [str(write_jsonl(folder / "a.jsonl", a)), str(write_jsonl(folder / "b.jsonl", b))]
    return files, [r["id"] for r in a + b[:-1]] + ["r3#dup1"]


def job(model: Path, inputs: Any, out: Any, ray_replicas: int | None = 2, **sections: Any) -> dict[str, Any]:
    """A small job; ``ray_replicas`` None runs it locally."""
    sections = {"sampling": {"max_tokens": 6}, "output": {"rows_per_part": 2, "carry_columns": ["title"]},
                "batching": {"sort_window": 4}, "engine": {"kv_cache_memory": 64 << 20}, **sections}
    data = spec_dict(model, inputs, out, **sections)
    if ray_replicas:
        data["executor"] = {"kind": "ray", "num_replicas": ray_replicas}
    return data


def scoped_ids(out: Path, prefix: str = "") -> list[str]:
    """Row ids of the committed parts whose scope starts with ``prefix`` ("" for any)."""
    folder = out / "_manifest"
    names = sorted(p.name for p in folder.glob("*.json")) if folder.exists() else []
    return [i for p in entry_ids(names) if p.scope.startswith(prefix)
            for i in json.loads((folder / f"part-{p.key}.json").read_text())["row_ids"]]


@contextmanager
def acting_while_it_runs(act: Callable[[], bool]) -> Iterator[list[bool]]:
    """Calls ``act`` every 10 ms, in a thread of its own, while the block runs, until it returns True (it acted).
    Looking that often, rather than at the driver's 0.5-second progress updates, ``act`` finds the job mid-way
    even where a fast engine runs every window between two updates. Yields a list that holds True once ``act``
    acted."""
    acted: list[bool] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if act():
                acted.append(True)
                return
            done.wait(0.01)

    watcher = threading.Thread(target=watch, name="test-watcher", daemon=True)
    watcher.start()
    try:
        yield acted
    finally:
        done.set()
        watcher.join(timeout=30)


def close(a: Any, b: Any, tol: float = 1e-4) -> bool:
    """Equal, floats within ``tol``, however deep inside dicts and lists."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tol
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], tol) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b))
    return a == b


def same_rows(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want)
    assert by_id(got) == by_id(want)


def test_replica_resources_follow_the_cluster():
    spec = spec_from_dict(job("m", "in.jsonl", "out", ray_replicas=None, executor={"kind": "ray"}))
    assert replica_resources(spec, 0.0) == (1, 1.0, 0.0)  # CPU only: one replica
    assert replica_resources(spec, 8.0) == (8, 1.0, 1.0)  # a replica per GPU
    spec.engine.tensor_parallel_size = 2
    assert replica_resources(spec, 8.0) == (4, 1.0, 2.0)  # a replica per two GPUs
    spec.engine.data_parallel_size = 2
    assert replica_resources(spec, 8.0) == (2, 1.0, 4.0)  # a replica per engine of 2 x 2 ranks
    spec.executor.num_replicas, spec.executor.num_gpus = 3, 0.5
    assert replica_resources(spec, 8.0) == (3, 1.0, 0.5)


def test_the_board_counts_attempts_and_refuses_windows_after_a_stop():
    board = JobBoard()  # the actor's class, called directly: its calls run one at a time either way
    info = ReplicaInfo(node="n", pid=1, startup_s=0.5, token_budget=64, dtype="float32")
    a, b = board.register(info), board.register(dataclasses.replace(info, pid=2))
    assert board.begin("s00000-w00000", a) == WindowTicket(attempt=0, run=True)
    assert board.begin("s00000-w00000", b) == WindowTicket(attempt=1, run=True)  # a's attempt was cut short
    assert board.report(a, Counts(rows=1, ok_rows=1, prompt_tokens=9)) == BoardNews(stop=False, lost=None)
    board.end("s00000-w00000", b, Counts(rows=3, ok_rows=2, error_rows=1, prompt_tokens=30), {})
    board.lease_lost("taken by another run")
    assert board.report(a, Counts(rows=2, ok_rows=2, prompt_tokens=18)) == BoardNews(True, "taken by another run")
    assert board.begin("s00000-w00001", a) == WindowTicket(attempt=0, run=False)
    snapshot = board.snapshot()
    assert snapshot.totals() == Counts(rows=5, ok_rows=4, error_rows=1, prompt_tokens=48)
    assert (snapshot.windows, snapshot.retried, snapshot.active, snapshot.stop) == (1, 1, 0, True)
    assert snapshot.engine() == info and [r.info.pid for r in snapshot.replicas] == [1, 2]
    assert snapshot.generating_s() >= 0 and snapshot.replicas[1].windows == 1 and snapshot.replicas[0].windows == 0


def test_a_replica_reports_an_unexpected_error_to_the_board(monkeypatch):
    """Ray Data hands the driver its UserCodeException without the replica's error: the replica reports that error
    to the board first, and the driver's message is the report."""
    from types import SimpleNamespace

    from batchgen.pipeline.executors.ray import _job_error
    from batchgen.pipeline.executors import ray_replica
    from batchgen.pipeline.executors.ray_replica import EngineReplica

    monkeypatch.setattr(ray_replica, "load_window", lambda payload: payload)
    reports: list[str] = []
    replica = object.__new__(EngineReplica)
    replica.job = SimpleNamespace(board=SimpleNamespace(fail=SimpleNamespace(remote=reports.append)))

    def fails(key, window):
        raise LookupError("Unresolvable: http://example.com/x.json\n(more lines)")

    replica.run_window = fails
    with pytest.raises(LookupError):
        replica({"window": ["s00000-w00000"], "payload": [b""]})
    assert reports == ["the job failed on Ray: LookupError: Unresolvable: http://example.com/x.json"]
    assert str(_job_error(RuntimeError("UDF failed to process a data block."), reports[0])) == reports[0]
    replica.run_window = lambda key, window: (_ for _ in ()).throw(JobError("the job's own error"))
    with pytest.raises(JobError):
        replica({"window": ["s00000-w00000"], "payload": [b""]})
    assert len(reports) == 1  # the driver finds the job's own errors itself


@pytest.mark.timeout(120)
def test_planned_ids_equal_reading_order(ray_cluster, tmp_path):
    files, ids = job_inputs(tmp_path)
    spec = spec_from_dict(job("m", files, tmp_path / "out"))
    plan = plan_shards(spec, files, limit=None)
    assert plan.renamed == {(files[1], 14): "r3#dup1"} and plan.total == len(ids)
    assert [(s.file, s.rows) for s in plan.shards] == [(files[0], None), (files[1], None)]
    limited = plan_shards(spec, files, limit=30)  # the first 30 rows: all of a, 6 of b
    assert [(s.file, s.rows) for s in limited.shards] == [(files[0], 24), (files[1], 6)]
    assert limited.renamed == {} and limited.total == 30
    # the default ids need no look at the rows, and a limit counts them
    spec = spec_from_dict(job("m", files, tmp_path / "out", input={"path": files, "id_column": None}))
    assert plan_shards(spec, files, limit=None).total is None
    assert [s.rows for s in plan_shards(spec, files, limit=26).shards] == [24, 2]
    assert RowIds().assign("x") == "x"


@pytest.mark.timeout(300)
def test_two_replicas_give_the_local_rows(ray_cluster, tmp_path, tiny_model, tiny_llm):
    files, ids = job_inputs(tmp_path)
    local = tmp_path / "local"
    run_job(spec_from_dict(job(tiny_model, files, local, ray_replicas=None)), llm=tiny_llm, quiet=True)
    out = tmp_path / "ray"
    speculating = job(tiny_model, files, out, engine={"kv_cache_memory": 64 << 20,
                                                      "speculative_config": {"method": "ngram"}})
    stats = run_job(spec_from_dict(speculating), quiet=True)

    rows = check_output(out, stats, ids)
    same_rows(rows, read_output(str(local)))  # greedy: the same outputs, token counts, error rows, carried columns
    ngram = stats["engine"]["speculative"]["ngram"]  # the replicas' figures under their method's name
    assert ngram["decode_seqs_considered"] > 0 and ngram["cost_fitted"] is True
    assert by_id(rows)["r3#dup1"]["error"]["code"] == "duplicate_id"
    ex = stats["executor"]
    assert ex["kind"] == "ray" and ex["num_replicas"] == 2 and ex["retried_windows"] == 0
    # Which replica takes which window is Ray's choice: a fast engine lets the one ready first take them all
    # (the other may not even have registered, its model still loading, when the last window ends).
    assert 1 <= len(ex["replicas"]) <= 2, ex["replicas"]
    working = [r for r in ex["replicas"] if r["rows"]]
    assert working, ex["replicas"]
    assert sum(r["rows"] for r in ex["replicas"]) == stats["rows"] == stats["this_run"]["rows"] == len(ids)
    assert sum(r["completion_tokens"] for r in ex["replicas"]) == stats["completion_tokens"]
    assert all(r["rows_per_s"] > 0 and r["generated_tokens_per_s"] > 0 for r in working)
    assert stats["engine"]["steps"] > 0 and stats["complete"] is True and (out / "_SUCCESS").exists()

    names = sorted(p.name for p in out.iterdir() if p.name.startswith("part-"))
    assert names and all(RAY_PART.match(n) for n in names), names
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
    telemetry = json.loads((out / "telemetry.json").read_text())
    assert sum(telemetry["time_buckets"]["columns"]["rows"]) == stats["rows"]
    report = load_report_data(str(out))
    assert report.rows.height == stats["rows"] and report.complete

    again = run_job(spec_from_dict(speculating), quiet=True)  # a finished job is a no-op
    assert again["finished_at"] == stats["finished_at"]


@pytest.mark.timeout(400)
def test_a_killed_replica_loses_and_repeats_no_row(ray_cluster, tmp_path, tiny_model, tiny_llm):
    files, ids = job_inputs(tmp_path)
    reference = tmp_path / "reference"
    slow = {"batching": {"sort_window": 2}, "engine": {"max_num_seqs": 2, "kv_cache_memory": 64 << 20},
            "sampling": {"max_tokens": 16}}
    run_job(spec_from_dict(job(tiny_model, files, reference, ray_replicas=None, **slow)), llm=tiny_llm, quiet=True)
    out = tmp_path / "out"
    spec = spec_from_dict(job(tiny_model, files, out, **slow))
    killed: list[int] = []
    seen: Counter[str] = Counter()  # what the watcher found at each look, for the failure message

    def busy_replica() -> int | None:
        """The pid of a replica running a window, read from the job's board once a part is committed."""
        manifest = out / "_manifest"
        runs = {p.scope.split("-")[0] for p in entry_ids(os.listdir(manifest))} if manifest.exists() else set()
        if not runs:
            seen["no part committed yet"] += 1
            return None
        snapshot = ray.get(ray.get_actor(board_name(runs.pop())).snapshot.remote())
        busy = set(snapshot.running.values())
        pid = next((r.info.pid for r in snapshot.replicas if r.replica in busy), None)
        seen["no window running" if pid is None else "a window running"] += 1
        return pid

    def kill_a_busy_replica() -> bool:
        """Kills the first replica the board names as running a window: one read, so the pid found is the pid
        killed."""
        try:
            pid = busy_replica()
        except (ValueError, ray.exceptions.RayError) as e:  # the board not up yet, or gone with the job
            seen[type(e).__name__] += 1
            return False
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        return pid is not None

    with acting_while_it_runs(kill_a_busy_replica):
        stats = run_job(spec, quiet=True)
    assert killed, f"no replica process to kill; the watcher saw: {dict(seen)}"
    rows = check_output(out, stats, ids)
    same_rows(rows, read_output(str(reference)))
    assert Counter(scoped_ids(out)).most_common(1)[0][1] == 1  # each row in one committed part
    committed_files = {f for p in (out / "_manifest").glob("*.json") for f in json.loads(p.read_text())["files"]}
    assert {p.name for p in out.iterdir() if p.name.startswith("part-")} == committed_files  # no orphan left
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
    ex = stats["executor"]
    assert len(ex["replicas"]) >= 3 and ex["retried_windows"] >= 1, ex  # restarted, and its windows retried


@pytest.mark.timeout(500)
def test_an_interrupted_ray_job_resumes_under_ray_and_locally(ray_cluster, tmp_path, tiny_model, tiny_llm,
                                                             engine_calls):
    # after a stop, the windows already running finish: up to 2 replicas x WINDOWS_AT_ONCE + 1 windows in flight,
    # each 2 rows; three times the rows leave each interrupted run more than that to do
    files, ids = job_inputs(tmp_path, scale=3)
    slow = {"batching": {"sort_window": 2}, "engine": {"max_num_seqs": 2, "kv_cache_memory": 64 << 20},
            "sampling": {"max_tokens": 12}}
    out = tmp_path / "out"
    for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        before = set(scoped_ids(out))
        def stop_once_a_ray_part_lands(sig: int = sig) -> bool:
            if not set(scoped_ids(out, "r")) - before:
                return False
            os.kill(os.getpid(), sig)
            return True

        with acting_while_it_runs(stop_once_a_ray_part_lands) as sent, pytest.raises(JobInterrupted) as e:
            run_job(spec_from_dict(job(tiny_model, files, out, **slow)), quiet=True)
        assert sent and e.value.exit_code == code
        committed = scoped_ids(out)
        assert len(committed) == len(set(committed)) and before < set(committed) < set(ids)
        partial = json.loads((out / "stats.json").read_text())
        assert partial["complete"] is False and partial["rows"] == len(committed)
        assert not (out / "_SUCCESS").exists()
        assert partial["this_run"]["rows"] == len(committed) - len(before)  # only rows no earlier run committed
    ray_runs = {PartId.parse(n.removeprefix("part-").removesuffix(".json")).scope.split("-")[0]
                for n in os.listdir(out / "_manifest")}
    assert len(ray_runs) == 2

    committed = set(scoped_ids(out))
    stats = run_job(spec_from_dict(job(tiny_model, files, out, ray_replicas=None, **slow)), llm=tiny_llm,
                    quiet=True)
    check_output(out, stats, ids)
    runnable = {i for i in ids if i not in ("r5", "r3#dup1")}  # the error rows never reach the engine
    assert sorted(engine_calls) == sorted(runnable - committed)  # the local rerun computed only the missing rows
    assert stats["this_run"]["rows"] == len(ids) - len(committed) and stats["resumed"] is True


@pytest.mark.timeout(300)
def test_s3_input_and_output_on_ray(ray_cluster, s3, tmp_path, tiny_model, tiny_llm):  # noqa: F811
    client = s3.client()
    recs = [{"text": r["text"], "title": r["title"]} for r in records(24)]
    for name, part in (("x", recs[:12]), ("y", recs[12:])):  # same basename: ids are "x/data.parquet:<row>"
        path = write_parquet(tmp_path / name / "data.parquet", part)
        client.put_object(Bucket=s3.bucket, Key=f"in/{name}/data.parquet", Body=path.read_bytes())
    inputs = {"path": s3.url("in/*/data.parquet"), "id_column": None}
    local = tmp_path / "local"
    run_job(spec_from_dict(job(tiny_model, None, local, ray_replicas=None, input=inputs,
                               storage_options=s3.storage_options)), llm=tiny_llm, quiet=True, limit=20)
    out = s3.url("ray-out")
    spec = spec_from_dict(job(tiny_model, None, out, input=inputs, storage_options=s3.storage_options))
    stats = run_job(spec, quiet=True, limit=20)

    rows = read_output(out, s3.storage_options)
    want = [f"x/data.parquet:{i}" for i in range(12)] + [f"y/data.parquet:{i}" for i in range(8)]
    assert sorted(r["id"] for r in rows) == sorted(want) and stats["rows"] == 20 and stats["limit"] == 20
    same_rows(rows, read_output(str(local)))
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=s3.bucket, Prefix="ray-out/")["Contents"]]
    assert "ray-out/_SUCCESS" not in keys and "ray-out/stats.json" in keys  # a --limit trial completes nothing
    assert all(RAY_PART.match(k.rsplit("/", 1)[1]) for k in keys if k.startswith("ray-out/part-"))
    stored = json.loads(client.get_object(Bucket=s3.bucket, Key="ray-out/stats.json")["Body"].read())
    assert stored["spec"]["storage_options"]["secret"] == "***" and stored["complete"] is False


@pytest.mark.timeout(300)
def test_openai_batch_lines_on_ray(ray_cluster, tmp_path, tiny_model, tiny_llm):
    from tests.test_openai_batch import check_results, openai_spec, write_requests

    inp = write_requests(tmp_path / "requests.jsonl")
    data = openai_spec(inp, tmp_path / "local", max_tokens=6)
    data["model"]["path"] = str(tiny_model)
    data["batching"] = {"sort_window": 3}
    data["engine"] = {**data["engine"], "kv_cache_memory": 64 << 20}
    run_job(spec_from_dict(data), llm=tiny_llm, quiet=True)
    data["output"] = {**data["output"], "path": str(tmp_path / "ray")}
    stats = run_job(spec_from_dict({**data, "executor": {"kind": "ray", "num_replicas": 2}}), quiet=True)

    def essence(results: dict[str, dict]) -> dict[str, Any]:
        return {k: (r["response"]["body"]["choices"], r["response"]["body"]["usage"]) if r["response"] else r["error"]
                for k, r in results.items()}

    local, on_ray = check_results(tmp_path / "local"), check_results(tmp_path / "ray")
    # the same texts, token counts and errors (seeded sampling too); log-probabilities in other batches differ
    # in the last float32 digits
    assert close([essence(x) for x in on_ray], [essence(x) for x in local])
    assert stats["rows"] == len(on_ray[0]) + len(on_ray[1]) and stats["executor"]["windows"] >= 2
    files = [p.name for p in (tmp_path / "ray").glob("*.jsonl")]
    assert any(n.startswith("errors-r") for n in files) and all(RAY_PART.match(n.replace("errors-", "part-"))
                                                                for n in files)


@pytest.mark.timeout(180)
def test_a_replica_that_cannot_load_its_model_fails_the_job_naming_it(ray_cluster, tmp_path, tiny_model):
    files, _ = job_inputs(tmp_path)
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")  # the tokenizer loads, the weights do not
    with pytest.raises(JobError, match=f"^cannot load model {re.escape(str(broken))}: .*header"):
        run_job(spec_from_dict(job(broken, files, tmp_path / "out")), quiet=True)
    assert not (tmp_path / "out" / "_SUCCESS").exists()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_replicas_share_a_prefix_store(ray_cluster, tmp_path, tiny_model, tiny_llm):
    """Job A on two replicas fills a local-folder store; job B (the same documents, a new question) on two
    replicas takes every block the store holds (what plan expects) and computes the rest: the rows of a cold run."""
    files = [str(write_jsonl(tmp_path / f"{name}.jsonl", [{**r, "text": f"{r['id']}: {r['text']}"} for r in
                                                          records(n, name)])) for name, n in (("x", 20), ("y", 12))]
    store = str(tmp_path / "kv")  # every document is another (the store holds all B takes from A)

    def spec(out: str, question: str, ray_replicas: int | None = 2, **engine: Any):
        prompt = {"template": "{{ text }} {{ text }}\n" + question, "chat": False, "system": None}
        return spec_from_dict(job(tiny_model, files, tmp_path / out, ray_replicas, prompt=prompt,
                                  engine={"kv_cache_memory": 64 << 20, **engine}))

    first = run_job(spec("a", "What is it about?", prefix_cache_store=store), quiet=True)
    assert first["cached_prompt_tokens"] < first["prompt_tokens"] and any(Path(store).rglob("*.kv"))
    expected = plan_job(spec("b", "Which words repeat?", prefix_cache_store=store))["prefix_store"]
    cold = tmp_path / "cold"
    run_job(spec("cold", "Which words repeat?", ray_replicas=None), llm=tiny_llm, quiet=True)
    second = run_job(spec("b", "Which words repeat?", prefix_cache_store=store), quiet=True)
    same_rows(read_output(str(tmp_path / "b")), read_output(str(cold)))
    assert second["cached_prompt_tokens"] == expected["expected_store_tokens"] > second["prompt_tokens"] // 2
    # Job B's replicas are new processes reading what job A's wrote. Which of them runs which window is Ray's
    # choice: with a fast engine one replica may take every window before the other has started.
    assert sum(r["rows"] for r in second["executor"]["replicas"]) == second["rows"]

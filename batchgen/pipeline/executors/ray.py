"""The Ray executor: one job over the nodes and GPUs of a Ray cluster, on Ray Data.

CPU tasks read each input file (a shard), assign the job's row ids, skip committed rows, render, tokenize and cut
sort windows; each window goes to one engine replica of an actor pool (one ``LLM`` per actor), which commits its
rows as parts of the window's own scope (``part-<run>-s<shard>-w<window>-<n>``) through the same manifest
protocol as a local run. The driver holds the output's lease throughout, shows progress, and the runner writes
the stats and ``_SUCCESS`` once every part is committed.
"""
from __future__ import annotations

import logging
import os
import secrets
import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from batchgen.engine.flops import engine_figures
from batchgen.io import InputError, OutputError, OutputWriter, redact
from batchgen.io.lease import LeaseLost
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.executors.ray_board import REPORT_S, BoardSnapshot, JobBoard, ReplicaState, board_name
from batchgen.pipeline.executors.ray_replica import WINDOWS_AT_ONCE, EngineReplica, ReplicaJob
from batchgen.pipeline.executors.ray_shards import SHARD_CPUS, PrepareJob, ShardPlan, plan_shards, prepare_windows
from batchgen.pipeline.interrupt import StopRequest
from batchgen.pipeline.job import Execution, RunPlan
from batchgen.pipeline.progress import Progress
from batchgen.pipeline.spec import JobSpec
from batchgen.pipeline.stats import Counts
from batchgen.pipeline.telemetry import Telemetry

log = logging.getLogger(__name__)

# Ray Data's per-dataset lines would scroll past the job's progress bar (which replaces Ray's own bars)
_QUIET_LOGGERS = {"ray.data": logging.WARNING, "ray.data._internal.progress": logging.ERROR}


def replica_resources(spec: JobSpec, cluster_gpus: float) -> tuple[int, float, float]:
    """(replicas, CPUs and GPUs of each): by default a replica takes a GPU for each device of its engine (tensor x
    data parallel), and there are as many as the cluster's GPUs allow (one on a cluster without GPUs)."""
    ex = spec.executor
    gpus = ex.num_gpus if ex.num_gpus is not None else (float(spec.engine.world_size) if cluster_gpus else 0.0)
    replicas = ex.num_replicas or (max(1, int(cluster_gpus // gpus)) if gpus else 1)
    if gpus * replicas > cluster_gpus:
        log.warning("%d replicas of %g GPU(s) need more than the cluster's %g GPUs: some wait for GPUs to join",
                    replicas, gpus, cluster_gpus)
    return replicas, ex.num_cpus, gpus


def _local_cpus(spec: JobSpec) -> int:
    """Logical CPUs of a Ray started for the job: the machine's, plus what the replicas reserve, so that replicas
    never starve the read and prepare tasks of CPUs (the replicas mostly wait on the engine)."""
    replicas = spec.executor.num_replicas or 1
    return (os.cpu_count() or 1) + int(replicas * spec.executor.num_cpus + 0.999)


def _run_id(scopes: set[str]) -> str:
    """A new prefix for this run's part scopes: time-ordered, and no committed part's scope starts with it."""
    while True:
        run = f"r{int(time.time()):x}{secrets.token_hex(1)}"
        if not any(s.startswith(f"{run}-") for s in scopes):
            return run


def _job_error(e: BaseException, reported: str | None = None) -> BaseException:
    """The failure to report for an exception out of Ray: the job's own error where a task or a replica raised
    one (Ray wraps it, Ray Data wraps that and adds lines to its message), else the failure a replica reported
    to the board (Ray keeps only the text of an error in an actor's constructor), else one line naming it."""
    chain: list[BaseException] = []
    cause: BaseException | None = e
    while cause is not None and cause not in chain and len(chain) < 16:
        chain.append(cause)
        cause = getattr(cause, "cause", None) or cause.__cause__
    own = [c for c in chain if isinstance(c, (JobError, InputError, OutputError))]
    if own:  # the innermost: the error as raised, not a wrapper posing as its type
        return type(own[-1])((str(own[-1]).strip().splitlines() or [""])[0])
    if reported:
        return JobError(reported)
    first = (str(chain[-1]).strip().splitlines() or [""])[0]
    return JobError(redact(f"the job failed on Ray: {type(chain[-1]).__name__}: {first}"))


class _Watch:
    """The driver's side of a running job, every ``REPORT_S`` in a thread: it moves the progress bar to the rows
    the replicas finished, checks the output's lease (a lost one stops every replica before its next write) and
    passes a stop request on to the board (at once: a stop wakes the thread)."""

    def __init__(self, board: Any, progress: Progress, writer: OutputWriter, stop: StopRequest) -> None:
        self.board, self.progress, self.writer, self.stop = board, progress, writer, stop
        self.failure: LeaseLost | None = None
        self.snapshot = BoardSnapshot()
        self._seen = Counts()
        self._told = False
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._wake = threading.Event()
        stop.notify(self._wake)
        self._thread = threading.Thread(target=self._loop, name="ray-watch", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(REPORT_S)
            self._wake.clear()
            if self._closed.is_set():
                return
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - the board answers at the next tick or the job fails anyway
                log.debug("cannot read the job's board: %s", e)

    def tick(self) -> BoardSnapshot:
        with self._lock:
            try:
                self.writer.ensure_held()
            except LeaseLost as e:
                if self.failure is None:
                    self.failure = e
                    self.board.lease_lost.remote(str(e))
            if self.stop.is_set() and not self._told:
                self.board.request_stop.remote()
                self._told = True
            self.snapshot = ray.get(self.board.snapshot.remote(), timeout=60)
            now = self.snapshot.totals()
            self.progress.advance(now.rows - self._seen.rows, now.prompt_tokens - self._seen.prompt_tokens,
                                  now.completion_tokens - self._seen.completion_tokens)
            self._seen = now
            return self.snapshot

    def reported_failure(self) -> str | None:
        """What a replica reported failing it, if one did."""
        try:
            return self.tick().failure
        except Exception:  # noqa: BLE001 - the board is gone with the job
            return self.snapshot.failure

    def stopped(self) -> bool:
        """Whether a stop was requested and no window runs any more (none will start)."""
        snapshot = self.tick()
        return snapshot.stop and snapshot.active == 0

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=10)


@contextmanager
def _data_context() -> Iterator[None]:
    """Ray Data settings for the datasets built inside: every sort window a block of its own (it goes to a replica
    as soon as it is cut, however small), no Ray progress bars (the job has its own)."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    saved = ctx.target_max_block_size, ctx.enable_progress_bars
    ctx.target_max_block_size, ctx.enable_progress_bars = 1, False
    try:
        yield
    finally:
        ctx.target_max_block_size, ctx.enable_progress_bars = saved


def _replica_stats(r: ReplicaState) -> dict[str, Any]:
    metrics = (r.telemetry or {}).get("metrics") or {}
    span = r.active_s

    def rate(n: int) -> float:
        return round(n / span, 2) if span > 0 else 0.0

    return {"replica": r.replica, "node": r.info.node, "pid": r.info.pid, "startup_s": r.info.startup_s,
            "windows": r.windows, **r.counts.to_dict(), "active_s": round(span, 3),
            "engine_busy_s": round(metrics.get("prefill_time_s", 0.0) + metrics.get("decode_time_s", 0.0), 3),
            "rows_per_s": rate(r.counts.rows), "prompt_tokens_per_s": rate(r.counts.prompt_tokens),
            "generated_tokens_per_s": rate(r.counts.completion_tokens)}


class RayExecutor:
    """Runs the job on a Ray cluster: the one this process is connected to, ``executor.address``, ``RAY_ADDRESS``,
    or else a local Ray started for the job (and shut down after it)."""

    def __init__(self) -> None:
        self._started_ray = False
        self.address = "local"

    def start(self, spec: JobSpec) -> None:
        if ray.is_initialized():
            self.address = "connected"
            return
        address = spec.executor.address or os.environ.get("RAY_ADDRESS")
        try:
            if address:
                ray.init(address=address, logging_level=logging.WARNING)
                self.address = address
            else:
                ray.init(num_cpus=_local_cpus(spec), include_dashboard=False, logging_level=logging.WARNING)
                self._started_ray = True
        except Exception as e:  # noqa: BLE001 - unreachable address, bad auth, no room for a local Ray
            where = f"the Ray cluster at {address}" if address else "a local Ray"
            raise JobError(redact(f"cannot start or reach {where}: {type(e).__name__}: {e}")) from None

    def close(self) -> None:
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def execute(self, plan: RunPlan, writer: OutputWriter, stop: StopRequest) -> Execution:
        spec = plan.spec
        replicas, cpus, gpus = replica_resources(spec, ray.cluster_resources().get("GPU", 0.0))
        run_id = _run_id(writer.committed_scopes())
        log.info("%s: run %s on Ray with %d engine replica(s) of %g CPU(s) and %g GPU(s)", spec.name, run_id,
                 replicas, cpus, gpus)
        try:
            shards = plan_shards(spec, plan.files, plan.limit)
        except Exception as e:  # noqa: BLE001 - a read task failed: missing or corrupt input
            raise _job_error(e) from None
        startup_s = time.perf_counter() - plan.wall_start
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        board = ray.remote(JobBoard).options(num_cpus=0, scheduling_strategy=here,  # beside the driver
                                             name=board_name(run_id)).remote()
        try:
            replica_job = ReplicaJob(plan.for_workers(), run_id, board, writer.committed_column_types())
            snapshot = self._run(plan, shards, replica_job, writer, stop, (replicas, cpus, gpus))
        finally:
            ray.kill(board)
        writer.refresh(cleanup=not stop.is_set())  # files of replicas killed before their commit go
        generate_s = snapshot.generating_s()
        engine_info = snapshot.engine()  # every replica runs the same engine; None when none started
        telemetry = Telemetry(engine_info.token_budget if engine_info else 0, start=plan.wall_start)
        telemetry.stages.add("startup", startup_s)
        for r in snapshot.replicas:
            if r.telemetry:
                telemetry.absorb(r.telemetry)
        engine = engine_figures(telemetry.metrics, generate_s, telemetry.token_budget,
                                engine_info.profile if engine_info else None,
                                engine_info.peak_flops if engine_info else None, engines=replicas)
        executor = {"kind": "ray", "address": redact(self.address), "run": run_id, "num_replicas": replicas,
                    "replica_resources": {"num_cpus": cpus, "num_gpus": gpus}, "windows": snapshot.windows,
                    "retried_windows": snapshot.retried,
                    "replicas": [_replica_stats(r) for r in snapshot.replicas]}
        return Execution(run=Counts.total(writer.committed_stats(f"{run_id}-")), generate_s=generate_s,
                         engine=engine, telemetry=telemetry.to_dict(), executor=executor,
                         dtype=engine_info.dtype if engine_info else plan.spec.engine.dtype)

    def _run(self, plan: RunPlan, shards: ShardPlan, replica_job: ReplicaJob, writer: OutputWriter,
             stop: StopRequest, resources: tuple[int, float, float]) -> BoardSnapshot:
        """Builds the dataset and drains it; returns the board's last snapshot."""
        from ray.data import ActorPoolStrategy

        replicas, cpus, gpus = resources
        committed = ray.put(plan.committed)
        with _data_context():
            ds = ray.data.from_items([{"shard": i} for i in range(len(shards.shards))],
                                     override_num_blocks=max(1, len(shards.shards)))
            # one shard -> many windows: a flat_map, which Ray Data never fuses into the replicas' fixed batches
            ds = ds.flat_map(prepare_windows, num_cpus=SHARD_CPUS,
                             fn_kwargs={"job": PrepareJob(plan.spec, shards, plan.carry, committed)})
            pool = ActorPoolStrategy(size=replicas, max_concurrent_calls_per_actor=WINDOWS_AT_ONCE,
                                     enable_true_multi_threading=True,
                                     max_tasks_in_flight_per_actor=WINDOWS_AT_ONCE + 1)
            # Ray Data restarts a replica that dies and retries the windows it held (its defaults for actor
            # pools: max_restarts=-1, max_task_retries=-1), which is what exactly-once rests on (see ray_replica).
            ds = ds.map_batches(EngineReplica, batch_size=1, compute=pool, num_cpus=cpus, num_gpus=gpus,
                                fn_constructor_kwargs={"job": replica_job})
        progress = plan.progress(shards.total)
        watch = _Watch(replica_job.board, progress, writer, stop)
        quiet = {name: logging.getLogger(name).level for name in _QUIET_LOGGERS}
        for name, level in _QUIET_LOGGERS.items():
            logging.getLogger(name).setLevel(level)
        try:
            self._drain(ds, watch, stop)
        except KeyboardInterrupt:  # a second signal: stop at once
            stop.set(signal.SIGINT)
        except LeaseLost:
            raise
        except Exception as e:  # noqa: BLE001 - a replica or task failed: report the job's own error
            raise _job_error(e, watch.reported_failure()) from None
        finally:
            watch.close()
            for name, level in quiet.items():
                logging.getLogger(name).setLevel(level)
            try:
                snapshot = watch.tick()
            except Exception:  # noqa: BLE001 - the last one read
                snapshot = watch.snapshot
            progress.close()
        return snapshot

    @staticmethod
    def _drain(ds: Any, watch: _Watch, stop: StopRequest) -> None:
        """Iterates the dataset to its end, or until a requested stop has let the running windows finish."""
        rows = iter(ds.iter_rows())
        try:
            for _ in rows:
                if watch.failure is not None:
                    raise watch.failure
                if stop.is_set() and watch.stopped():
                    log.info("every running window finished after the stop request")
                    return
            if watch.failure is not None:
                raise watch.failure
        finally:
            close = getattr(rows, "close", None)
            if close is not None:
                close()

"""Runs a job: identity check, plan (preflight, resume set, schema) -> executor (local or Ray) -> commit (stats,
_SUCCESS)."""
from __future__ import annotations

import logging
import signal
import time
from typing import Any

from batchgen.crashpoints import crash_point
from batchgen.engine import LLM
from batchgen.io import InputError, OutputError, OutputWriter
from batchgen.pipeline import identity, preflight
from batchgen.pipeline.errors import JobError, JobInterrupted
from batchgen.pipeline.executors import executor_for
from batchgen.pipeline.interrupt import DEFAULT_GRACE_S, StopRequest, signals_raise, stop_on_signals
from batchgen.pipeline.job import Executor, Execution, RunPlan, plan_run
from batchgen.pipeline.spec import JobSpec
from batchgen.pipeline.stats import Counts, job_stats, run_entry, utc_now

log = logging.getLogger(__name__)

__all__ = ["run_job", "JobError", "JobInterrupted"]


def run_job(spec: JobSpec, *, limit: int | None = None, overwrite: bool = False, quiet: bool = False,
            llm: LLM | None = None, force_unlock: bool = False, grace_s: float = DEFAULT_GRACE_S) -> dict[str, Any]:
    """Runs ``spec`` and returns its stats (also written to stats.json, and to _SUCCESS once complete).

    Rows committed by an earlier run of the same job into the output folder are skipped; a finished folder makes
    this a no-op unless ``overwrite``. A folder holding rows of a job with another identity (see
    ``pipeline.identity``) is refused before the model loads. ``limit`` is a trial: the first N input rows are
    committed, the job is not marked complete. ``llm`` reuses a loaded model in a local run (its own engine
    settings then apply). The run owns the output folder (its lease) from before it touches it until it returns;
    ``force_unlock`` takes it even from a live run. Raises :class:`JobError` when the job cannot run or fails
    (another run owning the folder included), and :class:`JobInterrupted` after SIGINT/SIGTERM, once the finished
    rows are committed (the requests still running get ``grace_s`` seconds to finish).
    """
    wall_start, started_at = time.perf_counter(), utc_now()
    carry = preflight.carry_columns(spec)
    files = preflight.check_inputs(spec)
    job = identity.job_identity(spec, llm.config.model if llm is not None else None)
    if not overwrite:
        identity.check_recorded(spec, job)
    executor = executor_for(spec, llm)
    with signals_raise(), preflight.open_output(spec, overwrite, force_unlock) as writer:
        try:
            identity.record(spec, writer, job)
        except OutputError as e:
            raise JobError(str(e)) from None
        if writer.is_complete():
            return _already_complete(spec, writer)
        executor.start(spec)
        try:
            plan = plan_run(spec, writer, files, carry, job, limit=limit, quiet=quiet, wall_start=wall_start,
                            started_at=started_at)
            return _execute(plan, executor, writer, StopRequest(grace_s))
        finally:
            executor.close()


def _already_complete(spec: JobSpec, writer: OutputWriter) -> dict[str, Any]:
    log.info("%s: already complete in %s; nothing to do (use --overwrite to run it again)",
             spec.name, spec.resolved()["output"]["path"])
    return preflight.stored_stats(writer)


def _execute(plan: RunPlan, executor: Executor, writer: OutputWriter, stop: StopRequest) -> dict[str, Any]:
    """Executes the plan, then commits the job: stats.json and telemetry.json, then _SUCCESS (not after a --limit
    trial or a stop)."""
    spec = plan.spec
    try:
        with stop_on_signals(stop):
            execution = executor.execute(plan, writer, stop)
            totals = Counts.total(writer.committed_stats())
            complete = not stop.is_set() and plan.limit is None
            too_many_errors = bool(totals.rows) and totals.error_rows / totals.rows > spec.max_error_rate
            stats = _stats(plan, execution, totals, complete, stop.is_set())
            crash_point("stats.before")
            # a run that did nothing changes nothing (unless it completes the job)
            if execution.run.rows or not plan.runs or (complete and not too_many_errors):
                writer.write_stats(stats)
                writer.write_telemetry(execution.telemetry)
            crash_point("stats.after")
            if stop.is_set():
                assert stop.signum is not None
                log.warning("%s: stopped by %s with %d rows committed; rerun the same command to resume",
                            spec.name, signal.Signals(stop.signum).name, totals.rows)
                raise JobInterrupted(stop.signum)
            if too_many_errors:
                raise JobError(f"{totals.error_rows} of {totals.rows} rows failed, more than max_error_rate "
                               f"{spec.max_error_rate:g}; see the error column in "
                               f"{spec.resolved()['output']['path']}")
            if complete:
                writer.commit(stats)
            else:
                log.info("%s: --limit %d trial: %d rows committed; the job is not complete until a run without "
                         "--limit adds the rest", spec.name, plan.limit, totals.rows)
    except (InputError, OutputError) as e:
        raise JobError(str(e)) from None
    log.info("%s: %d rows (%d ok, %d errors), %d prompt + %d generated tokens%s; this run %.1f s",
             spec.name, totals.rows, totals.ok_rows, totals.error_rows, totals.prompt_tokens,
             totals.completion_tokens, " over all runs" if plan.runs else "", time.perf_counter() - plan.wall_start)
    return stats


def _stats(plan: RunPlan, execution: Execution, totals: Counts, complete: bool, stopped: bool) -> dict[str, Any]:
    runs = list(plan.runs)
    if execution.run.rows:
        runs.append(run_entry(run=execution.run, started_at=plan.started_at,
                              wall_s=time.perf_counter() - plan.wall_start, generate_s=execution.generate_s,
                              limit=plan.limit, interrupted=stopped, dtype=execution.dtype,
                              engine=execution.engine, executor=execution.executor))
    resolved = plan.spec.resolved()
    return job_stats(totals=totals, runs=runs, this_run=execution.run, limit=plan.limit, job=plan.spec.name,
                     model=resolved["model"]["path"], spec=resolved, identity=plan.identity.to_dict(),
                     complete=complete)

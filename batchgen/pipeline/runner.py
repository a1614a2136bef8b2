"""Runs a job: read -> render/tokenize -> sort window -> engine -> write parts -> stats -> _SUCCESS."""
from __future__ import annotations

import logging
import signal
import time
from typing import Any, Callable, Iterable

from batchgen.crashpoints import crash_point
from batchgen.engine import LLM
from batchgen.io import InputError, InputRow, OutputError, OutputWriter, count_rows, redact
from batchgen.pipeline import preflight
from batchgen.pipeline.errors import JobError, JobInterrupted
from batchgen.pipeline.interrupt import StopRequest, stop_on_signals
from batchgen.pipeline.progress import Progress
from batchgen.pipeline.openai_requests import default_url
from batchgen.pipeline.rows import PartSchema, ResultRow, engine_row, openai_record
from batchgen.pipeline.sink import PartSink
from batchgen.pipeline.spec import JobSpec
from batchgen.pipeline.prefetch import Prefetcher
from batchgen.pipeline.stages import Preparer, admit, divert_errors, input_rows, job_preparer, sorted_requests
from batchgen.pipeline.stats import Counts, job_stats, utc_now
from batchgen.pipeline.telemetry import Telemetry, engine_summary

log = logging.getLogger(__name__)

__all__ = ["run_job", "JobError", "JobInterrupted"]

PREFETCH_ROWS = 1024  # prepared rows queued ahead of the sort window


def row_writer(spec: JobSpec, schema: PartSchema) -> Callable[[ResultRow], dict[str, Any]]:
    """How a finished row becomes a record of the output format."""
    if spec.output.format != "openai":
        return lambda row: row.to_dict(schema.id_column)
    model = spec.resolved()["model"]["path"]
    url = default_url(spec.prompt is None or spec.prompt.chat)
    return lambda row: openai_record(row, model, url)


def _warn_if_spec_changed(previous: list[dict[str, Any]], digest: str) -> None:
    others = {p.get("spec_digest") for p in previous} - {digest, None}
    if others:
        log.warning("committed parts were written by a different job spec; resuming anyway "
                    "(use --overwrite to start over)")


def _save_finished(sink: PartSink) -> None:
    """Best effort after a failure: commit the rows that did finish, so a rerun need not redo them."""
    try:
        sink.flush()
    except Exception as e:  # noqa: BLE001 - the original failure is the one to report
        log.warning("could not commit %d finished rows: %s", sink.buffered, redact(str(e)))


def _generate(llm: LLM, spec: JobSpec, rows: Iterable[InputRow], preparer: Preparer, sink: PartSink,
              stop: StopRequest, telemetry: Telemetry) -> float:
    """Streams every row through the engine into the sink; returns the seconds it took.

    One lazy chain feeds one ``generate_stream`` call, with reading, rendering and tokenizing in a
    background thread, so the engine neither drains between sort windows nor waits while one fills. At
    most the prefetch depth, a sort window and the engine's pending requests are held at once. Each
    stage's time goes to ``telemetry``.
    """
    b, clock = spec.batching, telemetry.stages
    prepare = clock.timed(preparer.prepare(clock.timed(rows, "read")), "render_tokenize")
    prepared = Prefetcher(prepare, depth=min(b.sort_window, PREFETCH_ROWS), name="prepare")
    write = clock.wrap(sink.add, "write")
    try:
        requests = clock.timed(sorted_requests(divert_errors(prepared, write), b.sort_window, b.sort),
                               "queue_wait")
        start = time.perf_counter()
        with telemetry.listening(llm.engine.step_listeners):
            outputs = llm.generate_stream(admit(requests, stop.event))
            for req, out in clock.timed(outputs, "engine"):
                crash_point("generate")
                write(engine_row(req, out, llm.tokenizer))
        return time.perf_counter() - start
    finally:
        prepared.close()


def _progress(spec: JobSpec, files: list[str], committed: int, limit: int | None, quiet: bool) -> Progress:
    """The bar starts at the rows already committed; its total, the input's rows (at most ``limit``), is
    counted in the background."""
    progress = Progress(quiet, spec.name, done=min(committed, limit or committed), limit=limit)
    progress.count_total(lambda cancel: count_rows(files, spec.input.format, spec.storage_options, cancel))
    return progress


def run_job(spec: JobSpec, *, limit: int | None = None, overwrite: bool = False, quiet: bool = False,
            llm: LLM | None = None, force_unlock: bool = False) -> dict[str, Any]:
    """Runs ``spec`` and returns its stats (also written to stats.json and _SUCCESS).

    Rows committed by an earlier run of the same output folder are skipped; a finished folder makes this a
    no-op unless ``overwrite``. ``limit`` takes the first N input rows. ``llm`` reuses a loaded model (its
    own engine settings then apply). The run owns the output folder (its lease) from before it touches it
    until it returns; ``force_unlock`` takes it even from a live run. Raises :class:`JobError` when the job
    cannot run or fails (another run owning the folder included), and :class:`JobInterrupted` after
    SIGINT/SIGTERM, once the finished rows are committed.
    """
    wall_start, started_at = time.perf_counter(), utc_now()
    carry = preflight.carry_columns(spec)
    files = preflight.check_inputs(spec)
    with preflight.open_output(spec, overwrite, force_unlock) as writer:
        return _run(spec, writer, files, carry, limit=limit, quiet=quiet, llm=llm, wall_start=wall_start,
                    started_at=started_at)


def _run(spec: JobSpec, writer: OutputWriter, files: list[str], carry: list[str], *, limit: int | None,
         quiet: bool, llm: LLM | None, wall_start: float, started_at: str) -> dict[str, Any]:
    resolved, digest = spec.resolved(), spec.digest()
    if writer.is_complete():
        stored = preflight.stored_stats(writer)
        log.info("%s: already complete in %s; nothing to do (use --overwrite to run it again)",
                 spec.name, resolved["output"]["path"])
        if stored.get("limit") != limit:
            log.warning("%s: the finished run had --limit %s, this one %s; its output is kept as it is",
                        spec.name, stored.get("limit"), limit)
        return stored
    if llm is None:  # the job's own model: its worker processes (if any) stop with the job
        with preflight.load_model(spec) as own:
            return _run(spec, writer, files, carry, limit=limit, quiet=quiet, llm=own, wall_start=wall_start,
                        started_at=started_at)
    committed, previous = writer.committed_row_ids(), writer.committed_stats()
    _warn_if_spec_changed(previous, digest)
    inputs, recorded = preflight.check_inputs_unchanged(writer, files, spec.storage_options)
    log.info("%s: %d input file(s) -> %s%s", spec.name, len(files), resolved["output"]["path"],
             f" (resuming: {len(committed)} rows already committed)" if committed else "")

    schema = PartSchema(spec.input.id_column or "id", carry)
    schema.seed(writer.committed_column_types())
    telemetry = Telemetry(llm.engine.token_budget, start=wall_start)
    telemetry.stages.add("startup", time.perf_counter() - wall_start)
    progress = _progress(spec, files, len(committed), limit, quiet)
    sink = PartSink(writer, schema, spec.output.rows_per_part, digest,
                    on_row=lambda row: (progress.update(row), telemetry.on_row(row)),
                    to_record=row_writer(spec, schema), max_age_s=spec.output.max_part_age_s, inputs=inputs,
                    recorded=recorded)
    preparer = job_preparer(spec, llm.tokenizer, llm.max_model_len, carry, committed)
    rows = input_rows(spec, files, limit)

    stop = StopRequest()
    generate_s = 0.0
    try:
        with stop_on_signals(stop):
            try:
                generate_s = _generate(llm, spec, rows, preparer, sink, stop, telemetry)
            except KeyboardInterrupt:
                stop.set(signal.SIGINT)
            except Exception:
                _save_finished(sink)
                raise
            finally:
                sink.close()
                progress.close()
            with telemetry.stages.measure("write"):
                sink.flush()
        totals = Counts.total(writer.committed_stats())
        stats = job_stats(totals=totals, run=sink.run, job=spec.name, model=resolved["model"]["path"],
                          dtype=llm.config.dtype_choice.name, spec=resolved, spec_digest=digest,
                          started_at=started_at, wall_s=time.perf_counter() - wall_start, generate_s=generate_s,
                          resumed=bool(previous), complete=not stop.is_set(), limit=limit,
                          engine=engine_summary(telemetry.metrics, generate_s, telemetry.token_budget,
                                                llm.engine.executor.profile, llm.config.torch_device(),
                                                llm.config.world_size))
        crash_point("stats.before")
        writer.write_stats(stats)
        writer.write_telemetry(telemetry.to_dict())
        crash_point("stats.after")
        if stop.is_set():
            assert stop.signum is not None
            log.warning("%s: stopped by %s with %d rows committed; rerun the same command to resume",
                        spec.name, signal.Signals(stop.signum).name, totals.rows)
            raise JobInterrupted(stop.signum)
        if totals.rows and totals.error_rows / totals.rows > spec.max_error_rate:
            raise JobError(f"{totals.error_rows} of {totals.rows} rows failed, more than max_error_rate "
                           f"{spec.max_error_rate:g}; see the error column in {resolved['output']['path']}")
        writer.commit(stats)
    except (InputError, OutputError) as e:
        raise JobError(str(e)) from None
    log.info("%s: %d rows (%d ok, %d errors), %d prompt + %d generated tokens in %.1f s",
             spec.name, totals.rows, totals.ok_rows, totals.error_rows, totals.prompt_tokens,
             totals.completion_tokens, stats["wall_s"])
    return stats

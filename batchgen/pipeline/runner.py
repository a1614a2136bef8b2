"""Runs a job: read -> render/tokenize -> sort window -> engine -> write parts -> stats -> _SUCCESS."""
from __future__ import annotations

import logging
import signal
import time
from itertools import islice
from typing import Any, Iterable

from batchgen.engine import LLM, SamplingParams
from batchgen.io import InputError, InputRow, OutputError, read_rows, redact
from batchgen.pipeline import preflight
from batchgen.pipeline.errors import JobError, JobInterrupted
from batchgen.pipeline.interrupt import StopRequest, stop_on_signals
from batchgen.pipeline.progress import Progress
from batchgen.pipeline.render import PromptRenderer
from batchgen.pipeline.rows import PartSchema, engine_row
from batchgen.pipeline.sink import PartSink
from batchgen.pipeline.spec import JobSpec
from batchgen.pipeline.prefetch import Prefetcher
from batchgen.pipeline.stages import Preparer, admit, divert_errors, sorted_requests
from batchgen.pipeline.stats import Counts, job_stats, utc_now

log = logging.getLogger(__name__)

__all__ = ["run_job", "JobError", "JobInterrupted"]

PREFETCH_ROWS = 1024  # prepared rows queued ahead of the sort window


def sampling_params(spec: JobSpec) -> SamplingParams:
    s = spec.sampling
    return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          seed=s.seed, stop=list(s.stop))


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
              stop: StopRequest) -> float:
    """Streams every row through the engine into the sink; returns the seconds it took.

    One lazy chain feeds one ``generate_stream`` call, with reading, rendering and tokenizing in a
    background thread, so the engine neither drains between sort windows nor waits while one fills. At
    most the prefetch depth, a sort window and the engine's pending requests are held at once.
    """
    b = spec.batching
    prepared = Prefetcher(preparer.prepare(rows), depth=min(b.sort_window, PREFETCH_ROWS), name="prepare")
    try:
        requests = sorted_requests(divert_errors(prepared, sink.add), b.sort_window, b.sort)
        start = time.perf_counter()
        for req, out in llm.generate_stream(admit(requests, sampling_params(spec), stop.event)):
            sink.add(engine_row(req, out))
        return time.perf_counter() - start
    finally:
        prepared.close()


def run_job(spec: JobSpec, *, limit: int | None = None, overwrite: bool = False, quiet: bool = False,
            llm: LLM | None = None) -> dict[str, Any]:
    """Runs ``spec`` and returns its stats (also written to stats.json and _SUCCESS).

    Rows committed by an earlier run of the same output folder are skipped; a finished folder makes this a
    no-op unless ``overwrite``. ``limit`` takes the first N input rows. ``llm`` reuses a loaded model (its
    own engine settings then apply). Raises :class:`JobError` when the job cannot run or fails, and
    :class:`JobInterrupted` after SIGINT/SIGTERM, once the finished rows are committed.
    """
    wall_start, started_at = time.perf_counter(), utc_now()
    resolved, digest = spec.resolved(), spec.digest()
    carry = preflight.carry_columns(spec)
    files = preflight.check_inputs(spec)
    writer = preflight.open_output(spec, overwrite)
    if writer.is_complete():
        stored = preflight.stored_stats(writer)
        log.info("%s: already complete in %s; nothing to do (use --overwrite to run it again)",
                 spec.name, resolved["output"]["path"])
        if stored.get("limit") != limit:
            log.warning("%s: the finished run had --limit %s, this one %s; its output is kept as it is",
                        spec.name, stored.get("limit"), limit)
        return stored
    if llm is None:
        llm = preflight.load_model(spec)
    renderer = PromptRenderer(spec.prompt.template, spec.prompt.system, spec.prompt.chat, llm.tokenizer)
    committed, previous = writer.committed_row_ids(), writer.committed_stats()
    _warn_if_spec_changed(previous, digest)
    log.info("%s: %d input file(s) -> %s%s", spec.name, len(files), resolved["output"]["path"],
             f" (resuming: {len(committed)} rows already committed)" if committed else "")

    schema = PartSchema(spec.input.id_column or "id", carry)
    schema.seed(writer.committed_column_types())
    progress = Progress(limit, quiet, spec.name, done=min(len(committed), limit or len(committed)))
    sink = PartSink(writer, schema, spec.output.rows_per_part, digest, on_row=progress.update)
    max_prompt = min(spec.batching.max_prompt_tokens, llm.max_model_len - 1)  # room for >= 1 new token
    preparer = Preparer(renderer, carry, max_prompt, spec.batching.truncate, committed,
                        model_len=llm.max_model_len if max_prompt < spec.batching.max_prompt_tokens else None)
    rows: Iterable[InputRow] = read_rows(files, spec.input.format, spec.storage_options, spec.input.id_column)
    if limit is not None:
        rows = islice(rows, limit)

    stop = StopRequest()
    generate_s = 0.0
    try:
        with stop_on_signals(stop):
            try:
                generate_s = _generate(llm, spec, rows, preparer, sink, stop)
            except KeyboardInterrupt:
                stop.set(signal.SIGINT)
            except Exception:
                _save_finished(sink)
                raise
            finally:
                progress.close()
            sink.flush()
        totals = Counts.total(writer.committed_stats())
        stats = job_stats(totals=totals, run=sink.run, job=spec.name, model=resolved["model"]["path"],
                          dtype=llm.config.dtype_choice.name, spec=resolved, spec_digest=digest, started_at=started_at,
                          wall_s=time.perf_counter() - wall_start, generate_s=generate_s,
                          resumed=bool(previous), complete=not stop.is_set(), limit=limit)
        writer.write_stats(stats)
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

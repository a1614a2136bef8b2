"""The local executor: one lazy chain in this process, read -> render/tokenize -> sort window -> engine -> parts."""
from __future__ import annotations

import signal
import time
from typing import Iterable, Iterator

from batchgen.engine import LLM
from batchgen.io import InputRow, OutputWriter
from batchgen.pipeline import preflight
from batchgen.pipeline.interrupt import StopRequest
from batchgen.pipeline.job import Execution, RunPlan
from batchgen.pipeline.prefetch import Prefetcher
from batchgen.pipeline.progress import Progress
from batchgen.pipeline.rows import Request, ResultRow
from batchgen.pipeline.sink import PartSink
from batchgen.pipeline.spec import JobSpec
from batchgen.pipeline.stages import Preparer, divert_errors, input_rows, job_preparer, sorted_requests
from batchgen.pipeline.telemetry import Telemetry
from batchgen.pipeline.window_runner import committing, run_requests

PREFETCH_ROWS = 1024  # prepared rows queued ahead of the sort window


def _noting_prompts(items: Iterable[Request | ResultRow], progress: Progress) -> Iterator[Request | ResultRow]:
    """Passes prepared rows on, telling the progress bar each request's prompt length (for its ETA)."""
    for item in items:
        if isinstance(item, Request):
            progress.prepared(len(item.prompt_ids))
        yield item


def _generate(llm: LLM, spec: JobSpec, rows: Iterable[InputRow], preparer: Preparer, sink: PartSink,
              stop: StopRequest, telemetry: Telemetry, progress: Progress) -> float:
    """Streams every row through the engine into the sink; returns the seconds it took.

    One lazy chain feeds one ``generate_stream`` call, with reading, rendering and tokenizing in a
    background thread, so the engine neither drains between sort windows nor waits while one fills. At
    most the prefetch depth, a sort window and the engine's pending requests are held at once. Each
    stage's time goes to ``telemetry``.
    """
    b, clock = spec.batching, telemetry.stages
    prepare = _noting_prompts(clock.timed(preparer.prepare(clock.timed(progress.reading(rows), "read")),
                                          "render_tokenize"), progress)
    prepared = Prefetcher(prepare, depth=min(b.sort_window, PREFETCH_ROWS), name="prepare")
    write = clock.wrap(sink.add, "write")
    try:
        requests = clock.timed(sorted_requests(divert_errors(prepared, write), b.sort_window, b.sort),
                               "queue_wait")
        start = time.perf_counter()
        run_requests(llm, requests, stop.event, telemetry, write, cancel=stop.abort)
        return time.perf_counter() - start
    finally:
        prepared.close()


class LocalExecutor:
    """Runs the job in this process on one engine (``llm`` when given: its own engine settings then apply, and it
    stays open after the job; a model the executor loads itself is closed with it)."""

    def __init__(self, llm: LLM | None = None) -> None:
        self.llm = llm
        self._own: LLM | None = None

    def start(self, spec: JobSpec) -> None:
        if self.llm is None:
            self.llm = self._own = preflight.load_model(spec)

    def execute(self, plan: RunPlan, writer: OutputWriter, stop: StopRequest) -> Execution:
        llm, spec = self.llm, plan.spec
        assert llm is not None, "start() loads the model"
        telemetry = Telemetry(llm.engine.token_budget, start=plan.wall_start)
        telemetry.stages.add("startup", time.perf_counter() - plan.wall_start)
        progress = plan.progress()
        sink = plan.part_sink(writer, on_row=lambda row: (progress.update(row), telemetry.on_row(row)))
        preparer = job_preparer(spec, llm.tokenizer, llm.max_model_len, plan.carry, plan.committed)
        rows = input_rows(spec, plan.files, plan.limit)
        generate_s = 0.0
        try:
            with committing(sink, telemetry):
                try:
                    generate_s = _generate(llm, spec, rows, preparer, sink, stop, telemetry, progress)
                except KeyboardInterrupt:
                    stop.set(signal.SIGINT)
        finally:
            progress.close()
        engine = llm.metrics(generate_s, counters=telemetry.metrics)
        return Execution(run=sink.run, generate_s=generate_s, engine=engine, telemetry=telemetry.to_dict(),
                         executor={"kind": "local"}, dtype=llm.config.dtype_choice.name)

    def close(self) -> None:
        if self._own is not None:
            own, self._own, self.llm = self._own, None, None
            own.close()

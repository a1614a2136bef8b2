"""A run's plan (what is already committed, the inputs, the output schema) and what an executor hands back."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from batchgen.io import OutputWriter, count_rows
from batchgen.io.manifest import STATS
from batchgen.io.readers import detect_format
from batchgen.pipeline import preflight
from batchgen.pipeline.identity import JobIdentity
from batchgen.pipeline.interrupt import StopRequest
from batchgen.pipeline.openai_requests import default_url
from batchgen.pipeline.progress import Progress
from batchgen.pipeline.rows import PartSchema, ResultRow, openai_record
from batchgen.pipeline.sink import PartSink, PartWriter
from batchgen.pipeline.spec import JobSpec
from batchgen.pipeline.stats import Counts

log = logging.getLogger(__name__)


def row_writer(spec: JobSpec, schema: PartSchema) -> Callable[[ResultRow], dict[str, Any]]:
    """How a finished row becomes a record of the output format."""
    if spec.output.format != "openai":
        return lambda row: row.to_dict(schema.id_column)
    model = spec.resolved()["model"]["path"]
    url = default_url(spec.prompt is None or spec.prompt.chat)
    return lambda row: openai_record(row, model, url)


@dataclass
class RunPlan:
    """What this run of a job does, decided before any row is computed: the input files, the rows earlier runs
    committed (skipped), the input fingerprints to record, and the output schema to keep."""

    spec: JobSpec
    files: list[str]
    carry: list[str]
    limit: int | None
    committed: set[str]
    previous: list[dict[str, Any]]  # stats of the parts earlier runs committed
    inputs: dict[str, dict[str, Any]]  # fingerprint of each input file now
    recorded: set[str]  # input files whose fingerprint a committed part already holds
    schema: PartSchema
    identity: JobIdentity
    runs: list[dict[str, Any]] = field(default_factory=list)  # stats.json's runs of earlier runs that did work
    quiet: bool = False
    wall_start: float = field(default_factory=time.perf_counter)
    epoch_start: float = field(default_factory=time.time)  # wall_start on the clock other machines share
    started_at: str = ""

    @property
    def digest(self) -> str:
        return self.identity.digest

    def for_workers(self) -> RunPlan:
        """A copy without the sets that grow with the job, for processes that need neither."""
        return dataclasses.replace(self, committed=set(), previous=[], runs=[])

    def part_sink(self, writer: PartWriter, on_row: Callable[[ResultRow], None] | None = None) -> PartSink:
        """The sink that commits this run's rows as parts through ``writer``."""
        out = self.spec.output
        return PartSink(writer, self.schema, out.rows_per_part, self.digest, on_row=on_row,
                        to_record=row_writer(self.spec, self.schema), max_age_s=out.max_part_age_s,
                        inputs=self.inputs, recorded=self.recorded)

    def progress(self, total: int | None = None) -> Progress:
        """The bar starts at the rows already committed; its total is ``total`` when known, else the input's rows
        (at most ``limit``): Parquet files' from their footers now, JSONL files' counted in the background."""
        committed, limit, spec = len(self.committed), self.limit, self.spec
        done = min(committed, limit or committed)
        if total is not None:
            return Progress(self.quiet, spec.name, done=done, limit=limit, known=total)
        parquet = [f for f in self.files if detect_format(f, spec.input.format) == "parquet"]
        jsonl = [f for f in self.files if f not in set(parquet)]
        known = count_rows(parquet, spec.input.format, spec.storage_options) if parquet else 0  # footers only
        progress = Progress(self.quiet, spec.name, done=done, limit=limit, known=known, counting=bool(jsonl))
        if jsonl:
            progress.count_total(lambda cancel: count_rows(jsonl, spec.input.format, spec.storage_options, cancel))
        return progress


def earlier_runs(writer: OutputWriter) -> list[dict[str, Any]]:
    """The runs stats.json records: this job's, since the identity check passed (--overwrite deletes them)."""
    return list((writer.read_json(STATS) or {}).get("runs") or [])


def plan_run(spec: JobSpec, writer: OutputWriter, files: list[str], carry: list[str], identity: JobIdentity, *,
             limit: int | None, quiet: bool, wall_start: float, started_at: str) -> RunPlan:
    """Reads what earlier runs committed into ``writer``'s folder and checks the inputs against it."""
    committed, previous = writer.committed_row_ids(), writer.committed_stats()
    inputs, recorded = preflight.check_inputs_unchanged(writer, files, spec.storage_options,
                                                        positional_ids=spec.input.id_column is None)
    log.info("%s: %d input file(s) -> %s%s", spec.name, len(files), spec.resolved()["output"]["path"],
             f" (resuming: {len(committed)} rows already committed)" if committed else "")
    schema = PartSchema(spec.input.id_column or "id", carry)
    schema.seed(writer.committed_column_types())
    epoch_start = time.time() - (time.perf_counter() - wall_start)
    return RunPlan(spec, files, carry, limit, committed, previous, inputs, recorded, schema, identity,
                   earlier_runs(writer), quiet=quiet,
                   wall_start=wall_start, epoch_start=epoch_start, started_at=started_at)


@dataclass
class Execution:
    """What an executor did: this run's committed counts, the seconds from the first request to the last result,
    its engine totals (see ``LLM.metrics``), telemetry.json, how it ran (stats' ``executor``) and the
    dtype the model ran in ("auto" resolved)."""

    run: Counts
    generate_s: float
    engine: dict[str, Any]
    telemetry: dict[str, Any]
    executor: dict[str, Any]
    dtype: str


class Executor(Protocol):
    """Computes a run's rows and commits them as parts; the runner writes the stats and ``_SUCCESS`` after."""

    def start(self, spec: JobSpec) -> None:
        """Loads the model or connects to the cluster (before SIGINT/SIGTERM stop the job gracefully)."""

    def execute(self, plan: RunPlan, writer: OutputWriter, stop: StopRequest) -> Execution:
        """Runs every row of the plan, or those admitted before ``stop`` is set, committing them all."""

    def close(self) -> None:
        """Releases what ``start`` took: a model it loaded is closed (its engine's worker processes stop)."""

"""The input side of a Ray run: one shard per input file, the job's row ids decided over all of them first, and
the task each shard runs (read -> ids -> skip committed -> render + tokenize -> sort windows)."""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Iterator

import ray

from batchgen.io import InputRow, count_rows, read_rows, row_labels
from batchgen.pipeline import preflight
from batchgen.pipeline.spec import JobSpec
from batchgen.pipeline.stages import PlannedIds, RowIds, Window, job_preparer, windows

SHARD_CPUS = 1.0  # logical CPUs of a read or prepare task


@dataclass(frozen=True)
class Shard:
    """One input file; ``rows`` caps the rows read from it (``--limit``), None reads them all."""

    index: int
    file: str
    rows: int | None = None


@dataclass
class ShardPlan:
    """The shards, the per-file labels of default row ids, and the ids :class:`RowIds` gave to repeated ids
    (see :class:`PlannedIds`); ``total`` input rows, when the planning counted them."""

    shards: list[Shard]
    labels: dict[str, str]
    renamed: dict[tuple[str, int], str] = field(default_factory=dict)
    total: int | None = None


def _shard_rows(spec: JobSpec, file: str, labels: dict[str, str], rows: int | None) -> Iterator[InputRow]:
    found = read_rows([file], spec.input.format, spec.storage_options, spec.input.id_column,
                      max_row_bytes=spec.input.max_row_bytes, labels=labels)
    return islice(found, rows) if rows is not None else found


def _scan_ids(spec: JobSpec, file: str, labels: dict[str, str], cap: int | None) -> tuple[list[int], list[str]]:
    """(row indexes, ids as read) of a file's first ``cap`` rows."""
    indexes: list[int] = []
    ids: list[str] = []
    for row in _shard_rows(spec, file, labels, cap):
        indexes.append(row.index)
        ids.append(row.row_id)
    return indexes, ids


def plan_shards(spec: JobSpec, files: list[str], limit: int | None) -> ShardPlan:
    """Shards of ``files``, the first ``limit`` rows of them when given.

    Default ids (``"<file label>:<row index>"``) are unique per file, so only an id column needs a look at every
    row first: tasks read each file's ids in parallel and the driver assigns them in reading order exactly as a
    local run does, so a repeated id gets the same ``#dup`` id and ``duplicate_id`` error in any shard.
    """
    labels = row_labels(files)
    if spec.input.id_column is None and limit is None:
        return ShardPlan([Shard(i, f) for i, f in enumerate(files)], labels)
    task = ray.remote(_scan_ids if spec.input.id_column else count_rows).options(num_cpus=SHARD_CPUS)
    if spec.input.id_column:
        refs = [task.remote(spec, f, labels, limit) for f in files]
    else:
        refs = [task.remote([f], spec.input.format, spec.storage_options) for f in files]
    plan = ShardPlan([], labels, total=0)
    ids, remaining = RowIds(), limit
    for i, (file, ref) in enumerate(zip(files, refs)):
        if remaining == 0:
            ray.cancel(ref)
            continue
        found = ray.get(ref)
        indexes, raw = found if spec.input.id_column else (range(found), [])
        n = len(indexes) if remaining is None else min(len(indexes), remaining)
        for index, row_id in zip(indexes[:n], raw[:n]):
            assigned = ids.assign(row_id)
            if assigned != row_id:
                plan.renamed[(file, index)] = assigned
        plan.shards.append(Shard(i, file, n if limit is not None else None))
        plan.total = (plan.total or 0) + n
        remaining = None if remaining is None else remaining - n
    return plan


@dataclass
class PrepareJob:
    """What every prepare task needs: the spec, the shards, the carried columns, and (in the object store) the
    ids already committed."""

    spec: JobSpec
    shards: ShardPlan
    carry: list[str]
    committed: Any  # ObjectRef of set[str]


_tokenizers: dict[tuple[str, int | None], tuple[Any, int]] = {}
_committed: dict[str, set[str]] = {}


def _tokenizer(spec: JobSpec) -> tuple[Any, int]:
    """The model's tokenizer and context, loaded once per worker process."""
    key = (spec.model.path, spec.engine.max_model_len)
    if key not in _tokenizers:
        _tokenizers[key] = preflight.load_tokenizer(spec)
    return _tokenizers[key]


def _committed_ids(ref: Any) -> set[str]:
    """The committed ids behind ``ref``, fetched once per worker process (the latest job's only)."""
    key = ref.hex()
    if key not in _committed:
        _committed.clear()
        _committed[key] = ray.get(ref)
    return _committed[key]


def window_key(shard: int, window: int) -> str:
    return f"s{shard:05d}-w{window:05d}"


def prepare_windows(item: dict[str, Any], job: PrepareJob) -> Iterator[dict[str, Any]]:
    """A Ray Data row naming a shard -> one row per sort window of the shard: its key, its row count and the
    window itself (pickled: it crosses to an engine replica of the same job)."""
    spec, b = job.spec, job.spec.batching
    shard = job.shards.shards[int(item["shard"])]
    tokenizer, model_len = _tokenizer(spec)
    preparer = job_preparer(spec, tokenizer, model_len, job.carry, _committed_ids(job.committed),
                            ids=PlannedIds(job.shards.renamed))
    rows = _shard_rows(spec, shard.file, job.shards.labels, shard.rows)
    for n, window in enumerate(windows(preparer.prepare(rows), b.sort_window, b.sort)):
        yield {"window": window_key(shard.index, n), "rows": len(window),
               "payload": pickle.dumps(window, protocol=pickle.HIGHEST_PROTOCOL)}


def load_window(payload: bytes) -> Window:
    """A window that ``prepare_windows`` of this same job pickled."""
    return pickle.loads(payload)

"""The row stages before the engine: id assignment, skip on resume, render + tokenize, truncate, sort."""
from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol

from batchgen.engine import SamplingParams
from batchgen.io import InputRow, read_rows, redact
from batchgen.pipeline.batching import prompt_sort_key, sort_window
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.openai_requests import OpenAIPrompts
from batchgen.pipeline.render import PromptRenderer, PromptTokenizer, RenderError, TruncateMode, truncate
from batchgen.pipeline.rows import Request, ResultRow, carried_values, error_row
from batchgen.pipeline.sampling import row_seed
from batchgen.pipeline.spec import JobSpec

DUP_MARK = "#dup"


@dataclass
class RowIds:
    """Output ids that stay unique: the first occurrence of an input id keeps it, the k-th later one
    becomes ``"<id>#dup<k>"`` (skipping any id already taken) and is written as a ``duplicate_id`` error.

    Ids depend only on the input rows before them, so a rerun over the same input assigns the same ids
    and resume can skip committed rows by id, duplicates included.
    """

    seen: set[str] = field(default_factory=set)
    dup_counts: dict[str, int] = field(default_factory=dict)

    def assign(self, row_id: str) -> str:
        if row_id not in self.seen:
            self.seen.add(row_id)
            return row_id
        k = self.dup_counts.get(row_id, 0)
        while True:
            k += 1
            candidate = f"{row_id}{DUP_MARK}{k}"
            if candidate not in self.seen:
                break
        self.dup_counts[row_id] = k
        self.seen.add(candidate)
        return candidate

    def for_row(self, row: InputRow) -> str:
        return self.assign(row.row_id)


@dataclass
class PlannedIds:
    """The ids :class:`RowIds` gave a job's rows, decided beforehand over all of them: ``renamed`` maps
    (input file, row index) to the id of a later occurrence of an id; every other row keeps its own. A shard of
    the input then assigns the job's ids on its own."""

    renamed: dict[tuple[str, int], str] = field(default_factory=dict)

    def for_row(self, row: InputRow) -> str:
        return self.renamed.get((row.source, row.index), row.row_id)


class IdAssigner(Protocol):
    def for_row(self, row: InputRow) -> str: ...


class PromptSource(Protocol):
    """Turns a row's values into prompt token ids and the request's sampling (its seed the row's own, see
    ``row_seed``); raises RenderError."""

    def build(self, values: Mapping[str, Any], row_id: str) -> tuple[list[int], SamplingParams]: ...


@dataclass
class TemplatePrompts:
    """The spec's prompt template, with the spec's sampling for every row; a rendered prompt over
    ``max_chars`` is cut (or refused, see render.fit_chars) as it is rendered, before it is tokenized."""

    renderer: PromptRenderer
    params: SamplingParams
    max_chars: int
    truncate_mode: TruncateMode

    def build(self, values: Mapping[str, Any], row_id: str) -> tuple[list[int], SamplingParams]:
        text = self.renderer.render_text(values, self.max_chars, self.truncate_mode)
        params = self.params
        if params.seed is not None:
            params = copy.copy(params)  # the spec's checked fields, with the row's own seed
            params.seed = row_seed(self.params.seed, row_id)
        return self.renderer.encode(text), params


def prompt_source(spec: JobSpec, tokenizer: PromptTokenizer) -> PromptSource:
    """OpenAI Batch lines bring their own prompts and settings; other inputs go through the spec's template."""
    if spec.input.format == "openai":
        return OpenAIPrompts(tokenizer, spec.sampling, spec.batching.prompt_chars())
    p = spec.prompt
    assert p is not None  # the spec requires it for every other input format
    if p.chat and getattr(tokenizer, "chat_template", None) is None:
        raise JobError("prompt.chat is true but the model has no chat template (a base model?); set "
                       "prompt.chat: false to send the rendered prompt as it is")
    return TemplatePrompts(PromptRenderer(p.template, p.system, p.chat, tokenizer), spec.sampling.params(),
                           spec.batching.prompt_chars(), spec.batching.truncate)


@dataclass
class Preparer:
    """Turns input rows into engine requests, or into error rows for those that cannot run."""

    prompts: PromptSource
    carry_columns: list[str]
    max_prompt_tokens: int
    truncate_mode: TruncateMode
    committed: set[str]
    model_len: int | None = None  # the model's context, when it is what limits max_prompt_tokens
    ids: IdAssigner = field(default_factory=RowIds)
    skipped: int = 0  # rows already committed by an earlier run
    truncated: int = 0  # prompts cut to max_prompt_tokens ("left"/"right"; "error" makes them error rows)

    def prepare(self, rows: Iterable[InputRow]) -> Iterator[Request | ResultRow]:
        for row in rows:
            row_id = self.ids.for_row(row)
            if row_id in self.committed:
                self.skipped += 1
                continue
            carried = carried_values(row.values, self.carry_columns)
            if row_id != row.row_id:
                yield error_row(row_id, carried, "duplicate_id",
                                f"id {row.row_id!r} appeared earlier in the input; this occurrence "
                                f"(row {row.index} of {redact(row.source)}) is not run", row.source)
            elif row.error is not None:
                yield error_row(row_id, carried, "invalid_input", row.error, row.source)
            else:
                try:
                    ids, params = self.prompts.build(row.values, row_id)
                    if len(ids) > self.max_prompt_tokens:
                        ids = truncate(ids, self.max_prompt_tokens, self.truncate_mode)
                        self.truncated += 1
                except RenderError as e:
                    message = e.message
                    if e.code == "prompt_too_long" and self.model_len is not None:
                        message += (f" (the engine takes {self.model_len} tokens a sequence, one kept for output: "
                                    f"the least of the model's context, engine.max_model_len and what "
                                    f"engine.kv_cache_memory holds)")
                    yield error_row(row_id, carried, e.code, message, row.source)
                    continue
                yield Request(row_id, carried, ids, params, row.source)


def job_preparer(spec: JobSpec, tokenizer: PromptTokenizer, model_len: int, carry: list[str],
                 committed: set[str], ids: IdAssigner | None = None) -> Preparer:
    """The job's row preparation for a model of context ``model_len``; the run and ``batchgen plan`` both
    use it, so that the plan's token counts are the run's. ``ids``: see :class:`PlannedIds` (default: assign
    them in reading order)."""
    max_prompt = min(spec.batching.max_prompt_tokens, model_len - 1)  # room for >= 1 new token
    return Preparer(prompt_source(spec, tokenizer), carry, max_prompt, spec.batching.truncate, committed,
                    model_len=model_len if max_prompt < spec.batching.max_prompt_tokens else None,
                    ids=ids or RowIds())


def input_rows(spec: JobSpec, files: list[str], limit: int | None) -> Iterator[InputRow]:
    """The job's input rows in reading order, the first ``limit`` only when given."""
    rows = read_rows(files, spec.input.format, spec.storage_options, spec.input.id_column,
                     max_row_bytes=spec.input.max_row_bytes)
    return islice(rows, limit) if limit is not None else rows


def divert_errors(items: Iterable[Request | ResultRow], on_error: Callable[[ResultRow], None]
                  ) -> Iterator[Request]:
    """Passes requests on; error rows go to ``on_error`` as they come, so none wait for the engine."""
    for item in items:
        if isinstance(item, ResultRow):
            on_error(item)
        else:
            yield item


@dataclass
class Window:
    """A sort window's requests, in the order the engine gets them, and the error rows read among them."""

    requests: list[Request]
    errors: list[ResultRow]

    def __len__(self) -> int:
        return len(self.requests) + len(self.errors)


def windows(items: Iterable[Request | ResultRow], size: int, sort: bool) -> Iterator[Window]:
    """Prepared rows cut into windows of ``size`` requests, each sorted as ``sorted_requests`` sorts them; a window
    also ends at ``size`` error rows, so that a run of them is held in bounded memory too."""
    requests: list[Request] = []
    errors: list[ResultRow] = []
    for item in items:
        if isinstance(item, ResultRow):
            errors.append(item)
            if len(errors) == size:
                yield Window(list(sorted_requests(requests, size, sort)), errors)
                requests, errors = [], []
            continue
        requests.append(item)
        if len(requests) == size:
            yield Window(list(sorted_requests(requests, size, sort)), errors)
            requests, errors = [], []
    if requests or errors:
        yield Window(list(sorted_requests(requests, size, sort)), errors)


def sorted_requests(requests: Iterable[Request], window: int, enabled: bool) -> Iterator[Request]:
    """Longest prompts first within each window, rows sharing a prefix side by side (see batching)."""
    if not enabled:
        return iter(requests)
    return sort_window(requests, key=lambda r: prompt_sort_key(r.prompt_ids), window=window)


def admit(requests: Iterable[Request], stop: threading.Event
          ) -> Iterator[tuple[Request, list[int], SamplingParams]]:
    """The engine's request stream; it ends as soon as ``stop`` is set, so no new work is admitted."""
    for req in requests:
        if stop.is_set():
            return
        yield req, req.prompt_ids, req.params

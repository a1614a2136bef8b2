"""Checks before any compute: inputs exist and hold the needed columns, output is writable, model loads."""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from fsspec.core import split_protocol
from jinja2 import Environment, nodes

from batchgen.engine import LLM
from batchgen.engine.loading.loader import load_model_source
from batchgen.engine.models.registry import model_config
from batchgen.io import (InputError, OutputError, OutputWriter, count_rows, expand_inputs, read_columns, redact,
                         row_labels)
from batchgen.io.fingerprint import difference, fingerprints
from batchgen.io.lease import LeaseSettings
from batchgen.io.manifest import PartId, part_name
from batchgen.io.paths import filesystem, would_list
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.openai_requests import CARRY_COLUMNS as OPENAI_CARRY
from batchgen.pipeline.render import required_columns
from batchgen.pipeline.rows import RESULT_COLUMNS
from batchgen.pipeline.sink import INPUTS_KEY
from batchgen.pipeline.spec import JobSpec, SpecError

log = logging.getLogger(__name__)

_SHOWN_FILES = 3


def optional_columns(template: str) -> set[str]:
    """Columns the template can do without: tested with ``is defined``/``is undefined`` anywhere, or only
    ever read through the ``default`` filter."""
    ast = Environment().parse(template)
    guarded = {n.node.name for n in ast.find_all(nodes.Test)
               if n.name in ("defined", "undefined") and isinstance(n.node, nodes.Name)}
    defaulted = Counter(n.node.name for n in ast.find_all(nodes.Filter)
                        if n.name in ("default", "d") and isinstance(n.node, nodes.Name))
    uses = Counter(n.name for n in ast.find_all(nodes.Name) if n.ctx == "load")
    return guarded | {name for name, k in defaulted.items() if k == uses[name]}


def carry_columns(spec: JobSpec) -> list[str]:
    """Carried columns in spec order; the id column is always written, so carrying it is a no-op.

    OpenAI Batch output carries only what its lines need.
    """
    if spec.output.format == "openai":
        return list(OPENAI_CARRY) if spec.input.format == "openai" else []
    id_column = spec.input.id_column or "id"
    clash = [f"output.carry_columns: {c!r} clashes with an output column of the same name"
             for c in spec.output.carry_columns if c in RESULT_COLUMNS]
    if spec.input.id_column is None and "id" in spec.output.carry_columns:  # its values would be lost silently
        clash.append("output.carry_columns: 'id' is the output's column of row ids ('<file>:<row>' without "
                     "input.id_column); set input.id_column: id to keep the input's ids as the row ids")
    if clash:
        raise SpecError(clash)
    return list(dict.fromkeys(c for c in spec.output.carry_columns if c != id_column))


def _files_list(files: list[str]) -> str:
    shown = ", ".join(redact(f) for f in files[:_SHOWN_FILES])
    return shown + (f" and {len(files) - _SHOWN_FILES} more" if len(files) > _SHOWN_FILES else "")


def check_inputs(spec: JobSpec) -> list[str]:
    """The input files; raises JobError for missing or corrupt files, and for files lacking a column the
    template needs or the id column."""
    opts = spec.storage_options
    try:
        files = expand_inputs(spec.input.path, opts)
        _refuse_output_among(files, spec)
        template = spec.prompt.template if spec.prompt is not None else ""
        needed = required_columns(template) - optional_columns(template)
        if spec.input.id_column:
            needed.add(spec.input.id_column)
        if not needed:
            return files
        lacking: dict[str, list[str]] = {}
        for f in files:
            columns = read_columns([f], spec.input.format, opts, wanted=frozenset(needed))
            if not columns and count_rows([f], spec.input.format, opts) == 0:
                continue  # a file with no rows lacks nothing: it adds none
            for col in sorted(needed - columns):
                lacking.setdefault(col, []).append(f)
    except InputError as e:
        raise JobError(str(e)) from None
    if lacking:
        cols = ", ".join(f"'{c}'" for c in sorted(lacking))
        where = sorted({f for fs in lacking.values() for f in fs})
        raise JobError(f"the job needs column(s) {cols}, missing from input file(s) "
                       f"{_files_list(where)}")
    return files


def _refuse_output_among(files: list[str], spec: JobSpec) -> None:
    """Raises JobError when an input file lies in the output folder (a run would mix its rows with the input's
    files, and --overwrite or the cleanup of a killed run's parts would delete them), or when the output folder
    lies where an input folder or glob would take its parts as input rows on the next run."""
    fs, out = filesystem(spec.output.path, spec.storage_options)
    out, protocol = out.rstrip("/") + "/", split_protocol(spec.output.path)[0] or "file"
    for f in files:
        if (split_protocol(f)[0] or "file") == protocol and fs._strip_protocol(f).startswith(out):
            raise JobError(redact(f"input file {f} lies in the output folder {spec.output.path}: choose an output "
                                  f"folder apart from the input"))
    part = spec.output.path.rstrip("/") + "/" + part_name(PartId(), spec.output.format)
    paths = [spec.input.path] if isinstance(spec.input.path, str) else spec.input.path
    for path in paths:
        if would_list(path, part, spec.storage_options):
            raise JobError(redact(f"the output folder {spec.output.path} lies inside the input {path}: a rerun "
                                  f"would read its parts as input rows; choose an output folder outside the input"))


def open_output(spec: JobSpec, overwrite: bool, force_unlock: bool = False) -> OutputWriter:
    """Takes the output folder's lease and opens it (checking that it is writable); ``overwrite`` deletes
    earlier output; ``force_unlock`` takes the lease even from a live run."""
    lease = LeaseSettings(timeout_s=spec.output.lease_timeout_s, force=force_unlock)
    try:
        return OutputWriter(spec.output.path, spec.output.format, spec.storage_options, overwrite=overwrite,
                            id_key=spec.input.id_column or "id", lease=lease)
    except OutputError as e:
        raise JobError(str(e)) from None


def _recorded_inputs(writer: OutputWriter) -> dict[str, dict[str, Any]]:
    """{redacted input URL: fingerprint} as recorded when the file's rows were first committed."""
    recorded: dict[str, dict[str, Any]] = {}
    for stats in writer.committed_stats():
        for item in stats.get(INPUTS_KEY) or []:
            if isinstance(item, dict) and "file" in item:
                recorded.setdefault(str(item["file"]), item)
    return recorded


def check_inputs_unchanged(writer: OutputWriter, files: list[str], storage_options: dict[str, Any],
                           positional_ids: bool = False) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """(fingerprint of each input file now, files whose fingerprint earlier parts already hold); warns,
    naming the file, about each input whose committed rows came from other content. With ``positional_ids``
    (no id column: a row is known by its file and line) a file whose size or etag changed is refused: its
    committed rows could stand for other lines now."""
    current, recorded = fingerprints(files, storage_options), _recorded_inputs(writer)
    for url, label in row_labels(files).items():  # recorded with the fingerprint: the label default ids start with
        if url in current:  # (a file that could not be listed has none)
            current[url]["label"] = label
    for url, now in current.items():
        before = recorded.get(redact(url))
        if positional_ids and before and before.get("label") not in (None, now["label"]):
            raise JobError(redact(
                f"input file {url} is labelled {now['label']!r} in default row ids now, {before['label']!r} when its "
                f"rows were committed (the inputs' files with the same name changed): its committed rows would run "
                f"again under new ids. Restore the inputs, set input.id_column, or rerun with --overwrite"))
        change = difference(before, now) if before else None
        if change and positional_ids and any(before.get(k) not in (None, now.get(k)) for k in ("size", "etag")):
            raise JobError(redact(f"input file {url} changed since its rows were first committed ({change}); "
                                  f"without input.id_column a row is known by its position, so the committed rows "
                                  f"may no longer be the file's. Restore the file, or rerun with --overwrite"))
        if change:
            log.warning("input file %s changed since its rows were first committed (%s); the committed rows "
                        "are kept as they are, the others are read from the file as it is now (use "
                        "--overwrite to recompute them all)", redact(url), change)
    named = {redact(url) for url in current}
    for name in sorted(set(recorded) - named):
        log.warning("input file %s, whose rows were committed, is no longer among the inputs", name)
    return current, {url for url in current if redact(url) in recorded}


def stored_stats(writer: OutputWriter) -> dict[str, Any]:
    """The stats a finished job left in _SUCCESS."""
    try:
        return writer.success_stats()
    except (OutputError, ValueError) as e:  # unreadable, or not JSON
        raise JobError(redact(f"cannot read {writer.path}/_SUCCESS: {type(e).__name__}: {e}")) from None


def model_failure(spec: JobSpec, what: str, e: Exception) -> JobError:
    message = " ".join(str(e).split()) or type(e).__name__
    return JobError(redact(f"cannot load {what}{spec.resolved()['model']['path']}: {message}"))


def check_job(spec: JobSpec) -> tuple[list[str], list[str]]:
    """What ``batchgen validate`` checks beyond the spec, without loading weights: (what was found, the
    problems): the model resolves and the input files exist and hold the columns the job needs."""
    from batchgen.engine.loading.hub import describe_model, is_local_model

    found, problems = [], []
    try:
        found.append(f"model: {describe_model(spec.model.path, spec.storage_options)}")
        if is_local_model(spec.model.path):  # its config too: architecture, quantization, context (no weights)
            load_tokenizer(spec)
    except JobError as e:
        problems.append(redact(str(e)))
    except Exception as e:  # noqa: BLE001 - a missing path, an unreachable or refused URL alike
        problems.append(redact(f"model {spec.resolved()['model']['path']}: {' '.join(str(e).split())}"))
    draft = spec.engine.speculative_config.get("model")
    if isinstance(draft, str):  # draft_model's draft: checked as the model is
        try:
            found.append(f"draft model: {describe_model(draft, spec.storage_options)}")
        except Exception as e:  # noqa: BLE001
            problems.append(redact(f"engine.speculative_config.model {draft}: {' '.join(str(e).split())}"))
    try:
        files = check_inputs(spec)
        found.append(f"input: {len(files)} file(s): {_files_list(files)}")
    except JobError as e:
        problems.append(redact(str(e)))
    try:
        carry_columns(spec)
    except SpecError as e:
        problems += e.errors
    return found, problems


def load_tokenizer(spec: JobSpec) -> tuple[Any, int]:
    """(the model's tokenizer, its context length) without loading weights (a remote folder is fetched without
    its weight files)."""
    try:
        source = load_model_source(spec.model.path, spec.storage_options, weights=False)
        return source.tokenizer, model_config(source.config).context_len(spec.engine.max_model_len)
    except Exception as e:  # noqa: BLE001 - bad paths, unsupported architectures, bad tokenizers alike
        raise model_failure(spec, "the tokenizer of ", e) from None


def load_model(spec: JobSpec) -> LLM:
    """The job's engine; refused when its KV cache is what keeps rows the job allows from running (they would all
    be committed as error rows, and a rerun with a larger cache keeps them)."""
    try:
        llm = LLM.from_config(spec.engine_config())
    except Exception as e:  # noqa: BLE001 - bad paths, unsupported architectures, bad weights alike
        raise model_failure(spec, "model ", e) from None
    needed = min(spec.batching.max_prompt_tokens + 1, llm.engine.model_config.context_len(spec.engine.max_model_len))
    if llm.max_model_len < needed:
        llm.close()
        raise JobError(f"the engine's KV cache holds {llm.max_model_len} tokens, fewer than the {needed} a row may "
                       f"take (a prompt of up to batching.max_prompt_tokens and one token out, within the model's "
                       f"context): raise engine.kv_cache_memory, or lower batching.max_prompt_tokens or "
                       f"engine.max_model_len")
    return llm

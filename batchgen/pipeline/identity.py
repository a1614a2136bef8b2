"""Job identity: the part of a spec that changes outputs (and the model's weights), recorded in the output folder;
a run whose identity differs from the recorded one is refused."""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from batchgen.engine.loading.hub import describe_model, resolve_model_path
from batchgen.io import OutputError, OutputFolder, OutputWriter, redact
from batchgen.io.fingerprint import tree_digest
from batchgen.io.manifest import JOB
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.preflight import model_failure
from batchgen.pipeline.sampling import SamplingSpec
from batchgen.pipeline.spec import JobSpec

log = logging.getLogger(__name__)

# The spec keys that change what a row's output is, as dotted paths into JobSpec.resolved(). A key naming a section
# stands for each of its fields. Everything else (batching sort knobs, engine performance knobs, parts, lease,
# executor, replicas, credentials) only changes how and where rows are computed, and a run may change it to resume.
OUTPUT_KEYS: tuple[str, ...] = (
    "model.path", "engine.dtype", "engine.max_model_len",
    "prompt.system", "prompt.template", "prompt.chat",
    "sampling",
    "batching.max_prompt_tokens", "batching.truncate", "batching.max_prompt_chars",
    "input.path", "input.format", "input.id_column", "input.max_row_bytes",
    "output.format", "output.carry_columns",
)
# Keys renamed in the spec since an output recorded them: {old: new}, so that outputs written before a rename
# resume (add an entry when renaming a key of OUTPUT_KEYS).
RENAMED_KEYS: dict[str, str] = {}
# Keys added to the spec since an output recorded its identity: {key: the value that acts as before it existed}.
# An output without such a key resumes while the spec keeps that value (add an entry when adding a field under
# OUTPUT_KEYS).
ADDED_KEYS: dict[str, Any] = {f"sampling.{name}": SamplingSpec.model_fields[name].default  # their neutral defaults
                              for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")}
# A JSON Schema's key order is the order its outputs' fields are generated in: it is recorded as JSON text.
SCHEMA_KEY = "sampling.json_schema"
WEIGHTS_KEY = "model.weights"  # not a spec key: the digest of the model's files (see io.fingerprint.tree_digest)
# How that digest is taken, its prefix; outputs that recorded an older kind ("sha256": large files sampled) are
# taken as made by the weights they find, and record the new kind.
WEIGHTS_DIGEST = "sha256-full"


def spec_values(spec: JobSpec, keys: tuple[str, ...] = OUTPUT_KEYS) -> dict[str, Any]:
    """{dotted key: value} of ``keys`` in ``spec`` (a section's fields one by one; an absent optional section's
    keys are None). A key that names no spec field raises KeyError: the list must follow the spec."""
    data, out = spec.resolved(), {}
    for key in keys:
        node: Any = data
        for name in key.split("."):
            if node is None:
                break
            if not isinstance(node, dict) or name not in node:
                raise KeyError(f"identity key {key!r} names no field of the job spec")
            node = node[name]
        if isinstance(node, dict) and key.count(".") == 0:
            out.update({f"{key}.{k}": v for k, v in sorted(node.items())})
        else:
            out[key] = node
    if isinstance(out.get(SCHEMA_KEY), dict):  # as text: metadata files sort their keys, a schema's order counts
        out[SCHEMA_KEY] = json.dumps(out[SCHEMA_KEY], ensure_ascii=False, separators=(",", ":"))
    return out


def weights_digest(model_path: str, storage_options: dict[str, Any]) -> str:
    """The digest of a model's files: a built-in name's cached file, a local file or folder, or a remote URL's
    listing (sizes and etags, nothing downloaded)."""
    remote = "://" in model_path and not model_path.startswith("file://")
    if not remote:
        describe_model(model_path)  # names what a path that is no model lacks (a folder without config.json, ...)
    path = model_path if remote else resolve_model_path(model_path, storage_options)  # checks it, names built-ins
    return f"{WEIGHTS_DIGEST}:" + tree_digest(path, storage_options)


@dataclass(frozen=True)
class Change:
    key: str
    recorded: Any
    now: Any

    def describe(self) -> str:
        return f"{self.key}: {_show(self.recorded, self.key)} -> {_show(self.now, self.key)}"


def _same(key: str, recorded: Any, now: Any) -> bool:
    """Whether a recorded value is the current one; a schema that an older output recorded as a mapping (its key
    order lost) is taken as the same when its keys and values are."""
    if key == SCHEMA_KEY and isinstance(recorded, dict) and isinstance(now, str):
        return recorded == json.loads(now)
    return recorded == now


def _show(value: Any, key: str = "") -> str:
    if key == SCHEMA_KEY and isinstance(value, str):  # JSON text already
        text = value
    else:
        text = json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    return text if len(text) <= 120 else text[:117] + "..."


@dataclass(frozen=True)
class JobIdentity:
    """What makes a job's outputs what they are: ``values`` by dotted key, weights digest included."""

    values: dict[str, Any]

    @property
    def digest(self) -> str:
        canon = json.dumps(self.values, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
        return hashlib.sha256(canon.encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {"digest": self.digest, "values": self.values}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobIdentity:
        """A recorded identity, its renamed keys under their new names."""
        return cls({RENAMED_KEYS.get(k, k): v for k, v in (data.get("values") or {}).items()})

    def changes(self, recorded: JobIdentity) -> list[Change]:
        """Every key whose value differs from ``recorded`` (a key only one side has counts as changed, unless
        ADDED_KEYS gives its value from before it existed)."""
        keys = sorted(set(self.values) | set(recorded.values))
        old = str(recorded.values.get(WEIGHTS_KEY) or "").split(":", 1)[0]
        if old and old != WEIGHTS_DIGEST:
            log.warning("the output recorded its model's weights by an older digest (%s); they are taken as the "
                        "weights found now", old)
            keys.remove(WEIGHTS_KEY)
        was = {**ADDED_KEYS, **recorded.values}
        return [Change(k, was.get(k), self.values.get(k)) for k in keys if not _same(k, was.get(k), self.values.get(k))]


def job_identity(spec: JobSpec, model_path: str | None = None) -> JobIdentity:
    """The spec's identity; ``model_path`` is where the weights really are when it is not ``spec.model.path``
    (a loaded model handed to the run)."""
    values = spec_values(spec)
    try:
        values[WEIGHTS_KEY] = weights_digest(model_path or spec.model.path, spec.storage_options)
    except Exception as e:  # noqa: BLE001 - bad paths, unreadable files, failed downloads alike
        raise model_failure(spec, "model ", e) from None
    return JobIdentity(values)


def refusal(output: str, changes: list[Change]) -> str:
    """The message of a run refused because its identity differs from the one recorded in ``output``."""
    listed = "; ".join(c.describe() for c in changes)
    return redact(f"{output} holds rows made by a different job: changed since they were made: {listed}. Its rows "
                  f"would mix two jobs, so nothing was run or changed. Rerun with --overwrite to replace them, or "
                  f"set another output.path to keep them")


def _refuse_change(output: str, recorded: dict[str, Any] | None, identity: JobIdentity) -> None:
    if recorded is None:
        return
    changes = identity.changes(JobIdentity.from_dict(recorded))
    if changes:
        raise JobError(refusal(output, changes))


def check_recorded(spec: JobSpec, identity: JobIdentity) -> None:
    """Raises JobError when the output folder holds rows of a job with another identity; reads only, so a refused
    run leaves the folder as it was. A folder that cannot be read is left to the writer, which says why."""
    try:
        folder = OutputFolder(spec.output.path, spec.storage_options)
        holds_rows = bool(folder.entries()) or folder.read_json("_SUCCESS") is not None
        recorded = folder.read_json(JOB) if holds_rows else None
    except OutputError:
        return
    _refuse_change(spec.resolved()["output"]["path"], recorded, identity)


def record(spec: JobSpec, writer: OutputWriter, identity: JobIdentity) -> None:
    """Under the folder's lease: checks again (a run may have committed since ``check_recorded``), then records
    ``identity`` as the one the folder's rows are made by. A folder without committed rows takes the new one."""
    output = spec.resolved()["output"]["path"]
    recorded = writer.read_json(JOB)
    holds_rows = bool(writer.committed_row_ids()) or writer.is_complete()
    if holds_rows:
        _refuse_change(output, recorded, identity)
        if recorded is None:
            log.warning("%s was written before batchgen recorded what made its rows; they are taken as made by this "
                        "spec (use --overwrite to start over)", output)
    if recorded != identity.to_dict():
        writer.write_job(identity.to_dict())

"""Job spec: YAML with ${ENV} interpolation and --set overrides, validated by pydantic, every error at once."""
from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Sequence, get_args, get_origin

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from batchgen.engine.config import EngineConfig
from batchgen.io.paths import url_problem
from batchgen.io.redaction import redact
from batchgen.pipeline.engine_spec import EngineSpec, move_legacy_keys, renamed_path
from batchgen.pipeline.executors.ray_extra import RAY_EXTRA_HINT, ray_available
from batchgen.pipeline.render import check_template
from batchgen.pipeline.sampling import OneOrMany, SamplingSpec, check_constraints
from batchgen.pipeline.spec_types import Number

KeyPath = tuple[str | int, ...]
WEEK_S = 7 * 86400


class SpecError(Exception):
    """An invalid job spec; ``errors`` holds one ``"key.path: message"`` line per problem."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _location(url: str) -> str:
    problem = url_problem(url)
    if problem:
        raise ValueError(problem)
    return url


Location = Annotated[str, Field(min_length=1), AfterValidator(_location)]


class ModelSpec(_Section):
    """``path``: a built-in model name, a local folder or .gguf file, or an fsspec URL. How the engine runs it
    (dtype, device, parallel sizes, ...) is the ``engine`` section's."""

    path: Location


class InputSpec(_Section):
    """``path``: URLs or globs. Without ``id_column`` rows get stable ``"<file>:<row>"`` ids in column "id".

    ``format: openai`` reads OpenAI Batch request lines: ``custom_id`` is the row id, each line brings its own
    prompt and sampling settings (the spec's are the defaults).
    """

    path: Annotated[OneOrMany, AfterValidator(lambda paths: [_location(p) for p in paths])] = Field(min_length=1)
    format: Literal["auto", "parquet", "jsonl", "openai"] = "auto"
    id_column: str | None = None
    max_row_bytes: Number[int] = Field(default=32 << 20, ge=1, le=1 << 40)  # a longer JSONL line or Parquet row is an error row

    @model_validator(mode="after")
    def _openai_ids(self) -> "InputSpec":
        if self.format == "openai":
            if self.id_column not in (None, "custom_id"):
                raise ValueError("format openai: the row id is custom_id; leave id_column unset")
            self.id_column = "custom_id"
        return self


class PromptSpec(_Section):
    """A Jinja2 template over the row's columns; ``chat`` wraps it in the model's chat template."""

    system: str | None = None
    template: str = Field(min_length=1)
    chat: bool = True

    @field_validator("template")
    @classmethod
    def _parses(cls, v: str) -> str:
        check_template(v)
        return v


class BatchingSpec(_Section):
    """Prompt limits; ``sort_window`` rows are read ahead and sorted by prompt length unless ``sort`` is false.
    The engine's step budgets are the ``engine`` section's (max_num_batched_tokens, max_num_seqs)."""

    sort_window: Number[int] = Field(default=4096, ge=1, le=10**7)
    max_prompt_tokens: Number[int] = Field(default=4096, ge=1, le=2**31 - 1)
    truncate: Literal["error", "left", "right"] = "error"
    sort: bool = True
    # rendered prompts longer than this are cut (truncate left/right) or error rows before tokenizing;
    # None: 32 characters per token of max_prompt_tokens
    max_prompt_chars: Number[int | None] = Field(default=None, ge=1, le=1 << 40)

    def prompt_chars(self) -> int:
        return self.max_prompt_chars or 32 * self.max_prompt_tokens


class OutputSpec(_Section):
    """A folder URL; ``carry_columns`` are input columns copied to each output row.

    ``format: openai`` writes OpenAI Batch result lines (``part-N.jsonl``) and error lines (``errors-N.jsonl``).
    """

    path: Location
    format: Literal["parquet", "jsonl", "openai"] = "parquet"
    carry_columns: OneOrMany = []
    rows_per_part: Number[int] = Field(default=512, ge=1, le=10**7)  # finished rows per part file, the unit of resume
    max_part_age_s: Number[float] = Field(default=180.0, gt=0, le=WEEK_S)  # ...or fewer, once the oldest has waited this long
    lease_timeout_s: Number[float] = Field(default=120.0, ge=1, le=WEEK_S)  # a run silent this long no longer owns the folder

    @model_validator(mode="after")
    def _openai_columns(self) -> "OutputSpec":
        if self.format == "openai" and self.carry_columns:
            raise ValueError("format openai writes OpenAI Batch lines, which have no room for carry_columns")
        return self


class ExecutorSpec(_Section):
    """Where the job runs: ``local``, in this process, or ``ray``, on a Ray cluster at ``address`` (default
    ``RAY_ADDRESS``, else a local Ray started for the job) with ``num_replicas`` engine replicas (default: the
    cluster's GPUs divided by a replica's devices, or 1 without GPUs), each reserving ``num_cpus`` and ``num_gpus``
    (default: its engine's devices, ``engine.world_size``, on a cluster with GPUs, else 0)."""

    kind: Literal["local", "ray"] = "local"
    address: str | None = None
    num_replicas: Number[int | None] = Field(default=None, ge=1, le=10**4)
    num_cpus: Number[float] = Field(default=1.0, ge=0, le=10**4)
    num_gpus: Number[float | None] = Field(default=None, ge=0, le=10**4)

    @model_validator(mode="after")
    def _ray_only(self) -> "ExecutorSpec":
        given = sorted(self.model_fields_set - {"kind"})
        if self.kind == "local" and given:
            raise ValueError(f"{given[0]} applies to kind ray only")
        return self


class JobSpec(_Section):
    """A validated job. Relative input/output paths stay relative to the working directory."""

    name: str = Field(min_length=1)
    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    input: InputSpec
    prompt: PromptSpec | None = None  # required unless the input is OpenAI Batch lines
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    batching: BatchingSpec = Field(default_factory=BatchingSpec)
    output: OutputSpec
    storage_options: dict[str, Any] = {}
    max_error_rate: Number[float] = Field(default=1.0, ge=0.0, le=1.0)  # above this fraction of error rows, exit 1
    executor: ExecutorSpec = Field(default_factory=ExecutorSpec)

    def engine_config(self) -> EngineConfig:
        """The EngineConfig the job's engine runs with: the engine section, model.path and storage_options."""
        return self.engine.config(self.model.path, self.storage_options)

    def resolved(self) -> dict:
        """The spec as plain data, with the credentials in storage_options and in URLs replaced by "***"."""
        data = self.model_dump(mode="json")
        data["storage_options"] = redact(data["storage_options"])
        data["model"]["path"] = redact(data["model"]["path"])
        data["input"]["path"] = redact(data["input"]["path"])
        data["output"]["path"] = redact(data["output"]["path"])
        data["executor"]["address"] = redact(data["executor"]["address"])
        return data

    def digest(self) -> str:
        """sha256 of the canonical JSON of :meth:`resolved` but its executor: the redacted form, so the digest is
        safe to log and two runs that differ only in credentials, or in where they run, share it."""
        job = {k: v for k, v in self.resolved().items() if k != "executor"}
        canon = json.dumps(job, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(canon.encode()).hexdigest()


def _fmt(path: KeyPath) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<spec>"


def _known_path(keys: list[str]) -> bool:
    """Whether ``keys`` names a JobSpec field, or anything below the free-form storage_options."""
    model: type[BaseModel] = JobSpec
    for i, key in enumerate(keys):
        if key not in model.model_fields:
            return False
        field_type = model.model_fields[key].annotation
        sections = [t for t in get_args(field_type) if isinstance(t, type) and issubclass(t, BaseModel)]
        field_type = sections[0] if sections else field_type  # an optional section
        if get_origin(field_type) is dict or i == len(keys) - 1:
            return True
        if not (isinstance(field_type, type) and issubclass(field_type, BaseModel)):
            return False
        model = field_type
    return True


def _section_at(keys: Sequence[str | int]) -> type[BaseModel] | None:
    """The spec section that ``keys`` lead to (JobSpec itself for none), None where they lead to no section."""
    model: type[BaseModel] = JobSpec
    for key in keys:
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            return None
        sections = [t for t in (field.annotation, *get_args(field.annotation))
                    if isinstance(t, type) and issubclass(t, BaseModel)]
        if not sections:
            return None
        model = sections[0]
    return model


def _unknown_key(keys: Sequence[str | int]) -> str:
    """"unknown key", with the nearest key to the first unknown one of ``keys`` when one is close (a typo)."""
    for i, key in enumerate(keys):
        section = _section_at(keys[:i])
        if section is None:
            break
        if key not in section.model_fields:
            close = difflib.get_close_matches(str(key), list(section.model_fields), n=1)
            return f"unknown key; did you mean `{close[0]}`?" if close else "unknown key"
    return "unknown key"


def _parse_value(text: str) -> Any:
    """A YAML scalar or flow collection; anything else (``Be brief: one line``, bad YAML, a ``#`` that YAML would
    read as the start of a comment: ``Item #{{ id }}``) stays a string."""
    try:
        value = yaml.safe_load(text)
        tokens = [t for t in yaml.scan(text) if not isinstance(t, yaml.StreamEndToken)]
    except yaml.YAMLError:
        return text
    if text[max((t.end_mark.index for t in tokens), default=0):].strip():  # a comment, which YAML drops
        return text
    if isinstance(value, (dict, list)) and not text.lstrip().startswith(("{", "[")):
        return text
    return value


def apply_overrides(data: dict, overrides: Sequence[str], errors: list[str]) -> None:
    """Applies ``a.b=value`` overrides in place; the value is read as a YAML scalar or flow collection."""
    for item in overrides:
        dotted, sep, raw = item.partition("=")
        keys = renamed_path(dotted.strip().split("."))
        if not sep or not all(keys):
            key = re.split(r"[:\s]", item, maxsplit=1)[0]  # a mistyped '=' may have put a credential after it
            shown = item if key == item else f"{key}{item[len(key)]}..."
            errors.append(f"--set {shown}: expected KEY.PATH=VALUE")
            continue
        if not _known_path(keys):
            errors.append(f"--set {dotted}: {_unknown_key(keys)}")
            continue
        node = data
        for i, key in enumerate(keys[:-1]):
            child = node.setdefault(key, {})
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                errors.append(f"--set {dotted}: {'.'.join(keys[: i + 1])} is not a mapping")
                break
            node = child
        else:
            node[keys[-1]] = _parse_value(raw)


_REF = re.compile(r"(\$?)\$\{([^}]*)\}")
_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?$", re.DOTALL)


def _interpolate_str(s: str, env: Mapping[str, str], path: KeyPath, errors: dict[KeyPath, str]) -> str:
    def sub(m: re.Match) -> str:
        if m.group(1):
            return m.group(0)[1:]
        ref = _NAME.match(m.group(2))
        if not ref:
            errors[path] = f"invalid variable reference {m.group(0)}"
            return m.group(0)
        name, default = ref.groups()
        value = env.get(name)
        if value is None or (value == "" and default is not None):
            if default is None:
                errors[path] = f"environment variable {name} is not set"
                return m.group(0)
            return default
        return value

    return _REF.sub(sub, s)


def interpolate(value: Any, env: Mapping[str, str], errors: dict[KeyPath, str], path: KeyPath = ()) -> Any:
    """Replaces ``${VAR}`` / ``${VAR:-default}`` (default also when empty) in every string value.

    ``$${...}`` stands for a literal ``${...}``; any other ``$`` is left alone.
    """
    if isinstance(value, dict):
        return {k: interpolate(v, env, errors, path + (str(k),)) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env, errors, path + (i,)) for i, v in enumerate(value)]
    if isinstance(value, str):
        return _interpolate_str(value, env, path, errors)
    return value


def _describe(err: dict) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return _unknown_key(err["loc"])
    if kind == "missing":
        return "required key is missing"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return "expected a mapping"
    msg = err["msg"].removeprefix("Value error, ")
    value = err.get("input")
    if isinstance(value, (str, int, float, bool)) and kind != "value_error":
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        msg += f" (got {shown})"
    return msg


def spec_from_dict(data: Any, overrides: Sequence[str] = (), env: Mapping[str, str] | None = None) -> JobSpec:
    """Validates raw spec data: overrides first, then ``${...}`` interpolation, then the schema."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError([f"<spec>: expected a mapping at the top level, got {type(data).__name__}"])
    try:
        data = json.loads(json.dumps(data, default=str))  # a private, plain copy (YAML dates become strings)
    except ValueError:  # json's "Circular reference detected"
        raise SpecError(["<spec>: a YAML alias refers to a mapping or list that holds it (a value that contains "
                         "itself)"]) from None
    errors: list[str] = []
    apply_overrides(data, overrides, errors)
    move_legacy_keys(data, errors)
    env_errors: dict[KeyPath, str] = {}
    data = interpolate(data, os.environ if env is None else env, env_errors)
    errors += [f"{_fmt(p)}: {m}" for p, m in env_errors.items()]
    spec = None
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as e:
        for err in e.errors():
            loc = tuple(err["loc"])
            # A field whose ${VAR} failed already has its error; its raw text would only add noise.
            if not any(loc[: len(p)] == p for p in env_errors):
                errors.append(f"{_fmt(loc)}: {_describe(err)}")
    if spec is not None and not errors:
        if spec.prompt is None and spec.input.format != "openai":
            errors.append("prompt: required key is missing (only OpenAI Batch input brings its own prompts)")
        errors += check_constraints(spec.sampling, spec.storage_options)
        if spec.engine.speculative_config and (spec.sampling.params().penalized or spec.sampling.min_tokens):
            errors.append("sampling: penalties and min_tokens are not taken with speculative decoding "
                          "(engine.speculative_config)")
        if spec.executor.kind == "ray" and not ray_available():
            errors.append(f"executor.kind: {RAY_EXTRA_HINT}")
    if errors or spec is None:
        raise SpecError(errors)
    return spec


class _SpecLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_spec(path: str, overrides: Sequence[str] = (), env: Mapping[str, str] | None = None) -> JobSpec:
    """Reads a YAML job spec (a safe loader, refusing repeated keys); ``name`` defaults to the file's stem.

    Raises :class:`SpecError` listing every problem, one per line with its key path.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError([f"{path}: cannot read spec: {e.strerror or e}"]) from None
    except UnicodeDecodeError as e:
        raise SpecError([f"{path}: not a YAML text file: invalid UTF-8 at byte {e.start}"]) from None
    try:
        data = yaml.load(text, Loader=_SpecLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        problem = getattr(e, "problem", None) or str(e).replace("\n", " ")
        raise SpecError([f"{where}: invalid YAML: {problem}"]) from None
    if data is None:
        data = {}  # an empty file: the missing sections are named below
    if isinstance(data, dict) and "name" not in data:
        data["name"] = Path(path).stem
    return spec_from_dict(data, overrides, env)


__all__ = ["JobSpec", "SpecError", "load_spec", "spec_from_dict"]

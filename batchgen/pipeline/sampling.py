"""The job spec's ``sampling`` section, derived from the engine's SamplingParams, and JSON Schema checks."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from functools import lru_cache
from typing import Annotated, Any, get_type_hints

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model, model_validator

from batchgen.engine.sampling.params import CONSTRAINTS, PARAM_LIMITS, SamplingParams
from batchgen.engine.sampling.structured import (EXTRA_HINT, json_schema_problem, regex_problem,
                                                 structured_available)
from batchgen.io import InputError, read_bytes, redact
from batchgen.pipeline.spec_types import number_type

# Where a job differs from the engine: deterministic, longer outputs by default.
JOB_DEFAULTS: dict[str, Any] = {"max_tokens": 128, "temperature": 0.0, "seed": 0}
PER_REQUEST_ONLY = ("logprobs",)  # only OpenAI Batch lines ask for it: the other formats have no column for it
NonEmpty = Annotated[str, Field(min_length=1)]
# A list of non-empty strings; a lone string is taken as a list of one.
OneOrMany = Annotated[list[NonEmpty], BeforeValidator(lambda v: [v] if isinstance(v, str) else v)]
# Spec types that accept more than the engine's: one stop string for a list, a schema file's path or URL.
_NONE_IS_EMPTY = BeforeValidator(lambda v: [] if v is None else v)  # null: none, as the engine takes it
SPEC_TYPES: dict[str, Any] = {
    "stop": Annotated[OneOrMany, _NONE_IS_EMPTY],
    "stop_token_ids": Annotated[list[int], _NONE_IS_EMPTY],
    "json_schema": dict[str, Any] | str | None,
    "choice": Annotated[list[NonEmpty], Field(min_length=1)] | None,
}


def _fields() -> dict[str, Any]:
    hints = get_type_hints(SamplingParams)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(SamplingParams):
        if f.name in PER_REQUEST_ONLY:
            continue
        engine_default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        default = JOB_DEFAULTS.get(f.name, engine_default)
        out[f.name] = (SPEC_TYPES.get(f.name, number_type(hints[f.name])),
                       Field(default=default, **PARAM_LIMITS.get(f.name, {})))
    return out


class _Fields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _engine_checks(self) -> "_Fields":
        """The checks across fields (one constraint at most, min_tokens within max_tokens), as the engine's."""
        SamplingParams(**self.model_dump())
        return self


class SamplingSpec(create_model("SamplingFields", __base__=_Fields, **_fields())):  # type: ignore[misc]
    """The engine's SamplingParams with job defaults (greedy, seed 0, 128 tokens); ``json_schema`` is an
    inline mapping or the path/URL of a .json file (loaded by :func:`check_constraints`)."""

    def params(self, **overrides: Any) -> SamplingParams:
        """The engine's parameters for a request; ``overrides`` (engine field names) replace the job's values."""
        return SamplingParams(**{**self.model_dump(), **overrides})


def row_seed(job_seed: int | None, row_id: str) -> int | None:
    """A row's own seed: the job's seed mixed with the row's id, so that rows sample independently of one another
    (equal prompts give different samples) and a rerun samples each row as before, in any batch or replica."""
    if job_seed is None:
        return None
    key = f"{job_seed}\0{row_id}".encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 2


def _json_path(path: Any) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def schema_problem(schema: Any) -> tuple[str, str] | None:
    """(key path inside the schema, message) when ``schema`` is not a valid JSON Schema, refers outside itself, or
    is one that constrained decoding cannot compile (where xgrammar is installed); else None."""
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    if not isinstance(schema, dict):
        return "", f"not a valid JSON Schema: expected an object, got {type(schema).__name__}"
    try:
        validator_for(schema).check_schema(schema)
        outside = _outside_reference(schema)
        if outside:
            return outside
        problem = json_schema_problem(json.dumps(schema)) if structured_available() else None
    except SchemaError as e:
        return _json_path(e.path), f"not a valid JSON Schema: {e.message}"
    except RecursionError:
        return "", "nested too deeply to check"
    return ("", f"a JSON Schema that constrained decoding cannot compile: {problem}") if problem else None


def _outside_reference(schema: dict[str, Any]) -> tuple[str, str] | None:
    """(where, message) for the first ``$ref`` that does not point inside the schema ("#..."): nothing is fetched
    from elsewhere, so no output could be checked against it."""
    stack: list[tuple[tuple[Any, ...], Any]] = [((), schema)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                return (_json_path(path + ("$ref",)),
                        f"only references inside the schema (\"#/...\") are followed, got {ref!r}")
            stack.extend((path + (k,), v) for k, v in reversed(node.items()))
        elif isinstance(node, list):
            stack.extend((path + (i,), v) for i, v in reversed(list(enumerate(node))))
    return None


def check_constraints(sampling: SamplingSpec, storage_options: dict[str, Any]) -> list[str]:
    """Loads a json_schema given as a path/URL into the spec and checks it; returns ``"key.path: message"`` errors.

    A constraint also needs the optional xgrammar extra.
    """
    given = [name for name in CONSTRAINTS if getattr(sampling, name) is not None]
    if not given:
        return []
    available = structured_available()
    errors = [] if available else [f"sampling.{given[0]}: {EXTRA_HINT}"]
    if available and sampling.regex is not None and (problem := regex_problem(sampling.regex)):
        errors.append(f"sampling.regex: {problem}")
    schema = sampling.json_schema
    if isinstance(schema, str):
        try:
            schema = json.loads(read_bytes(schema, storage_options))
        except InputError as e:
            return errors + [f"sampling.json_schema: {e}"]
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            return errors + [f"sampling.json_schema: {redact(sampling.json_schema)} is not valid JSON: {e}"]
        sampling.json_schema = schema
    if schema is not None:
        problem = schema_problem(schema)
        if problem:
            errors.append(f"sampling.json_schema{problem[0]}: {problem[1]}")
    return errors


@lru_cache(maxsize=64)
def _validator(schema_json: str):
    from jsonschema.validators import validator_for

    schema = json.loads(schema_json)
    return validator_for(schema)(schema)


def output_problem(params: SamplingParams, text: str, grammar_complete: bool | None,
                   finish_reason: str | None = None) -> tuple[str, str] | None:
    """(error code, message) for a constrained output that a stop condition cut short or, as a safety net, that
    is off its schema. An output cut by max_tokens or the context (finish_reason "length") is no error: as in the
    OpenAI API, it is the partial result, and its finish_reason says so."""
    if finish_reason == "length":
        return None
    if grammar_complete is False:
        what = "JSON" if params.json_schema is not None else "output"
        return (f"incomplete_{what.lower()}",
                f"a stop condition ended the {what} before it was complete")
    if params.json_schema is None:
        return None
    schema = params.json_schema
    try:
        value = json.loads(text)
    except ValueError as e:
        return "schema_violation", f"the output is not valid JSON: {e}"
    try:
        validator = _validator(schema if isinstance(schema, str) else json.dumps(schema))
        error = next(iter(validator.iter_errors(value)), None)
    except Exception as e:  # noqa: BLE001 - a schema the validator cannot follow: this row's error, not the job's
        return "schema_violation", f"the output could not be checked against the schema: {type(e).__name__}: {e}"
    if error is not None:
        where = _json_path(error.path).lstrip(".") or "the output"
        return "schema_violation", f"{where}: {error.message}"
    return None

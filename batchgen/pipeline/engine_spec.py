"""The job spec's ``engine`` section, derived from the engine's EngineConfig, and the old names it replaced."""
from __future__ import annotations

import dataclasses
import logging
from typing import Annotated, Any, Literal, get_type_hints

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model, model_validator

from batchgen.engine.config import EngineConfig, engine_knobs, knob_default
from batchgen.pipeline.spec_types import number_type

log = logging.getLogger(__name__)

# Where a job differs from the engine: a larger step budget, as batching.max_batch_tokens had.
JOB_DEFAULTS: dict[str, Any] = {"max_num_batched_tokens": 16384}
# Spec keys of the previous release -> their engine key (read for one more release, with a warning).
LEGACY_KEYS: dict[tuple[str, str], str] = {
    **{("model", name): name for name in ("dtype", "device", "max_model_len", "tensor_parallel_size",
                                          "data_parallel_size", "enable_expert_parallel")},
    ("batching", "max_batch_tokens"): "max_num_batched_tokens",
    ("batching", "max_num_seqs"): "max_num_seqs",
    ("batching", "kv_cache_memory"): "kv_cache_memory",
}
_warned: set[tuple[str, str]] = set()


def field_type(f: dataclasses.Field) -> Any:
    """The field's type, narrowed to a Literal of its choices where it has a choice list."""
    hint = get_type_hints(EngineConfig)[f.name]
    choices = f.metadata["choices"]
    if not choices:
        return number_type(hint)
    literal = Literal[tuple(choices)]  # type: ignore[valid-type]
    choice = Annotated[literal, BeforeValidator(lambda v: _yaml_word(v, choices))]
    return choice | None if type(None) in getattr(hint, "__args__", ()) else choice


def _yaml_word(value: Any, choices: tuple) -> Any:
    """YAML reads a bare on/off (yes/no, true/false) as a boolean: the word it spells, so that a knob of choices
    takes it, or names it among the choices it is not."""
    return {True: "on", False: "off"}[value] if isinstance(value, bool) else value


def _fields() -> dict[str, Any]:
    return {f.name: (field_type(f), Field(default=JOB_DEFAULTS.get(f.name, knob_default(f)),
                                          description=f.metadata["help"], **f.metadata["limits"]))
            for f in engine_knobs()}


class _Fields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _engine_accepts(self) -> "_Fields":
        EngineConfig(model="", **self.model_dump())  # the checks across fields (a ValueError names them)
        return self


class EngineSpec(create_model("EngineFields", __base__=_Fields, **_fields())):  # type: ignore[misc]
    """The engine's EngineConfig with job defaults (max_num_batched_tokens 16384); see ``batchgen.engine.config``."""

    def config(self, model: str, storage_options: dict[str, Any]) -> EngineConfig:
        """The EngineConfig of a job that runs ``model`` with the job's ``storage_options``."""
        return EngineConfig(model=model, storage_options=dict(storage_options), **self.model_dump())

    @property
    def world_size(self) -> int:
        """Devices one engine runs on: tensor-parallel size x data-parallel size."""
        return self.config("", {}).world_size

    @property
    def token_budget(self) -> int:
        """Tokens one engine step may compute, over all its data-parallel replicas."""
        return self.config("", {}).token_budget


def renamed_path(keys: list[str]) -> list[str]:
    """A ``--set`` key path under its engine name (an old name warns once): ``--set model.device=cpu`` then
    overrides a spec's ``engine.device`` as ``--set engine.device=cpu`` would."""
    new = LEGACY_KEYS.get(tuple(keys)) if len(keys) == 2 else None
    if new is None:
        return keys
    _warn(keys[0], keys[1], new)
    return ["engine", new]


def _warn(section: str, old: str, new: str) -> None:
    if (section, old) not in _warned:
        _warned.add((section, old))
        log.warning("spec key %s.%s is deprecated and will be removed in the next release: use engine.%s",
                    section, old, new)


def move_legacy_keys(data: dict[str, Any], errors: list[str]) -> None:
    """Moves the previous release's engine keys (``model.dtype``, ``batching.max_batch_tokens``, ...) into
    ``engine``, in place; each old key warns once per process, naming its new key. Both given is an error."""
    for (section, old), new in LEGACY_KEYS.items():
        node = data.get(section)
        if not isinstance(node, dict) or old not in node:
            continue
        engine = data.setdefault("engine", {})
        if engine is None:
            engine = data["engine"] = {}
        if not isinstance(engine, dict):
            return  # the schema reports the engine section that is not a mapping
        if new in engine:
            errors.append(f"{section}.{old}: deprecated name of engine.{new}, and both are given; keep engine.{new}")
            del node[old]
            continue
        engine[new] = node.pop(old)
        _warn(section, old, new)


__all__ = ["EngineSpec", "JOB_DEFAULTS", "LEGACY_KEYS", "move_legacy_keys"]

"""`bench`'s engine options, one per EngineConfig knob under vLLM's names, and the old names they replaced."""
from __future__ import annotations

import json
import logging
import types
from dataclasses import Field
from typing import Any, Callable, Union, get_args, get_origin, get_type_hints

import click
from click.core import ParameterSource

from batchgen.engine.config import EngineConfig, engine_knobs, knob_default

log = logging.getLogger(__name__)

# Options of the previous release -> (the knob they set, the value a flag stands for; None: the option's value).
LEGACY_OPTIONS: dict[str, tuple[str, Any]] = {
    "--max-batch-tokens": ("max_num_batched_tokens", None),
    "--no-prefix-caching": ("enable_prefix_caching", False),
    "--tp": ("tensor_parallel_size", None),
    "--dp": ("data_parallel_size", None),
    "--ep": ("enable_expert_parallel", True),
    "--overlap": ("overlap_schedule", None),
}


class JsonObject(click.ParamType):
    """A JSON object on the command line (``--eplb-config '{"num_redundant_experts": 8}'``), as vLLM takes one."""

    name = "JSON"

    def convert(self, value: Any, param: Any, ctx: Any) -> dict:
        if isinstance(value, dict):
            return value
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            self.fail(f"not JSON: {e.msg} at character {e.pos}", param, ctx)
        if not isinstance(parsed, dict):
            self.fail(f"expected a JSON object, got {type(parsed).__name__}", param, ctx)
        return parsed


def option_name(f: Field) -> str:
    return "--" + f.name.replace("_", "-")


def _base_type(f: Field) -> type:
    hint = get_type_hints(EngineConfig)[f.name]
    if get_origin(hint) in (Union, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    return hint


def _click_type(f: Field) -> Any:
    meta = f.metadata
    if meta["choices"]:
        return click.Choice(meta["choices"])
    base = _base_type(f)
    if base is int and "ge" in meta["limits"]:
        return click.IntRange(min=int(meta["limits"]["ge"]))
    return {int: click.INT, float: click.FLOAT, str: click.STRING, dict: JsonObject()}[base]


def _option(f: Field) -> Callable:
    help_text = f.metadata["help"][:1].upper() + f.metadata["help"][1:] + "."
    if _base_type(f) is bool:
        flag = option_name(f)[2:]
        return click.option(f"--{flag}/--no-{flag}", f.name, default=knob_default(f), show_default=True,
                            help=help_text)
    return click.option(option_name(f), f.name, type=_click_type(f), default=knob_default(f), show_default=True,
                        help=help_text)


def _legacy_option(old: str, knob: str, flag_value: Any) -> Callable:
    f = next(f for f in engine_knobs() if f.name == knob)
    param = "legacy_" + old.strip("-").replace("-", "_")
    if flag_value is not None:
        return click.option(old, param, flag_value=flag_value, default=None, hidden=True)
    return click.option(old, param, type=_click_type(f), default=None, hidden=True)


def engine_options(command: Callable) -> Callable:
    """Adds one option per EngineConfig knob (``--max-num-batched-tokens``, ...) and the deprecated old names."""
    for old, (knob, flag_value) in reversed(LEGACY_OPTIONS.items()):
        command = _legacy_option(old, knob, flag_value)(command)
    for f in reversed(engine_knobs()):
        command = _option(f)(command)
    return command


def engine_config(model: str, options: dict[str, Any]) -> EngineConfig:
    """The EngineConfig that ``options`` (the command's keyword arguments, consumed) ask for; an old option name
    warns, naming its new one, and is an error beside it."""
    ctx = click.get_current_context()
    for old, (knob, flag_value) in LEGACY_OPTIONS.items():
        value = options.pop("legacy_" + old.strip("-").replace("-", "_"))
        if value is None:
            continue
        new = option_name(next(f for f in engine_knobs() if f.name == knob))
        if flag_value is False:  # a flag that turns its knob off: its new spelling is the --no- one
            new = "--no-" + new.removeprefix("--")
        if ctx.get_parameter_source(knob) is not ParameterSource.DEFAULT:
            raise click.UsageError(f"{old} is the deprecated name of {new}: give only {new}")
        log.warning("bench option %s is deprecated and will be removed in the next release: use %s", old, new)
        options[knob] = value
    knobs = {f.name: options.pop(f.name) for f in engine_knobs()}
    try:
        return EngineConfig(model=model, **knobs)
    except ValueError as e:
        raise click.UsageError(str(e)) from None

"""A recorded forward's ops as one C++ program (``batchgen_cpu.OpProgram``): a replay without Python per op."""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from batchgen.engine.backends.cpu.build import load_kernels

log = logging.getLogger(__name__)

# A replay's step: the op, its arguments (tensors bound to their memory) and the tensors its returns are copied
# into (empty where the op writes its outputs itself).
Step = tuple[torch._ops.OpOverload, tuple, dict, tuple]


def _positional(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[Any]:
    """Every argument of ``op``'s schema in its order, defaults filled in: the stack a boxed call takes."""
    schema = op._schema.arguments
    if len(args) > len(schema) or set(kwargs) - {a.name for a in schema}:
        raise TypeError(f"{op} was recorded with arguments its schema does not have")
    stack = []
    for i, arg in enumerate(schema):
        if i < len(args):
            stack.append(args[i])
        elif arg.name in kwargs:
            stack.append(kwargs[arg.name])
        elif arg.has_default_value():
            stack.append(arg.default_value)
        else:
            raise TypeError(f"{op} was recorded without its argument {arg.name}")
    return stack


class CompiledSteps:
    """A replay's steps as one ``batchgen_cpu.OpProgram``: calling it runs them; ``timed`` runs them once more,
    returning each step's seconds."""

    def __init__(self, program: torch.ScriptObject):
        self.program = program
        self._run = torch.ops.batchgen_cpu.run_program
        self._timed = torch.ops.batchgen_cpu.run_program_timed

    def __call__(self) -> None:
        self._run(self.program)

    def timed(self) -> list[float]:
        return self._timed(self.program)


def compile_steps(steps: Sequence[Step]) -> CompiledSteps | None:
    """``steps`` compiled to run as a replay's Python loop would (the same ops, arguments and copies), from C++;
    None where the kernels are not built or an argument has no C++ form (the replay keeps its loop)."""
    if not load_kernels():
        return None
    program = torch.classes.batchgen_cpu.OpProgram()
    try:
        for op, args, kwargs, copies in steps:
            program.add(op._schema.name, op._schema.overload_name, _positional(op, args, kwargs), list(copies))
    except (RuntimeError, TypeError, ValueError) as exc:
        log.info("recorded ops replay from Python: %s", exc)
        return None
    return CompiledSteps(program)

"""Recorded forwards: one call's ops, recorded at the dispatcher and replayed from a flat list, with no Python
per op; the intermediates live in one arena that every recording shares."""
from __future__ import annotations

import functools
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

# Ops that hand a tensor's values to Python (tolist resolves conjugate and negative views first): a replay
# could not see what the Python code did with them.
HOST_READS = frozenset({"item", "_local_scalar_dense", "is_nonzero", "equal", "resolve_conj", "resolve_neg",
                        "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive"})
ALLOCATORS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
ALIGN = 64  # bytes: each intermediate starts where the allocator would have put it


class NotReplayable(RuntimeError):
    """The forward does something a replay of its ops would not repeat (a host read, per-step Python data)."""


class HostOnly:
    """Per-step metadata that only Python code reads (lengths per sequence) in a recorded step: its length (the
    batch size, the same at every replay) can be had; any read of its values stops the recording, since a
    replay would repeat the values of the step recorded."""

    def __init__(self, length: int):
        self.length = length

    def __len__(self) -> int:
        return self.length

    def _refuse(self, *_: Any) -> Any:
        raise NotReplayable("the forward reads per-step metadata on the host")

    __iter__ = __getitem__ = __contains__ = _refuse


@functools.cache
def _kind(func: torch._ops.OpOverload) -> str:
    """"write" (mutates an argument), "view" (returns aliases), "alloc" (uninitialised memory) or "new"."""
    schema = func._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "write"
    if schema.returns and all(r.alias_info is not None for r in schema.returns):
        return "view"
    return "alloc" if func._overloadpacket.__name__ in ALLOCATORS else "new"


@functools.cache
def _out_variant(func: torch._ops.OpOverload) -> tuple[torch._ops.OpOverload, list[str]] | None:
    """The out= overload of a functional op and its out argument names, or None."""
    packet, name = func._overloadpacket, func._overloadname
    for candidate in (("out",) if name == "default" else (f"{name}_out", "out")):
        overload = getattr(packet, candidate, None) if candidate in packet.overloads() else None
        if overload is None:
            continue
        outs = [a.name for a in overload._schema.arguments if a.is_out]
        base = [a.name for a in func._schema.arguments]
        if [a.name for a in overload._schema.arguments if not a.is_out] == base and \
                len(outs) == len(func._schema.returns):
            return overload, outs
    return None


def _tensors(tree: Any, strided: bool = True) -> list[torch.Tensor]:
    """The tensors in ``tree``: those with storage, or (``strided=False``) those without (oneDNN's prepacked
    weights, opaque: loaded state that a replay passes as it is)."""
    if isinstance(tree, torch.Tensor):
        return [tree] if (tree.layout == torch.strided) == strided else []
    if isinstance(tree, (tuple, list)):
        return [t for x in tree for t in _tensors(x, strided)]
    if isinstance(tree, dict):
        return [t for x in tree.values() for t in _tensors(x, strided)]
    return []


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _aliases(out: Any, inputs: Any) -> bool:
    """Whether every tensor ``out`` holds shares memory with one of ``inputs``."""
    held = {_ptr(t) for t in _tensors(inputs)}
    return all(_ptr(t) in held for t in _tensors(out))


@dataclass
class _Call:
    func: torch._ops.OpOverload
    kind: str
    args: tuple
    kwargs: dict
    out: Any


class _Recorder(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing is compiled here; wrapping each op in dynamo's disable imports dynamo (~2 s)

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[_Call] = []
        self.created: list[weakref.ref] = []  # every tensor an op returned, to find those that outlive the call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._overloadpacket.__name__ in HOST_READS:
            raise NotReplayable(f"the forward reads a tensor on the host ({func})")
        out = func(*args, **kwargs)
        if _tensors(out, strided=False):
            raise NotReplayable(f"{func} made a tensor without storage, which a replay could not place")
        kind = _kind(func)
        if kind == "view" and not _aliases(out, (args, kwargs)):
            kind = "new"  # an op that may return its input returned a copy here (to(dtype), contiguous, reshape)
        if kind != "view":
            self.calls.append(_Call(func, kind, args, kwargs, out))
        self.created += [weakref.ref(t) for t in _tensors(out)]
        return out


@dataclass(frozen=True)
class _Slot:
    """A tensor in the arena: where its storage sits, and the tensor's place in it."""

    offset: int  # bytes
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # elements

    def bind(self, arena: torch.UntypedStorage) -> torch.Tensor:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return torch.empty(0, dtype=self.dtype).set_(arena, self.offset // itemsize + self.storage_offset,
                                                     self.size, self.stride)


@dataclass
class Recording:
    """A forward's ops as a replay runs them: tensors the forward made are arena slots, the others (weights,
    caches, input buffers) the tensors themselves. ``bind`` ties the slots to an arena of ``arena_bytes``."""

    steps: list[tuple[Callable, tuple, dict, tuple]]  # (op, args, kwargs, outputs to copy into: no out= op)
    outputs: Any
    arena_bytes: int
    bound: list[tuple[Callable, tuple, dict, tuple]] = field(default_factory=list)
    bound_outputs: Any = None
    # Seconds per op name over the replays while set (a dict): each op timed on its own, with no profiler.
    op_seconds: dict[str, float] | None = None
    # The bound steps compiled (bind's `compile`), run in their place; where it has timed() (each step's seconds,
    # in order), the timed replays run it too.
    program: Callable[[], None] | None = None

    def bind(self, arena: torch.UntypedStorage,
             compile: Callable[[list[tuple]], Callable[[], None] | None] | None = None) -> None:
        """Ties the slots to ``arena``; ``compile`` (the bound steps, with their ops as recorded) may return a
        callable that runs them all, which replays then call instead of their loop over the steps."""
        def tie(x):
            return x.bind(arena) if isinstance(x, _Slot) else x

        bound = [(op, tree_map(tie, args), tree_map(tie, kwargs), tree_map(tie, copies))
                 for op, args, kwargs, copies in self.steps]
        # An OpOverload's _op is the call its __call__ makes: one Python frame less per op.
        self.bound = [(getattr(op, "_op", op), args, kwargs, copies) for op, args, kwargs, copies in bound]
        self.bound_outputs = tree_map(tie, self.outputs)
        self.program = compile(bound) if compile is not None else None

    @torch.inference_mode()
    def replay(self) -> Any:
        if self.op_seconds is not None:
            return self._timed_replay(self.op_seconds)
        if self.program is not None:
            self.program()
            return self.bound_outputs
        for op, args, kwargs, copies in self.bound:
            if copies:
                for dst, src in zip(copies, _tensors(op(*args, **kwargs)), strict=True):
                    dst.copy_(src)
            else:
                op(*args, **kwargs)
        return self.bound_outputs

    def _timed_replay(self, seconds: dict[str, float]) -> Any:
        timed = getattr(self.program, "timed", None)
        if timed is not None:  # the program's own clock around each op
            per_step = timed()
            if len(per_step) != len(self.steps):
                raise RuntimeError(f"{len(per_step)} timings for {len(self.steps)} recorded steps")
            for step, spent in zip(self.steps, per_step):
                name = str(step[0])
                seconds[name] = seconds.get(name, 0.0) + spent
            return self.bound_outputs
        # replay's loop with a timer around each op, apart from it so that the untimed loop stays as it was
        for (op, args, kwargs, copies), step in zip(self.bound, self.steps, strict=True):
            start = time.perf_counter()
            if copies:
                for dst, src in zip(copies, _tensors(op(*args, **kwargs)), strict=True):
                    dst.copy_(src)
            else:
                op(*args, **kwargs)
            name = str(step[0])
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
        return self.bound_outputs


def record(forward: Callable[[], Any]) -> tuple[Any, Recording]:
    """Runs ``forward`` once under inference mode, recording its ops; returns its outputs (computed eagerly) and
    the recording. Raises NotReplayable where a replay would not compute what the forward computes."""
    recorder = _Recorder()
    with torch.inference_mode(), recorder:
        outputs = forward()
    made = _lifetimes(recorder.calls, outputs)
    steps, out = _describe(recorder.calls, outputs, made)
    recorder.calls.clear()  # drops the recording's references, so that only tensors kept elsewhere stay alive
    # A tensor that outlives the call besides its outputs (a table a module builds on first use) stays where it
    # is; the others are dead and their memory goes to the arena.
    outputs_at = {_ptr(t) for t in _tensors(outputs)}
    kept: dict[int, torch.Tensor] = {}
    for ref in recorder.created:
        t = ref()
        if t is not None and _ptr(t) in made and _ptr(t) not in outputs_at:
            kept[_ptr(t)] = t
    for ptr in kept:
        del made[ptr]
    offsets, arena_bytes = _pack(made)

    def place(x):
        if not isinstance(x, _Made):
            return x
        if x.ptr in kept:
            return torch.empty(0, dtype=x.dtype).set_(kept[x.ptr].untyped_storage(), x.storage_offset, x.size,
                                                      x.stride)
        return _Slot(offsets[x.ptr], x.dtype, x.size, x.stride, x.storage_offset)

    return outputs, Recording([tree_map(place, s) for s in steps], tree_map(place, out), arena_bytes)


@dataclass(frozen=True)
class _Made:
    """A tensor in memory the forward's own ops allocated, while the plan is drawn up."""

    ptr: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


def _lifetimes(calls: list[_Call], outputs: Any) -> dict[int, list[int]]:
    """Each storage the forward's ops allocated: [call that made it, last call that reads it, bytes]; the
    outputs' storages live past the last call."""
    made: dict[int, list[int]] = {}
    for i, call in enumerate(calls):
        for t in _tensors((call.args, call.kwargs)):
            if _ptr(t) in made:
                made[_ptr(t)][1] = i
        if call.kind in ("alloc", "new"):
            for t in _tensors(call.out):
                if _ptr(t) in made:
                    raise NotReplayable(f"{call.func} returned a tensor the forward already had")
                if t.untyped_storage().nbytes():
                    made[_ptr(t)] = [i, i, t.untyped_storage().nbytes()]
    for t in _tensors(outputs):
        if _ptr(t) in made:
            made[_ptr(t)][1] = len(calls)
    return made


def _describe(calls: list[_Call], outputs: Any, made: dict[int, list[int]]) -> tuple[list[tuple], Any]:
    """The replay's steps, (op, args, kwargs, outputs to copy into), and its outputs, with the forward's own
    tensors as _Made: functional ops write into their recorded outputs through their out= overloads."""
    def describe(x):
        if not _tensors(x) or _ptr(x) not in made:  # not a tensor with storage the forward made
            return x
        return _Made(_ptr(x), x.dtype, tuple(x.shape), tuple(x.stride()), x.storage_offset())

    steps = []
    for call in calls:
        if call.kind == "alloc":
            continue  # nothing to run: the memory is there
        args, kwargs = tree_map(describe, call.args), tree_map(describe, call.kwargs)
        if call.kind == "write":
            steps.append((call.func, args, kwargs, ()))
            continue
        outs = [describe(t) for t in _tensors(call.out)]
        variant = _out_variant(call.func)
        if variant is None:
            steps.append((call.func, args, kwargs, tuple(outs)))
        else:
            overload, names = variant
            steps.append((overload, args, {**kwargs, **dict(zip(names, outs, strict=True))}, ()))
    return steps, tree_map(describe, outputs)


def _pack(made: dict[int, list[int]]) -> tuple[dict[int, int], int]:
    """Byte offsets in one arena for the storages, two sharing bytes only if their lifetimes do not overlap
    (first fit, in the order the forward made them); and the arena's size."""
    offsets: dict[int, int] = {}
    live: list[tuple[int, int, int]] = []  # (offset, end, last use)
    top = 0
    for ptr, (first, last, nbytes) in sorted(made.items(), key=lambda kv: kv[1][0]):
        live = sorted((b for b in live if b[2] >= first), key=lambda b: b[0])
        size = -(-nbytes // ALIGN) * ALIGN
        at = 0
        for offset, end, _ in live:
            if offset - at >= size:
                break
            at = max(at, end)
        offsets[ptr] = at
        live.append((at, at + size, last))
        top = max(top, at + size)
    return offsets, top

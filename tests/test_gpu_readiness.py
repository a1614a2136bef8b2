"""The CUDA path's host behaviour, checked on CPU with test doubles: no synchronisation inside graph capture,
host->device copies that never block the host, block tables built without Python padding."""
from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from batchgen.engine.executor.cuda_graphs import GraphRunner
from batchgen.engine.executor.step import StepInput
from batchgen.engine.backends.triton.backend import plan_mixed_step
from batchgen.engine.layers.mla import MLAMetadata
from batchgen.engine.executor.model_runner import ModelRunner, padded_block_tables
from batchgen.engine.parallel.group import CommClock
from batchgen.engine.sampling.sampler import TokenBitmask, apply_token_bitmask

aten = torch.ops.aten


class FakeCapture:
    """Stands in for CUDA stream capture: synchronising while it is on raises, as the CUDA runtime does."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.on, self.syncs = False, 0
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: self.on)
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)

    def synchronize(self, device=None) -> None:
        if self.on:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.syncs += 1


def test_measured_collectives_do_not_synchronize_inside_graph_capture(monkeypatch):
    capture = FakeCapture(monkeypatch)
    clock = CommClock(enabled=True, sync=True)  # what measure_communication sets on CUDA
    with clock.measure():  # an eager step: timed between two synchronisations
        pass
    assert capture.syncs == 2 and clock.seconds > 0
    clock.reset()
    capture.on = True
    with clock.measure():  # the same collective recorded into a CUDA graph
        pass
    assert capture.syncs == 2 and clock.seconds == 0


# --- host -> device copies ----------------------------------------------------------------------

class HostCopies(TorchDispatchMode):
    """Records every host -> device transfer that would make the host wait on CUDA: a copy that is not
    non_blocking from pinned memory, or a host tensor handed to an op on the device. The "device" is
    torch's meta device, which runs no kernels, so the step's host code runs unchanged on a CPU machine."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        super().__init__()
        self.pinned: set[int] = set()
        self.blocking: list[str] = []
        self.queued = 0
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, device=None: self._pin(t))  # a CPU build cannot pin

    def _pin(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        self.pinned.add(t.data_ptr())
        return t

    def _copy(self, func, src: torch.Tensor, dst_device: torch.device | None, non_blocking: bool) -> None:
        if src.device.type != "cpu" or dst_device is None or dst_device.type == "cpu":
            return
        if non_blocking and src.data_ptr() in self.pinned:
            self.queued += 1
        else:
            self.blocking.append(f"{func} (non_blocking={non_blocking}, pinned={src.data_ptr() in self.pinned})")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._to_copy.default:
            self._copy(func, args[0], kwargs.get("device"), kwargs.get("non_blocking", False))
        elif func is aten.copy_.default:
            self._copy(func, args[1], args[0].device, args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        else:
            tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            on_host = [t.device.type == "cpu" for t in tensors]
            if not all(on_host) and any(host and t.dim() for host, t in zip(on_host, tensors)):
                self.blocking.append(f"{func} with a host tensor argument")
        return func(*args, **kwargs)


class TensorsFromHostData(TorchFunctionMode):
    """Records ``torch.tensor(data, device=...)`` on a device: a copy from pageable memory."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and torch.device(kwargs.get("device") or "cpu").type != "cpu":
            self.calls.append(f"{func.__name__}(..., device={kwargs['device']})")
        return func(*args, **kwargs)


@pytest.fixture
def copies(monkeypatch):
    host, from_data = HostCopies(monkeypatch), TensorsFromHostData()
    with from_data, host:
        yield host
    assert from_data.calls == [] and host.blocking == [], from_data.calls + host.blocking
    assert host.queued > 0


META = torch.device("meta")


def mixed_step() -> StepInput:
    """Two decodes, one of them of a token the previous step is still sampling, and a prefill chunk."""
    step = StepInput(input_ids=[5, 0, 7, 8, 9], query_lens=[1, 1, 3], context_lens=[9, 17, 3],
                     block_tables=[[3], [1, 4], [2]], sample_seqs=[0, 1, 2],
                     deferred_positions=[1], deferred_rows=[0])
    for seed in range(3):
        step.sampling.append(0.7, 5, 0.9, seed, 2, True)
    return step


def test_a_step_copies_its_inputs_without_waiting(copies):
    runner = ModelRunner.__new__(ModelRunner)  # only the host side of a step: no model, no weights
    runner.device, runner.block_size, runner._last_tokens = META, 16, torch.zeros(3, dtype=torch.int64, device=META)
    step = mixed_step()
    _, _, meta, _ = runner.prepare(step)
    batch = step.sampling.to_batch(META, TokenBitmask(torch.zeros(1, 2, dtype=torch.int32), rows=[1]))
    apply_token_bitmask(torch.zeros(3, 40, device=META), batch.bitmask)
    plan_mixed_step(meta, META)  # the Triton backend's tile and decode-slot lists
    assert meta.decode_rows is not None
    MLAMetadata.for_step(runner.prepare(step)[2], 16)


def test_a_graph_step_copies_its_inputs_without_waiting(copies):
    def model(ids, positions, meta, rows):
        return torch.zeros(rows.shape[0], 8, device=META)

    graphs = GraphRunner(model, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=16,
                         device=META, capture=False)
    runner = ModelRunner.__new__(ModelRunner)
    runner.device, runner.block_size, runner._last_tokens = META, 16, torch.zeros(3, dtype=torch.int64, device=META)
    input_ids, positions, meta, rows = runner.prepare(mixed_step())
    key = graphs.pick(meta, len(input_ids))
    assert key == ("mixed", 16)
    graphs.run(key, input_ids, positions, meta, rows)


# --- block tables ---------------------------------------------------------------------------------

def test_block_tables_are_padded_in_one_vectorized_pass():
    tables = [[3, -1, 7], [1], [4, 5, 6, 8], list(range(100, 2148))]  # a freed (-1) block, a 32K-token table
    width = max(map(len, tables))
    expected = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    got = padded_block_tables(tables)
    assert got.dtype == torch.int32 and torch.equal(got, expected)

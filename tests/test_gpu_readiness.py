"""The CUDA path's host behaviour, checked on CPU with test doubles: no synchronisation inside graph capture,
host->device copies that never block the host, block tables built without Python padding."""
from __future__ import annotations

import pytest
import torch

from batchgen.engine.parallel.group import CommClock


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

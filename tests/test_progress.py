"""The progress bar: its total from Parquet footers at once and from a JSONL count in the background (rows read
shown until then), and an ETA from prompt tokens rather than rows."""
from __future__ import annotations

import threading

import pytest

from batchgen.pipeline.identity import JobIdentity, spec_values
from batchgen.pipeline.job import RunPlan
from batchgen.pipeline.progress import Progress
from batchgen.pipeline.rows import PartSchema
from tests.job_helpers import make_spec, records, write_jsonl, write_parquet


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def plan_for(tmp_path, files, limit=None) -> RunPlan:
    spec = make_spec(tmp_path / "model", [str(f) for f in files], tmp_path / "out")
    return RunPlan(spec, [str(f) for f in files], [], limit, set(), [], {}, set(), PartSchema("id", []),
                   JobIdentity(spec_values(spec)), quiet=True)


def test_parquet_inputs_give_the_total_from_the_start(tmp_path):
    files = [write_parquet(tmp_path / "a.parquet", records(7)), write_parquet(tmp_path / "b.parquet", records(5, "b"))]
    progress = plan_for(tmp_path, files).progress()
    try:
        assert progress.total == 12 and progress.bar.total == 12  # no background count to wait for
        assert progress._counter is None
    finally:
        progress.close()
    progress = plan_for(tmp_path, files, limit=4).progress()
    assert progress.total == 4
    progress.close()


def test_jsonl_rows_are_counted_in_the_background(tmp_path):
    files = [write_parquet(tmp_path / "a.parquet", records(3)), write_jsonl(tmp_path / "b.jsonl", records(9, "b"))]
    progress = plan_for(tmp_path, files, limit=5).progress()
    assert progress.bar.total == 5
    progress.close()
    progress = plan_for(tmp_path, files).progress()
    progress._counter.join(timeout=30)
    assert progress.total == 12
    progress.close()


def test_the_bar_shows_rows_read_until_the_count_is_done(capsys):
    gate = threading.Event()
    progress = Progress(quiet=False, desc="job", known=0, clock=FakeClock())
    progress.count_total(lambda cancel: gate.wait(30) and 50)
    assert progress.total is None
    assert list(progress.reading(range(3))) == [0, 1, 2]
    progress._set_postfix()
    progress.bar.refresh()
    assert "3 read, counting" in capsys.readouterr().err
    gate.set()
    progress._counter.join(timeout=30)
    assert progress.total == 50
    progress.close()
    assert "50/50" not in capsys.readouterr().err  # nothing finished: the bar is at 0 of 50


def test_eta_comes_from_prompt_tokens_not_rows(capsys):
    """Ten rows; four prepared (300, 100, 100, 100 prompt tokens); the 300-token one finished after 10 s. By rows
    the ETA would be 9 rows x 10 s = 90 s; by tokens it is (300 pending + 6 unread x 150 mean) / 30 tok/s."""
    clock = FakeClock()
    progress = Progress(quiet=False, desc="job", known=10, clock=clock)
    for tokens in (300, 100, 100, 100):
        progress.prepared(tokens)
    clock.now = 10.0
    progress.advance(1, 300, 20)
    assert progress.prompt_tokens_left() == pytest.approx(300 + 6 * 150)
    assert progress.eta_s() == pytest.approx(40.0)
    progress.close()
    assert "ETA 0:40" in capsys.readouterr().err


def test_eta_without_prepared_rows_uses_the_finished_rows(capsys):
    """Replicas report finished rows only: the mean prompt length of those stands in for the rest."""
    clock = FakeClock()
    progress = Progress(quiet=True, desc="job", done=2, known=12, clock=clock)
    assert progress.eta_s() is None  # nothing measured yet
    clock.now = 5.0
    progress.advance(2, 1000, 10)  # 200 prompt tok/s; 8 rows left at 500 tokens each
    assert progress.eta_s() == pytest.approx(8 * 500 / 200)
    progress.close()

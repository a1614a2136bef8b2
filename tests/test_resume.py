"""Interrupted jobs keep their finished parts and resume without redoing them; finished jobs are no-ops."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from batchgen.io import OutputWriter
from batchgen.pipeline.errors import JobInterrupted
from batchgen.pipeline.runner import run_job
from tests.job_helpers import (  # noqa: F401
    check_output, engine_calls, make_spec, manifest_ids, records, spec_dict, tiny_llm, write_jsonl,
)


def input_rows(n: int) -> list[dict]:
    recs = records(n)
    for i in (5, 17):
        recs[i]["text"] = None  # error rows are committed like any other and not redone either
    return recs


def test_sigint_then_resume(tmp_path, tiny_model, tiny_llm, engine_calls, monkeypatch):
    recs = input_rows(40)
    inp, out = write_jsonl(tmp_path / "in.jsonl", recs), tmp_path / "out"
    spec = make_spec(tiny_model, inp, out, output={"rows_per_part": 4})
    parts = []
    original = OutputWriter.write_part

    def write_part(self, *args, **kwargs):
        url = original(self, *args, **kwargs)
        parts.append(url)
        if len(parts) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return url

    monkeypatch.setattr(OutputWriter, "write_part", write_part)
    with pytest.raises(JobInterrupted) as e:
        run_job(spec, llm=tiny_llm, quiet=True)
    assert e.value.exit_code == 130
    assert not (out / "_SUCCESS").exists()
    first = manifest_ids(out)
    assert len(first) == len(set(first)) and 8 <= len(first) < 40
    partial = json.loads((out / "stats.json").read_text())
    assert partial["complete"] is False and partial["rows"] == len(first)
    assert set(engine_calls) <= set(first)  # requests in flight at the signal finished and were kept

    engine_calls.clear()
    stats = run_job(spec, llm=tiny_llm, quiet=True)
    check_output(out, stats, [r["id"] for r in recs])
    ran = set(r["id"] for r in recs if r["text"] is not None) - set(first)
    assert sorted(engine_calls) == sorted(ran)  # only the missing rows were computed
    assert stats["resumed"] is True and stats["this_run"]["rows"] == 40 - len(first)
    assert (out / "_SUCCESS").exists()


def test_finished_job_is_a_noop_and_overwrite_redoes_it(tmp_path, tiny_model, tiny_llm, engine_calls):
    inp, out = write_jsonl(tmp_path / "in.jsonl", records(6)), tmp_path / "out"
    spec = make_spec(tiny_model, inp, out)
    first = run_job(spec, llm=tiny_llm, quiet=True)
    engine_calls.clear()
    again = run_job(spec, llm=tiny_llm, quiet=True)
    assert again == json.loads(json.dumps(first)) and engine_calls == []

    (out / "extra.txt").write_text("left alone")
    third = run_job(spec, llm=tiny_llm, quiet=True, overwrite=True)
    assert sorted(engine_calls) == [f"r{i}" for i in range(6)]
    assert third["resumed"] is False and third["finished_at"] >= first["finished_at"]
    check_output(out, third, [f"r{i}" for i in range(6)])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_cli_run_resumes(tmp_path, tiny_model, tiny_llm, engine_calls, sig):
    n = 120
    recs = input_rows(n)
    inp, out = write_jsonl(tmp_path / "in.jsonl", recs), tmp_path / "out"
    job = tmp_path / "job.yaml"
    data = spec_dict(tiny_model, inp, out, output={"rows_per_part": 3}, sampling={"max_tokens": 8},
                     batching={"sort_window": 32}, engine={"max_num_seqs": 2, "max_num_batched_tokens": 256})
    job.write_text(yaml.safe_dump(data))
    proc = subprocess.Popen([sys.executable, "-m", "batchgen.cli", "run", str(job), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "_manifest" / "part-00000.json").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no part committed in time"
        time.sleep(0.01)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert not (out / "_SUCCESS").exists()
    if sig == signal.SIGTERM:
        assert proc.returncode == 143, stderr
        assert "SIGTERM" in stderr and "rerun the same command to resume" in stderr
        assert "Traceback" not in stderr
    else:
        assert proc.returncode == -signal.SIGKILL
    first = manifest_ids(out)
    assert 3 <= len(first) < n and len(first) == len(set(first))

    same = {k: data[k] for k in ("output", "sampling", "batching", "engine")}
    stats = run_job(make_spec(tiny_model, inp, out, **same), llm=tiny_llm, quiet=True)
    check_output(out, stats, [r["id"] for r in recs])
    assert set(engine_calls).isdisjoint(first) and stats["this_run"]["rows"] == n - len(first)

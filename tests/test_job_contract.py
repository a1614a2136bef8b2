"""The job contract through the CLI: a --limit trial then the full run, edits that are refused or resume, stats
over every run, and Ctrl-C with a grace period."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.io import read_output
from batchgen.pipeline import identity, preflight
from batchgen.pipeline.runner import run_job
from tests.job_helpers import (  # noqa: F401
    check_output, engine_calls, make_spec, manifest_ids, records, spec_dict, tiny_llm, write_jsonl,
)

N = 9
IDS = [f"r{i}" for i in range(N)]


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture
def loads(monkeypatch, tiny_llm) -> list[str]:
    """CLI runs reuse the module's engine; the list holds one entry per model load."""
    loaded: list[str] = []

    def load(spec):
        loaded.append(spec.model.path)
        return tiny_llm

    monkeypatch.setattr(preflight, "load_model", load)
    return loaded


def job_file(tmp_path: Path, model: Path, **sections) -> Path:
    inp = tmp_path / "in.jsonl"
    if not inp.exists():
        recs = records(N)
        recs[4]["text"] = None  # an error row is committed like the others
        write_jsonl(inp, recs)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec_dict(model, inp, tmp_path / "out", output={"rows_per_part": 2}, **sections)))
    return path


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def stats_of(out: Path) -> dict:
    return json.loads((out / "stats.json").read_text())


def test_limit_is_a_trial_then_the_full_run_adds_the_rest(tmp_path, tiny_model, loads, engine_calls):
    job, out = job_file(tmp_path, tiny_model), tmp_path / "out"
    res = invoke("run", str(job), "--limit", "3", "--quiet")
    assert res.exit_code == 0, res.output
    assert not (out / "_SUCCESS").exists() and sorted(manifest_ids(out)) == IDS[:3]
    assert stats_of(out)["complete"] is False
    trial = list(engine_calls)

    res = invoke("plan", str(job), "--json")
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)
    assert plan["complete"] is False and plan["committed_rows"] == 3 and plan["rows"] == N - 3

    engine_calls.clear()
    res = invoke("run", str(job), "--quiet")
    assert res.exit_code == 0, res.output
    assert f"test-job: {N} rows" in res.stdout
    stats = json.loads((out / "_SUCCESS").read_text())
    check_output(out, stats, IDS)
    assert sorted(manifest_ids(out)) == IDS  # every id exactly once
    assert set(engine_calls).isdisjoint(trial) and sorted(engine_calls + trial) == sorted(set(IDS) - {"r4"})
    assert stats["complete"] is True and stats["this_run"]["rows"] == N - 3


def test_output_changing_edits_are_refused_on_a_finished_and_a_partial_output(tmp_path, tiny_model, loads):
    job, out = job_file(tmp_path, tiny_model), tmp_path / "out"
    for args in (["--limit", "3"], []):  # a partial output, then a finished one
        assert invoke("run", str(job), "--quiet", *args).exit_code == 0
        before, loaded = snapshot(out), len(loads)
        res = invoke("run", str(job), "--set", "sampling.max_tokens=3", "--set", "prompt.template=Say: {{ text }}",
                     "--set", "output.carry_columns=[]")
        assert res.exit_code == 1, res.output
        message = res.stderr
        for change in ("sampling.max_tokens: 6 -> 3", 'prompt.template: "Summarize: {{ text }}" -> "Say: {{ text }}"',
                       'output.carry_columns: ["title"] -> []', "--overwrite", "output.path"):
            assert change in message, message
        assert "batching" not in message and "rows_per_part" not in message
        assert snapshot(out) == before and len(loads) == loaded  # refused before the model loads
        res = invoke("plan", str(job), "--set", "sampling.max_tokens=3")
        assert res.exit_code == 1 and "sampling.max_tokens: 6 -> 3" in res.stderr  # plan says what run would
    res = invoke("run", str(job), "--quiet", "--set", "sampling.max_tokens=3", "--overwrite")
    assert res.exit_code == 0, res.output
    assert {r["completion_tokens"] for r in read_output(str(out))} <= {0, 1, 2, 3}


def test_changed_weights_are_refused(tmp_path, tiny_model, loads):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    job, out = job_file(tmp_path, model), tmp_path / "out"
    assert invoke("run", str(job), "--limit", "2", "--quiet").exit_code == 0
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one weight's last byte
    weights.write_bytes(bytes(data))
    before = snapshot(out)
    res = invoke("run", str(job))
    assert res.exit_code == 1 and "model.weights: " in res.stderr, res.output
    assert snapshot(out) == before


def test_an_older_kind_of_weights_digest_resumes_and_is_recorded_anew(tmp_path, tiny_model, loads):
    """Outputs that recorded the weights by an older digest (large files sampled) resume, and record the new one."""
    job, out = job_file(tmp_path, tiny_model), tmp_path / "out"
    assert invoke("run", str(job), "--limit", "2", "--quiet").exit_code == 0
    recorded = json.loads((out / "_job.json").read_text())
    now = recorded["values"]["model.weights"]
    recorded["values"]["model.weights"] = "sha256:" + now.split(":", 1)[1][::-1]
    (out / "_job.json").write_text(json.dumps(recorded))
    res = invoke("run", str(job), "--quiet")
    assert res.exit_code == 0, res.output
    assert json.loads((out / "_job.json").read_text())["values"]["model.weights"] == now
    check_output(out, stats_of(out), IDS)


def test_neutral_edits_resume(tmp_path, tiny_model, loads, engine_calls):
    job, out = job_file(tmp_path, tiny_model), tmp_path / "out"
    assert invoke("run", str(job), "--limit", "4", "--quiet").exit_code == 0
    trial = list(engine_calls)
    engine_calls.clear()
    res = invoke("run", str(job), "--quiet", "--set", "output.rows_per_part=3", "--set", "batching.sort_window=2",
                 "--set", "batching.sort=false", "--set", "engine.max_num_seqs=2", "--set",
                 "output.lease_timeout_s=30")
    assert res.exit_code == 0, res.output
    check_output(out, json.loads((out / "_SUCCESS").read_text()), IDS)
    assert set(engine_calls).isdisjoint(trial) and len(engine_calls) + len(trial) == N - 1


def test_stats_cover_every_run_and_a_noop_changes_nothing(tmp_path, tiny_model, loads):
    job, out = job_file(tmp_path, tiny_model), tmp_path / "out"
    assert invoke("run", str(job), "--limit", "3", "--quiet").exit_code == 0
    first = (out / "stats.json").read_bytes()
    assert invoke("run", str(job), "--limit", "3", "--quiet").exit_code == 0  # nothing left among the first 3
    assert (out / "stats.json").read_bytes() == first

    assert invoke("run", str(job), "--quiet").exit_code == 0
    stats = stats_of(out)
    check_output(out, stats, IDS)  # totals are sums over every committed row, error rows included
    runs = stats["runs"]
    assert [r["rows"] for r in runs] == [3, N - 3] and [r["limit"] for r in runs] == [3, None]
    for key in ("rows", "ok_rows", "error_rows", "prompt_tokens", "completion_tokens"):
        assert stats[key] == sum(r[key] for r in runs), key
    assert all(r["generate_s"] > 0 and r["generated_tokens_per_s"] > 0 for r in runs)
    generate_s = sum(r["generate_s"] for r in runs)
    assert stats["generated_tokens_per_s"] == pytest.approx(stats["completion_tokens"] / generate_s, rel=0.01)
    assert stats["started_at"] == runs[0]["started_at"] and stats["finished_at"] == runs[1]["finished_at"]

    done = (out / "stats.json").read_bytes()
    assert invoke("run", str(job), "--quiet").exit_code == 0  # complete: a no-op
    assert (out / "stats.json").read_bytes() == done
    res = invoke("plan", str(job), "--rates-from", str(out), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["rates"]["prefill_tokens_per_s"] == stats["engine"]["prefill_tokens_per_s"] > 0


def test_identity_keys_name_spec_fields(tmp_path, tiny_model):
    """Every declared key resolves in a spec (a renamed spec key must be renamed here too), and what is left out
    of the identity does not move its digest."""
    spec = make_spec(tiny_model, tmp_path / "in.jsonl", tmp_path / "out")
    values = identity.spec_values(spec)
    assert values["engine.dtype"] == "float32" and values["sampling.max_tokens"] == 6
    assert not any(k.startswith(("batching.sort", "output.rows_per_part", "executor", "storage")) for k in values)
    other = make_spec(tiny_model, tmp_path / "in.jsonl", tmp_path / "out", output={"rows_per_part": 1},
                      engine={"max_num_seqs": 1}, batching={"sort": False})
    assert identity.spec_values(other) == values
    with pytest.raises(KeyError, match="model.nope"):
        identity.spec_values(spec, ("model.nope",))


def test_a_renamed_identity_key_keeps_old_outputs_resumable(tmp_path, tiny_model, monkeypatch):
    now = identity.JobIdentity(identity.spec_values(make_spec(tiny_model, tmp_path / "in.jsonl", tmp_path / "o")))
    old = {"values": {("model.precision" if k == "engine.dtype" else k): v for k, v in now.values.items()}}
    assert [c.key for c in now.changes(identity.JobIdentity.from_dict(old))] == ["engine.dtype", "model.precision"]
    monkeypatch.setitem(identity.RENAMED_KEYS, "model.precision", "engine.dtype")
    assert now.changes(identity.JobIdentity.from_dict(old)) == []


def test_an_output_recorded_before_a_sampling_field_existed_resumes_while_it_keeps_its_neutral_value(tmp_path,
                                                                                                       tiny_model):
    now = identity.JobIdentity(identity.spec_values(make_spec(tiny_model, tmp_path / "in.jsonl", tmp_path / "o")))
    assert set(identity.ADDED_KEYS) <= set(now.values)  # every added key names a spec field
    old = identity.JobIdentity({k: v for k, v in now.values.items() if k not in identity.ADDED_KEYS})
    assert now.changes(old) == []
    penalized = identity.JobIdentity(identity.spec_values(make_spec(
        tiny_model, tmp_path / "in.jsonl", tmp_path / "o", sampling={"repetition_penalty": 1.2})))
    assert [(c.key, c.recorded, c.now) for c in penalized.changes(old)] == [("sampling.repetition_penalty", 1.0, 1.2)]


@pytest.mark.timeout(300)
def test_ctrl_c_aborts_after_the_grace_period_and_the_rerun_completes(tmp_path, tiny_model, tiny_llm):
    # Each pair of rows needs 1,500 steps (about 0.6 s here; 300 took 0.12 s, near the grace period), far more
    # than the grace period: the pair that starts after the first one is committed is still running when it ends.
    n, grace, tokens = 6, 0.1, 1500
    inp, out = write_jsonl(tmp_path / "in.jsonl", records(n)), tmp_path / "out"
    sections = dict(output={"rows_per_part": 1}, sampling={"max_tokens": tokens, "ignore_eos": True},
                    engine={"max_num_seqs": 2, "max_num_batched_tokens": 256})
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec_dict(tiny_model, inp, out, **sections)))
    proc = subprocess.Popen([sys.executable, "-m", "batchgen.cli", "run", str(job), "--grace", str(grace)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    deadline = time.monotonic() + 200
    # two rows run at a time, two more wait in the engine; once the first pair is committed, the next pair runs
    while not (out / "_manifest" / "part-00000.json").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no row committed in time"
        time.sleep(0.02)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    took = time.monotonic() - sent
    assert proc.returncode == 130, stderr
    assert took < grace + 10, (took, stderr[-3000:])  # the rows running need ~1,500 more steps
    assert "rerun the same command to resume" in stderr and "Traceback" not in stderr
    first = manifest_ids(out)
    assert len(first) == 2 and not (out / "_SUCCESS").exists()  # the first pair; the next one was aborted
    assert not list((out / "_lease").glob("*.json"))

    stats = run_job(make_spec(tiny_model, inp, out, **sections), llm=tiny_llm, quiet=True)
    check_output(out, stats, [f"r{i}" for i in range(n)])  # every id exactly once
    assert sorted(manifest_ids(out)) == sorted(f"r{i}" for i in range(n))
    assert all(r["completion_tokens"] == tokens for r in read_output(str(out)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_model_loads_releases_the_lease(tmp_path, tiny_model, sig):
    """SIGTERM's default action would kill the run with its lease held: a rerun from another host waits it out."""
    inp, out = write_jsonl(tmp_path / "in.jsonl", records(2)), tmp_path / "out"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec_dict(tiny_model, inp, out)))
    slow_load = ("import sys, time; from batchgen.pipeline import preflight; "
                 "preflight.load_model = lambda spec: time.sleep(120); from batchgen.cli import main; "
                 f"sys.argv = ['batchgen', 'run', {str(job)!r}]; main()")
    proc = subprocess.Popen([sys.executable, "-c", slow_load], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    deadline = time.monotonic() + 120
    while not list((out / "_lease").glob("*.json")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, stderr
    assert f"interrupted by {signal.Signals(sig).name} before any work was done" in stderr
    assert not list((out / "_lease").glob("*.json"))

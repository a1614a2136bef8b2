"""``batchgen plan`` estimates what the prefix store will serve: job B over job A's documents, against B's run."""
from __future__ import annotations

import shutil

import yaml
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.engine.kv_store.estimate import PromptSample
from batchgen.pipeline.plan import plan_job
from batchgen.pipeline.runner import run_job
from tests.job_helpers import make_spec, records, spec_dict, write_jsonl

ASK_A, ASK_B = "{{ text }} {{ text }}\nWhat is it about?", "{{ text }} {{ text }}\nWhich words repeat?"


def sections(template: str, store) -> dict:
    return {"prompt": {"template": template, "chat": False, "system": None},
            "engine": {"prefix_cache_store": str(store), "kv_cache_memory": 16 << 20}}


def test_plan_expects_what_the_store_then_serves(tmp_path, tiny_model):
    inp, store = write_jsonl(tmp_path / "in.jsonl", records(12)), tmp_path / "kv"
    cold = plan_job(make_spec(tiny_model, inp, tmp_path / "b", **sections(ASK_B, store)))["prefix_store"]
    assert cold["expected_store_tokens"] == 0 and cold["sampled_prompts"] == cold["prompts"] == 12
    run_job(make_spec(tiny_model, inp, tmp_path / "a", **sections(ASK_A, store)), quiet=True)
    spec_b = make_spec(tiny_model, inp, tmp_path / "b", **sections(ASK_B, store))
    plan = plan_job(spec_b)
    stats = run_job(spec_b, quiet=True)
    store_plan = plan["prefix_store"]
    assert store_plan["expected_store_tokens"] == stats["cached_prompt_tokens"] > 0
    assert store_plan["hit_rate"] == stats["prefix_cache_hit_rate"]
    assert store_plan["namespace"] == next(store.iterdir()).name and store_plan["dtype"] == "float32"


def test_plan_command_prints_the_store_estimate_or_why_not(tmp_path, tiny_model):
    inp, store = write_jsonl(tmp_path / "in.jsonl", records(6)), tmp_path / "kv"
    bare = shutil.copytree(tiny_model, tmp_path / "bare")
    (bare / "model.safetensors").unlink()
    for model, needle in ((tiny_model, "0 of "), (bare, "hit rate unknown (the model's weight files")):
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(spec_dict(model, inp, tmp_path / "out", **sections(ASK_A, store))))
        res = CliRunner().invoke(main, ["plan", str(path)], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        assert f"prefix store {store}: {needle}" in res.stdout, res.stdout


def test_prompt_sample_is_uniform_bounded_and_repeatable():
    def sample(n: int) -> PromptSample:
        s = PromptSample(size=50)
        for i in range(n):
            s.add([i])
        return s

    small, large = sample(30), sample(10_000)
    assert small.prompts == [[i] for i in range(30)] and small.seen == 30
    assert len(large.prompts) == 50 and large.seen == 10_000 and large.prompts == sample(10_000).prompts
    picked = sorted(p[0] for p in large.prompts)
    assert sum(p < 5000 for p in picked) in range(15, 36)  # both halves of the stream are sampled

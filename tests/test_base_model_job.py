"""A base (non-chat) model in a job: ``prompt.chat: false`` renders plain text prompts, no chat template needed."""
from __future__ import annotations

import json
import shutil

import yaml
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.engine import LLM, SamplingParams
from tests.job_helpers import check_output, records, spec_dict, write_jsonl


def test_base_gemma_model_runs_a_plain_prompt_job(tiny_model_factory, tmp_path):
    base = tmp_path / "gemma3-base"
    shutil.copytree(tiny_model_factory("gemma3"), base)
    (base / "chat_template.jinja").unlink()
    tok_cfg = json.loads((base / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    rows = records(5)
    spec = spec_dict(base, write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out",
                     prompt={"system": None, "template": "Summary of {{ title }}: {{ text }}", "chat": False},
                     sampling={"max_tokens": 8, "temperature": 0.0})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    res = CliRunner().invoke(main, ["run", str(tmp_path / "job.yaml"), "--quiet"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    stats = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    out = {r["id"]: r for r in check_output(tmp_path / "out", stats, [r["id"] for r in rows])}
    assert stats["ok_rows"] == len(rows)

    llm = LLM(str(base), dtype="float32", device="cpu")
    assert llm.tokenizer.chat_template is None
    prompts = [llm.tokenizer.encode(f"Summary of {r['title']}: {r['text']}") for r in rows]
    expected = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    assert len(expected) == len(rows)
    for row, prompt, want in zip(rows, prompts, expected):
        assert out[row["id"]]["prompt_tokens"] == len(prompt)
        assert out[row["id"]]["output"] == want.text

    chat_spec = dict(spec, prompt={**spec["prompt"], "chat": True},
                     output={**spec["output"], "path": str(tmp_path / "o2")})
    (tmp_path / "chat.yaml").write_text(yaml.safe_dump(chat_spec))
    res = CliRunner().invoke(main, ["run", str(tmp_path / "chat.yaml"), "--quiet"], catch_exceptions=False)
    assert res.exit_code == 1 and "no chat template" in res.output and "prompt.chat: false" in res.output

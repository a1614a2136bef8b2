"""Helpers for job tests: input files, specs over the tiny model, a shared engine, output checks."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.engine import LLM
from batchgen.io import read_output
from batchgen.pipeline.spec import JobSpec, spec_from_dict

WORDS = ("the quick brown fox jumps over the lazy dog while Ada and Alan read documents about batch "
         "inference").split()


def texts(n: int, seed: int = 0) -> list[str]:
    """n texts of varied lengths (4 to ~40 words), deterministic."""
    return [" ".join(WORDS[(i * 7 + j + seed) % len(WORDS)] for j in range(4 + (i * 13) % 37))
            for i in range(n)]


def records(n: int, prefix: str = "r") -> list[dict[str, Any]]:
    return [{"id": f"{prefix}{i}", "text": t, "title": f"title {i}"} for i, t in enumerate(texts(n))]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def spec_dict(model: Path | str, inputs: Any, out: Path | str, **sections: Any) -> dict[str, Any]:
    """A spec over the tiny model; keyword sections (``sampling={...}``) update the defaults."""
    data: dict[str, Any] = {
        "name": "test-job",
        "model": {"path": str(model)},
        "engine": {"dtype": "float32", "device": "cpu", "max_num_batched_tokens": 512, "max_num_seqs": 8},
        "input": {"path": inputs if isinstance(inputs, list) else str(inputs), "id_column": "id"},
        "prompt": {"system": "Be brief.", "template": "Summarize: {{ text }}", "chat": True},
        "sampling": {"max_tokens": 6, "temperature": 0.0},
        "batching": {"sort_window": 64},
        "output": {"path": str(out), "format": "parquet", "carry_columns": ["title"], "rows_per_part": 8},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return data


def make_spec(model: Path | str, inputs: Any, out: Path | str, **sections: Any) -> JobSpec:
    return spec_from_dict(spec_dict(model, inputs, out, **sections))


@pytest.fixture(scope="module")
def tiny_llm(tiny_model) -> LLM:
    """One engine per test module, with a small KV cache so it loads in about a second."""
    return LLM(str(tiny_model), dtype="float32", device="cpu", max_num_batched_tokens=512, max_num_seqs=8,
               kv_cache_memory=64 << 20)


@pytest.fixture
def engine_calls(tiny_llm, monkeypatch):
    """Row ids of every request the shared engine is given."""
    seen: list[str] = []
    original = tiny_llm.generate_stream

    def spy(requests, max_pending=None, cancel=None):
        def tap():
            for item in requests:
                seen.append(item[0].row_id)
                yield item
        return original(tap(), max_pending, cancel)

    monkeypatch.setattr(tiny_llm, "generate_stream", spy)
    return seen


TOKEN_KEYS = ("rows", "ok_rows", "error_rows", "prompt_tokens", "completion_tokens")


def check_output(out: Path | str, stats: dict[str, Any], expected_ids: list[str],
                 id_column: str = "id") -> list[dict[str, Any]]:
    """Asserts rows in = rows out with unique ids, and that the stats add up from the rows and parts."""
    rows = read_output(str(out))
    ids = [r[id_column] for r in rows]
    assert len(ids) == len(set(ids)), [i for i, k in Counter(ids).items() if k > 1]
    assert sorted(ids) == sorted(expected_ids)
    ok = [r for r in rows if r["error"] is None]
    assert stats["rows"] == len(rows)
    assert stats["ok_rows"] == len(ok) and stats["error_rows"] == len(rows) - len(ok)
    assert stats["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
    assert stats["completion_tokens"] == sum(r["completion_tokens"] for r in rows)
    for r in rows:
        if r["error"] is None:
            assert r["output"] is not None and r["finish_reason"] in ("stop", "length")
        else:
            assert r["output"] is None and r["finish_reason"] == "error"
            assert set(r["error"]) == {"code", "message"} and r["error"]["code"]
    manifest = sorted(Path(str(out), "_manifest").glob("*.json")) if "://" not in str(out) else []
    if manifest:
        parts = [json.loads(p.read_text())["stats"] for p in manifest]
        for key in TOKEN_KEYS + ("cached_prompt_tokens",):
            assert stats[key] == sum(p[key] for p in parts), key
    return rows


def manifest_ids(out: Path) -> list[str]:
    """Row ids of the committed parts of a local output folder, in part order."""
    entries = sorted((out / "_manifest").glob("*.json"))
    return [i for p in entries for i in json.loads(p.read_text())["row_ids"]]


def by_id(rows: list[dict[str, Any]], id_column: str = "id") -> dict[str, dict[str, Any]]:
    return {r[id_column]: r for r in rows}

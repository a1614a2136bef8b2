"""Hostile input in bounded memory: an over-long JSONL line, a huge Parquet row or row group, a prompt of a
million characters each become an error row (or stream through), never an out-of-memory kill."""
from __future__ import annotations

import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.engine import SamplingParams
from batchgen.io import InputRow, read_rows
from batchgen.pipeline.openai_requests import OpenAIPrompts
from batchgen.pipeline.render import PromptRenderer, RenderError, truncate
from batchgen.pipeline.runner import run_job
from batchgen.pipeline.sampling import SamplingSpec
from batchgen.pipeline.stages import Preparer, TemplatePrompts
from tests.job_helpers import check_output, make_spec, records, texts, tiny_llm, write_jsonl  # noqa: F401

MB = 1 << 20


def peak_bytes(fn) -> int:
    """Peak Python allocation while fn runs: where the bytes read from a file land (the reader hands
    pyarrow a Python file object)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_overlong_jsonl_line_is_an_error_row_read_in_bounded_memory(tmp_path):
    path = tmp_path / "in.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"id": "a", "text": "short"}\n')
        huge = b'{"id": "huge", "text": "' + b"x" * (8 * MB) + b'"}\n'
        f.write(huge)
        f.write(b'{"id": "b", "text": "after"}')  # no final newline
    got: list = []
    peak = peak_bytes(lambda: got.extend(read_rows([str(path)], id_column="id", max_row_bytes=MB)))
    assert [r.row_id for r in got] == ["a", "in.jsonl:1", "b"]
    assert got[1].values == {} and f"line 2: the line is {len(huge)} bytes, more than the limit of {MB}" in got[1].error
    assert got[2].values == {"id": "b", "text": "after"}
    assert peak < 4 * MB  # the 8 MB line was never held: one 1 MiB read chunk at a time
    # the check can fail: with a limit above the line, it is read (and held) whole
    assert peak_bytes(lambda: list(read_rows([str(path)], max_row_bytes=16 * MB))) > 8 * MB


def test_oversized_parquet_rows_are_error_rows(tmp_path):
    path = tmp_path / "in.parquet"
    texts = ["small"] * 5 + ["y" * (2 * MB)] + ["small"] * 5
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(11)], "text": texts}), path)
    got = list(read_rows([str(path)], id_column="id", max_row_bytes=MB, batch_rows=4))
    assert [r.row_id for r in got] == [f"p{i}" for i in range(5)] + ["in.parquet:5"] + [f"p{i}" for i in range(6, 11)]
    assert got[5].values == {} and f"row 5: the row is {2 * MB + 2} bytes, more than the limit of {MB}" in got[5].error
    assert all(r.error is None and r.values["text"] == "small" for i, r in enumerate(got) if i != 5)


def parquet_row_group(path: Path, n: int, width: int = 1000) -> Path:
    """One uncompressed row group of about n * width bytes."""
    table = pa.table({"id": pa.array([f"{i:08d}" for i in range(n)]),
                      "text": pa.array([f"{i:08d}".ljust(width, "z") for i in range(n)])})
    pq.write_table(table, path, row_group_size=n, compression="none")
    return path


def read_all(path: Path) -> tuple[int, int]:
    """(rows, error rows) of path, read one row at a time."""
    rows = errors = 0
    for row in read_rows([str(path)], batch_rows=64):
        rows, errors = rows + 1, errors + (row.error is not None)
    return rows, errors


def test_large_parquet_row_groups_stream(tmp_path, monkeypatch):
    path = parquet_row_group(tmp_path / "big.parquet", 24_000)  # ~24 MB in one row group
    monkeypatch.setattr("batchgen.io.readers._PREBUFFER_LIMIT", 8 * MB)  # row groups above 8 MiB stream
    counts: list = []
    assert peak_bytes(lambda: counts.append(read_all(path))) < 8 * MB and counts == [(24_000, 0)]
    # the check can fail: a row group read whole puts all of its bytes in memory at once
    monkeypatch.setattr("batchgen.io.readers._PREBUFFER_LIMIT", 64 * MB)
    assert peak_bytes(lambda: read_all(path)) > 20 * MB


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_realistic_sizes(tmp_path):
    """A 120 MB row group and a single 500 MB JSONL line, at the default limits."""
    rg = parquet_row_group(tmp_path / "big.parquet", 120_000)
    counts: list = []
    assert peak_bytes(lambda: counts.append(read_all(rg))) < 16 * MB and counts == [(120_000, 0)]
    rg.unlink()
    path = tmp_path / "huge.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"id": "a", "text": "ok"}\n{"id": "huge", "text": "')
        block = b"x" * (16 * MB)
        for _ in range(32):
            f.write(block)
        f.write(b'"}\n{"id": "b", "text": "ok"}\n')
    # held: up to max_row_bytes (32 MiB by default) of the line before it is known to be too long
    assert peak_bytes(lambda: counts.append(read_all(path))) < 40 * MB and counts[-1] == (3, 1)


def test_million_character_prompt(tmp_path, tiny_model, tiny_llm):
    recs = records(4)
    recs[1]["text"] = "lorem ipsum dolor " * 55_556  # 1,000,008 characters
    inp, out = write_jsonl(tmp_path / "in.jsonl", recs), tmp_path / "out"
    stats = run_job(make_spec(tiny_model, inp, out), llm=tiny_llm, quiet=True)
    rows = {r["id"]: r for r in check_output(out, stats, [r["id"] for r in recs])}
    assert rows["r1"]["error"]["code"] == "prompt_too_long"
    assert "characters > max 131072 (batching.max_prompt_chars)" in rows["r1"]["error"]["message"]
    assert all(rows[f"r{i}"]["error"] is None for i in (0, 2, 3))

    # with truncation the row runs: cut to max_prompt_chars first, then to max_prompt_tokens
    left = make_spec(tiny_model, inp, tmp_path / "left", batching={"truncate": "left", "max_prompt_tokens": 64})
    stats = run_job(left, llm=tiny_llm, quiet=True)
    rows = {r["id"]: r for r in check_output(tmp_path / "left", stats, [r["id"] for r in recs])}
    assert rows["r1"]["error"] is None and rows["r1"]["prompt_tokens"] == 64


@pytest.mark.parametrize("mode", ["left", "right"])
def test_cutting_characters_first_keeps_the_same_tokens(tiny_llm, mode):
    """Truncating a long prompt's text before tokenizing gives the tokens that truncating after would."""
    renderer = PromptRenderer("Summarize: {{ text }}", "Be brief.", True, tiny_llm.tokenizer)
    text = " ".join(texts(400))  # ~30,000 characters
    prompts = TemplatePrompts(renderer, SamplingParams(), max_chars=32 * 64, truncate_mode=mode)
    [request] = list(Preparer(prompts, [], 64, mode, set()).prepare([InputRow("x", {"text": text}, "in.jsonl", 0)]))
    full = truncate(renderer.render({"text": text}), 64, mode)
    assert len(text) > 10 * 32 * 64 and request.prompt_ids == full


def test_openai_request_over_the_character_limit_is_refused_before_tokenizing(tiny_llm):
    prompts = OpenAIPrompts(tiny_llm.tokenizer, SamplingSpec(), max_chars=1000)
    chat = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "x" * 5000}]}}
    with pytest.raises(RenderError, match=r"prompt has 5009 characters > max 1000"):
        prompts.build(chat, "a")
    completion = {"custom_id": "b", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "m", "prompt": "y" * 1001}}
    with pytest.raises(RenderError, match="prompt_too_long"):
        prompts.build(completion, "b")
    completion["body"]["prompt"] = "y" * 1000
    ids, _ = prompts.build(completion, "b")
    assert ids == tiny_llm.tokenizer.encode("y" * 1000)

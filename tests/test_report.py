"""``batchgen report``: the page opens in headless Chromium with no console errors and no network, every
chart holds data, the headline equals stats.json, errors and longest rows come from the output rows."""
from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.io import read_output
from batchgen.pipeline.runner import run_job
from batchgen.report import ReportError, build_report, write_report
from tests.browser import Chromium, find_chromium
from tests.job_helpers import make_spec, records, spec_dict, tiny_llm, write_jsonl  # noqa: F401
from tests.s3_server import moto_server, s3  # noqa: F401

CHARTS = ("throughput", "stages", "prompt-tokens", "completion-tokens", "utilization")
HEADLINE_KEYS = ("rows", "ok_rows", "error_rows", "prompt_tokens", "completion_tokens", "wall_s",
                 "prompt_tokens_per_s", "generated_tokens_per_s", "prefix_cache_hit_rate", "engine.mfu")
PAGE_FACTS = """JSON.stringify({
  charts: [...document.querySelectorAll('figure.chart')].map(f => ({
    name: f.id.replace('chart-', ''), points: Number(f.dataset.points),
    height: f.querySelector('svg') ? f.querySelector('svg').getBoundingClientRect().height : 0,
    drawn: [...f.querySelectorAll('svg [id^="series-"] path')].filter(p => (p.getAttribute('d') || '').length > 10).length,
  })),
  headline: Object.fromEntries([...document.querySelectorAll('#headline .stat')].map(
    s => [s.dataset.key, {value: s.dataset.value, text: s.querySelector('.value').textContent}])),
  errors: [...document.querySelectorAll('#errors tr[data-code]')].map(r => ({
    code: r.dataset.code, rows: Number(r.dataset.rows),
    examples: [...r.querySelectorAll('.example')].map(e => e.textContent)})),
  longest: [...document.querySelectorAll('#longest tbody tr')].map(r => r.querySelector('code').textContent),
  status: document.getElementById('status').textContent,
  width: document.documentElement.scrollWidth,
})"""


@pytest.fixture(scope="module")
def browser():
    binary = find_chromium()
    if binary is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium; or set BATCHGEN_CHROMIUM "
                    "to a Chrome binary): the report page cannot be checked in a browser")
    chromium = Chromium(binary)
    yield chromium
    chromium.close()


def nested(stats: dict, key: str):
    for part in key.split("."):
        stats = (stats or {}).get(part)
    return stats


def error_rows_input(tmp_path: Path) -> Path:
    recs = records(24)
    for i in (2, 9, 15):
        recs[i]["text"] = None
    recs[5]["id"] = recs[4]["id"]
    del recs[20]["text"]
    path = write_jsonl(tmp_path / "in.jsonl", recs)
    with open(path, "a", encoding="utf-8") as f:
        f.write("{broken\n")
    return path


def open_report(browser: Chromium, page: Path, shot: Path) -> dict:
    session, load = browser.open(page.as_uri())
    assert load.console_errors == []
    assert load.requests == [page.as_uri()], "the page must not fetch anything"
    facts = json.loads(browser.evaluate(session, PAGE_FACTS))
    browser.screenshot(session, shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    print(f"screenshot: {shot}")
    return facts


def check_page(facts: dict, stats: dict) -> None:
    assert [c["name"] for c in facts["charts"]] == list(CHARTS)
    for chart in facts["charts"]:
        assert chart["points"] > 0 and chart["drawn"] > 0 and chart["height"] > 100, chart
    assert set(facts["headline"]) == set(HEADLINE_KEYS)
    for key in HEADLINE_KEYS:
        expected = nested(stats, key)
        assert facts["headline"][key]["value"] == ("" if expected is None else str(expected)), key
    for key in ("rows", "ok_rows", "error_rows", "prompt_tokens", "completion_tokens"):
        assert int(facts["headline"][key]["text"].replace(",", "")) == stats[key], key
    assert facts["width"] <= 1280, "nothing runs off the side of the page"


@pytest.mark.timeout(300)
def test_report_of_a_finished_job(tmp_path, tiny_model, tiny_llm, browser):
    inp, out = write_jsonl(tmp_path / "in.jsonl", records(30)), tmp_path / "out"
    stats = run_job(make_spec(tiny_model, inp, out, sampling={"max_tokens": 12}), llm=tiny_llm, quiet=True)
    res = CliRunner().invoke(main, ["report", str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    page = out / "report.html"
    assert res.stdout.strip() == str(page)
    facts = open_report(browser, page, tmp_path / "report.png")
    check_page(facts, stats)
    assert facts["status"] == "complete" and facts["errors"] == []
    rows = read_output(str(out))
    by_size = sorted(rows, key=lambda r: (-(r["prompt_tokens"] + r["completion_tokens"]), r["id"]))
    assert facts["longest"] == [r["id"] for r in by_size[:10]]


@pytest.mark.timeout(300)
def test_report_of_a_job_with_error_rows(tmp_path, tiny_model, tiny_llm, browser):
    out = tmp_path / "out"
    stats = run_job(make_spec(tiny_model, error_rows_input(tmp_path), out, output={"rows_per_part": 5}),
                    llm=tiny_llm, quiet=True)
    page = Path(write_report(str(out), str(tmp_path / "elsewhere" / "page.html")))
    facts = open_report(browser, page, tmp_path / "report-errors.png")
    check_page(facts, stats)
    rows = read_output(str(out))
    expected: dict[str, list[dict]] = {}
    for r in rows:
        if r["error"]:
            expected.setdefault(r["error"]["code"], []).append(r)
    assert stats["error_rows"] == sum(map(len, expected.values())) == 6
    assert {e["code"]: e["rows"] for e in facts["errors"]} == {k: len(v) for k, v in expected.items()}
    assert [e["rows"] for e in facts["errors"]] == sorted((e["rows"] for e in facts["errors"]), reverse=True)
    messages = {f"{r['id']}: {r['error']['message']}" for r in rows if r["error"]}
    for e in facts["errors"]:
        assert 1 <= len(e["examples"]) <= 3 and set(e["examples"]) <= messages


class _Headline(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, str] = {}
        self.figures: dict[str, int] = {}

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if "data-key" in a:
            self.values[a["data-key"]] = a["data-value"]
        if tag == "figure":
            self.figures[a["id"].removeprefix("chart-")] = int(a["data-points"])


def parse(page: str) -> _Headline:
    parser = _Headline()
    parser.feed(page)
    return parser


def test_report_of_an_s3_output(s3, tiny_model, tiny_llm):  # noqa: F811
    client = s3.client()
    body = "".join(json.dumps(r) + "\n" for r in records(6)).encode()
    client.put_object(Bucket=s3.bucket, Key="in/a.jsonl", Body=body)
    from batchgen.pipeline.spec import spec_from_dict

    out = s3.url("jobs/out")
    spec = spec_from_dict(spec_dict(tiny_model, s3.url("in/a.jsonl"), out, storage_options=s3.storage_options))
    stats = run_job(spec, llm=tiny_llm, quiet=True)
    page = parse(build_report(out, s3.storage_options))
    assert page.values["rows"] == "6" and page.values["prompt_tokens"] == str(stats["prompt_tokens"])
    assert all(page.figures[c] > 0 for c in CHARTS)


def test_report_of_a_crashed_job_and_of_no_job(tmp_path, tiny_model, tiny_llm):
    inp, out = write_jsonl(tmp_path / "in.jsonl", records(10)), tmp_path / "out"
    stats = run_job(make_spec(tiny_model, inp, out, output={"rows_per_part": 3}), llm=tiny_llm, quiet=True)
    for name in ("_SUCCESS", "stats.json", "telemetry.json"):
        (out / name).unlink()  # as if it crashed before writing them
    text = build_report(str(out))
    page = parse(text)
    for key in ("rows", "ok_rows", "error_rows", "prompt_tokens", "completion_tokens"):
        assert page.values[key] == str(stats[key]), key
    assert page.figures["throughput"] == 0 and page.figures["prompt-tokens"] == 10
    assert "no telemetry.json in this folder" in text and "running or crashed" in text

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ReportError, match="holds no job output"):
        build_report(str(empty))
    res = CliRunner().invoke(main, ["report", str(empty)])
    assert res.exit_code == 1 and "holds no job output" in res.stderr


def test_report_totals_are_the_committed_parts_when_stats_json_is_behind_them(tmp_path, tiny_model, tiny_llm):
    """A --limit trial writes stats.json; a run killed (SIGKILL) after committing more parts leaves it behind."""
    inp, out = write_jsonl(tmp_path / "in.jsonl", records(10)), tmp_path / "out"
    spec = make_spec(tiny_model, inp, out, output={"rows_per_part": 3})
    run_job(spec, llm=tiny_llm, quiet=True, limit=3)
    trial = (out / "stats.json").read_bytes()
    full = run_job(spec, llm=tiny_llm, quiet=True)
    (out / "stats.json").write_bytes(trial)  # as the killed run left it
    (out / "_SUCCESS").unlink()
    page = parse(build_report(str(out)))
    for key in ("rows", "ok_rows", "error_rows", "prompt_tokens", "completion_tokens"):
        assert page.values[key] == str(full[key]), key


def test_report_shows_sample_rows_with_their_input_and_output(tmp_path, tiny_model, tiny_llm):
    import html

    out = tmp_path / "out"
    run_job(make_spec(tiny_model, error_rows_input(tmp_path), out, output={"rows_per_part": 5}), llm=tiny_llm,
            quiet=True)
    page = build_report(str(out))
    table = page.split('<table id="samples">', 1)[1].split("</table>", 1)[0]
    ok = [r for r in read_output(str(out)) if not r["error"]]
    shown = [r for r in ok if f"<code>{html.escape(r['id'])}</code>" in table]
    assert [r["id"] for r in shown] == [r["id"] for r in ok[:8]]
    for r in shown:
        assert html.escape(f"title: {r['title']}") in table
        first_words = " ".join(r["output"].split())[:20]
        if first_words.isprintable():
            assert html.escape(first_words) in table

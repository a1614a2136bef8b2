"""The report page: one HTML file with its CSS and SVG charts inline, nothing fetched when it is opened."""
from __future__ import annotations

from typing import Any

import polars as pl
from jinja2.sandbox import ImmutableSandboxedEnvironment

from batchgen.pipeline.stats import utc_now
from batchgen.report.charts import (
    Chart, length_chart, speculation_chart, stage_chart, throughput_chart, utilization_chart,
)
from batchgen.report.expert_charts import balancing_summary, expert_load_chart, rank_load_chart
from batchgen.report.data import ReportData

_ENV = ImmutableSandboxedEnvironment(autoescape=True)
EXAMPLES_PER_ERROR = 3
LONGEST_ROWS = 10


def _num(value: Any, digits: int = 0) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def _pct(value: Any) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _flops(per_s: float) -> str:
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)):
        if per_s >= scale:
            return f"{per_s / scale:.3g} {unit}"
    return f"{per_s:.3g} FLOP/s"


def _duration(seconds: Any) -> str:
    if seconds is None:
        return "n/a"
    s = float(seconds)
    if s < 120:
        return f"{s:.1f} s"
    h, rest = divmod(int(round(s)), 3600)
    return f"{h} h {rest // 60:02d} min" if h else f"{rest // 60} min {rest % 60:02d} s"


def headline(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """The numbers at the top: ``key`` names the stats.json field each one shows (``engine.mfu`` for MFU)."""
    engine = stats.get("engine") or {}
    mfu, tflops = engine.get("mfu"), engine.get("achieved_tflops")
    mfu_note = "" if tflops is None else f"{_flops(tflops * 1e12)} achieved" + \
        ("" if mfu is not None else "; the device's peak is unknown")
    return [
        dict(key="rows", value=stats.get("rows"), text=_num(stats.get("rows")), label="rows",
             note=f"{_num(stats.get('ok_rows'))} ok, {_num(stats.get('error_rows'))} errors"),
        dict(key="ok_rows", value=stats.get("ok_rows"), text=_num(stats.get("ok_rows")), label="ok rows", note=""),
        dict(key="error_rows", value=stats.get("error_rows"), text=_num(stats.get("error_rows")),
             label="error rows", note=_pct(stats["error_rows"] / stats["rows"]) if stats.get("rows") else ""),
        dict(key="prompt_tokens", value=stats.get("prompt_tokens"), text=_num(stats.get("prompt_tokens")),
             label="prompt tokens", note=f"{_num(stats.get('cached_prompt_tokens'))} from the prefix cache"),
        dict(key="completion_tokens", value=stats.get("completion_tokens"),
             text=_num(stats.get("completion_tokens")), label="generated tokens", note=""),
        dict(key="wall_s", value=stats.get("wall_s"), text=_duration(stats.get("wall_s")), label="wall time",
             note=f"{_duration(stats.get('generate_s'))} generating"),
        dict(key="prompt_tokens_per_s", value=stats.get("prompt_tokens_per_s"),
             text=_num(stats.get("prompt_tokens_per_s")), label="prompt tok/s", note="runs that computed"),
        dict(key="generated_tokens_per_s", value=stats.get("generated_tokens_per_s"),
             text=_num(stats.get("generated_tokens_per_s")), label="generated tok/s", note="runs that computed"),
        dict(key="prefix_cache_hit_rate", value=stats.get("prefix_cache_hit_rate"),
             text=_pct(stats.get("prefix_cache_hit_rate")), label="prefix-cache hit rate", note=""),
        dict(key="engine.mfu", value=mfu, text=_pct(mfu), label="MFU", note=mfu_note),
    ]


def engine_rows(engine: dict[str, Any]) -> list[tuple[str, str]]:
    if not engine:
        return []
    return [
        ("engine steps", f"{_num(engine.get('steps'))} ({_num(engine.get('prefill_steps'))} with prompt "
                         f"tokens, {_num(engine.get('decode_steps'))} decode only)"),
        ("prompt tokens computed", f"{_num(engine.get('prompt_tokens_computed'))} at "
                                   f"{_num(engine.get('prefill_tokens_per_s'))} tok/s in prompt steps"),
        ("decode", f"{_num(engine.get('decode_tokens'))} tokens at {_num(engine.get('decode_tokens_per_s'))} "
                   f"tok/s in decode-only steps"),
        ("step token budget", f"{_num(engine.get('token_budget'))} tokens, "
                              f"{_pct(engine.get('token_budget_utilization'))} used on average"),
        ("padding share", _pct(engine.get("padding_share"))),
        ("engine idle share", f"{_pct(engine.get('idle_share'))} of the generation time outside model steps"),
        ("preemptions", _num(engine.get("preemptions"))),
    ]


def error_table(rows: pl.DataFrame) -> list[dict[str, Any]]:
    errors = rows.filter(pl.col("error_code").is_not_null())
    if errors.is_empty():
        return []
    grouped = (errors.group_by("error_code", maintain_order=True)
               .agg(pl.len().alias("rows"), pl.col("id").head(EXAMPLES_PER_ERROR).alias("ids"),
                    pl.col("error_message").head(EXAMPLES_PER_ERROR).alias("messages"))
               .sort(["rows", "error_code"], descending=[True, False]))
    return [dict(code=r["error_code"], rows=r["rows"], share=_pct(r["rows"] / rows.height),
                 examples=list(zip(r["ids"], r["messages"]))) for r in grouped.iter_rows(named=True)]


def longest_rows(rows: pl.DataFrame) -> list[dict[str, Any]]:
    top = (rows.filter(pl.col("error_code").is_null())
           .with_columns((pl.col("prompt_tokens") + pl.col("completion_tokens")).alias("total_tokens"))
           .sort(["total_tokens", "id"], descending=[True, False]).head(LONGEST_ROWS))
    return list(top.iter_rows(named=True))


def charts(data: ReportData) -> list[Chart]:
    engine = data.stats.get("engine") or {}
    return [
        throughput_chart(data.telemetry),
        stage_chart(data.telemetry, engine, float(data.stats.get("wall_s") or 0.0)),
        length_chart(data.rows, "prompt_tokens", "Prompt length", by_finish=False),
        length_chart(data.rows, "completion_tokens", "Completion length", by_finish=True),
        utilization_chart(data.telemetry),
        *([expert_load_chart(data.eplb)] if data.eplb is not None else []),
        *([rank_load_chart(data.eplb)] if data.eplb is not None and data.eplb.rank_loads_after is not None else []),
        *([speculation_chart(engine)] if engine.get("speculative") else []),
    ]


def eplb_runs(data: ReportData) -> list[tuple[int, str, str]]:
    """(run number, its start, its balancing figures) for each run that balanced experts."""
    runs = data.stats.get("runs") or []
    return [(i + 1, runs[i].get("started_at", ""), balancing_summary(e))
            for i, e in enumerate(data.run_eplb) if e is not None]


def status(data: ReportData) -> str:
    if data.complete:
        return "complete"
    if not data.stats_found:
        return "running or crashed: no stats.json yet, totals from the committed parts"
    return "interrupted: rerun the job to resume" if data.stats.get("complete") is False \
        else "not complete: too many error rows, or not committed"


def render_page(data: ReportData, samples: list[dict[str, Any]] | None = None) -> str:
    """The page; ``samples`` are rows to show as examples (``show.sample_rows``)."""
    stats = data.stats
    return _ENV.from_string(_TEMPLATE).render(
        title=f"batchgen report: {stats.get('job', data.path)}", stats=stats, path=data.path,
        status=status(data), parts=data.parts, headline=headline(stats),
        engine=engine_rows(stats.get("engine") or {}), charts=charts(data), eplb_runs=eplb_runs(data),
        errors=error_table(data.rows),
        longest=longest_rows(data.rows), samples=samples or [], generated_at=utc_now(), num=_num)


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{ title }}</title>
<style>
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1a202c; margin: 0;
       background: #f7fafc; }
main { max-width: 1280px; margin: 0 auto; padding: 20px 28px 40px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 28px 0 10px; }
.meta { color: #4a5568; margin: 0; } .meta b { color: #1a202c; }
.status { display: inline-block; padding: 1px 8px; border-radius: 10px; background: #e2e8f0; }
.status.complete { background: #c6f6d5; color: #22543d; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(180px, 1fr)); gap: 10px;
         margin-top: 16px; }
.stat { background: #fff; border: 1px solid #e2e8f0; border-radius: 8px; padding: 10px 12px; }
.stat .label { color: #4a5568; font-size: 12px; text-transform: uppercase; letter-spacing: .03em; }
.stat .value { font-size: 24px; font-weight: 600; } .stat .note { color: #718096; font-size: 12px; }
.charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: 14px; }
figure.chart { background: #fff; border: 1px solid #e2e8f0; border-radius: 8px; margin: 0; padding: 10px; }
figure.chart figcaption { font-weight: 600; margin-bottom: 4px; }
figure.chart svg { width: 100%; height: auto; display: block; }
figure.chart .note { color: #718096; font-size: 12px; }
.empty { color: #718096; padding: 40px 0; text-align: center; }
table { border-collapse: collapse; background: #fff; width: 100%; border: 1px solid #e2e8f0; }
th, td { text-align: left; padding: 6px 10px; border-bottom: 1px solid #edf2f7; vertical-align: top; }
th { background: #edf2f7; font-weight: 600; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
code { font: 12px ui-monospace, SFMono-Regular, Menlo, monospace; word-break: break-all; }
#errors td:first-child code { white-space: nowrap; word-break: normal; }
.example { margin: 2px 0; } footer { color: #a0aec0; margin-top: 30px; font-size: 12px; }
</style></head>
<body><main>
<h1>{{ title }}</h1>
<p class="meta">Output <b>{{ path }}</b> &middot; model <b>{{ stats.get("model", "n/a") }}</b> &middot;
<span class="status{{ ' complete' if status == 'complete' else '' }}" id="status">{{ status }}</span></p>
<p class="meta">{{ stats.get("started_at", "") }} &rarr; {{ stats.get("finished_at", "") }} &middot;
{{ num(parts) }} committed parts{% if stats.get("resumed") %} &middot; resumed{% endif %}</p>

<section class="cards" id="headline">
{% for h in headline %}<div class="stat" data-key="{{ h.key }}" data-value="{{ h.value if h.value is not none else '' }}">
<div class="label">{{ h.label }}</div><div class="value">{{ h.text }}</div><div class="note">{{ h.note }}</div></div>
{% endfor %}</section>

<h2>Charts</h2>
<section class="charts">
{% for c in charts %}<figure class="chart" id="chart-{{ c.name }}" data-points="{{ c.points }}">
<figcaption>{{ c.title }}</figcaption>
{% if c.svg %}{{ c.svg | safe }}{% if c.note %}<div class="note">{{ c.note }}</div>{% endif %}
{% else %}<div class="empty">{{ c.note }}</div>{% endif %}
</figure>
{% endfor %}</section>

{% if engine %}<h2>Engine</h2>
<table id="engine"><tbody>
{% for k, v in engine %}<tr><th>{{ k }}</th><td>{{ v }}</td></tr>{% endfor %}
</tbody></table>{% endif %}

{% if eplb_runs %}<h2>Expert load balancing per run</h2>
<table id="eplb-runs"><thead><tr><th>run</th><th>started</th><th>balancing</th></tr></thead><tbody>
{% for n, started, figures in eplb_runs %}<tr><td class="n">{{ n }}</td><td>{{ started }}</td><td>{{ figures }}</td></tr>
{% endfor %}</tbody></table>{% endif %}

<h2>Errors</h2>
{% if errors %}<table id="errors"><thead><tr><th>code</th><th>rows</th><th>share</th><th>examples (row id: message)</th></tr></thead><tbody>
{% for e in errors %}<tr data-code="{{ e.code }}" data-rows="{{ e.rows }}"><td><code>{{ e.code }}</code></td>
<td class="n">{{ num(e.rows) }}</td><td class="n">{{ e.share }}</td><td>
{% for id, message in e.examples %}<div class="example"><code>{{ id }}</code>: {{ message }}</div>{% endfor %}</td></tr>
{% endfor %}</tbody></table>
{% else %}<p id="errors">No error rows.</p>{% endif %}

<h2>Sample rows</h2>
{% if samples %}<table id="samples"><thead><tr><th>row id</th><th>input (carried columns)</th><th>output</th><th>finish</th></tr></thead><tbody>
{% for r in samples %}<tr><td><code>{{ r.id }}</code></td><td>{{ r.input }}</td><td>{{ r.output }}</td>
<td>{{ r.finish_reason }}</td></tr>
{% endfor %}</tbody></table>
{% else %}<p id="samples">No ok rows.</p>{% endif %}

<h2>Longest rows (the most compute: prompt + generated tokens)</h2>
{% if longest %}<table id="longest"><thead><tr><th>row id</th><th>prompt tokens</th><th>generated tokens</th><th>total</th><th>finish</th><th>part</th></tr></thead><tbody>
{% for r in longest %}<tr><td><code>{{ r.id }}</code></td><td class="n">{{ num(r.prompt_tokens) }}</td>
<td class="n">{{ num(r.completion_tokens) }}</td><td class="n">{{ num(r.total_tokens) }}</td>
<td>{{ r.finish_reason }}</td><td>{{ r.part }}</td></tr>
{% endfor %}</tbody></table>
{% else %}<p id="longest">No ok rows.</p>{% endif %}

<footer>Written by <code>batchgen report</code> at {{ generated_at }}. Rates and engine figures cover the
last run of the job; row and token totals cover every committed part.</footer>
</main></body></html>
"""

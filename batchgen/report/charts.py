"""The report's charts, drawn by matplotlib as inline SVG: static, offline, no script needed to view them."""
from __future__ import annotations

import io
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import polars as pl
from matplotlib import rc_context
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator


BLUE, ORANGE, GREEN, GREY, RED = "#2b6cb0", "#dd6b20", "#2f855a", "#a0aec0", "#c53030"
_STYLE = {"svg.fonttype": "none", "font.size": 9, "axes.spines.top": False, "axes.spines.right": False,
          "axes.grid": True, "grid.color": "#e2e8f0", "grid.linewidth": 0.6, "axes.edgecolor": "#718096",
          "legend.frameon": False}
MAX_POINTS = 60  # points of a time series: enough for a shape, few enough to read
STAGE_LABELS = {"startup": "startup (checks, model load)", "read": "read input",
                "render_tokenize": "render + tokenize", "queue_wait": "engine waits for rows",
                "engine_steps": "engine: model steps", "engine_other": "engine: scheduling, detokenize",
                "write": "write + commit parts"}


@dataclass
class Chart:
    """One figure of the page; ``points`` counts the data drawn (0: ``note`` says why there is none)."""

    name: str
    title: str
    svg: str = ""
    points: int = 0
    note: str = ""


def _figure(height: float = 2.8) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(6.4, height), layout="constrained")
    return fig, fig.add_subplot()


def _svg(fig: Figure, name: str) -> str:
    buf = io.StringIO()
    with rc_context({**_STYLE, "svg.hashsalt": name}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    return re.sub(r"^.*?(?=<svg)", "", text, flags=re.DOTALL)  # drop the XML prolog and DOCTYPE


def _draw(name: str, title: str, points: int, draw, height: float = 2.8) -> Chart:
    with rc_context({**_STYLE, "svg.hashsalt": name}):
        fig, ax = _figure(height)
        draw(ax)
        return Chart(name, title, _svg(fig, name), points)


def _time_series(telemetry: dict[str, Any], max_points: int = MAX_POINTS
                 ) -> tuple[dict[str, np.ndarray], np.ndarray, str, float]:
    """The telemetry buckets summed into at most ``max_points`` wider ones (a readable line): the columns,
    the buckets' start times in a readable unit, that unit's axis label, and the bucket width in seconds."""
    buckets = telemetry["time_buckets"]
    columns = {k: np.asarray(v, dtype=float) for k, v in buckets["columns"].items()}
    n = len(columns["steps"])
    group = max(1, -(-n // max_points))
    padded = -(-n // group) * group
    columns = {k: np.pad(v, (0, padded - n)).reshape(-1, group).sum(axis=1) for k, v in columns.items()}
    width = float(buckets["bucket_s"]) * group
    span = padded * width / group
    scale, unit = (3600.0, "hours") if span > 3 * 3600 else (60.0, "minutes") if span > 600 else (1.0, "seconds")
    t = np.arange(len(columns["steps"])) * width / scale
    return columns, t, f"time since the job started ({unit})", width


def throughput_series(telemetry: dict[str, Any]) -> tuple[np.ndarray, dict[str, np.ndarray], str]:
    """(bucket start times, rates per second in each bucket: "prompt", "generated", "rows", the time axis
    label). Step amounts are spread over the time their steps took, so each rate integrates to its total."""
    cols, t, label, width = _time_series(telemetry)
    rates = {"prompt": cols["prefill_tokens"] / width, "generated": cols["generated_tokens"] / width,
             "rows": cols["rows"] / width}
    return t, rates, label


def throughput_chart(telemetry: dict[str, Any] | None) -> Chart:
    title = "Throughput over time"
    if not telemetry:
        return Chart("throughput", title, note="no telemetry.json in this folder")
    t, rates, label = throughput_series(telemetry)

    def draw(ax: Axes) -> None:
        ax.step(t, rates["prompt"], where="post", color=BLUE, gid="series-prompt",
                label="prompt tokens computed / s")
        ax.step(t, rates["generated"], where="post", color=ORANGE, gid="series-generated",
                label="generated tokens / s")
        ax.set_xlabel(label)
        ax.set_ylabel("tokens / s")
        rows = ax.twinx()
        rows.step(t, rates["rows"], where="post", color=GREEN, linestyle="--", gid="series-rows",
                  label="rows finished / s")
        rows.set_ylabel("rows / s")
        rows.grid(False)
        handles = ax.get_legend_handles_labels()[0] + rows.get_legend_handles_labels()[0]
        _legend_above(ax, handles)

    return _draw("throughput", title, len(t), draw)


def _name_each(bars: Any, name: str) -> None:
    """SVG ids for the bars (``<g id="series-...-N">``), unique within the page."""
    for i, bar in enumerate(bars):
        bar.set_gid(f"{name}-{i}")


def _legend_above(ax: Axes, handles: list) -> None:
    ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(handles), fontsize=8)


def _bins(values: np.ndarray) -> tuple[np.ndarray, bool]:
    """Histogram edges: log-spaced when the lengths span more than 50x, else linear, and never narrower
    than one token (each bin centred on whole numbers)."""
    lo, hi = max(1, int(values.min())), max(1, int(values.max()))
    if hi / lo > 50:
        return np.unique(np.geomspace(lo, hi + 1, 40).round()), True
    step = max(1, -(-(hi - lo + 1) // 40))
    return np.arange(lo, hi + step + 1, step) - 0.5, False


def length_chart(rows: pl.DataFrame, column: str, title: str, by_finish: bool) -> Chart:
    """Histogram of a token column over the ok rows; stacked by finish_reason when ``by_finish``."""
    ok = rows.filter(pl.col("error_code").is_null())
    name = column.replace("_", "-")
    if ok.is_empty():
        return Chart(name, title, note="no ok rows")
    edges, log = _bins(ok[column].to_numpy())
    groups: Sequence[tuple[str, str]] = [("stop", BLUE), ("length", ORANGE)] if by_finish else [("", BLUE)]

    def draw(ax: Axes) -> None:
        bottom = np.zeros(len(edges) - 1)
        for reason, color in groups:
            part = ok.filter(pl.col("finish_reason") == reason) if reason else ok
            counts, _ = np.histogram(part[column].to_numpy(), edges)
            label = {"stop": "stopped (EOS or stop string)", "length": "hit max_tokens"}.get(reason)
            bars = ax.bar(edges[:-1], counts, width=np.diff(edges), bottom=bottom, align="edge", color=color,
                          edgecolor="white", linewidth=0.4, label=label)
            _name_each(bars, f"series-{name}-{reason or 'rows'}")
            bottom += counts
        if log:
            ax.set_xscale("log")
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            margin = max(1.0, (edges[-1] - edges[0]) * 0.02)
            ax.set_xlim(edges[0] - margin, edges[-1] + margin)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(f"{column.replace('_', ' ')} per row" + (" (log scale)" if log else ""))
        ax.set_ylabel("rows")
        if by_finish:
            _legend_above(ax, ax.get_legend_handles_labels()[0])

    return _draw(name, title, ok.height, draw)


def stage_seconds(telemetry: dict[str, Any], engine: dict[str, Any]) -> dict[str, float]:
    """Seconds per stage, the engine split into model steps and the rest of its loop."""
    stages = dict(telemetry.get("stages_s") or {})
    busy = float(engine.get("busy_s") or 0.0)
    total_engine = float(stages.pop("engine", 0.0))
    out = {k: float(stages.get(k, 0.0)) for k in ("startup", "read", "render_tokenize", "queue_wait")}
    out.update(engine_steps=min(busy, total_engine), engine_other=max(0.0, total_engine - busy),
               write=float(stages.get("write", 0.0)))
    return out


def stage_chart(telemetry: dict[str, Any] | None, engine: dict[str, Any], wall_s: float) -> Chart:
    title = "Time per stage"
    if not telemetry:
        return Chart("stages", title, note="no telemetry.json in this folder")
    seconds = stage_seconds(telemetry, engine)
    names = list(seconds)[::-1]
    values = np.array([seconds[n] for n in names])

    def draw(ax: Axes) -> None:
        colors = [GREY if n in ("read", "render_tokenize") else BLUE if n.startswith("engine") else
                  ORANGE if n == "queue_wait" else GREEN for n in names]
        _name_each(ax.barh([STAGE_LABELS[n] for n in names], values, color=colors), "series-stage")
        for y, v in enumerate(values):
            share = f" ({v / wall_s:.0%})" if wall_s > 0 else ""
            ax.text(v, y, f" {v:.2f} s{share}", va="center", fontsize=8)
        ax.set_xlabel("seconds")
        ax.set_xlim(0, max(values.max(), 1e-3) * 1.35)
        ax.grid(axis="y", visible=False)

    chart = _draw("stages", title, int((values > 0).sum()), draw, height=2.9)
    chart.note = "Grey stages run in a background thread, overlapping the others."
    return chart


def utilization_chart(telemetry: dict[str, Any] | None) -> Chart:
    title = "Step token budget use"
    if not telemetry:
        return Chart("utilization", title, note="no telemetry.json in this folder")
    cols, t, label, _ = _time_series(telemetry)
    busy = cols["steps"] > 0
    steps = np.where(busy, cols["steps"], 1)
    tokens = cols["prefill_tokens"] + cols["decode_tokens"]
    budget = float(telemetry.get("token_budget") or 1)

    def draw(ax: Axes) -> None:
        ax.plot(t[busy], 100 * tokens[busy] / (steps[busy] * budget), color=BLUE, marker=".", markersize=3,
                linewidth=1, gid="series-budget", label="tokens per step / budget")
        padded = cols["padded_tokens"]
        ax.plot(t[busy], 100 * padded[busy] / np.maximum(tokens + padded, 1)[busy], color=RED, linewidth=1,
                gid="series-padding", label="padding share")
        ax.set_ylabel("% of the step token budget")
        ax.set_ylim(0, 105)
        ax.set_xlabel(label)
        seqs = ax.twinx()
        seqs.plot(t[busy], cols["seqs"][busy] / steps[busy], color=GREEN, linestyle="--", linewidth=1,
                  gid="series-seqs", label="sequences per step")
        seqs.set_ylabel("sequences per step")
        seqs.set_ylim(bottom=0)
        seqs.grid(False)
        handles = ax.get_legend_handles_labels()[0] + seqs.get_legend_handles_labels()[0]
        _legend_above(ax, handles)

    return _draw("utilization", title, int(busy.sum()), draw)


def speculation_chart(engine: dict[str, Any]) -> Chart:
    """Per speculative method: output tokens that came from accepted drafts beside those decoded one per step."""
    methods = engine.get("speculative") or {}
    title = "Speculative decoding: where the output tokens came from"
    generated = int(engine.get("tokens_generated") or 0)
    if not methods or not generated:
        return Chart("speculation", title, note="no output tokens in this run")
    names = list(methods)
    drafted = np.array([int(methods[m].get("accepted_tokens") or 0) for m in names])
    stepped = np.maximum(generated - drafted, 0)

    def draw(ax: Axes) -> None:
        _name_each(ax.barh(names, stepped, color=BLUE, label="decoded one per step"), "series-stepped")
        _name_each(ax.barh(names, drafted, left=stepped, color=GREEN, label="accepted drafts"), "series-drafted")
        for y, m in enumerate(names):
            f = methods[m]
            rate, length = f.get("acceptance_rate"), f.get("mean_accepted_length")
            ax.text(generated, y, f" {'n/a' if rate is None else f'{rate:.0%}'} accepted, "
                                  f"{'n/a' if length is None else f'{length:.2f}'} tokens per verify",
                    va="center", fontsize=8)
        ax.set_xlabel("output tokens")
        ax.set_xlim(0, generated * 1.6)
        ax.grid(axis="y", visible=False)
        _legend_above(ax, ax.get_legend_handles_labels()[0])

    chart = _draw("speculation", title, len(names), draw, height=1.6 + 0.3 * len(names))
    share = methods[names[0]].get("drafting_share")
    chart.note = ("Each accepted draft token is a decode step its sequence did not run. The cost model let "
                  f"{'n/a' if share is None else f'{share:.0%}'} of the decoding sequence-steps draft: it "
                  "drafts where the fitted step time grows slowly with tokens and the sequence's drafts are "
                  "accepted, and falls back to plain decode where steps are compute-bound.")
    return chart

"""``batchgen report`` on a job that balanced experts (``enable_eplb``): the loader reads ``engine.eplb`` of
stats.json exactly, the page draws the expert-load heatmap with its balancedness figures and the busiest
rank against the mean per layer, an output without EPLB data renders with no such chart, and a real DP2+EP
job writes the tokens per rank that the page charts."""
from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from batchgen.engine.core.metrics import EngineMetrics
from batchgen.engine.flops import engine_figures
from batchgen.engine.parallel.balancer import EplbReport
from batchgen.engine.parallel.eplb import balancedness, contiguous_placement, rebalance
from batchgen.pipeline.runner import run_job
from batchgen.pipeline.spec import spec_from_dict
from batchgen.pipeline.stats import Counts, job_stats, run_entry
from batchgen.report import ReportError, build_report
from batchgen.report.data import load_report_data
from tests.job_helpers import records, spec_dict, write_jsonl

# Tokens per logical expert (8) in each MoE layer (3): expert 5 of layer 2 is hot.
LOADS = [[10, 12, 9, 11, 10, 8, 12, 10],
         [30, 2, 5, 7, 1, 40, 3, 0],
         [4, 6, 5, 3, 2, 90, 1, 7]]
RANKS = 4


def eplb_report(loads: list[list[int]]) -> dict:
    """The report ``ExpertBalancer.evaluate`` writes after a rebalance onto 4 redundant slots, its tokens per rank
    and balancedness from the placement functions."""
    table = torch.tensor(loads, dtype=torch.float64)
    before = contiguous_placement(len(loads), len(loads[0]), RANKS).rank_loads(table)
    after = rebalance(table, len(loads[0]) + 4, RANKS).rank_loads(table)
    return EplbReport(balancedness_before=balancedness(before), balancedness_after=balancedness(after),
                      rebalances=2, skipped=1, moved_bytes=3 * 2**20, rebalance_time_s=0.25, steps=3000,
                      layers=loads, totals=table.sum(0).long().tolist(), rank_loads_before=before.tolist(),
                      rank_loads_after=after.tolist()).as_dict()


def engine(eplb: dict | None) -> dict:
    metrics = EngineMetrics(prefill_steps=3, prefill_time_s=0.5, prompt_tokens_computed=120, tokens_computed=120)
    metrics.eplb = eplb
    return engine_figures(metrics, wall_s=1.0, token_budget=64)


def write_stats(out: Path, *run_eplb: dict | None) -> dict:
    """stats.json of a job of one run per entry of ``run_eplb`` (its engine's eplb report, or None)."""
    counts = Counts(rows=4, ok_rows=4, prompt_tokens=120, completion_tokens=16)
    runs = [run_entry(run=counts, started_at=f"2026-12-01T10:0{i}:00Z", wall_s=2.0, generate_s=1.0, limit=None,
                      interrupted=False, dtype="float32", engine=engine(e)) for i, e in enumerate(run_eplb)]
    stats = job_stats(totals=counts, runs=runs, this_run=counts, limit=None, job="moe-job", model="tiny-moe",
                      spec={}, identity={}, complete=True)
    out.mkdir()
    (out / "stats.json").write_text(json.dumps(stats), encoding="utf-8")
    return stats


def figure(page: str, name: str) -> str:
    found = re.search(rf'<figure class="chart" id="chart-{name}".*?</figure>', page, flags=re.DOTALL)
    assert found, f"no chart {name}"
    return found.group(0)


def test_loader_reads_the_expert_loads_of_the_latest_run_and_of_each_run(tmp_path):
    report = eplb_report(LOADS)
    write_stats(tmp_path / "out", None, report)
    data = load_report_data(str(tmp_path / "out"))
    assert data.eplb is not None
    assert data.eplb.loads.shape == (3, 8) and data.eplb.loads.dtype == np.int64
    np.testing.assert_array_equal(data.eplb.loads, np.array(LOADS))
    assert data.eplb.balancedness_before == report["balancedness_before"]
    assert (data.eplb.balancedness_after, data.eplb.rebalances, data.eplb.moved_bytes) == \
        (report["balancedness_after"], 2, 3 * 2**20)
    np.testing.assert_array_equal(data.eplb.rank_loads_before, np.array(LOADS).reshape(3, RANKS, 2).sum(-1))
    np.testing.assert_array_equal(data.eplb.rank_loads_after, np.array(report["rank_loads_after"]))
    assert data.run_eplb[0] is None
    np.testing.assert_array_equal(data.run_eplb[1].loads, np.array(LOADS))


def test_page_draws_the_expert_load_heatmap_with_its_balancedness(tmp_path):
    report = eplb_report(LOADS)
    write_stats(tmp_path / "out", report)
    page = build_report(str(tmp_path / "out"))
    chart = figure(page, "expert-load")
    assert 'data-points="24"' in chart
    before, after = report["balancedness_before"], report["balancedness_after"]
    assert f"balancedness {before:.3f} \N{RIGHTWARDS ARROW} {after:.3f}, 2 rebalances, 3.0 MiB moved" in chart
    ranks = np.array(LOADS).reshape(3, RANKS, -1).sum(-1)  # the contiguous placement: 2 experts a rank
    hot = ranks.max(-1).sum() / ranks.mean(-1).sum()  # every layer waits for its busiest rank
    assert f"carries {hot:.2f}x the mean rank&#39;s tokens with the contiguous" in chart
    assert f"{1 / after:.2f}x with the placement in use" in chart
    assert "tokens routed" in chart and "MoE layer" in chart and "logical expert" in chart
    # The heatmap is embedded one pixel per cell, row i the layer i: the darker the cell, the more tokens.
    png = re.search(r'xlink:href="data:image/png;base64,([^"]+)"', chart).group(1)
    pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(png))).convert("RGB"), dtype=float)
    assert pixels.shape[:2] == (3, 8)
    darkness = -pixels.sum(-1)
    assert np.unravel_index(darkness.argmax(), darkness.shape) == (2, 5)
    assert np.argsort(darkness.ravel(), kind="stable").tolist() == \
        np.argsort(np.array(LOADS).ravel(), kind="stable").tolist()
    table = page.split('<table id="eplb-runs">', 1)[1].split("</table>", 1)[0]
    assert table.count("<tr>") == 2 and "2026-12-01T10:00:00Z" in table


def series_points(chart: str, gid: str) -> np.ndarray:
    """The (x, y) vertices of a line drawn with ``gid`` (SVG y grows downwards)."""
    group = re.search(rf'<g id="{gid}">.*?</g>', chart, flags=re.DOTALL).group(0)
    path = re.search(r'<path d="([^"]+)"', group).group(1)
    return np.array([float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", path)]).reshape(-1, 2)


def test_page_draws_the_busiest_rank_against_the_mean_per_layer(tmp_path):
    report = eplb_report(LOADS)
    write_stats(tmp_path / "out", report)
    chart = figure(build_report(str(tmp_path / "out")), "rank-load")
    assert 'data-points="6"' in chart  # 3 layers, contiguous and in use
    ratios = {}
    for key in ("before", "after"):
        ranks = np.array(report[f"rank_loads_{key}"])
        ratios[key] = ranks.max(1) / ranks.mean(1)
        points = series_points(chart, f"series-rank-{key}")
        assert len(points) == 3 and (np.diff(points[:, 0]) > 0).all()  # one point per layer, in order
        # Heights on the axis: an affine map of the ratios, higher up for a larger ratio.
        slope, offset = np.polyfit(ratios[key], points[:, 1], 1)
        assert slope < 0 and np.allclose(slope * ratios[key] + offset, points[:, 1], atol=0.05)
    np.testing.assert_allclose(ratios["before"], [22 / 20.5, 41 / 22, 92 / 29.5])  # by hand, from LOADS
    assert (ratios["after"] <= ratios["before"] + 1e-9).all()
    worst = int(ratios["after"].argmax())
    rank = int(np.argmax(report["rank_loads_after"][worst]))
    assert f"{ratios['after'][worst]:.2f}x the mean at worst (layer {worst}, rank {rank})" in chart
    assert f"in layer {worst} rank {rank} computes" in chart


def test_output_without_eplb_renders_with_no_expert_load_chart(tmp_path):
    write_stats(tmp_path / "out", None)
    page = build_report(str(tmp_path / "out"))
    assert load_report_data(str(tmp_path / "out")).eplb is None
    assert 'id="chart-throughput"' in page and "chart-expert-load" not in page and "eplb-runs" not in page
    assert "chart-rank-load" not in page
    # A report written before the rank loads were: the expert heatmap, no rank chart.
    old = {k: v for k, v in eplb_report(LOADS).items() if not k.startswith("rank_loads")}
    write_stats(tmp_path / "old", old)
    page = build_report(str(tmp_path / "old"))
    assert "chart-expert-load" in page and "chart-rank-load" not in page


def test_expert_loads_that_are_not_a_matrix_of_counts_are_a_clear_error(tmp_path):
    write_stats(tmp_path / "ragged", eplb_report(LOADS) | {"layers": [[1, 2, 3], [4, 5]]})
    with pytest.raises(ReportError, match="engine.eplb.layers is not a matrix"):
        build_report(str(tmp_path / "ragged"))
    write_stats(tmp_path / "words", eplb_report(LOADS) | {"layers": [["ten", 2]]})
    with pytest.raises(ReportError, match="holds something other than token counts"):
        build_report(str(tmp_path / "words"))
    write_stats(tmp_path / "ranks", eplb_report(LOADS) | {"rank_loads_after": [[1.0, 2.0, 3.0, 4.0]]})
    with pytest.raises(ReportError, match="engine.eplb.rank_loads_after has 1 layers, engine.eplb.layers 3"):
        build_report(str(tmp_path / "ranks"))


@pytest.mark.timeout(300)
def test_a_balanced_job_writes_tokens_per_rank_to_stats_and_the_report_charts_them(tiny_model_factory, tmp_path):
    """DP2+EP with EPLB through the pipeline: stats.json's engine.eplb holds each layer's tokens per rank, which
    add up to the layer's routed pairs, and the page charts the busiest rank of the run."""
    inputs = write_jsonl(tmp_path / "in.jsonl", records(6))
    engine = {"max_num_batched_tokens": 64, "max_num_seqs": 4, "data_parallel_size": 2, "enable_expert_parallel": True,
              "enable_eplb": True, "distributed_timeout_s": 60,
              "eplb_config": {"num_redundant_experts": 2, "window_size": 2, "step_interval": 3}}
    run_job(spec_from_dict(spec_dict(tiny_model_factory("deepseek-v3"), inputs, tmp_path / "out", engine=engine)),
            quiet=True)
    eplb = json.loads((tmp_path / "out" / "stats.json").read_text())["engine"]["eplb"]
    assert len(eplb["layers"]) == len(eplb["rank_loads_after"]) == len(eplb["rank_loads_before"]) == 2
    for experts, before, after in zip(eplb["layers"], eplb["rank_loads_before"], eplb["rank_loads_after"]):
        assert len(before) == len(after) == 2
        assert sum(before) == sum(experts) == pytest.approx(sum(after), abs=0.02)
    after = np.array(eplb["rank_loads_after"])
    ratios = after.max(1) / after.mean(1)
    assert eplb["balancedness_after"] == pytest.approx(after.mean(1).sum() / after.max(1).sum(), abs=1e-3)
    chart = figure(build_report(str(tmp_path / "out")), "rank-load")
    worst = int(ratios.argmax())
    assert f"{ratios[worst]:.2f}x the mean at worst (layer {worst}, rank {int(after[worst].argmax())})" in chart

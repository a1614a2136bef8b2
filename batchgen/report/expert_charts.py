"""The report's charts of expert-parallel load balancing: tokens per expert and per rank in each MoE layer."""
from __future__ import annotations

import numpy as np
from matplotlib.axes import Axes
from matplotlib.ticker import MaxNLocator

from batchgen.report.charts import BLUE, GREY, ORANGE, Chart, _draw, _legend_above
from batchgen.report.data import ExpertLoads


def _ratio_text(balancedness: float | None) -> str:
    """The busiest rank's tokens over the mean rank's: balancedness is mean / max, summed over layers."""
    return "n/a" if not balancedness else f"{1 / balancedness:.2f}x"


def balancing_summary(eplb: ExpertLoads) -> str:
    """Balancedness before (contiguous placement) -> after (the placement in use), rebalances, bytes moved."""
    before, after = (f"{b:.3f}" if b is not None else "n/a" for b in (eplb.balancedness_before,
                                                                       eplb.balancedness_after))
    rebalances = f"{eplb.rebalances} rebalance{'' if eplb.rebalances == 1 else 's'}"
    return (f"balancedness {before} \N{RIGHTWARDS ARROW} {after}, {rebalances}, "
            f"{eplb.moved_bytes / 2**20:.1f} MiB moved")


def expert_load_chart(eplb: ExpertLoads) -> Chart:
    """Heatmap of the tokens per logical expert (x) per MoE layer (y), with a colour bar."""
    loads = eplb.loads
    title = f"Expert load per MoE layer: {balancing_summary(eplb)}"
    if not loads.size:
        return Chart("expert-load", title, note="the EPLB report holds no expert loads yet")

    def draw(ax: Axes) -> None:
        image = ax.imshow(loads, aspect="auto", interpolation="none", cmap="YlOrRd", origin="lower",
                          vmin=0, gid="series-expert-load")
        ax.figure.colorbar(image, ax=ax, label="tokens routed")
        ax.set_xlabel("logical expert")
        ax.set_ylabel("MoE layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(False)

    chart = _draw("expert-load", title, int(loads.size), draw, height=max(2.8, min(6.0, 0.12 * len(loads))))
    chart.note = (f"Tokens routed to each expert of each MoE layer in the latest load window (at step "
                  f"{eplb.steps:,}). Every layer waits for its busiest expert-parallel rank, so one hot rank sets "
                  f"the whole step's time: the busiest rank carries {_ratio_text(eplb.balancedness_before)} the "
                  f"mean rank's tokens with the contiguous placement, {_ratio_text(eplb.balancedness_after)} with "
                  "the placement in use.")
    return chart


def busiest_rank_ratios(rank_loads: np.ndarray) -> np.ndarray:
    """Per MoE layer, the busiest expert-parallel rank's tokens over the mean rank's (1.0: even, or no tokens)."""
    mean = rank_loads.mean(axis=1)
    return np.divide(rank_loads.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0)


def rank_load_chart(eplb: ExpertLoads) -> Chart:
    """Per MoE layer, the busiest rank over the mean rank, with the contiguous placement and the one in use."""
    after = eplb.rank_loads_after
    ratios = busiest_rank_ratios(after)
    layer = int(ratios.argmax())
    rank = int(after[layer].argmax())
    title = (f"Busiest expert-parallel rank per MoE layer: {ratios[layer]:.2f}x the mean at worst "
             f"(layer {layer}, rank {rank})")
    before = busiest_rank_ratios(eplb.rank_loads_before) if eplb.rank_loads_before is not None else None
    layers = np.arange(len(ratios))

    def draw(ax: Axes) -> None:
        if before is not None:
            ax.plot(layers, before, color=ORANGE, marker=".", linewidth=1, gid="series-rank-before",
                    label="contiguous placement")
        ax.plot(layers, ratios, color=BLUE, marker=".", linewidth=1, gid="series-rank-after",
                label="placement in use")
        ax.axhline(1.0, color=GREY, linestyle="--", linewidth=1, label="even")
        ax.set_xlabel("MoE layer")
        ax.set_ylabel("busiest rank / mean rank")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _legend_above(ax, ax.get_legend_handles_labels()[0])

    chart = _draw("rank-load", title, len(ratios) * (1 if before is None else 2), draw)
    chart.note = (f"Tokens each of the {after.shape[1]} expert-parallel ranks computes in each MoE layer over the "
                  "latest load window (an expert's tokens split evenly over its replicas). Every rank waits at "
                  f"each layer for the busiest one: in layer {layer} rank {rank} computes {after[layer, rank]:,.0f} "
                  f"tokens against a mean of {after[layer].mean():,.0f}.")
    return chart

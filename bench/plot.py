"""Empirical CDFs of TTFT and ITL (matplotlib, no display, small PNGs).

``plot_cdfs``: one run, with its SLOs marked (``epd bench --plot``). ``plot_series_cdfs``: several
labelled series side by side, plus the ITL tail (the comparison scripts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .record import RequestRecord

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def _cdf(ax: Axes, values_ms: Sequence[float], title: str, slo_ms: float | None) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)
    if not len(values_ms):
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    xs = np.sort(np.asarray(values_ms))
    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post")
    if slo_ms is not None:
        ax.axvline(slo_ms, color="red", linestyle="--", label=f"SLO {slo_ms:g} ms")
        ax.legend(loc="lower right")


def plot_cdfs(
    records: Sequence[RequestRecord],
    path: str | Path,
    ttft_slo_ms: float | None = None,
    itl_slo_ms: float | None = None,
    title: str = "epd bench",
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.ok]
    ttft_ms = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    itl_ms = [gap * 1e3 for r in ok for gap in r.itl_s]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    _cdf(left, ttft_ms, f"TTFT ({len(ttft_ms)} requests)", ttft_slo_ms)
    _cdf(right, itl_ms, f"ITL ({len(itl_ms)} gaps)", itl_slo_ms)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_series_cdfs(series: Mapping[str, Sequence[RequestRecord]], path: Path, title: str) -> None:
    """Three panels, one line per labelled series: the empirical CDFs of TTFT and ITL, and the
    ITL tail (fraction of gaps above x, log-log), where a stall shows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for i, (label, records) in enumerate(series.items()):
        color = f"C{i}"
        ok = [r for r in records if r.ok]
        ttft = np.sort([r.ttft_s * 1e3 for r in ok if r.ttft_s is not None])
        itl = np.sort([g * 1e3 for r in ok for g in r.itl_s])
        for ax, xs in ((axes[0], ttft), (axes[1], itl)):
            if len(xs):
                ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", color=color,
                        label=f"{label} (n={len(xs)})")
        if len(itl):
            axes[2].step(itl, (len(itl) - np.arange(len(itl))) / len(itl), where="post", color=color, label=label)
    for ax, name, ylabel in zip(axes, ("TTFT CDF", "ITL CDF", "ITL tail"),
                                ("fraction", "fraction", "fraction of gaps >= x (log)")):
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("ms (log)", fontsize=8)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[2].set_yscale("log")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=70)
    plt.close(fig)

"""``--plot``: empirical CDFs of TTFT and ITL from one run (matplotlib, no display)."""

from __future__ import annotations

from collections.abc import Sequence
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

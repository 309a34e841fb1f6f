"""PNG charts for ``epd simulate --plot DIR`` (matplotlib, Agg backend, imported lazily).

Writes ``ttft_cdf.png`` and ``itl_cdf.png`` (one line per placement) and
``queue_depth_<placement>.png`` (one line per stage over time).
"""

from __future__ import annotations

from pathlib import Path

from sim.metrics import hist_cdf
from sim.simulator import SimResult


def _label(result: SimResult) -> str:
    cfg = result.config
    chunked = cfg.transfer == "chunked" and cfg.placement != "colocated"
    return cfg.placement + ("/chunked" if chunked else "")


def write_plots(results: list[SimResult], out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    slo_ttft, slo_itl = results[0].config.ttft_slo_ms, results[0].config.itl_slo_ms

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for result in results:
        values = sorted(result.metrics.ttft_ms)
        if values:
            n = len(values)
            ax.plot(values, [(i + 1) / n for i in range(n)], label=_label(result))
    ax.axvline(slo_ttft, color="grey", linestyle="--", linewidth=1, label=f"TTFT SLO {slo_ttft:g} ms")
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF")
    ax.legend()
    ax.grid(alpha=0.3)
    written.append(_save(fig, out / "ttft_cdf.png", plt))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for result in results:
        values, fractions = hist_cdf(result.metrics.itl_hist)
        if values:  # start at 0 so a single gap size still draws a visible step
            ax.step([values[0]] + values, [0.0] + fractions, where="post", label=_label(result))
    ax.axvline(slo_itl, color="grey", linestyle="--", linewidth=1, label=f"ITL SLO {slo_itl:g} ms")
    ax.set(xlabel="inter-token gap (ms)", ylabel="fraction of gaps", title="ITL CDF")
    ax.legend()
    ax.grid(alpha=0.3)
    written.append(_save(fig, out / "itl_cdf.png", plt))

    for result in results:
        m = result.metrics
        fig, ax = plt.subplots(figsize=(8, 4.5))
        t = [x / 1000.0 for x in m.sample_t_ms]
        for stage, values in m.samples.items():
            if values and max(values) > 0:
                ax.plot(t, values, label=stage)
        ax.set(xlabel="time (s)", ylabel="requests", title=f"queue depth per stage: {_label(result)}")
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
        written.append(_save(fig, out / f"queue_depth_{_label(result).replace('/', '_')}.png", plt))
    return written


def _save(fig: object, path: Path, plt: object) -> Path:
    fig.tight_layout()  # type: ignore[attr-defined]
    fig.savefig(path, dpi=110)  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[attr-defined]
    return path

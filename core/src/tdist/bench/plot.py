"""``--plot FILE``: bus bandwidth against size, one line per backend, one panel per
(operation, world size). Needs matplotlib (``make bench`` installs it)."""

from __future__ import annotations

from typing import Sequence

__all__ = ["plot"]


def plot(path: str, results: Sequence[dict], backends: Sequence[str]) -> None:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib (make bench installs it)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report import format_size

    ops = [
        op
        for op in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")
        if any(r["op"] == op for r in results)
    ]
    worlds = sorted({r["world"] for r in results})
    fig, axes = plt.subplots(len(worlds), len(ops), figsize=(4.2 * len(ops), 3.4 * len(worlds)), squeeze=False)
    for i, world in enumerate(worlds):
        for j, op in enumerate(ops):
            ax = axes[i][j]
            for b in backends:
                rows = sorted(
                    (r for r in results if r["world"] == world and r["op"] == op and r["backend"] == b),
                    key=lambda r: r["bytes"],
                )
                if rows:
                    ax.plot([r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows], marker="o", ms=3, label=b)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{op}, {world} ranks", fontsize=10)
            ax.set_xlabel("size")
            if j == 0:
                ax.set_ylabel("bus bandwidth (GB/s)")
            sizes = sorted({r["bytes"] for r in results if r["op"] == op})
            ticks = sizes[:: max(1, len(sizes) // 6)]
            ax.set_xticks(ticks)
            ax.set_xticklabels([format_size(s).replace(" ", "") for s in ticks], fontsize=7)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

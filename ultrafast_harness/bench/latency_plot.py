"""PNG of the latency distributions `ultrafast bench` measured: one panel per concurrency,
TTFT and per-token latency (box plots, log scale) for every runner. The only matplotlib user."""

from __future__ import annotations

from pathlib import Path


def _level_order(level) -> tuple[bool, int, str]:
    """ "1", "4", "16", then "long 4", "long 16": the count last in the name, numerically."""
    text = str(level)
    last = text.split()[-1] if text.split() else ""
    return (not text.isdigit(), int(last) if last.isdigit() else 0, text)


def plot_latencies(samples: dict, out: str | Path, title: str) -> Path:
    """samples: {concurrency: {runner: {"ttft_ms": [...], "itl_ms": [...]}}}."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    levels = sorted(samples, key=_level_order)
    fig, axes = plt.subplots(2, len(levels), figsize=(4.5 * len(levels), 7), squeeze=False)
    for col, level in enumerate(levels):
        runners = samples[level]
        for row, (key, label) in enumerate((("ttft_ms", "TTFT ms"), ("itl_ms", "per-token ms"))):
            ax = axes[row][col]
            names = [n for n in runners if runners[n][key]]
            if names:
                ax.boxplot([runners[n][key] for n in names], whis=(1, 99), showfliers=False)
                ax.set_xticks(range(1, len(names) + 1), names, rotation=30, ha="right", fontsize=8)
                ax.set_yscale("log")
            ax.set_title(f"concurrency {level}: {label}", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title + " (boxes: p25-p75, whiskers: p1-p99)", fontsize=10)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

"""PNG plots of a bench run (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

import os

from specserve.bench.report import aggregate_by_position, spec_configs
from specserve.bench.options import ALL

SPEEDUP = "speedup_by_category.png"
ACCEPTANCE = "acceptance_by_position.png"
THROUGHPUT = "tok_s_vs_batch_size.png"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def write_plots(doc: dict, out_dir: str) -> list[str]:
    """Write the plots into ``out_dir``; returns their file names."""
    plt = _pyplot()
    written = []
    s = doc["settings"]
    idx = {(r["temperature"], r["batch_size"], r["category"], r["config"]): r for r in doc["results"]}
    names = [c["name"] for c in doc["configs"]]
    others = [n for n in names if n != "plain"]
    temps, sizes = s["temperatures"], s["batch_sizes"]
    cats = doc["categories"] + [ALL]

    # Speedup over plain decoding, per category, one bar per configuration; a panel per (temperature, batch).
    if others:
        fig, axes = plt.subplots(len(temps), len(sizes), figsize=(max(6.0, 0.55 * len(cats) * len(sizes) + 2),
                                                                  3.6 * len(temps)), squeeze=False)
        width = 0.8 / len(others)
        for i, t in enumerate(temps):
            for j, bs in enumerate(sizes):
                ax = axes[i][j]
                for k, n in enumerate(others):
                    ys = [(idx.get((t, bs, c, n)) or {}).get("speedup_vs_plain") or 0.0 for c in cats]
                    ax.bar([x + (k - (len(others) - 1) / 2) * width for x in range(len(cats))], ys, width, label=n)
                ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
                ax.set_xticks(range(len(cats)))
                ax.set_xticklabels(cats, rotation=45, ha="right", fontsize=8)
                ax.set_ylabel("speedup vs plain")
                ax.set_title(f"temperature {t:g}, batch {bs}", fontsize=10)
                ax.grid(axis="y", alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle("Speedup over plain decoding (tok/s ratio)")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, SPEEDUP), dpi=110)
        plt.close(fig)
        written.append(SPEEDUP)

    # Acceptance rate by draft position, one line per proposer and temperature.
    specs = spec_configs(doc)
    if specs:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for n in specs:
            for t in temps:
                pos = aggregate_by_position(doc, n, t)
                if pos:
                    ax.plot(range(1, len(pos) + 1), pos, marker="o",
                            label=n if len(temps) == 1 else f"{n}, T={t:g}")
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1.02)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title("Acceptance by draft position (all categories)")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, ACCEPTANCE), dpi=110)
        plt.close(fig)
        written.append(ACCEPTANCE)

    # tok/s against batch size, one line per configuration; a panel per temperature.
    fig, axes = plt.subplots(1, len(temps), figsize=(5.2 * len(temps), 3.8), squeeze=False)
    for i, t in enumerate(temps):
        ax = axes[0][i]
        for n in names:
            ys = [(idx.get((t, bs, ALL, n)) or {}).get("tok_s") for bs in sizes]
            ax.plot(sizes, [y if y is not None else float("nan") for y in ys], marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(b) for b in sizes])
        ax.set_xlabel("batch size")
        ax.set_ylabel("tok/s (all categories)")
        ax.set_title(f"temperature {t:g}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Throughput against batch size")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, THROUGHPUT), dpi=110)
    plt.close(fig)
    written.append(THROUGHPUT)
    return written

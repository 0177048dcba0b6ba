"""Figures from sweep results: dPPL vs bits/element per quantizer, one panel per model."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from kvq.results import summarize

LOG_FLOOR = 1e-3
MARKERS = "osD^vP*X"  # dPPL <= 0 (lossless within noise) is drawn at this floor on the log axis


def pareto_front(points: pd.DataFrame) -> pd.DataFrame:
    """Points no other point beats on both bits/element and dPPL (lower is better on both)."""
    ordered = points.sort_values(["bits_per_element", "dppl_mean"])
    front, best = [], float("inf")
    for _, row in ordered.iterrows():
        if row.dppl_mean < best:
            front.append(row)
            best = row.dppl_mean
    return pd.DataFrame(front)


def plot_dppl_vs_bits(frame: pd.DataFrame, out_dir: Path, stem: str = "dppl_vs_bits") -> list[Path]:
    summary = summarize(frame)
    summary["y"] = summary.dppl_mean.clip(lower=LOG_FLOOR)
    model_names = list(dict.fromkeys(summary.model))
    fig, axes = plt.subplots(1, len(model_names), figsize=(6 * len(model_names), 4.5), squeeze=False)
    for ax, model in zip(axes[0], model_names, strict=True):
        panel = summary[summary.model == model]
        # Colour tells the granularity and marker the quantizer, so series stay apart past ten of them;
        # with a single granularity the colour tells the quantizer too.
        colour_key = "granularity" if panel.granularity.nunique() > 1 else "quantizer"
        colours = {g: f"C{i % 10}" for i, g in enumerate(dict.fromkeys(panel[colour_key]))}
        markers = {q: MARKERS[i % len(MARKERS)] for i, q in enumerate(dict.fromkeys(panel.quantizer))}
        for series, points in panel.groupby("series", sort=False):
            points = points.sort_values("bits_per_element")
            first = points.iloc[0]
            ax.errorbar(points.bits_per_element, points.y, yerr=points.dppl_std, capsize=3, label=series,
                        color=colours[first[colour_key]], marker=markers[first.quantizer], ms=7, alpha=0.85)
        front = pareto_front(panel)
        ax.plot(front.bits_per_element, front.dppl_mean.clip(lower=LOG_FLOOR), "k--", lw=1, marker="s",
                mfc="none", ms=13, alpha=0.6, label="Pareto frontier")
        ax.set_yscale("log")
        ax.set_xlabel("bits / element (scales included)")
        ax.set_ylabel("dPPL vs fp (log)")
        ax.set_title(f"{model} ({panel['mode'].iloc[0]} mode)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.png", out_dir / f"{stem}.pdf"]
    for path in paths:
        fig.savefig(path, dpi=130)
    plt.close(fig)
    return paths

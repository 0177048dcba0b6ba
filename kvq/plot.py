"""Figures from sweep results: dPPL (or KL to fp) vs bits/element per quantizer, one panel per model, with the
Pareto frontier marked."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from kvq.results import summarize

# dPPL <= 0 (lossless within noise) is drawn at its floor on the log axis; KL is never negative, and near-lossless
# settings reach 1e-4 nats/token
LOG_FLOORS = {"dppl": 1e-3, "kld": 1e-5}
MARKERS = "osD^vP*X"


METRIC_AXES = {"dppl": "dPPL vs fp (log)", "kld": "KL(fp || quantized), nats/token (log)"}


def pareto_front(points: pd.DataFrame, metric: str = "dppl") -> pd.DataFrame:
    """Points no other point beats on both bits/element and the metric (lower is better on both)."""
    ordered = points.sort_values(["bits_per_element", f"{metric}_mean"])
    front, best = [], float("inf")
    for _, row in ordered.iterrows():
        if row[f"{metric}_mean"] < best:
            front.append(row)
            best = row[f"{metric}_mean"]
    return pd.DataFrame(front)


def plot_metric_vs_bits(frame: pd.DataFrame, out_dir: Path, metric: str = "dppl") -> list[Path]:
    """One figure, `<metric>_vs_bits.png/.pdf` in out_dir: `metric` is dppl or kld (cells without it are left out)."""
    summary = summarize(frame)
    summary = summary[summary[f"{metric}_mean"].notna()].copy()
    floor = LOG_FLOORS[metric]
    summary["y"] = summary[f"{metric}_mean"].clip(lower=floor)
    stem = f"{metric}_vs_bits"
    model_names = list(dict.fromkeys(summary.model))
    fig, axes = plt.subplots(1, len(model_names), figsize=(6 * len(model_names), 4.5), squeeze=False)
    for ax, model in zip(axes[0], model_names, strict=True):
        panel = summary[summary.model == model]
        # A panel of ten series or fewer (e.g. one quantizer under several site policies) gets a colour each;
        # past that, colour tells the quantizer and marker the granularity.
        colour_key = "series" if panel.series.nunique() <= 10 else "quantizer"
        colours = {g: f"C{i % 10}" for i, g in enumerate(dict.fromkeys(panel[colour_key]))}
        markers = {g: MARKERS[i % len(MARKERS)] for i, g in enumerate(dict.fromkeys(panel.granularity))}
        for series, points in panel.groupby("series", sort=False):
            points = points.sort_values("bits_per_element")
            first = points.iloc[0]
            ax.errorbar(points.bits_per_element, points.y, yerr=points[f"{metric}_std"], capsize=3, label=series,
                        color=colours[first[colour_key]], marker=markers[first.granularity], ms=7, alpha=0.85)
        front = pareto_front(panel, metric)
        ax.plot(front.bits_per_element, front[f"{metric}_mean"].clip(lower=floor), "k--", lw=1, marker="s",
                mfc="none", ms=13, alpha=0.6, label="Pareto frontier")
        ax.set_yscale("log")
        ax.set_xlabel("bits / element (scales included)")
        ax.set_ylabel(METRIC_AXES[metric])
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

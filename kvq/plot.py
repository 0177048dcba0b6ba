"""Figures from sweep results: dPPL (or KL to fp) vs bits/element per quantizer, one panel per model, with the
Pareto frontier marked."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from kvq.results import summarize

# KL is never negative, and near-lossless settings reach 1e-4 nats/token: a log axis, values under its floor drawn
# at the floor. dPPL goes negative where a setting is lossless within noise: a symmetric log axis, linear within
# its threshold, so a negative dPPL is drawn where it is, below zero.
LOG_FLOORS = {"kld": 1e-5}
SYMLOG_THRESHOLDS = {"dppl": 1e-3}
MARKERS = "osD^vP*X"


METRIC_AXES = {"dppl": "dPPL vs fp (symmetric log, linear within ±0.001)",
               "kld": "KL(fp || quantized), nats/token (log)"}


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
    fig = metric_figure(frame, metric)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{metric}_vs_bits.png", out_dir / f"{metric}_vs_bits.pdf"]
    for path in paths:
        fig.savefig(path, dpi=130)
    plt.close(fig)
    return paths


def _shown(values: pd.Series, metric: str) -> pd.Series:
    """Where a metric's values are drawn on its axis."""
    return values.clip(lower=LOG_FLOORS[metric]) if metric in LOG_FLOORS else values


def metric_figure(frame: pd.DataFrame, metric: str = "dppl") -> plt.Figure:
    """`metric` (mean and std over seeds) against bits/element, a panel per model, the Pareto frontier marked."""
    summary = summarize(frame)
    summary = summary[summary[f"{metric}_mean"].notna()].copy()
    summary["y"] = _shown(summary[f"{metric}_mean"], metric)
    model_names = list(dict.fromkeys(summary.model))
    fig, axes = plt.subplots(1, len(model_names), figsize=(6 * len(model_names), 4.5), squeeze=False)
    for ax, model in zip(axes[0], model_names, strict=True):
        panel = summary[summary.model == model]
        # A panel of ten series or fewer (e.g. one quantizer under several site policies) gets a colour each;
        # past that, colour tells the quantizer (from twenty colours past ten quantizers) and marker the granularity.
        colour_key = "series" if panel.series.nunique() <= 10 else "quantizer"
        keys = list(dict.fromkeys(panel[colour_key]))
        pairs = plt.get_cmap("tab20").colors  # dark and light shades alternate: the dark ten first
        palette = [f"C{i}" for i in range(10)] if len(keys) <= 10 else list(pairs[0::2] + pairs[1::2])
        colours = {g: palette[i % len(palette)] for i, g in enumerate(keys)}
        markers = {g: MARKERS[i % len(MARKERS)] for i, g in enumerate(dict.fromkeys(panel.granularity))}
        for series, points in panel.groupby("series", sort=False):
            points = points.sort_values("bits_per_element")
            first = points.iloc[0]
            ax.errorbar(points.bits_per_element, points.y, yerr=points[f"{metric}_std"], capsize=3, label=series,
                        color=colours[first[colour_key]], marker=markers[first.granularity], ms=7, alpha=0.85)
        front = pareto_front(panel, metric)
        ax.plot(front.bits_per_element, _shown(front[f"{metric}_mean"], metric), "k--", lw=1, marker="s",
                mfc="none", ms=13, alpha=0.6, label="Pareto frontier")
        if metric in SYMLOG_THRESHOLDS:
            ax.set_yscale("symlog", linthresh=SYMLOG_THRESHOLDS[metric])
            ax.axhline(0, color="grey", lw=0.8)
        else:
            ax.set_yscale("log")
        ax.set_xlabel("bits / element (scales included)")
        ax.set_ylabel(METRIC_AXES[metric])
        ax.set_title(f"{model} ({panel['mode'].iloc[0]} mode)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig

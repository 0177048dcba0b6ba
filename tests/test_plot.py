"""kvq plot draws every point where it is: a negative dPPL (lossless within noise) below zero, not at a floor."""

import pandas as pd
import pytest

from kvq.plot import metric_figure


def _cells(values: dict[str, list[float]], metric: str) -> pd.DataFrame:
    rows = []
    for index, (label, per_seed) in enumerate(values.items()):
        for seed, value in enumerate(per_seed):
            rows.append({"model": "m", "mode": "cache", "quantizer": label, "granularity": "per_token",
                         "series": label, "label": label, "config": label, "protocol": "default", "seed": seed,
                         "bits_per_element": 4.0 + index, "quantized_bits_per_element": 4.0 + index, "fp_ppl": 50.0,
                         "dppl": value if metric == "dppl" else 1.0, "calibration_mse_reduction": None,
                         **({"kld": value} if metric == "kld" else {})})
    return pd.DataFrame(rows)


def _drawn(fig) -> list[float]:
    return [float(y) for ax in fig.axes for line in ax.get_lines() for y in line.get_ydata()]


def test_negative_dppl_is_drawn_below_zero_on_a_symmetric_log_axis():
    fig = metric_figure(_cells({"int-8": [-0.22, -0.24], "srft-8": [-0.01, -0.01], "int-4": [2.0, 3.0]}, "dppl"))
    drawn = _drawn(fig)
    assert fig.axes[0].get_yscale() == "symlog"
    for mean in (-0.23, -0.01, 2.5):
        assert any(y == pytest.approx(mean) for y in drawn), mean


def test_kl_under_the_log_floor_is_drawn_at_the_floor():
    fig = metric_figure(_cells({"a": [1e-7], "b": [0.3]}, "kld"), "kld")
    assert fig.axes[0].get_yscale() == "log"
    assert min(_drawn(fig)) == pytest.approx(1e-5)

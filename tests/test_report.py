"""The two-corpus comparison a ranking finding rests on."""

import pandas as pd
import pytest

from kvq.report import _frontiers, corpus_agreement, rank_correlation


def test_rank_correlation_is_spearmans_rho():
    assert rank_correlation(pd.Series([1.0, 2.0, 3.0, 4.0]), pd.Series([10.0, 20.0, 30.0, 40.0])) == pytest.approx(1)
    assert rank_correlation(pd.Series([1.0, 2.0, 3.0, 4.0]), pd.Series([4.0, 3.0, 2.0, 1.0])) == pytest.approx(-1)
    # one swapped pair of four: 1 - 6 * (1 + 1) / (4 * 15)
    assert rank_correlation(pd.Series([1.0, 2.0, 3.0, 4.0]), pd.Series([1.0, 3.0, 2.0, 4.0])) == pytest.approx(0.8)


def _cells(dppl_by_label: dict[str, list[float]], fp_ppl: float, protocol: str = "default") -> pd.DataFrame:
    rows = []
    for index, (label, values) in enumerate(dppl_by_label.items()):
        for seed, dppl in enumerate(values):
            rows.append({"model": "m", "mode": "cache", "quantizer": label, "granularity": "per_token",
                         "series": label, "label": label, "config": label + protocol, "protocol": protocol,
                         "seed": seed, "bits_per_element": 2.0 + index, "quantized_bits_per_element": 2.0 + index,
                         "fp_ppl": fp_ppl, "dppl": dppl, "calibration_mse_reduction": None})
    return pd.DataFrame(rows)


def test_corpus_agreement_pairs_configurations_and_ranks_them():
    first = pd.concat([_cells({"a": [4.0, 6.0], "b": [1.0, 1.0], "c": [9.0, 9.0], "only-here": [0.0]}, 50.0),
                       _cells({"a": [0.5], "b": [0.2]}, 50.0, protocol="w128")])
    second = pd.concat([_cells({"a": [2.0], "b": [3.0], "c": [8.0]}, 20.0),
                        _cells({"a": [0.4], "b": [0.1]}, 20.0, protocol="w128")])
    text = corpus_agreement(first, second, "one", "two")
    default, windowed = text.split("### m, protocol ")[1:]
    assert default.startswith("default (fp PPL 50.000 / 20.000)")
    assert "| a | 2.000 | 2.000 | +5.000 ± 1.000 | +10.0% | +2.000 | +10.0% |" in default
    assert "only-here" not in text
    assert "over these 3 configurations: 0.500" in default  # ranks (2, 1, 3) against (1, 2, 3)
    assert "over these 2 configurations: 1.000" in windowed


def test_findings_name_the_frontier_per_model_and_metric():
    frame = _cells({"cheap-bad": [5.0], "dominated": [6.0, 6.0], "dear-good": [1.0, 3.0]}, 50.0)
    frame["kld"] = [0.5, 0.7, 0.7, 0.1, 0.3]
    lines = _frontiers(frame, ["dppl", "kld"]).splitlines()
    assert lines == ["- m, dPPL frontier: cheap-bad (2.00 b, +5.0000), dear-good (4.00 b, +2.0000)",
                     "- m, KL frontier: cheap-bad (2.00 b, 0.5000), dear-good (4.00 b, 0.2000)"]

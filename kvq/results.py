"""Loading sweep cells into pandas and summarising over seeds.

Seeds are averaged only within one configuration: cells that differ in anything but the seed (data,
mode, lm-eval settings, any quantizer field) are summarised apart, even when their labels match.
"""

from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from kvq.fingerprint import record_digest
from kvq.policy import parse_policy
from kvq.protocol import Protocol
from kvq.quant import QUANTIZERS, QuantSpec, used_fields
from kvq.quant.scalar import GROUPED
from kvq.store import read_json

CELL_FORMAT_PREFIX = "kvq-cell/"  # every format version holds the fields read here
SERIES_KEYS = ["model", "mode", "protocol", "quantizer", "granularity", "series", "label", "config"]


ACC_SUFFIX = " acc"
DIVERGENCE_COLUMNS = ("kld", "max_window_kld", "top1_agreement")


def _lmeval_columns(metrics: dict) -> dict:
    columns = {}
    for task, info in metrics.get("lmeval", {}).items():
        columns[f"{task}{ACC_SUFFIX}"] = info["metrics"].get("acc,none")
        columns[f"{task} fp{ACC_SUFFIX}"] = info["fp_metrics"].get("acc,none")
    return columns


def _config_without_seed(config: dict) -> str:
    return record_digest({**config, "quant": {**config["quant"], "seed": None}})


def _row(record: dict, path: Path) -> dict:
    config = record["config"]
    quant = QuantSpec(**config["quant"])
    unseeded = QuantSpec(**{**config["quant"], "seed": 0})
    # a method that reads no granularity (KIVI, the codebook and engine formats) is drawn as one series of its own
    reads = used_fields(quant.quantizer) if quant.quantizer in QUANTIZERS else frozenset({"granularity"})
    granularity = (quant.granularity + (f"-g{quant.group_size}" if quant.granularity in GROUPED else "")
                   if "granularity" in reads else "")
    protocol = Protocol(**config.get("protocol", {}))
    policy = parse_policy(config.get("policy"))
    suffix = (f" {policy.label()}" if not policy.is_default else "") + (
        f" {protocol.label()}" if not protocol.is_default else "")
    divergence = record["metrics"].get("divergence", {})
    return {
        "model": config["model"],
        "mode": config["mode"],
        "quantizer": quant.quantizer,
        "bits": quant.bits,
        "granularity": granularity,
        "series": f"{quant.quantizer} {granularity}".rstrip() + suffix,
        "label": unseeded.label() + suffix,
        "protocol": protocol.label() or "default",
        "config": _config_without_seed(config),
        "seed": quant.seed,
        "bits_per_element": record["bits_per_element"],
        # the encoded bits alone: a long context's cost, where a protocol window's fp16 share vanishes
        "quantized_bits_per_element": record.get("quantized_bits_per_element", record["bits_per_element"]),
        "fp_ppl": record["metrics"]["fp_ppl"],
        "ppl": record["metrics"]["ppl"],
        "dppl": record["metrics"]["dppl"],
        "kld": divergence.get("kld"),
        "max_window_kld": divergence.get("max_window_kld"),
        "top1_agreement": divergence.get("top1_agreement"),
        "calibration_mse_reduction": (record.get("calibration") or {}).get("mse_reduction"),
        "cell_id": record.get("cell_id"),
        "measured_with": record.get("measured_with"),
        "commit": record["git"]["commit"],
        "dirty": record["git"]["dirty"],
        "path": str(path),
        **_lmeval_columns(record["metrics"]),
    }


def load(path: str | Path) -> pd.DataFrame:
    """One row per cell record under `path` (a sweep folder, a runs/ folder, or one JSON file)."""
    path = Path(path)
    return load_files([path] if path.is_file() else sorted(path.rglob("*.json")))


def load_files(files: Iterable[Path]) -> pd.DataFrame:
    """One row per file that holds a cell record (others, such as baselines, are passed over)."""
    rows = []
    for file in files:
        record = read_json(file)
        if record and str(record.get("format", "")).startswith(CELL_FORMAT_PREFIX):
            rows.append(_row(record, file))
    return pd.DataFrame(rows)


def summarize(frame: pd.DataFrame) -> pd.DataFrame:
    """Mean and std of dPPL (and of KL to fp, where measured) over seeds per configuration (std is 0 for a
    single seed)."""
    frame = frame.assign(**{column: float("nan") for column in DIVERGENCE_COLUMNS if column not in frame})
    grouped = frame.groupby(SERIES_KEYS, sort=False)
    accuracies = {c: (c, "mean") for c in frame.columns if c.endswith(ACC_SUFFIX)}
    summary = grouped.agg(
        **accuracies,
        bits_per_element=("bits_per_element", "first"),
        quantized_bits_per_element=("quantized_bits_per_element", "first"),
        fp_ppl=("fp_ppl", "first"),
        dppl_mean=("dppl", "mean"),
        dppl_std=("dppl", lambda s: float(s.std(ddof=0))),
        kld_mean=("kld", "mean"),
        kld_std=("kld", lambda s: float(s.std(ddof=0))),
        max_window_kld=("max_window_kld", "max"),
        top1_mean=("top1_agreement", "mean"),
        seeds=("seed", "nunique"),
        calibration_mse_reduction=("calibration_mse_reduction", "first"),
    )
    return summary.reset_index()

"""The RESULTS.md finding a finished sweep appends: command, source, table, JSON and figure paths.

A finding reports exactly the cells its spec expands to. Its key digests what it reports (the
spec's name, its cell ids and the table), so rerunning a sweep whose numbers did not change finds the
same key and the ledger adds nothing.
"""

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from kvq.fingerprint import record_digest
from kvq.ledger import markdown_table
from kvq.provenance import describe_source, git_state
from kvq.results import ACC_SUFFIX, summarize
from kvq.sweep_spec import SweepSpec


@dataclass(frozen=True)
class Finding:
    title: str
    body: str
    key: str


def _table(frame: pd.DataFrame) -> str:
    summary = summarize(frame).sort_values(["model", "bits_per_element", "dppl_mean"])
    header = ["model", "quantizer", "bits/elem", "fp PPL", "dPPL mean ± std", "seeds"]
    rows = [
        [r.model, r.label, f"{r.bits_per_element:.4f}", f"{r.fp_ppl:.3f}", f"{r.dppl_mean:+.4f} ± {r.dppl_std:.4f}",
         str(r.seeds)]
        for r in summary.itertuples()
    ]
    if (summary.quantized_bits_per_element != summary.bits_per_element).any():  # a protocol window is in
        header.insert(3, "encoded bits/elem")
        for row, bits in zip(rows, summary.quantized_bits_per_element, strict=True):
            row.insert(3, f"{bits:.4f}")
    for column in [c for c in summary.columns if c.endswith(ACC_SUFFIX)]:
        header.append(column)
        for row, value in zip(rows, summary[column], strict=True):
            row.append(f"{value:.2f}")
    if summary.calibration_mse_reduction.notna().any():
        header.append("calibration MSE reduction")
        for row, reduction in zip(rows, summary.calibration_mse_reduction, strict=True):
            row.append("-" if pd.isna(reduction) else f"{100 * reduction:.1f}%")
    return markdown_table(header, rows)


def _measured_with(contexts: list[dict]) -> str:
    """The cells' shared measuring context (a finding's cells are all current, so they share one)."""
    distinct = {record_digest(c) for c in contexts}
    if len(distinct) != 1:
        return f"{len(distinct)} different measuring contexts"
    context = contexts[0]
    return (f"code `{context['code']}`, torch {context['torch']}, transformers {context['transformers']}, "
            f"device {context['device']}")


def sweep_finding(spec: SweepSpec, frame: pd.DataFrame, directory: Path, figures: list[Path],
                  command: str) -> Finding:
    """`frame` holds the spec's cells (all current) and nothing else."""
    table = _table(frame)
    commits = sorted(set(frame.commit.dropna()))
    data = spec.data
    body = "\n".join([
        f"Command: `{command}`",
        f"Source: {describe_source(git_state())}; cells ran at: " + (", ".join(f"`{c[:12]}`" for c in commits) or "-"),
        f"Measured with: {_measured_with(list(frame.measured_with))}.",
        f"Spec: `{spec.source}`; mode `{spec.mode}`; data {data.corpus}, {data.n_windows} x {data.seq_len} tokens"
        " (eval split).",
        "",
        table,
        "",
        f"JSON: `{directory}/` ({len(frame)} cells of this spec)",
        "Figure: " + ", ".join(f"`{p}`" for p in figures),
    ])
    key = record_digest({"sweep": spec.name, "cells": sorted(frame.cell_id), "table": table})
    return Finding(f"{spec.name}: dPPL vs bits/element", body, key)

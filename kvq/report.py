"""The RESULTS.md finding a finished sweep appends: command, commit, table, JSON and figure paths."""

from pathlib import Path

import pandas as pd

from kvq.ledger import markdown_table
from kvq.provenance import git_state
from kvq.results import ACC_SUFFIX, summarize
from kvq.sweep_spec import SweepSpec


def sweep_finding(spec: SweepSpec, frame: pd.DataFrame, directory: Path, figures: list[Path],
                  command: str) -> tuple[str, str]:
    summary = summarize(frame).sort_values(["model", "bits_per_element", "dppl_mean"])
    git = git_state()
    commits = sorted(set(frame.commit.dropna()))
    header = ["model", "quantizer", "bits/elem", "fp PPL", "dPPL mean ± std", "seeds"]
    rows = [
        [r.model, r.label, f"{r.bits_per_element:.4f}", f"{r.fp_ppl:.3f}", f"{r.dppl_mean:+.4f} ± {r.dppl_std:.4f}",
         str(r.seeds)]
        for r in summary.itertuples()
    ]
    for column in [c for c in summary.columns if c.endswith(ACC_SUFFIX)]:
        header.append(column)
        for row, value in zip(rows, summary[column], strict=True):
            row.append(f"{value:.2f}")
    if summary.calibration_mse_reduction.notna().any():
        header.append("calibration MSE reduction")
        for row, reduction in zip(rows, summary.calibration_mse_reduction, strict=True):
            row.append("-" if pd.isna(reduction) else f"{100 * reduction:.1f}%")
    data = spec.data
    body = "\n".join([
        f"Command: `{command}`",
        f"Commit: `{git['commit']}`{' (dirty)' if git['dirty'] else ''}; cells ran at: "
        + ", ".join(f"`{c[:12]}`" for c in commits),
        f"Spec: `{spec.source}`; mode `{spec.mode}`; data {data.corpus}, {data.n_windows} x {data.seq_len} tokens"
        " (eval split).",
        "",
        markdown_table(header, rows),
        "",
        f"JSON: `{directory}/` ({len(frame)} cells)",
        "Figure: " + ", ".join(f"`{p}`" for p in figures),
    ])
    return f"{spec.name}: dPPL vs bits/element", body

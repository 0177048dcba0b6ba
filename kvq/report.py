"""The RESULTS.md finding a finished sweep appends: command, source, table, JSON and figure paths.

A finding reports exactly the cells its spec expands to. Its key digests what it reports (the
spec's name, its cell ids and the table), so rerunning a sweep whose numbers did not change finds the
same key and the ledger adds nothing.
"""

from collections import Counter
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
    key: str | None = None  # sweep findings only: what the ledger matches a rerun against


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
    if summary.kld_mean.notna().any():
        header += ["KL(fp||q) mean ± std", "worst-window KL", "top-1 agreement"]
        for row, r in zip(rows, summary.itertuples(), strict=True):
            row += ["-", "-", "-"] if pd.isna(r.kld_mean) else [
                f"{r.kld_mean:.4f} ± {r.kld_std:.4f}", f"{r.max_window_kld:.4f}", f"{r.top1_mean:.4f}"]
    for column in [c for c in summary.columns if c.endswith(ACC_SUFFIX)]:
        header.append(column)
        for row, value in zip(rows, summary[column], strict=True):
            row.append(f"{value:.2f}")
    if summary.calibration_mse_reduction.notna().any():
        header.append("calibration MSE reduction")
        for row, reduction in zip(rows, summary.calibration_mse_reduction, strict=True):
            row.append("-" if pd.isna(reduction) else f"{100 * reduction:.1f}%")
    return markdown_table(header, rows)


def _frontiers(frame: pd.DataFrame, metrics: list[str]) -> str:
    """Per model and metric, the configurations no other beats on both stored bits and the metric's mean over
    seeds, cheapest first: which method holds the frontier at which budget."""
    from kvq.plot import pareto_front

    summary = summarize(frame)
    lines = []
    for model, panel in summary.groupby("model", sort=False):
        for metric in metrics:
            points = panel[panel[f"{metric}_mean"].notna()]
            if points.empty:
                continue
            front = pareto_front(points, metric)
            name = "dPPL" if metric == "dppl" else "KL"
            steps = ", ".join(f"{r.label} ({r.bits_per_element:.2f} b, {getattr(r, f'{metric}_mean'):+.4f})"
                              if metric == "dppl" else
                              f"{r.label} ({r.bits_per_element:.2f} b, {getattr(r, f'{metric}_mean'):.4f})"
                              for r in front.itertuples())
            lines.append(f"- {model}, {name} frontier: {steps}")
    return "\n".join(lines)


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
        "Pareto frontier (stored bits/element, mean over seeds):",
        _frontiers(frame, ["dppl", "kld"] if "kld" in spec.metrics else ["dppl"]),
        "",
        f"JSON: `{directory}/` ({len(frame)} cells of this spec)",
        "Figure: " + ", ".join(f"`{p}`" for p in figures),
    ])
    key = record_digest({"sweep": spec.name, "cells": sorted(frame.cell_id), "table": table})
    metrics = "dPPL and KL" if "kld" in spec.metrics else "dPPL"
    return Finding(f"{spec.name}: {metrics} vs bits/element", body, key)


def ppl_report(base, quantized, bits_per_element: float, encoded_bits: float | None) -> str:
    """`kvq ppl`'s result lines: fp and quantized PPL (kvq.ppl results), KL where measured, and bits/element, with
    what the encoded part alone stores where a protocol window holds tokens in fp16."""
    lines = [f"fp PPL         {base.ppl:.4f}", f"quantized PPL  {quantized.ppl:.4f}",
             f"dPPL           {quantized.ppl - base.ppl:+.4f}"]
    if quantized.divergence:
        divergence = quantized.divergence
        lines += [f"KL(fp||q)      {divergence.kld:.5f} nats/token (worst window {divergence.max_window_kld:.5f})",
                  f"top-1 agree    {divergence.top1_agreement:.4f}"]
    encoded = ("" if encoded_bits is None
               else f" (the window's tokens in fp16, the rest at {encoded_bits:.4f} as encoded)")
    return "\n".join([*lines, f"bits/element   {bits_per_element:.4f}{encoded}"])


def status_report(states, directory: Path) -> str:
    """`kvq sweep --status`: a line per record (kvq.sweep.CellState), then counts that add up to those lines. A
    record that no cell of the spec names is 'other', never counted as a stale cell."""
    lines = []
    for s in states:
        what = f"{s.cell.model}  seed={s.cell.quant.seed}  {s.cell.label()}" if s.cell else "-"
        state = s.state if s.cell else "other"
        lines.append(f"{s.cell_id}  {state:7s}  {what}" + (f"  ({s.detail})" if s.state == "stale" else ""))
    counts = Counter(s.state for s in states if s.cell is not None)
    others = sum(s.cell is None for s in states)
    lines.append(f"{counts.total()} cells: {counts['current']} current, {counts['todo']} todo, {counts['stale']} "
                 f"stale; {others} other records in {directory} are not in this spec")
    return "\n".join(lines)


def retrieval_finding(command: str, model: str, task: str, spec, samples_per_method: int, table: str, out: Path,
                      figures: list[Path]) -> Finding:
    """The finding `kvq retrieval` appends: accuracy per method and length (`spec` a kvq.longctx.RetrievalSpec)."""
    body = "\n".join([
        f"Command: `{command}`",
        f"Source: {describe_source(git_state())}; {samples_per_method} samples per method is "
        f"{len(spec.lengths)} lengths x {len(spec.depths)} depths x {spec.samples}; greedy decoding.",
        "", "Accuracy (mean over depths):", "", table, "",
        f"JSON: `{out}/{model}-{task}-*.json`", "Figure: " + ", ".join(f"`{p}`" for p in figures),
    ])
    return Finding(f"{task} retrieval on {model}", body)


def bench_finding(command: str, kind: str, record: dict, table: str, path: Path) -> Finding:
    """The finding `kvq bench` appends: its table, from one run on one device."""
    body = "\n".join([
        f"Command: `{command}`",
        f"Source: {describe_source(record['git'])}; device: {record['device']}; "
        f"torch {record['versions']['torch']}. Ratios are from this one run.", "", table, "", f"JSON: `{path}`",
    ])
    return Finding(f"kvq bench {kind} on {record['device']}", body)


def rank_correlation(a: pd.Series, b: pd.Series) -> float:
    """Spearman's rho: the Pearson correlation of the two series' ranks (ties share their mean rank)."""
    ranks = pd.DataFrame({"a": a.rank(), "b": b.rank()})
    return float(ranks.a.corr(ranks.b))


def _seeds(counts: pd.Series) -> str:
    most = int(counts.max())
    return f"{most} seeds" if most > 1 else "1 seed"


def corpus_agreement(first: pd.DataFrame, second: pd.DataFrame, first_name: str, second_name: str) -> str:
    """Per model and protocol, each configuration's dPPL on two corpora side by side (mean ± std over the
    seeds each holds, and as % of fp PPL), rows by encoded bits, then the rank correlation of dPPL
    between the corpora over the configurations both hold: does an order seen on one text hold on another?"""
    columns = ["model", "protocol", "label", "quantized_bits_per_element", "bits_per_element", "fp_ppl",
               "dppl_mean", "dppl_std", "kld_mean", "seeds"]
    merged = summarize(first)[columns].merge(summarize(second)[columns], on=["model", "protocol", "label"],
                                             suffixes=("", "_2"))
    sections = []
    for (model, protocol), rows in merged.groupby(["model", "protocol"], sort=False):
        rows = rows.sort_values(["quantized_bits_per_element", "dppl_mean"])
        header = ["method", "encoded bits/elem", "stored bits/elem", f"dPPL {first_name} ({_seeds(rows.seeds)})",
                  "% of fp", f"dPPL {second_name} ({_seeds(rows.seeds_2)})", "% of fp"]
        table = [[r.label, f"{r.quantized_bits_per_element:.3f}", f"{r.bits_per_element:.3f}",
                  f"{r.dppl_mean:+.3f}" + (f" ± {r.dppl_std:.3f}" if r.seeds > 1 else " (one cell)"),
                  f"{100 * r.dppl_mean / r.fp_ppl:+.1f}%", f"{r.dppl_mean_2:+.3f}"
                  + (f" ± {r.dppl_std_2:.3f}" if r.seeds_2 > 1 else ""), f"{100 * r.dppl_mean_2 / r.fp_ppl_2:+.1f}%"]
                 for r in rows.itertuples()]
        rho = rank_correlation(rows.dppl_mean, rows.dppl_mean_2)
        lines = [f"### {model}, protocol {protocol} (fp PPL {rows.fp_ppl.iloc[0]:.3f} / {rows.fp_ppl_2.iloc[0]:.3f})",
                 "", markdown_table(header, table), "",
                 f"Spearman rank correlation of dPPL between the corpora over these {len(rows)} configurations: "
                 f"{rho:.3f}"]
        if rows.kld_mean.notna().all() and rows.kld_mean_2.notna().all():
            lines.append(f"Spearman rank correlation of KL(fp || q) between the corpora: "
                         f"{rank_correlation(rows.kld_mean, rows.kld_mean_2):.3f}")
        sections.append("\n".join(lines))
    return "\n\n".join(sections)


def ruler_table(scores: dict[str, dict[str, dict]], suite: dict[str, dict]) -> str:
    """RULER scores per task (rows) and length (columns), each with its bootstrap interval, and the suite mean."""
    lengths = list(suite)

    def cell(score: dict) -> str:
        return f"{score['mean']:.2f} [{score['low']:.2f}, {score['high']:.2f}]"

    rows = [[task, *(cell(by_length[length]) for length in lengths), str(by_length[lengths[0]]["samples"])]
            for task, by_length in scores.items()]
    rows.append(["suite mean", *(cell(suite[length]) for length in lengths), ""])
    return markdown_table(["task", *(f"{length} tok" for length in lengths), "samples"], rows)

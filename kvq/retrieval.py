"""Long-context retrieval under several quantizers: per-sample JSON, accuracy table and heatmap."""

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
import torch

from kvq import models
from kvq.experiment import make_bank, refuse_centers
from kvq.ledger import markdown_table
from kvq.lmeval import run_task, stored_bits, stored_bits_by_length
from kvq.longctx import RetrievalSpec, write_tasks
from kvq.models import cache_dir
from kvq.policy import SitePolicy
from kvq.protocol import Protocol
from kvq.provenance import provenance
from kvq.quant import QuantSpec
from kvq.store import write_json_atomic


def label(spec: QuantSpec | None, policy: SitePolicy = SitePolicy()) -> str:
    if spec is None:
        return "fp"
    return spec.label() if policy.is_default else f"{spec.label()}+{policy.label()}"


def run_retrieval(model_name: str, specs: list[QuantSpec | None], retrieval: RetrievalSpec, mode: str,
                  task: str, out_dir: Path, device: str = "cpu", limit: int | None = None,
                  protocol: Protocol = Protocol(), batch_size: int = 1, decode: str = "auto",
                  dtype: str = "float32", policy: SitePolicy = SitePolicy()) -> list[dict]:
    """One lm-eval run of `task` per spec (under `policy`'s per-site settings where it quantizes), the model in
    `dtype`; each result is written to out_dir as JSON and returned. `batch_size` and `decode` are
    kvq.lmeval.QuantizedHFLM's."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks are local files
    config = models.load_config(model_name)
    banks = {label(s, policy): (s, make_bank(model_name, config, s, policy) if s else None) for s in specs}
    for _, bank in banks.values():
        refuse_centers(bank, "kvq retrieval")
    lm = models.load(model_name, device=device, dtype=getattr(torch, dtype))
    folder = write_tasks(lm.tokenizer, retrieval, cache_dir() / "tasks", only=[task])
    records = []
    for name, (spec, bank) in banks.items():
        result = run_task(lm, bank, mode, task, limit, folder, device, protocol, batch_size, decode)
        record = {
            "format": "kvq-retrieval/1", "model": model_name, "mode": mode, "protocol": protocol.to_dict(),
            "task": task, "label": name, "dtype": dtype, "decode": result["decode"],
            "quant": spec.to_dict() if spec else None, "policy": policy.to_dict() if spec else None,
            "retrieval": retrieval.__dict__,
            "accuracy": result["metrics"]["acc,none"], "samples": result["samples"],
            "bits_per_element": stored_bits(bank),
            "stored_bits_per_element": stored_bits_by_length(bank, protocol, retrieval.lengths), **provenance(device),
        }
        write_json_atomic(out_dir / f"{model_name}-{task}-{name}.json", record)
        records.append(record)
    return records


def accuracy_frame(records: list[dict]) -> pd.DataFrame:
    rows = [{"method": r["label"], "bits": r["bits_per_element"], **s} for r in records for s in r["samples"]]
    return pd.DataFrame(rows)


def accuracy_table(frame: pd.DataFrame) -> str:
    """Accuracy per method (rows) and context length (columns), averaged over depths."""
    pivot = frame.pivot_table(index=["method", "bits"], columns="length", values="acc", aggfunc="mean", sort=False)
    header = ["method", "bits/elem", *[f"{length} tok" for length in pivot.columns], "mean"]
    rows = [[method, f"{bits:.3f}", *[f"{v:.2f}" for v in values], f"{values.mean():.2f}"]
            for (method, bits), values in zip(pivot.index, pivot.to_numpy(), strict=True)]
    return markdown_table(header, rows)


def heatmap(frame: pd.DataFrame, path: Path, title: str) -> list[Path]:
    methods = list(dict.fromkeys(frame.method))
    fig, axes = plt.subplots(1, len(methods), figsize=(3.6 * len(methods), 3.2), squeeze=False)
    for ax, method in zip(axes[0], methods, strict=True):
        grid = frame[frame.method == method].pivot_table(index="depth", columns="length", values="acc", aggfunc="mean")
        image = ax.imshow(grid.to_numpy(), vmin=0, vmax=1, cmap="RdYlGn", origin="lower", aspect="auto")
        ax.set_xticks(range(len(grid.columns)), [str(c) for c in grid.columns])
        ax.set_yticks(range(len(grid.index)), [f"{d:.0%}" for d in grid.index])
        ax.set_xlabel("context length (tokens)")
        if ax is axes[0][0]:
            ax.set_ylabel("needle depth")
        ax.set_title(method, fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    fig.suptitle(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Model names hold dots ("qwen2.5-..."), so the suffix is appended, never substituted.
    paths = [path.parent / f"{path.name}.{ext}" for ext in ("png", "pdf")]
    for p in paths:
        fig.savefig(p, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return paths

"""Quality beside speed for the caches `kvq bench decode` runs fused: one row per cache, its KL and dPPL to fp on
each built-in model (from sweeps of the layout it stores, every key quantized) beside its ms/token, its speed
against the fair fp16 row of its own bench run and the fraction of its bytes-ideal, and the K/V it holds; with
--memory, what fits of it on the device of a `kvq bench memory` run.

Usage: python scripts/fast_path_table.py --bench runs/bench/decode-A.json [more bench JSON] \
           --studies runs/vq_pareto runs/fast_path runs/gemma3_d256 runs/fast_path_gemma3 \
           [--second runs/vq_pareto_gpl3 runs/fast_path_gpl3 runs/gemma3_d256_gpl3 runs/fast_path_gemma3_gpl3] \
           [--memory runs/bench/memory-A.json [more memory JSON]]
Prints a Markdown table; with --second, per model whether the caches' KL order holds on the second corpus.
"""

import argparse
import json
from pathlib import Path

import pandas as pd

import kvq.results
from kvq.bench.decode import KVQ_STATIC_LAYOUTS

# a bench row's precision -> the label its layout's cells carry in the sweeps
STUDY_LABELS = {
    "int4": "srft-4b-per_group-g32",
    "int4+fp": "srft-4b-per_group-g32 first1:fp last1:fp",
    "k8v4": "srft-4b-per_group-g32 k[bits=8]",
    "kivi4": "kivi-4b-g32",
    "kivi2": "kivi-2b-g32",
    "turbo4": "turbo-4b",
    "turbo3": "turbo-3b",
}
MODELS = ("qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m")
# a memory row's cache -> the precision of the decode rows storing the same layout
PRECISION_OF_CACHE = {"fp16": "fp16"} | {name: precision for name, _, precision, _ in KVQ_STATIC_LAYOUTS}


def quality(folders: list[str]) -> pd.DataFrame:
    """Mean and spread over seeds per (model, label), every key quantized (cache mode, no window)."""
    frame = pd.concat([kvq.results.load(folder) for folder in folders], ignore_index=True)
    frame = frame[frame.protocol == "default"]
    return kvq.results.summarize(frame).set_index(["model", "label"])


def speed_rows(files: list[str]) -> dict[str, dict]:
    """The fused rows of each bench run by precision, each with the run it came from; a precision measured in two
    runs keeps the later file's row."""
    rows = {}
    for file in files:
        result = json.loads(Path(file).read_text())["result"]
        for row in result["rows"]:
            if "skipped" not in row:
                rows[row["precision"]] = {**row, "run": file}
    return rows


def memory_cells(files: list[str]) -> dict[str, str]:
    """Per precision: the largest batch at the runs' context and the longest context at one row, each with its
    ratio to the runs' fp16 cache (the runs are of one device and setting; a cache in two keeps the later one)."""
    rows = {row["cache"]: row for file in files for row in json.loads(Path(file).read_text())["result"]["rows"]}
    fp16 = rows["fp16"]
    return {PRECISION_OF_CACHE[name]: f"{row['largest_batch']} x {row['context'] // 1024}K "
            f"({row['largest_batch'] / fp16['largest_batch']:.2f}x); {row['longest_context'] / 1e6:.2f}M "
            f"({row['longest_context'] / fp16['longest_context']:.2f}x)"
            for name, row in rows.items() if name in PRECISION_OF_CACHE}


def cell(summary: pd.DataFrame, model: str, label: str) -> str:
    if (model, label) not in summary.index:
        return "not measured"
    row = summary.loc[(model, label)]
    spread = f" ± {row.kld_std:.4f}" if row.seeds > 1 else ""
    return f"{row.kld_mean:.4f}{spread} ({row.dppl_mean:+.2f}; {row.bits_per_element:.2f} b)"


def kl_order_holds(first: pd.DataFrame, second: pd.DataFrame, model: str, labels: list[str]) -> str:
    """Whether the layouts `labels` rank alike by KL on both corpora, among those measured on both."""
    labels = [label for label in labels if (model, label) in first.index and (model, label) in second.index]
    order = [sorted(labels, key=lambda label: table.loc[(model, label)].kld_mean) for table in (first, second)]
    return "yes" if order[0] == order[1] else f"no: {' < '.join(order[1])} there"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", nargs="+", required=True)
    parser.add_argument("--studies", nargs="+", required=True)
    parser.add_argument("--second", nargs="*", default=[])
    parser.add_argument("--memory", nargs="*", default=[])
    args = parser.parse_args()
    summary, speed = quality(args.studies), speed_rows(args.bench)
    fits = memory_cells(args.memory)
    print("| cache | " + " | ".join(f"KL {model} (dPPL; bits)" for model in MODELS)
          + " | ms/token | vs fair fp16 | of bytes-ideal | K/V MiB |"
          + (" fits: rows at a context; tokens at one row |" if fits else "") + " bench run |")
    print("|---" * (len(MODELS) + 6 + bool(fits)) + "|")
    for precision, row in speed.items():
        label = STUDY_LABELS.get(precision)
        kl = [("0 (fp)" if precision == "fp16" else cell(summary, model, label) if label else "not measured")
              for model in MODELS]
        print(f"| {row['cache']} | " + " | ".join(kl) + f" | {row['ms_per_token']:.2f} | "
              f"{row['speedup_vs_best_fp16']:.2f}x | {row['fraction_of_bytes_ideal']:.2f} | "
              f"{row['cache_bytes'] / 2**20:.0f} |" + (f" {fits.get(precision, 'not measured')} |" if fits else "")
              + f" {row['run']} |")
    if args.second:
        second = quality(args.second)
        print()
        for model in MODELS:
            holds = kl_order_holds(summary, second, model, [STUDY_LABELS[p] for p in speed if p in STUDY_LABELS])
            print(f"- {model}: the caches' KL order holds on the second corpus: {holds}")


if __name__ == "__main__":
    main()

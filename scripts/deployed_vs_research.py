"""Per model: each deployed KV format (the engine quantizers) beside the research method with the lowest mean KL
at no more measured bits, from a sweep's runs and, if given, its twin on a second corpus.

Usage: python scripts/deployed_vs_research.py runs/vq_pareto [runs/vq_pareto_gpl3]
Prints a Markdown table per model: KL and dPPL of each (mean ± std over seeds), the KL ratio, and whether the
research method and the format keep their KL order on the second corpus.
"""

import sys

import kvq.results

DEPLOYED = ("fp8", "nvfp4", "mx", "ggml", "mlx")


def summary(runs: str):
    frame = kvq.results.load(runs)
    grouped = frame.groupby(["model", "label", "quantizer"], as_index=False)
    return grouped.agg(bits=("bits_per_element", "mean"), kl=("kld", "mean"), kl_std=("kld", "std"),
                       dppl=("dppl", "mean"), dppl_std=("dppl", "std"), seeds=("seed", "count")).fillna(0.0)


def best_research(table, model: str, bits: float):
    research = table[(table.model == model) & ~table.quantizer.isin(DEPLOYED) & (table.bits <= bits + 1e-9)]
    return None if research.empty else research.loc[research.kl.idxmin()]


def kl_of(table, model: str, label: str) -> float | None:
    row = table[(table.model == model) & (table.label == label)]
    return None if row.empty else float(row.kl.iloc[0])


def main(first: str, second: str | None = None) -> None:
    table = summary(first)
    other = summary(second) if second else None
    for model in sorted(table.model.unique()):
        print(f"\n### {model}\n")
        print("| deployed format | bits | KL | dPPL | best research method at <= its bits (by KL) | bits | KL ± std "
              "| dPPL ± std | KL ratio | same order on the second corpus |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        deployed = table[(table.model == model) & table.quantizer.isin(DEPLOYED)].sort_values(["bits", "kl"])
        for _, row in deployed.iterrows():
            best = best_research(table, model, row.bits)
            if best is None:
                print(f"| {row.label} | {row.bits:.2f} | {row.kl:.4f} | {row.dppl:+.3f} | none | | | | | |")
                continue
            holds = ""
            if other is not None:
                mine, theirs = kl_of(other, model, row.label), kl_of(other, model, best.label)
                holds = "n/a" if mine is None or theirs is None else ("yes" if (theirs < mine) == (best.kl < row.kl)
                                                                      else "no")
            print(f"| {row.label} | {row.bits:.2f} | {row.kl:.4f} | {row.dppl:+.3f} | {best.label} | {best.bits:.2f} | "
                  f"{best.kl:.4f} ± {best.kl_std:.4f} | {best.dppl:+.3f} ± {best.dppl_std:.3f} | "
                  f"{best.kl / row.kl:.2f} | {holds} |")


if __name__ == "__main__":
    main(*sys.argv[1:])

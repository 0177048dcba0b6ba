"""Synthetic distortions of TurboQuant, QJL and PolarQuant beside their papers' numbers (CPU, ~1 min).

    python benchmarks/paper_distortions.py [--d 128] [--vectors 4096] [--seeds 3]

TurboQuant: E|x - x~|^2 (mse) and d E[(<y, x> - <y, x~>)^2] (prod) on random unit x, y, per rotation.
QJL and PolarQuant: relative score error E[(q.k~ - q.k)^2] / E[(q.k)^2] on Gaussian q, k.
Each cell is the mean over seeds, with the spread (max - min) beside it.
"""

import argparse

import torch

from kvq.quant import QuantSpec, Site, build_quantizer

THEOREM_1 = {1: 0.36, 2: 0.117, 3: 0.03, 4: 0.009}
THEOREM_2 = {1: 1.57, 2: 0.56, 3: 0.18, 4: 0.047}


def gaussian(n: int, d: int, seed: int, unit: bool) -> torch.Tensor:
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (x / x.norm(dim=-1, keepdim=True) if unit else x).float()


def through(name: str, bits: int, seed: int, d: int, x: torch.Tensor, **options) -> torch.Tensor:
    quantizer = build_quantizer(QuantSpec(name, bits, seed=seed, options=options), Site(0, "k", d))
    return quantizer(x[None])[0]


def spread(values: list[float]) -> str:
    mean = sum(values) / len(values)
    return f"{mean:.4g} ({max(values) - min(values):.2g})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--vectors", type=int, default=4096)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    d, n, seeds = args.d, args.vectors, range(args.seeds)
    x, y = gaussian(n, d, 10_001, unit=True), gaussian(n, d, 10_002, unit=True)
    k, q = gaussian(n, d, 10_003, unit=False), gaussian(n, d, 10_004, unit=False)
    scores = (q * k).sum(-1)

    print(f"| b | Theorem 1 | mse srft | mse haar | Theorem 2 | prod srft | prod haar |  (d={d}, {n} vectors)")
    print("|---|---|---|---|---|---|---|")
    for bits in (1, 2, 3, 4):
        row = [str(bits), str(THEOREM_1[bits])]
        for rotation in ("srft", "haar"):
            row.append(spread([float(((through("turbo", bits, s, d, x, rotation=rotation) - x) ** 2).sum(-1).mean())
                               for s in seeds]))
        row.append(str(THEOREM_2[bits]))
        for rotation in ("srft", "haar"):
            row.append(spread([d * float((((through("turbo", bits, s, d, x, rotation=rotation, variant="prod") - x)
                                           * y).sum(-1) ** 2).mean()) for s in seeds]))
        print("| " + " | ".join(row) + " |")

    def relative(estimate: torch.Tensor) -> float:
        return float((((estimate * q).sum(-1) - scores) ** 2).mean() / (scores**2).mean())

    print("\n| method | key bits/element | relative score MSE |")
    print("|---|---|---|")
    for m in (d, 2 * d):
        for orthogonal in (False, True):
            errors = [relative(through("qjl", 4, s, d, k, m=m, orthogonal=orthogonal)) for s in seeds]
            label = f"qjl m={m} {'orthogonal blocks' if orthogonal else 'i.i.d.'}"
            print(f"| {label} | {(m + 16) / d:.4g} | {spread(errors)} |")
    for bits, upper in ((4, 2), (3, 2), (2, 1)):
        quantizer = build_quantizer(QuantSpec("polar", bits, options={"upper_bits": upper}), Site(0, "k", d))
        errors = [relative(through("polar", bits, s, d, k, upper_bits=upper)) for s in seeds]
        print(f"| polar {bits}/{upper} bits | {quantizer.bits_per_element(d, 1):.4g} | {spread(errors)} |")


if __name__ == "__main__":
    main()

"""Seconds from `kvq ...` to its one-line error, for arguments wrong on their face (checked before kvq imports
torch or transformers) and for a model name that is not one (checked when the model is resolved).

    python benchmarks/cli_error_time.py [--repeats 5]
"""

import argparse
import statistics
import subprocess
import sys
import time

CASES = {
    "bits out of range": ["ppl", "--bits", "12"],
    "unknown option": ["sweep", "--bogus", "x"],
    "sweep file missing": ["sweep", "no-such-sweep.yaml"],
    "unknown model": ["ppl", "--model", "/no/such/model/dir"],
}


def seconds(args: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "kvq", *args], capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != 2:
        raise SystemExit(f"kvq {' '.join(args)} exited {done.returncode}, not 2: {done.stderr[-300:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    print("| error | median s | min s |\n|---|---|---|")
    for name, args in CASES.items():
        times = [seconds(args) for _ in range(repeats)]
        print(f"| {name} (`kvq {' '.join(args)}`) | {statistics.median(times):.2f} | {min(times):.2f} |")


if __name__ == "__main__":
    main()

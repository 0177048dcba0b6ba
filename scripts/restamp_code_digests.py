"""Re-stamps sweep records with the code digest kvq.fingerprint gives them now, where provably the same code
measured them, after a change to what a digest covers (not to what a measurement runs).

    python scripts/restamp_code_digests.py --base REV [runs]

A record is re-stamped only when both hold:
- its `code` equals the digest REV's kvq gives it: REV's own kvq/fingerprint.py, run in a fresh process over
  REV's sources, so REV's code measured it;
- every source its new digest covers reads as the same code (syntax tree) in the working tree as at REV.
Then the code its new digest names is the code that measured it. A baseline moves to the path of its new key, and
each cell's baseline fingerprints follow; a record that fails either test, or that measured lm-eval tasks, is
left as it is (stale).
"""

import argparse
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from functools import cache
from io import BytesIO
from pathlib import Path

from kvq.fingerprint import PACKAGE_DIR, code_version, measuring_files, python_code, record_digest, sealed
from kvq.records import BASELINE_FORMAT, CELL_FORMAT, baseline_fingerprint, quantizers_of
from kvq.store import read_json, write_json_atomic

ROOT = PACKAGE_DIR.parent


def _at(base: str, path: str) -> bytes | None:
    done = subprocess.run(["git", "show", f"{base}:{path}"], cwd=ROOT, capture_output=True)
    return done.stdout if done.returncode == 0 else None


def digests_at(base: str, quantizer_sets: list[frozenset[str]]) -> dict[frozenset[str], str]:
    """The code digest REV's kvq gives a measurement with each quantizer set."""
    archive = subprocess.run(["git", "archive", "--format=tar", base, "kvq"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    script = ("import sys; from kvq.fingerprint import code_version; "
              "print(*(code_version(frozenset(s.split(',')) - {''}) for s in sys.argv[1:]))")
    with tempfile.TemporaryDirectory() as folder:
        tarfile.open(fileobj=BytesIO(archive)).extractall(folder, filter="data")
        done = subprocess.run([sys.executable, "-c", script, *(",".join(sorted(s)) for s in quantizer_sets)],
                              cwd=folder, capture_output=True, text=True, check=True,
                              env={"PATH": "", "PYTHONPATH": folder})
    return dict(zip(quantizer_sets, done.stdout.split(), strict=True))


@cache
def unchanged_since(base: str, quantizers: frozenset[str]) -> bool:
    """Whether every source a measurement with these quantizers runs reads as the same code now as at REV."""
    for path in measuring_files(quantizers):
        name = path.relative_to(ROOT).as_posix()
        then = _at(base, name)
        if then is None:
            return False
        now = path.read_bytes()
        if (python_code(now) != python_code(then)) if path.suffix == ".py" else now != then:
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True)
    parser.add_argument("runs", nargs="?", default="runs")
    args = parser.parse_args()
    cells = [(path, read_json(path)) for path in sorted(Path(args.runs).glob("*/*.json"))]
    cells = [(path, record) for path, record in cells if record.get("format") == CELL_FORMAT]
    sets = {frozenset(quantizers_of(record["config"])) for _, record in cells} | {frozenset()}
    old = digests_at(args.base, sorted(sets, key=sorted))
    counts: Counter = Counter()
    fingerprints = {}  # a baseline's old fingerprint -> its new one
    for path in sorted(Path(args.runs).glob("*/baselines/*.json")):
        record = read_json(path)
        if (record.get("format") != BASELINE_FORMAT or path.name.startswith("lmeval-")
                or record["key"].get("code") != old[frozenset()]):
            counts["baselines left"] += 1
            continue
        if not unchanged_since(args.base, frozenset()):
            counts["baselines whose code changed"] += 1
            continue
        key = {**record["key"], "code": code_version()}
        body = {k: v for k, v in record.items() if k != "digest"}
        restamped = sealed({**body, "key": key})
        write_json_atomic(path.with_name(f"{record_digest(key)}.json"), restamped)
        if path.name != f"{record_digest(key)}.json":
            path.unlink()
        fingerprints[baseline_fingerprint(record)] = baseline_fingerprint(restamped)
        counts["baselines restamped"] += 1
    for path, record in cells:
        quantizers = frozenset(quantizers_of(record["config"]))
        if record["config"].get("lmeval") or record["measured_with"].get("code") != old[quantizers]:
            counts["cells left"] += 1
            continue
        if not unchanged_since(args.base, quantizers) or not set(record["baselines"].values()) <= set(fingerprints):
            counts["cells whose code or baselines changed"] += 1
            continue
        body = {k: v for k, v in record.items() if k != "digest"}
        body["measured_with"] = {**record["measured_with"], "code": code_version(quantizers)}
        body["baselines"] = {name: fingerprints[fp] for name, fp in record["baselines"].items()}
        write_json_atomic(path, sealed(body))
        counts["cells restamped"] += 1
    print(f"fp digest at {args.base}: {old[frozenset()]}, now {code_version()}")
    for what, count in sorted(counts.items()):
        print(f"{what}: {count}")


if __name__ == "__main__":
    main()

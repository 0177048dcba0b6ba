"""Re-stamps sweep records measured under the whole-path code digest with the per-cell one, where provably the same
code measured them.

    python scripts/restamp_code_digests.py --base REV [runs]

Until REV, a record's `code` digested every measuring module (as Python 3.11 tokenizes them). Now it digests
what its cell runs (kvq.fingerprint.measuring_files). A record is re-stamped only when both hold:
- its `code` equals the whole-path digest of the sources at REV, computed with REV's own kvq/fingerprint.py, so
  REV's code measured it;
- every source its new digest covers reads as the same code (syntax tree) in the working tree as at REV.
Then the code its new digest names is the code that measured it. A baseline moves to the path of its new key, and
each cell's baseline fingerprints follow; a record that fails either test is left as it is (stale).
"""

import argparse
import subprocess
from collections import Counter
from functools import cache
from pathlib import Path, PurePosixPath

from kvq.fingerprint import PACKAGE_DIR, code_version, measuring_files, python_code, record_digest, sealed
from kvq.records import BASELINE_FORMAT, CELL_FORMAT, baseline_fingerprint, quantizers_of
from kvq.store import read_json, write_json_atomic

ROOT = PACKAGE_DIR.parent


def _at(base: str, path: str) -> bytes | None:
    done = subprocess.run(["git", "show", f"{base}:{path}"], cwd=ROOT, capture_output=True)
    return done.stdout if done.returncode == 0 else None


class _LegacySource:
    """What REV's `_code(path)` reads of a path: its suffix and bytes, here from git."""

    def __init__(self, name: str, data: bytes):
        self.suffix, self._data = PurePosixPath(name).suffix, data

    def read_bytes(self) -> bytes:
        return self._data


def whole_path_digest(base: str) -> str:
    """The code digest REV's kvq gave every record: its fingerprint module run over its own sources."""
    legacy: dict = {}
    exec(compile(_at(base, "kvq/fingerprint.py"), f"{base}:kvq/fingerprint.py", "exec"), legacy)
    listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", base, "kvq"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split()
    files = [f for f in listed if f.endswith(".py") and f.removeprefix("kvq/") not in legacy["PRESENTATION_MODULES"]]
    files += [f for f in listed if f.startswith("kvq/kernels/csrc/")]
    chunks = []
    for name in sorted(files, key=lambda f: PurePosixPath(f).parts):
        chunks += [name.encode(), legacy["_code"](_LegacySource(name, _at(base, name)))]
    return legacy["_sha"](*chunks)


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
    old = whole_path_digest(args.base)
    counts: Counter = Counter()
    fingerprints = {}  # a baseline's old fingerprint -> its new one
    for path in sorted(Path(args.runs).glob("*/baselines/*.json")):
        record = read_json(path)
        if record.get("format") != BASELINE_FORMAT or record["key"].get("code") != old:
            counts["baselines left"] += 1
            continue
        if not unchanged_since(args.base, frozenset()):
            counts["baselines whose code changed"] += 1
            continue
        key = {**record["key"], "code": code_version()}
        body = {k: v for k, v in record.items() if k != "digest"}
        restamped = sealed({**body, "key": key})
        prefix = "lmeval-" if path.name.startswith("lmeval-") else ""
        write_json_atomic(path.with_name(f"{prefix}{record_digest(key)}.json"), restamped)
        path.unlink()
        fingerprints[baseline_fingerprint(record)] = baseline_fingerprint(restamped)
        counts["baselines restamped"] += 1
    for path in sorted(Path(args.runs).glob("*/*.json")):
        record = read_json(path)
        if record.get("format") != CELL_FORMAT or record["measured_with"].get("code") != old:
            counts["cells left"] += int(record.get("format") == CELL_FORMAT)
            continue
        quantizers = frozenset(quantizers_of(record["config"]))
        if not unchanged_since(args.base, quantizers) or not set(record["baselines"].values()) <= set(fingerprints):
            counts["cells whose code or baselines changed"] += 1
            continue
        body = {k: v for k, v in record.items() if k != "digest"}
        body["measured_with"] = {**record["measured_with"], "code": code_version(quantizers)}
        body["baselines"] = {name: fingerprints[fp] for name, fp in record["baselines"].items()}
        write_json_atomic(path, sealed(body))
        counts["cells restamped"] += 1
    print(f"whole-path digest at {args.base}: {old}")
    for what, count in sorted(counts.items()):
        print(f"{what}: {count}")


if __name__ == "__main__":
    main()

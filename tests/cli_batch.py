"""Runs kvq's command line once per case in one fresh process, so a suite of bad-input cases pays Python's and
torch's start-up once instead of once per case. Each case goes through `kvq.cli.main`, as `python -m kvq` does, in
its own working directory, with its stdout and stderr captured at the file descriptors (what a shell captures,
a C library's prints included) and with warnings' once-per-place memory cleared, so a warning that a fresh process
would print is printed in every case. kvq.cli is imported inside the first case, so that case sees what its import
prints.

Usage: python cli_batch.py CASES.json RESULTS.json, CASES a list of {"cwd": ..., "args": [...]}; RESULTS gets a
list of {"code": exit status, "stdout": ..., "stderr": ...} in the same order.
"""

import json
import os
import sys
import tempfile
import traceback
import warnings


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def run_case(cwd: str, args: list[str]) -> dict:
    captured = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    sys.stdout.flush()
    sys.stderr.flush()
    kept = [os.dup(1), os.dup(2)]
    os.dup2(captured[0].fileno(), 1)
    os.dup2(captured[1].fileno(), 2)
    try:
        with warnings.catch_warnings():  # entering and leaving it forgets which warnings were shown
            os.chdir(cwd)
            sys.argv = ["kvq", *args]
            try:
                from kvq.cli import main

                main()
                code = 0
            except SystemExit as exc:
                code = _exit_code(exc)
            except BaseException:  # what `python -m kvq` would show as a traceback
                traceback.print_exc()
                code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in zip((1, 2), kept, strict=True):
            os.dup2(saved, fd)
            os.close(saved)
    texts = []
    for stream in captured:
        stream.seek(0)
        texts.append(stream.read().decode(errors="replace"))
        stream.close()
    return {"code": code, "stdout": texts[0], "stderr": texts[1]}


if __name__ == "__main__":
    cases_path, results_path = sys.argv[1:3]
    with open(cases_path) as f:
        cases = json.load(f)
    results = [run_case(case["cwd"], case["args"]) for case in cases]
    with open(results_path, "w") as f:
        json.dump(results, f)

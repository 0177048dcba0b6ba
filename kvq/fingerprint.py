"""Digests of what a measured number depends on beyond its config, and of records themselves.

- `code_version`: the kvq sources a cell's measurement runs, read as code: the shared measuring path (the
  modules the cell runner imports, and any module nothing reaches statically), plus the modules of the cell's own
  quantizers and what they import, plus those of the metrics it measures beyond perplexity (lm-eval tasks), which
  a perplexity cell never imports, plus for a cell measured on an accelerator (or one measuring lm-eval tasks,
  which may decode on one) the kernels' builds, launches and sources, which a CPU measurement never imports.
  Comments, docstrings and layout are left out, so rewording a comment keeps results current, while any change to
  what runs makes the cells that run it stale, and only those: an edit to `kvq/quant/qjl.py` stales QJL's cells,
  one to a CUDA kernel the cells measured on a GPU. A new module is shared until it is listed here as
  presentation, metric or kernel, or reached only from a quantizer's or a metric's modules, so an unlisted change
  can only make results stale, never silently current.
- `corpus_digest`: the text of a corpus, so an edited corpus file is a different baseline.
- `file_digest`: a calibration artifact's bytes.
- `record_digest`: a JSON record's content, so a record edited by hand no longer verifies.
"""

import ast
import hashlib
import json
import re
import sys
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import torch

from kvq.provenance import PACKAGE_DIR, device_name, versions

# Modules that cannot change a cell's number: they parse specs, print, plot, lock, store or judge records, time
# kernels for kvq bench (kvq bench reports speed, never a cell), or hand cells to workers (every executor measures
# a cell with kvq.sweep's CellRunner, which is on the path).
PRESENTATION_MODULES = frozenset({
    "__main__.py", "cli.py", "cli_bench.py", "cli_calibrate.py", "cli_common.py", "errors.py", "fingerprint.py",
    "ledger.py", "locks.py", "plot.py", "provenance.py", "records.py", "report.py", "results.py", "store.py",
    "yamlspec.py", "bench/__init__.py", "bench/decode.py", "bench/kernels.py", "bench/memory.py", "bench/tables.py",
    "bench/timing.py",
    "executors/__init__.py", "executors/driver.py", "executors/ray_backend.py", "executors/settings.py",
    "executors/slurm_backend.py", "executors/worker.py",
})
# Modules only a metric's measurement imports, by the metric's name: the runner reaches them through that metric
# alone, so they are digested for the cells that measure it, never for a perplexity cell (a test runs one and
# checks that it imports none of them). lm-eval tasks generate through kvq.generate's static cache on CUDA.
METRIC_MODULES = {
    "lmeval": frozenset({"generate.py", "gqa_attention.py", "haystack.py", "lmeval.py", "lmeval_decode.py",
                         "longctx.py", "retrieval.py", "ruler.py", "tasks/__init__.py", "tasks/scoring.py"}),
}
# The kernels' builds, launches and sources: kvq.ops imports them on an accelerator only (on a CPU the torch
# reference serves), so they are digested for cells measured on one and for cells of lm-eval tasks (which may
# decode through the static cache on one), never for a perplexity cell on a CPU (a test measures one and checks
# that it imports none of them).
ACCELERATOR_MODULES = frozenset({
    "kernels/backends.py", "kernels/cuda_decode.py", "kernels/decode_attention.py", "kernels/decode_graph.py",
    "kernels/dispatch.py", "kernels/launch.py", "kernels/plan.py", "kernels/source.py", "kernels/triton_codes.py",
    "kernels/triton_decode.py", "kernels/triton_launch.py", "kernels/triton_quantize.py",
})
# What measures every cell, whichever executor runs it.
MEASURING_ENTRY = "sweep.py"
KERNEL_SOURCES = PACKAGE_DIR / "kernels" / "csrc"
DIGEST_CHARS = 16


def _sha(*chunks: bytes) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(len(chunk).to_bytes(8, "little"))
        h.update(chunk)
    return h.hexdigest()[:DIGEST_CHARS]


def _in(path: Path, names: frozenset[str]) -> bool:
    return path.is_relative_to(PACKAGE_DIR) and path.relative_to(PACKAGE_DIR).as_posix() in names


def _is_presentation(path: Path) -> bool:
    return _in(path, PRESENTATION_MODULES)


def _is_metric_module(path: Path) -> bool:
    return any(_in(path, names) for names in METRIC_MODULES.values())


def _is_accelerator_only(path: Path) -> bool:
    return _in(path, ACCELERATOR_MODULES) or path.is_relative_to(KERNEL_SOURCES)


def _name(path: Path) -> str:
    """A source's name in a digest: its path beside kvq, or for a quantizer's module kept elsewhere (registered by
    a user's own code) its file name, so the digest does not depend on where a checkout lies."""
    return path.relative_to(PACKAGE_DIR.parent).as_posix() if path.is_relative_to(PACKAGE_DIR.parent) else path.name


def _module_files(dotted: str) -> list[Path]:
    """The files importing `dotted` (a kvq module, or a name in one) runs: each package's __init__ on the way
    and the module itself; none for a name that is not a module."""
    files, here = [], PACKAGE_DIR.parent
    for part in dotted.split("."):
        here = here / part
        if (here / "__init__.py").is_file():
            files.append(here / "__init__.py")
        elif here.with_suffix(".py").is_file():
            files.append(here.with_suffix(".py"))
            break
        else:
            break
    return files


@cache
def _imports(path: Path) -> frozenset[Path]:
    """The kvq modules a source imports anywhere in it (inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == PACKAGE_DIR.name:
                found.update(_module_files(name))
    return frozenset(found)


def _reach(starts: Iterable[Path], within_metrics: bool = False, accelerator: bool = False) -> set[Path]:
    """The measuring modules `starts` import, directly or through each other (presentation modules are neither
    digested nor followed; metric modules only when `within_metrics`, the kernels' modules only on an
    `accelerator`)."""
    seen, todo = set(), list(starts)
    while todo:
        path = todo.pop()
        if (path in seen or _is_presentation(path) or (_is_metric_module(path) and not within_metrics)
                or (_is_accelerator_only(path) and not accelerator)):
            continue
        seen.add(path)
        todo.extend(_imports(path))
    return seen


@cache
def _quantizer_modules() -> dict[str, Path]:
    """Each registered quantizer's module file, by the name YAML and the CLI use."""
    from kvq.quant import QUANTIZERS

    return {name: Path(sys.modules[QUANTIZERS.get(name).__module__].__file__).resolve()
            for name in QUANTIZERS.names()}


def _kernel_sources() -> set[Path]:
    return {p for p in KERNEL_SOURCES.rglob("*") if p.is_file()}


@cache
def _shared_files(accelerator: bool) -> frozenset[Path]:
    """What every cell on a CPU (or on an `accelerator`) runs: the cell runner's imports (on an accelerator every
    kernel source too), and every measuring module that neither the runner, nor any quantizer's module, nor any
    metric's reaches (loaded by name, say), since an edit there must not leave a result silently current."""
    measuring = {p for p in PACKAGE_DIR.rglob("*.py") if not _is_presentation(p) and not _is_metric_module(p)
                 and (accelerator or not _is_accelerator_only(p))}
    shared = _reach([PACKAGE_DIR / MEASURING_ENTRY], accelerator=accelerator)
    reached = (shared | _reach((p for p in _quantizer_modules().values() if p.is_relative_to(PACKAGE_DIR)),
                               accelerator=accelerator)
               | set().union(*(_metric_files(metric) for metric in METRIC_MODULES)))
    return frozenset(shared | (measuring - reached) | (_kernel_sources() if accelerator else set()))


def _metric_files(metric: str) -> set[Path]:
    """A metric's modules and what they import, the kernels included: lm-eval tasks may decode on an accelerator."""
    return _reach((PACKAGE_DIR / name for name in METRIC_MODULES[metric] if (PACKAGE_DIR / name).is_file()),
                  within_metrics=True, accelerator=True) | _kernel_sources()


def measuring_files(quantizers: Iterable[str] = (), metrics: Iterable[str] = (),
                    accelerator: bool = False) -> list[Path]:
    """The sources a measurement with these quantizers (none: fp) of these metrics beyond perplexity runs, on a
    CPU or on an `accelerator`."""
    modules = _quantizer_modules()
    files = _shared_files(accelerator) | _reach((modules[name] for name in quantizers), accelerator=accelerator)
    for metric in metrics:
        files |= _metric_files(metric)
    return sorted(files)


def _normal_form(node) -> str:
    """A syntax tree as text, without string statements (docstrings) and without fields that are empty, so a
    field a newer Python adds to its nodes (as 3.12 added type_params) leaves older code's form unchanged."""
    if isinstance(node, list):
        return "[" + ",".join(_normal_form(item) for item in node if not _is_string_statement(item)) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    fields = [f"{name}={_normal_form(value)}" for name, value in ast.iter_fields(node)
              if value is not None and value != []]
    return f"{type(node).__name__}({','.join(fields)})"


def _is_string_statement(node) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def python_code(source: bytes) -> bytes:
    """A Python source's syntax tree without docstrings or other string statements: what executes, in a form that
    comments, layout, quoting and the tokenizer's version leave unchanged."""
    return _normal_form(ast.parse(source)).encode()


# C-family comments, matched beside string and character literals so that a "//" inside one stays.
_C_COMMENT_OR_LITERAL = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)


def c_code(source: bytes) -> bytes:
    """A CUDA / C++ / Metal source without comments, blank lines or runs of spaces (lines stay, as the
    preprocessor reads them)."""
    text = _C_COMMENT_OR_LITERAL.sub(lambda m: m.group() if m.group()[0] in "\"'" else " ", source.decode())
    lines = (" ".join(line.split()) for line in text.splitlines())
    return "\n".join(line for line in lines if line).encode()


def _code(path: Path) -> bytes:
    if path.suffix == ".py":
        return python_code(path.read_bytes())
    if path.suffix in (".cu", ".cuh", ".h", ".cpp", ".metal"):
        return c_code(path.read_bytes())
    return path.read_bytes()


@cache
def code_version(quantizers: frozenset[str] = frozenset(), metrics: frozenset[str] = frozenset(),
                 accelerator: bool = False) -> str:
    """Digest of the sources a measurement with these quantizers (none: fp) of these metrics runs on a CPU or on
    an `accelerator` (names and code); fixed for a process's life."""
    chunks = []
    for path in measuring_files(quantizers, metrics, accelerator):
        chunks += [_name(path).encode(), _code(path)]
    return _sha(*chunks)


def device_kind(device: str) -> str:
    """'cuda:1' -> 'cuda'."""
    return device.split(":", 1)[0]


def measuring_context(device: str, quantizers: Iterable[str] = (), metrics: Iterable[str] = (),
                      threads: int | None = None) -> dict[str, str | int | None]:
    """What a number measured now with these quantizers (none: fp) of these metrics beyond perplexity depends on
    besides its config and data. The device is named as provenance names it (the card; the CPU's model and the
    instruction set its kernels take): another CPU rounds sums apart, so its cells are stale here and its fp
    baselines are not the ones this CPU's cells are paired with. On a CPU so does another count of intra-op threads
    (`threads`, default this process's), which splits each sum another way."""
    installed = versions()
    accelerator = device_kind(device) != "cpu"
    context = {"code": code_version(frozenset(quantizers), frozenset(metrics), accelerator),
               "torch": installed["torch"], "transformers": installed["transformers"], "device": device_name(device)}
    if not accelerator:
        context["threads"] = threads or torch.get_num_threads()
    return context


def corpus_digest(corpus: str) -> str:
    from kvq.data import documents

    return _sha(*(doc.encode() for doc in documents(corpus)))


def file_digest(path: str | Path) -> str:
    return _sha(Path(path).read_bytes())


def record_digest(record: dict) -> str:
    """Digest of a record's content, its own 'digest' field left out."""
    body = {k: v for k, v in record.items() if k != "digest"}
    return _sha(json.dumps(body, sort_keys=True).encode())


def verified(record: dict | None) -> dict | None:
    """The record if it carries its own correct digest, else None."""
    if record is None or record.get("digest") != record_digest(record):
        return None
    return record


def sealed(record: dict) -> dict:
    """The record with its digest added."""
    return {**record, "digest": record_digest(record)}

"""code_version reads sources as code: rewording a comment or docstring keeps results current, any
change to what runs makes them stale, and only the cells that run it."""

import inspect
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import requires_models

from kvq import fingerprint
from kvq.fingerprint import PACKAGE_DIR, _code, c_code, measuring_files, python_code
from kvq.quant import QUANTIZERS

PYTHON = b'''"""Module docstring."""

import math

SCALE = 2.0  # why this scale


def norm(x):
    """What it returns."""
    # a comment of its own line
    return math.sqrt(x) * SCALE
'''

PYTHON_REWORDED = b'''"""Another module docstring,
over two lines."""
import math
SCALE = 2.0   # reworded

def norm(x):
    """Reworded."""
    return math.sqrt( x )*SCALE  # trailing
'''

CUDA = b'''// header comment
#define KVQ_TILE 64  /* tile rows */
__device__ float scale(float x) {
    const char* tag = "a // not a comment";
    return x * 0.5f; // half
}
'''

CUDA_REWORDED = b'''/* reworded header
   over lines */
#define KVQ_TILE 64
__device__ float scale(float x) {
        const char* tag = "a // not a comment";

    return x  *  0.5f;
}
'''


PERPLEXITY_SPEC = """name: r
models: [smollm2-135m]
data: {corpus: shakespeare, seq_len: 32, n_windows: 2, batch_size: 2}
mode: cache
grid:
  quantizer: [srft, kivi]
  bits: [2]
metrics: [ppl, kld]
"""


def test_comments_docstrings_and_layout_leave_the_code_unchanged():
    assert python_code(PYTHON) == python_code(PYTHON_REWORDED)
    assert c_code(CUDA) == c_code(CUDA_REWORDED)


@pytest.mark.parametrize("read,source,old,new", [
    (python_code, PYTHON, b"SCALE = 2.0", b"SCALE = 3.0"),
    (python_code, PYTHON, b"math.sqrt(x)", b"math.exp(x)"),
    (python_code, PYTHON, b"    return math", b"    x = x + 1\n    return math"),
    (python_code, PYTHON, b"    # a comment of its own line\n",
     b'    """What it returns."""\n    x = "not a docstring" + x\n'),
    (c_code, CUDA, b"0.5f", b"0.25f"),
    (c_code, CUDA, b"KVQ_TILE 64", b"KVQ_TILE 128"),
    (c_code, CUDA, b'"a // not a comment"', b'"a // changed"'),
    (c_code, CUDA, b"#define KVQ_TILE 64  /* tile rows */\n", b"#define KVQ_TILE 64 \\\n 2\n"),
])
def test_any_change_to_what_runs_changes_the_code(read, source, old, new):
    assert old in source
    assert read(source.replace(old, new)) != read(source)


def test_every_measuring_source_reads_as_code_and_a_comment_leaves_it_unchanged():
    for path in measuring_files(QUANTIZERS.names()):
        source = path.read_bytes()
        commented = (b"// a note\n" if path.suffix != ".py" else b"# a note\n") + source
        assert _code(path), path
        assert (c_code(commented) if path.suffix != ".py" else python_code(commented)) == _code(path), path


FSTRINGS = b'''
def label(name, bits, scale):
    return f"{name}-{bits}b" + f'{scale:>8.3f}' + f"{'{'}{name!r}{'}'}" + f"{bits=}"
'''

FSTRINGS_RETOKENIZED = b'''
def label(name, bits, scale):
    return (f'{name}-{bits}b'
            + f"{scale:>8.3f}" + f"{'{'}{name!r}{'}'}" + f'{bits=}')
'''


def test_the_code_is_the_syntax_tree_so_quoting_and_line_breaks_inside_f_strings_leave_it_unchanged():
    assert python_code(FSTRINGS) == python_code(FSTRINGS_RETOKENIZED)
    assert python_code(FSTRINGS) != python_code(FSTRINGS.replace(b">8.3f", b">9.3f"))


def _other_python() -> str | None:
    """A working Python on the other side of 3.12's tokenizer change (PEP 701 made f-strings tokens of their own)."""
    minors = (11, 10) if sys.version_info >= (3, 12) else (12, 13)
    candidates = [str(p) for minor in minors
                  for p in sorted(Path.home().glob(f".pyenv/versions/3.{minor}*/bin/python"))]
    candidates += [found for minor in minors if (found := shutil.which(f"python3.{minor}"))]
    for candidate in candidates:
        if subprocess.run([candidate, "-c", "pass"], capture_output=True).returncode == 0:
            return candidate
    return None


def test_the_code_of_every_measuring_source_is_the_same_under_another_python_version():
    """Python 3.12 tokenizes f-strings differently from 3.11 (PEP 701): the digest must not follow."""
    other = _other_python()
    if other is None:
        pytest.skip("no Python of the other tokenizer generation is installed")
    functions = "\n".join(inspect.getsource(f) for f in (fingerprint._normal_form, fingerprint._is_string_statement,
                                                          fingerprint.python_code))
    files = [str(p) for p in measuring_files(QUANTIZERS.names()) if p.suffix == ".py"]
    script = "import ast, hashlib, sys\n" + functions + textwrap.dedent("""
        for name in sys.argv[1:]:
            print(hashlib.sha256(python_code(open(name, "rb").read())).hexdigest())
        """)
    there = subprocess.run([other, "-c", script, *files], capture_output=True, text=True, check=True).stdout.split()
    here = [fingerprint.hashlib.sha256(python_code(Path(f).read_bytes())).hexdigest() for f in files]
    assert there == here


def _digests(package: Path, cells: list[tuple[frozenset[str], frozenset[str], bool]]) -> list[str]:
    """code_version of each (quantizers, metrics, on an accelerator), computed by a fresh process from the kvq
    package at `package`."""
    script = ("import sys; from kvq.fingerprint import code_version; "
              "print(*(code_version(*(frozenset(part.split(',')) - {''} for part in s.split('|')[:2]), "
              "s.endswith('|gpu')) for s in sys.argv[1:]))")
    arguments = [",".join(sorted(quantizers)) + "|" + ",".join(sorted(metrics)) + ("|gpu" if gpu else "|cpu")
                 for quantizers, metrics, gpu in cells]
    done = subprocess.run([sys.executable, "-c", script, *arguments], cwd=package.parent, capture_output=True,
                          text=True, check=True, env={"PATH": "", "PYTHONPATH": str(package.parent)})
    return done.stdout.split()


EDITS = {"quantizer": ("quant/qjl.py", "_EDITED = 1\n"), "shared": ("apply.py", "_EDITED = 1\n"),
         "comment": ("quant/qjl.py", "# a reworded note\n"), "metric": ("longctx.py", "_EDITED = 1\n"),
         "kernel launch": ("kernels/launch.py", "_EDITED = 1\n"),
         "kernel dispatch": ("kernels/dispatch.py", "_EDITED = 1\n"),
         "kernel source": ("kernels/csrc/decode_attention.cu", "#define KVQ_EDITED 1\n")}


@pytest.mark.parametrize("edit", EDITS)
def test_an_edit_stales_the_cells_that_run_what_it_changed_and_no_others(tmp_path, edit):
    """A cell's code digest covers what its measurement runs: an edit to one quantizer's module changes only the
    digests of cells that use it, an edit to the shared path changes every digest (the fp baseline's too), an
    edit to a module only lm-eval tasks run changes only the digests of cells that measure them, an edit to the
    kernels' builds, launches or sources only those of cells measured on an accelerator or measuring lm-eval tasks,
    and an edit to a comment changes none."""
    package = tmp_path / "kvq"
    shutil.copytree(PACKAGE_DIR, package, ignore=shutil.ignore_patterns("__pycache__"))
    none, lmeval = frozenset(), frozenset({"lmeval"})
    cpu, gpu = False, True
    cells = [(frozenset(), none, cpu), (frozenset({"qjl"}), none, cpu), (frozenset({"turbo"}), none, cpu),
             (frozenset({"kivi"}), none, cpu), (frozenset({"srft"}), none, cpu),
             (frozenset({"srft", "qjl"}), none, cpu), (frozenset(), lmeval, cpu), (frozenset({"kivi"}), lmeval, cpu),
             (frozenset(), none, gpu), (frozenset({"srft"}), none, gpu)]
    before = _digests(package, cells)
    target, line = EDITS[edit]
    with (package / target).open("a") as source:
        source.write(line)
    after = _digests(package, cells)
    changed = [cell for cell, old, new in zip(cells, before, after, strict=True) if old != new]
    on_gpu_or_lmeval = [cell for cell in cells if cell[2] or cell[1] == lmeval]
    expected = {"quantizer": [(frozenset({"qjl"}), none, cpu), (frozenset({"srft", "qjl"}), none, cpu)],
                "shared": cells, "comment": [],
                "metric": [(frozenset(), lmeval, cpu), (frozenset({"kivi"}), lmeval, cpu)],
                "kernel launch": on_gpu_or_lmeval, "kernel dispatch": on_gpu_or_lmeval,
                "kernel source": on_gpu_or_lmeval}
    assert changed == expected[edit]


@requires_models
def test_a_perplexity_cell_imports_no_module_of_another_metric(tmp_path):
    """What keeps lm-eval's modules and the kernels' out of a CPU perplexity cell's digest: measuring perplexity
    and KL on a CPU (hook and cache mode, quantizers with and without a packed layout) never imports them."""
    (tmp_path / "r.yaml").write_text(PERPLEXITY_SPEC)
    (tmp_path / "h.yaml").write_text(PERPLEXITY_SPEC.replace("name: r", "name: h").replace("mode: cache", "mode: hook"))
    script = textwrap.dedent("""
        import sys
        from kvq.cli import main
        from kvq.fingerprint import ACCELERATOR_MODULES, METRIC_MODULES, PACKAGE_DIR
        for spec in ("r.yaml", "h.yaml"):
            sys.argv = ["kvq", "sweep", spec, "--runs-dir", "runs", "--results", "R.md"]
            try:
                main()
            except SystemExit as exit:
                assert not exit.code, exit.code
        names = {name for modules in METRIC_MODULES.values() for name in modules} | ACCELERATOR_MODULES
        loaded = [m.__name__ for m in list(sys.modules.values())
                  if getattr(m, "__file__", None) and m.__file__.startswith(str(PACKAGE_DIR))
                  and m.__file__[len(str(PACKAGE_DIR)) + 1:] in names]
        print("loaded", loaded)
        """)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [len(list((tmp_path / "runs" / name).glob("*.json"))) for name in "rh"] == [2, 2]
    assert "loaded []" in done.stdout, done.stdout

"""code_version reads sources as code: rewording a comment or docstring keeps results current, any
change to what runs makes them stale."""

import pytest

from kvq.fingerprint import _code, _measuring_files, c_code, python_code

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
    for path in _measuring_files():
        source = path.read_bytes()
        commented = (b"// a note\n" if path.suffix != ".py" else b"# a note\n") + source
        assert _code(path), path
        assert (c_code(commented) if path.suffix != ".py" else python_code(commented)) == _code(path), path

"""Digests of what a measured number depends on beyond its config, and of records themselves.

- `code_version`: the kvq sources on the measuring path (every module but the ones that only parse,
  print, plot or store) and the kernel sources, read as code: comments, docstrings and layout are left
  out, so rewording a comment keeps results current while any change to what runs makes them stale. A
  new module is on the path until listed here as presentation, so an unlisted change can only make
  results stale, never silently current.
- `corpus_digest`: the text of a corpus, so an edited corpus file is a different baseline.
- `file_digest`: a calibration artifact's bytes.
- `record_digest`: a JSON record's content, so a record edited by hand no longer verifies.
"""

import hashlib
import io
import json
import re
import tokenize
from functools import cache
from pathlib import Path

from kvq.provenance import PACKAGE_DIR, versions

# Modules that cannot change a cell's number: they parse specs, print, plot, lock or store, time kernels or
# serve only kvq bench's rows (kvq bench reports speed, never a cell), or hand cells to workers (every executor
# measures a cell with kvq.sweep's CellRunner, which is on the path).
PRESENTATION_MODULES = frozenset({
    "__main__.py", "bench.py", "cli.py", "errors.py", "fingerprint.py", "gqa_attention.py", "ledger.py",
    "locks.py", "plot.py", "provenance.py", "report.py", "results.py", "store.py", "yamlspec.py",
    "executors/__init__.py", "executors/driver.py", "executors/ray_backend.py", "executors/settings.py",
    "executors/slurm_backend.py", "executors/worker.py",
})
DIGEST_CHARS = 16


def _sha(*chunks: bytes) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(len(chunk).to_bytes(8, "little"))
        h.update(chunk)
    return h.hexdigest()[:DIGEST_CHARS]


def _measuring_files() -> list[Path]:
    files = [p for p in PACKAGE_DIR.rglob("*.py")
             if p.relative_to(PACKAGE_DIR).as_posix() not in PRESENTATION_MODULES]
    files += [p for p in (PACKAGE_DIR / "kernels" / "csrc").rglob("*") if p.is_file()]
    return sorted(files)


# A string statement after these tokens (or first in the file) is a docstring or another no-op.
_STATEMENT_START = frozenset({tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING})
_LAYOUT = frozenset({tokenize.COMMENT, tokenize.NL})
# C-family comments, matched beside string and character literals so that a "//" inside one stays.
_C_COMMENT_OR_LITERAL = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)


def python_code(source: bytes) -> bytes:
    """The token stream of a Python source without comments, blank lines, spacing or string statements
    (docstrings): what executes, in a form that rewording or reflowing leaves unchanged."""
    tokens = [t for t in tokenize.tokenize(io.BytesIO(source).readline) if t.type not in _LAYOUT]
    kept = []
    for index, token in enumerate(tokens):
        follows = tokens[index - 1].type if index else tokenize.ENCODING
        ends = tokens[index + 1].type if index + 1 < len(tokens) else tokenize.ENDMARKER
        if token.type == tokenize.STRING and follows in _STATEMENT_START and ends in (tokenize.NEWLINE,
                                                                                     tokenize.ENDMARKER):
            continue
        kept.append(f"{token.type}" if token.type in _STATEMENT_START else f"{token.type} {token.string}")
    return "\n".join(kept).encode()


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
def code_version() -> str:
    """Digest of the measuring path's source files (names and code); fixed for a process's life."""
    chunks = []
    for path in _measuring_files():
        chunks += [path.relative_to(PACKAGE_DIR.parent).as_posix().encode(), _code(path)]
    return _sha(*chunks)


def device_kind(device: str) -> str:
    """'cuda:1' -> 'cuda': the kind of device shapes numbers, not which card of it."""
    return device.split(":", 1)[0]


def measuring_context(device: str) -> dict[str, str | None]:
    """What a number measured now depends on besides its config and data."""
    installed = versions()
    return {"code": code_version(), "torch": installed["torch"], "transformers": installed["transformers"],
            "device": device_kind(device)}


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

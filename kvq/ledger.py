"""RESULTS.md: a numbered ledger of findings. New findings are appended; earlier ones never change.

Appends hold an exclusive lock on the ledger file, so concurrent writers get distinct numbers. A
finding may carry a key (a digest of what it reports, written as an HTML comment, invisible when
rendered); appending a key the ledger already holds adds nothing.
"""

import re
from dataclasses import dataclass
from pathlib import Path

from kvq.locks import exclusive

HEADING = re.compile(r"^## (\d+)\. ", re.MULTILINE)
PREAMBLE = ("# kvq results\n\nNumbered findings, each appended by `kvq sweep`, `kvq bench` or `kvq retrieval` (or by "
            "hand); an item is not edited once written, a later one supersedes it.\n")


def _key_marker(key: str) -> str:
    return f"<!-- kvq finding {key} -->"


@dataclass(frozen=True)
class Appended:
    number: int
    new: bool  # False: the ledger already held this finding (same key), under `number`


def next_number(text: str) -> int:
    numbers = [int(n) for n in HEADING.findall(text)]
    return max(numbers, default=0) + 1


def _number_holding(text: str, marker: str) -> int | None:
    at = text.find(marker)
    if at < 0:
        return None
    headings = HEADING.findall(text[:at])
    return int(headings[-1]) if headings else None


def append_finding(path: Path, title: str, body: str, key: str | None = None) -> Appended:
    """Appends '## N. title' + body, N one past the highest number, under the ledger's lock.
    Opens in append mode so old bytes stay as they were."""
    path = Path(path)
    marker = _key_marker(key) if key else None
    with exclusive(path):
        existing = path.read_text()
        held = _number_holding(existing, marker) if marker else None
        if held is not None:
            return Appended(held, new=False)
        number = next_number(existing)
        chunk = "" if existing else PREAMBLE
        if existing and not existing.endswith("\n"):
            chunk += "\n"
        chunk += f"\n## {number}. {title}\n\n{body.rstrip()}\n"
        if marker:
            chunk += f"\n{marker}\n"
        with path.open("a") as f:
            f.write(chunk)
    return Appended(number, new=True)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A pipe table; a '|' inside a cell (as in "KL(fp||q)") is escaped, or it would split the cell."""
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header), *(line(row) for row in rows)])

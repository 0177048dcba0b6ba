"""RESULTS.md: a numbered ledger of findings. New findings are appended; earlier ones never change."""

import re
from pathlib import Path

HEADING = re.compile(r"^## (\d+)\. ", re.MULTILINE)
PREAMBLE = "# kvq results\n\nNumbered findings, each appended by `kvq sweep` (or by hand). Never edit old items.\n"


def next_number(text: str) -> int:
    numbers = [int(n) for n in HEADING.findall(text)]
    return max(numbers, default=0) + 1


def append_finding(path: Path, title: str, body: str) -> int:
    """Appends '## N. title' + body and returns N. Opens in append mode so old bytes stay as they were."""
    path = Path(path)
    existing = path.read_text() if path.exists() else ""
    number = next_number(existing)
    chunk = ("" if existing else PREAMBLE)
    if existing and not existing.endswith("\n"):
        chunk += "\n"
    chunk += f"\n## {number}. {title}\n\n{body.rstrip()}\n"
    with path.open("a") as f:
        f.write(chunk)
    return number


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)

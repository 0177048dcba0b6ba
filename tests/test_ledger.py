import multiprocessing
import re
from pathlib import Path

from markdown_it import MarkdownIt

from kvq.ledger import HEADING, append_finding, markdown_table, next_number

PROCESSES, APPENDS = 6, 30


def _append_many(ledger: str, worker: int) -> None:
    for i in range(APPENDS):
        append_finding(ledger, f"worker {worker} item {i}", f"body {worker}/{i}")


def test_concurrent_appends_get_distinct_numbers(tmp_path):
    ledger = tmp_path / "RESULTS.md"
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_append_many, args=(str(ledger), w)) for w in range(PROCESSES)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    text = ledger.read_text()
    numbers = [int(n) for n in HEADING.findall(text)]
    assert sorted(numbers) == list(range(1, PROCESSES * APPENDS + 1))
    assert text.count("# kvq results") == 1
    # every item is whole: its heading, a blank line, its own body
    for worker, i in re.findall(r"^## \d+\. worker (\d+) item (\d+)$", text, re.MULTILINE):
        assert f"worker {worker} item {i}\n\nbody {worker}/{i}\n" in text


def test_a_finding_with_a_known_key_is_not_appended_again(tmp_path):
    ledger = tmp_path / "RESULTS.md"
    first = append_finding(ledger, "sweep a", "table 1", key="k1")
    assert (first.number, first.new) == (1, True)
    append_finding(ledger, "other", "unkeyed")
    before = ledger.read_bytes()
    again = append_finding(ledger, "sweep a", "table 1", key="k1")
    assert (again.number, again.new) == (1, False)
    assert ledger.read_bytes() == before
    changed = append_finding(ledger, "sweep a", "table 2", key="k2")
    assert (changed.number, changed.new) == (3, True)
    assert next_number(ledger.read_text()) == 4


def test_ledger_numbering_keeps_old_items_byte_identical(tmp_path):
    ledger = tmp_path / "RESULTS.md"
    assert append_finding(ledger, "first", "body one").number == 1
    before = ledger.read_bytes()
    assert append_finding(ledger, "second", "| a |\n|---|\n| 1 |").number == 2
    after = ledger.read_bytes()
    assert after.startswith(before)
    assert next_number(after.decode()) == 3
    assert "## 2. second" in after.decode()


def _pipe_blocks(text: str) -> list[str]:
    """Each run of consecutive lines that start with '|': a pipe table as written."""
    blocks, current = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            blocks.append("\n".join(current))
            current = []
    return blocks


def _renders_as_table(block: str) -> bool:
    """Whether a Markdown renderer with GFM tables reads the block as one table of all its rows."""
    tokens = MarkdownIt("commonmark").enable("table").parse(block)
    rows = sum(token.type == "tr_open" for token in tokens)
    return tokens[0].type == "table_open" and rows == len(block.splitlines()) - 1


def test_a_cell_holding_a_pipe_is_escaped_and_the_table_still_renders_with_it():
    table = markdown_table(["model", "KL(fp||q) mean ± std"], [["m", "0.1 | 0.2"]])
    assert _renders_as_table(table)
    html = MarkdownIt("commonmark").enable("table").render(table)
    assert "<th>KL(fp||q) mean ± std</th>" in html and "<td>0.1 | 0.2</td>" in html


def test_every_table_in_the_results_ledger_renders_as_a_table():
    ledger = Path(__file__).resolve().parents[1] / "RESULTS.md"
    blocks = _pipe_blocks(ledger.read_text())
    assert len(blocks) > 30
    broken = [block.splitlines()[0] for block in blocks if not _renders_as_table(block)]
    assert broken == []

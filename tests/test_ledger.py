import multiprocessing
import re

from kvq.ledger import HEADING, append_finding, next_number

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

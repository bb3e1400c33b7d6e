"""Build this paper's artifact: ``python papers/cross-domain-latency/build.py [--quick] [--seed N] [--out DIR]``.

The same as ``qlink paper build`` (see :mod:`qlink.paper`): runs the scenarios at fixed
seeds and writes ``build/`` here — figures (PNG, PDF), tables (CSV, LaTeX), ``paper.md``
with its tables filled in, and ``manifest.json`` with the SHA-256 of every file.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, when qlink is not installed
    from qlink.cli import main

    sys.exit(main(["paper", "build", *sys.argv[1:]]))

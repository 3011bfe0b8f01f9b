"""The support matrix: every architecture x capture, -O2 per target, mixed precision, training.

    python benchmarks/support_matrix.py                          # everything; docs/SUPPORT.md + docs/SUPPORT.json
    python benchmarks/support_matrix.py --models mlp,bert --cells capture,O2:cpu,train --json out.json --md out.md

Writes the JSON as results arrive (a killed run keeps what it finished) and the
Markdown at the end.  The code lives in :mod:`mlcomp.measure.support_matrix`;
``mlcomp support`` runs the same.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlcomp.measure.support_run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

"""The bench scripts import each other as modules beside them (`from heldout import ...`), as they do
when run as `python bench/<script>.py`; their tests import them the same way."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

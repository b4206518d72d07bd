"""Where things are: the repository root, defined once for every test and bench."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROOT_PATH = Path(ROOT)

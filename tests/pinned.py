"""Values a test holds exactly to a file of recorded ones (the planner's figures, the renders): a
change shows as the case and field that moved, and is either a bug or a deliberate change, which
running the test with its update variable set to 1 records (review the file's diff, commit it with
the change)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def holds_recorded(path: Path, key: str, now: Any, update: str) -> None:
    now = json.loads(json.dumps(now))   # as JSON holds it: tuples as lists
    recorded = json.loads(path.read_text()) if path.exists() else {}
    if os.environ.get(update) == "1":
        path.write_text(json.dumps({**recorded, key: now}, indent=1, sort_keys=True) + "\n")
        return
    assert key in recorded, f"{key}: not recorded in {path.name}; run with {update}=1 and review what it records"
    assert now == recorded[key]

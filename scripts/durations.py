"""Write tests/durations.json, each xdist group's worker seconds, from a run's junit XML, so that
tests/conftest.py hands the longest groups out first:

    .venv/bin/python -m pytest -n 2 --dist loadgroup --junitxml=/tmp/run.xml   # (scripts/test.sh --junitxml=...)
    .venv/bin/python scripts/durations.py /tmp/run.xml

A group is a test file, or one test of the docs tier (tests/conftest.py ``_worker_group``). Only the ranking
matters: a run on a loaded machine does as well as an idle one.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "durations.json"
DOCS_FILE = "tests/test_docs_run.py"


def _file(classname: str) -> str:
    """``tests.test_x`` or ``tests.test_x.TestClass`` -> ``tests/test_x.py``."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (ROOT / path).exists():
            return path
    return "/".join(parts) + ".py"


def group_seconds(xml: Path) -> dict[str, float]:
    seconds: dict[str, float] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        path = _file(case.get("classname", ""))
        group = f"{path}::{case.get('name')}" if path == DOCS_FILE else path
        seconds[group] = seconds.get(group, 0.0) + float(case.get("time") or 0.0)
    return {group: round(s, 1) for group, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    seconds = group_seconds(Path(sys.argv[1]))
    OUT.write_text(json.dumps(seconds, indent=0) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}: {len(seconds)} groups, {sum(seconds.values()):.0f} worker seconds")
    return 0


if __name__ == "__main__":
    sys.exit(main())

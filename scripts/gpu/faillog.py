"""pytest plugin for runs that may be cut by a time limit (docs/gpu.md): each failure, and each test slower than
20 s, is appended to $OUT/failures.log (else /tmp) as it happens, also under xdist.

    PYTHONPATH=/tmp/site:scripts/gpu python3 -m pytest -n 8 -p faillog tests
"""

from __future__ import annotations

import os
from typing import Any


def pytest_runtest_logreport(report: Any) -> None:
    """Append a failed report's traceback tail, or a slow test's duration."""
    path = os.path.join(os.environ.get("OUT", "/tmp"), "failures.log")
    if report.failed:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"=== FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-2500:]}\n")
    elif report.when == "call" and report.duration > 20:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"--- slow {report.duration:.0f}s {report.nodeid}\n")

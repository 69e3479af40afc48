"""GPU diagnostics (docs/gpu.md), a pytest plugin or an import: before each CUDA graph capture, the step runs
once eagerly under torch's sync debug mode and the Python stack of every synchronising op is printed (once per
place): what makes a capture fail ("operation not permitted when stream is capturing").

    PYTHONPATH=/tmp/site:scripts/gpu python3 -m pytest -s -p syncprobe -k graph tests/unit/test_static_decode.py
"""

from __future__ import annotations

import traceback
import warnings
from typing import Any

import torch

from specdraft.eval import graphs

_seen: set[str] = set()
_show = warnings.showwarning
_init = graphs.CudaGraph.__init__


def _report(
    message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None
) -> None:
    if "synchroniz" not in str(message):
        _show(message, category, filename, lineno, file, line)
        return
    stack = [f for f in traceback.format_stack()[:-2] if "/site-packages/torch/" not in f]
    key = "".join(stack[-3:])
    if key not in _seen:
        _seen.add(key)
        print("\nSYNC:", str(message)[:80], "\n" + "".join(stack[-8:]), flush=True)


def _probing_init(self: Any, fn: Any, device: torch.device) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = _report
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    _init(self, fn, device)


graphs.CudaGraph.__init__ = _probing_init  # type: ignore[method-assign]

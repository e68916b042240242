"""The PASS/FAIL lines of the GPU check scripts (``checks.py``, ``megatron_generation.py``,
``vllm_fp8.py``): each check prints one line with its numbers, the failed ones' names collect
in :data:`FAILURES`, and a script's exit code is their count. Imported by scripts run as
``python3 scripts/gpu/NAME.py`` (their folder is first on ``sys.path``)."""

from __future__ import annotations

from typing import List

FAILURES: List[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    """Print ``PASS  name  detail`` or ``FAIL  ...`` (flushed); a failure's name goes to
    :data:`FAILURES`."""
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)
    if not ok:
        FAILURES.append(name)

"""Process pools that must be stopped even when a task hangs (the reward pool, the environment
executor)."""

from __future__ import annotations

import concurrent.futures as cf
from typing import Optional


def kill_process_pool(pool: Optional[cf.ProcessPoolExecutor]) -> None:
    """Kill every process of ``pool`` and shut it down without waiting (a task that hangs
    ignores everything short of a kill; ``ProcessPoolExecutor`` has no public kill before
    Python 3.14's ``kill_workers``). Pending tasks are cancelled. Nothing for None."""
    if pool is None:
        return
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        if proc.is_alive():
            proc.kill()
    pool.shutdown(wait=False, cancel_futures=True)

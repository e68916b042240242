"""Opt-in torch-profiler tables of a worker's calls: where a phase's time goes.

Set ``MCORE_RL_PROFILE_DIR=<dir>`` in the environment of a run (the worker processes inherit
it) and every worker rank profiles the ``MCORE_RL_PROFILE_CALLS``-th call (default ``3``, a
steady-state call after warm-up and compilation; comma-separated for several) of each of its
methods, and writes ``<dir>/rank<r>_<method>_<n>.txt``: the call's wall seconds, the device's
busy seconds (kernel time summed), the number of kernel launches, and the profiler's top-30
operators by self device time and by self CPU time. A call whose busy time is far under its
wall time is bound by the host (launches, Python, synchronisation), not by the GPU.

Nothing happens without the variable: :func:`profiled_call` then calls straight through.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any, Callable, Dict

_counts: Dict[str, int] = collections.Counter()


def _wanted_calls() -> set:
    raw = os.environ.get("MCORE_RL_PROFILE_CALLS", "3")
    return {int(x) for x in raw.split(",") if x.strip()}


def profiled_call(name: str, fn: Callable[[], Any], rank: int = 0) -> Any:
    """Run ``fn()``; with ``MCORE_RL_PROFILE_DIR`` set and this the wanted occurrence of
    ``name`` in this process, under :mod:`torch.profiler` (CPU and, where there is one, CUDA),
    writing the table described in the module docstring. Returns ``fn()``'s result; its
    exceptions propagate unchanged (nothing is written then)."""
    out_dir = os.environ.get("MCORE_RL_PROFILE_DIR")
    if not out_dir:
        return fn()
    _counts[name] += 1
    n = _counts[name]
    if n not in _wanted_calls():
        return fn()
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        result = fn()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    # Kernel events only (an operator's row repeats its kernels' time).
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    device_us = sum(e.time_range.elapsed_us() for e in kernels)
    launches = len(kernels)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"rank{rank}_{name}_{n}.txt")
    with open(path, "w") as f:
        f.write(f"{name} call {n} rank {rank}: wall {wall:.3f} s, device busy "
                f"{device_us / 1e6:.3f} s, kernels {launches}\n\n")
        if cuda:
            f.write(events.table(sort_by="self_device_time_total", row_limit=30))
            f.write("\n")
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=30))
    return result

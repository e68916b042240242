"""The test process computes with the CPU arithmetic of a CPU run's processes
(:func:`mcore_rl.megatron.cpu_backend.pin_arithmetic`), pinned before any test runs a kernel:
references computed in this process then have the same bits on every x86-64 machine, like
the workers that tests spawn.

Idle OpenMP threads sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``, set before torch
loads its OpenMP runtime; the processes the tests start inherit it; a value already in the
environment wins). The suite runs two pytest workers, each starting worker processes, on few
cores: a spinning thread takes the core another process's thread waits for (measured:
tests/test_generation.py beside two busy processes on 2 cores, 79 s spinning, 6 s passive;
3.2 s and 3.6 s on idle cores). Only how threads wait changes: the thread counts, so the
arithmetic and its bits, stay as they were."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from mcore_rl.megatron import cpu_backend  # noqa: E402 -- after the OpenMP setting

cpu_backend.pin_arithmetic()


def pytest_collection_modifyitems(config, items):
    """Files holding slow-marked tests (end-to-end runs of minutes) run first, the rest after, each
    group in collection order (a stable sort; tests keep their order within a file). Under
    ``--dist loadfile`` (Makefile) xdist hands out whole files in this order, so the longest files
    start early instead of ending the run on one worker while the other idles: the last
    alphabetical files (tests/test_vllm_e2e.py, ~3 min) took the final ~6 minutes of a 21-minute
    run (2026-11-28)."""
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)

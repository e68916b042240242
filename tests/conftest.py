"""The test process computes with the CPU arithmetic of a CPU run's processes
(:func:`mcore_rl.megatron.cpu_backend.pin_arithmetic`), pinned before any test runs a kernel:
references computed in this process then have the same bits on every x86-64 machine, like
the workers that tests spawn."""

from mcore_rl.megatron import cpu_backend

cpu_backend.pin_arithmetic()

"""A CPU run computes the same bits on every x86-64 machine: the controller and every worker
process (spawned or a Ray actor) pin torch's kernels and MKL's code branch before their first
kernel (:func:`mcore_rl.megatron.cpu_backend.pin_arithmetic`), whatever the environment they
were started with.

:func:`fingerprint` hashes a small computation through both libraries: matrix products of
the default model's shapes and ``exp`` (MKL), softmax, log-softmax, reductions and SiLU
(torch's vectorized kernels). ``PINNED_FINGERPRINT`` is its value under the pin, measured on
two machines: an AMD EPYC (Zen 4, AVX-512; torch 2.13.0+cpu, 2 threads) and an Intel Xeon
(AVX-512 and AMX; torch 2.11.0, 1 and 16 threads). Unpinned they disagreed (``3fffda54ff``
and ``3a4020274c``: 6 of its 11 matrix products and ``exp`` differ); an AVX2-only machine runs
torch's AVX2 kernels unpinned too.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mcore_rl.distributed.worker_group import ProcessWorkerGroup
from mcore_rl.megatron import cpu_backend
from mcore_rl.workers.policy import PolicyWorker
from test_policy_worker import _kwargs

PINNED = {"ATEN_CPU_CAPABILITY": "AVX2", "MKL_CBWR": "COMPATIBLE"}
PINNED_FINGERPRINT = "e65cd30469"
# torch releases whose kernels gave PINNED_FINGERPRINT (a release that changes a kernel
# changes the bits: measure it on two machines, then add it here).
FINGERPRINT_TORCH = ("2.11.", "2.13.")
TESTS = Path(__file__).parent
LATE_PIN = "torch chose its CPU kernels before mcore-rl could pin them"

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="the pin is for x86-64 (torch's ISA builds and MKL)")


def fingerprint() -> str:
    """sha1 (10 hex digits) of the bits of a seeded fp32 computation (module docstring)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for m, k, n in [(832, 128, 512), (832, 512, 128), (128, 832, 512), (512, 832, 128), (832, 128, 384),
                    (128, 832, 384), (832, 128, 64), (64, 832, 128), (3328, 128, 48), (128, 3328, 48)]:
        out.append(torch.randn(m, k, generator=g) @ torch.randn(k, n, generator=g))
    out.append(torch.bmm(torch.randn(256, 13, 32, generator=g), torch.randn(256, 32, 13, generator=g)))
    x = torch.randn(64, 13, 128, generator=g)
    out += [torch.softmax(x, -1), torch.log_softmax(x, -1), x.sum(0), x.std(-1), torch.exp(x), F.silu(x),
            torch.rsqrt(x.pow(2).mean(-1))]
    digest = hashlib.sha1()
    for t in out:
        digest.update(t.contiguous().numpy().tobytes())
    return digest.hexdigest()[:10]


def _unpinned_env():
    """This process's environment without the pin's variables (so a child must pin itself)."""
    env = {k: v for k, v in os.environ.items() if k not in cpu_backend.PINNED_ARITHMETIC}
    return dict(env, PYTHONPATH=os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]))


def _python(code: str, env):
    """Run ``code`` in a fresh interpreter (the pin's warning an error); it prints one JSON
    line last, returned decoded."""
    out = subprocess.run([sys.executable, "-W", f"error:{LATE_PIN}:RuntimeWarning", "-c", code],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check_fingerprint(value: str) -> None:
    if torch.__version__.startswith(FINGERPRINT_TORCH):
        assert value == PINNED_FINGERPRINT


REPORT = ("import json, torch; from mcore_rl.megatron import cpu_backend; "
          "from test_cpu_arithmetic import fingerprint; "
          "print(json.dumps([cpu_backend.arithmetic(), fingerprint()]))")


@pytest.fixture(scope="module")
def controller():
    """``[arithmetic, fingerprint]`` of a controller's process started without the variables,
    after its first step (``resolve_device``); also checks that the variables are set for the
    processes it starts."""
    return _python("from mcore_rl.megatron.parallel import resolve_device; import os; "
                   "assert resolve_device('cpu') == 'cpu'; "
                   "assert os.environ['MKL_CBWR'] == 'COMPATIBLE'; " + REPORT, _unpinned_env())


def test_controller_pins_when_it_resolves_the_cpu_device(controller):
    arithmetic, value = controller
    assert arithmetic == PINNED
    _check_fingerprint(value)


def test_unpinned_arithmetic_differs_and_a_late_pin_warns(controller):
    """Control, in a process that runs a kernel before it pins: the machine's own arithmetic
    (unpinned MKL, and torch's AVX-512 kernels where the CPU has them) gives other bits, so the
    fingerprint sees the pin; and the pin, too late to take effect, warns naming both."""
    out = subprocess.run([sys.executable, "-c", REPORT + "; cpu_backend.pin_arithmetic()"],
                         env=_unpinned_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    arithmetic, value = json.loads(out.stdout.strip().splitlines()[-1])
    assert arithmetic != PINNED and value != controller[1]
    assert f"RuntimeWarning: {LATE_PIN}: " in out.stderr
    assert "MKL_CBWR=COMPATIBLE" in out.stderr.split("instead of")[1]


class ArithmeticProbe(PolicyWorker):
    """A policy worker that reports the arithmetic of its process."""

    def report(self):
        return cpu_backend.arithmetic(), fingerprint()


def test_spawned_worker_pins_before_it_builds_its_model(monkeypatch):
    """A Megatron worker spawned from a parent without the variables pins itself when it joins
    its world (``parallel.initialize``), before it builds its model."""
    for name in cpu_backend.PINNED_ARITHMETIC:
        monkeypatch.delenv(name, raising=False)
    group = ProcessWorkerGroup(ArithmeticProbe, 1, _kwargs())
    try:
        arithmetic, value = group.call("report")[0]
    finally:
        group.shutdown()
    assert arithmetic == PINNED
    _check_fingerprint(value)


@pytest.mark.slow
def test_ray_actor_pins(monkeypatch):
    """A Ray worker process of a local cluster started without the variables: the pin takes
    effect there too (Ray actors run the same worker start as spawned processes)."""
    import ray

    for name in cpu_backend.PINNED_ARITHMETIC:
        monkeypatch.delenv(name, raising=False)
    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False, log_to_driver=False)
    try:
        task = ray.remote(num_cpus=0)(cpu_backend.pin_arithmetic)
        assert ray.get(task.remote()) == PINNED
    finally:
        if started:
            ray.shutdown()

"""Run Megatron-Core on CPU processes (gloo) by redirecting its CUDA assumptions.

Megatron-Core is written for CUDA: tensor factories name ``device="cuda"`` or
``torch.cuda.current_device()``, the RNG tracker reads CUDA generator state, pipeline p2p
calls ``torch.cuda.synchronize()``, and the optimizer's grad clipping asserts CUDA tensor
types. None of that is needed for the maths, so when no GPU is used this module redirects
those spots to the CPU, and the product's worker code stays the same on CPU and GPU.

What is redirected (measured on megatron-core 0.16.1, see ``shared/notes/megatron-on-cpu.md``):

=============================================  ================================================
Megatron assumption                            Redirect while :func:`activate` is in effect
=============================================  ================================================
``torch.cuda.current_device()``                returns the CPU device (not 0: the mode below is
                                               off inside autograd ``Function.backward``, where
                                               sequence parallelism allocates with it)
factories with ``device="cuda"`` / an int      a ``TorchFunctionMode`` rewrites the device to CPU
``Tensor.cuda()`` / ``.to("cuda")``            the same mode makes them CPU no-ops
CUDA RNG state (tensor-parallel RNG tracker)   the CPU default generator, so ``torch.cuda.
                                               manual_seed(s)`` seeds it (a no-op seed would
                                               leave TP-replicated params different per rank)
``torch.cuda.synchronize`` / streams / events  no-ops / a null stream
``clip_grad_by_total_norm_fp32`` type assert   our own clip (:func:`_clip_grads_cpu`), same maths
MoE ``maybe_move_tensor_to_cpu(as_numpy=True)``  numpy also for host tensors (:func:`_host_numpy`):
                                               the alltoall token dispatcher's split sizes
=============================================  ================================================

The distributed optimizer is a GPU path (its param-group builder checks CUDA type strings)
and is refused by the config validation on CPU.

:func:`activate` is idempotent and process-global; it must run before Megatron builds a
model. :func:`is_active` lets tests assert a GPU run never activated it.

The same arithmetic on every x86-64 machine (:func:`pin_arithmetic`). Unpinned, the bits of a
CPU run depend on the processor, through two libraries that pick their kernels at run time:

* torch's own vectorized kernels (softmax, log-softmax, reductions, norms, SiLU, ...) come
  in a build per instruction set, and torch runs the newest the CPU has (``AVX512`` on an
  AVX-512 machine, ``AVX2`` on an AVX2-only one): other vector widths, another summation
  order. ``ATEN_CPU_CAPABILITY=avx2`` makes every machine run the AVX2 build.
* MKL (matrix products, ``exp``) picks kernels by vendor and instruction set, so an Intel
  and an AMD machine differ even at the same ISA (measured, torch's MKL 2024.2: 6 of 11
  matrix-product shapes of this project's model gave other bits on an Intel Xeon with
  AVX-512 than on an AMD EPYC Zen 4). ``MKL_CBWR=COMPATIBLE`` selects its SSE2 code path
  with Conditional Numerical Reproducibility, the one branch MKL runs identically on Intel
  and AMD processors (its ``AVX2`` and newer branches exist on Intel processors only: AMD
  ignores them). Measured: the same bits on both machines, with 1, 2 or 16 threads.

Both are read once per process, when torch runs its first kernel (MKL: its first call), so
they are set in the environment before that: in the controller when it resolves the CPU
device, before any tensor work, and in each worker when it joins its world
(:mod:`mcore_rl.megatron.parallel`); Ray actors and spawned processes also inherit them. A
value the user set wins: ``MKL_CBWR=AUTO ATEN_CPU_CAPABILITY=avx512`` runs the machine's
fastest kernels, at the price of machine-dependent results. The cost: MKL's SSE2 path made
the default model's matrix products 1.3x to 2.5x slower in isolation (best of 30, 2 threads,
AMD EPYC Zen 4); torch's AVX2 kernels cost about what its AVX-512 ones do.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import threading
import warnings
from typing import Dict, Optional

import torch
from torch.overrides import TorchFunctionMode

_ACTIVE = False
_LOCK = threading.Lock()

# The CPU arithmetic of every process of a CPU run on x86-64 (see the module docstring):
# environment variable -> value.
PINNED_ARITHMETIC = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"}
# MKL's code branch constants (mkl_cbwr.h): what mkl_cbwr_get(MKL_CBWR_BRANCH) returns.
_MKL_BRANCHES = {1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1",
                 8: "SSE4_2", 9: "AVX", 10: "AVX2", 12: "AVX512", 14: "AVX512_E1"}


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of torch calls to the CPU (see the module table)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")
        if func in (torch.Tensor.cuda,):
            return args[0]
        if func in (torch.Tensor.to,) and args:
            rest = list(args[1:])
            if rest and _is_cuda_device(rest[0]):
                rest[0] = torch.device("cpu")
            args = (args[0], *rest)
        if kwargs.pop("pin_memory", False):
            pass
        return func(*args, **kwargs)


class _NullStream:
    """Stand-in for ``torch.cuda.Stream`` on CPU: every operation is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        return None

    def synchronize(self):
        return None

    def record_event(self, *args, **kwargs):
        return _NullEvent()


class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        return None

    def wait(self, *args, **kwargs):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True


def _cpu_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


def _seed_cpu_generator(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _clip_grads_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False, **kwargs):
    """Megatron's ``clip_grad_by_total_norm_fp32`` without its CUDA type assert: scale every
    grad in place by ``max_norm / (total_norm + 1e-6)`` when that is below 1 (same formula)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


def _host_numpy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """Megatron's ``moe_utils.maybe_move_tensor_to_cpu`` for a process without GPU: it turns only
    CUDA tensors into numpy arrays, and the MoE alltoall token dispatcher passes the result as
    the split sizes of ``all_to_all_single``, which takes a sequence of ints, not a tensor."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def activate() -> None:
    """Install the CPU redirects for this process (idempotent).

    Call before building any Megatron model; never call it in a process that uses a GPU.
    """
    global _ACTIVE
    with _LOCK:
        if _ACTIVE:
            return
        import megatron.core.tensor_parallel.random as mrandom
        import megatron.core.optimizer.clip_grads as mclip
        import megatron.core.optimizer.optimizer as mopt
        import megatron.core.transformer.moe.moe_utils as mmoe
        import megatron.core.transformer.moe.token_dispatcher as mdispatch

        torch.cuda.current_device = lambda: torch.device("cpu")
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.Stream = _NullStream
        torch.cuda.Event = _NullEvent
        torch.cuda.current_stream = lambda *a, **k: _NullStream()
        torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
        torch.cuda.manual_seed = _seed_cpu_generator
        torch.cuda.manual_seed_all = lambda seed: None  # torch.manual_seed already seeds the CPU
        torch.cuda.get_rng_state = _cpu_rng_state
        torch.cuda.set_rng_state = _set_cpu_rng_state
        torch.cuda.random.get_rng_state = _cpu_rng_state
        torch.cuda.random.set_rng_state = _set_cpu_rng_state
        mrandom._get_cuda_rng_state = _cpu_rng_state
        mrandom._set_cuda_rng_state = _set_cpu_rng_state
        mclip.clip_grad_by_total_norm_fp32 = _clip_grads_cpu
        mopt.clip_grad_by_total_norm_fp32 = _clip_grads_cpu
        mmoe.maybe_move_tensor_to_cpu = mdispatch.maybe_move_tensor_to_cpu = _host_numpy
        _CudaToCpuMode().__enter__()
        _ACTIVE = True


def is_active() -> bool:
    """True when :func:`activate` ran in this process."""
    return _ACTIVE


def _mkl_branch() -> Optional[str]:
    """MKL's code branch in this process (a name of :data:`_MKL_BRANCHES`: ``"OFF"`` unpinned),
    or None where torch has no MKL or does not export MKL's query (``mkl_serv_cbwr_get``)."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        code = int(lib.mkl_serv_cbwr_get(1))  # MKL_CBWR_BRANCH
    except (OSError, AttributeError):
        return None
    return _MKL_BRANCHES.get(code, str(code))


def arithmetic() -> Dict[str, Optional[str]]:
    """The CPU arithmetic torch uses in this process, by the names of
    :data:`PINNED_ARITHMETIC`: ``ATEN_CPU_CAPABILITY`` as torch reports it (``"AVX2"``,
    ``"AVX512"``, ``"DEFAULT"``, ...) and ``MKL_CBWR`` (MKL's branch, :func:`_mkl_branch`).
    Asking fixes torch's choice for the life of the process, as a first kernel would."""
    return {"ATEN_CPU_CAPABILITY": torch.backends.cpu.get_cpu_capability(),
            "MKL_CBWR": _mkl_branch()}


def pin_arithmetic() -> Optional[Dict[str, Optional[str]]]:
    """Pin the CPU arithmetic of this process, and of the processes it starts from now on, to
    the one every x86-64 machine computes alike (:data:`PINNED_ARITHMETIC`; module docstring),
    unless the environment already names a value (the user's choice wins). Idempotent; a
    no-op on other architectures (a value for x86 would be ignored there).

    It takes effect only before torch runs its first kernel in this process. Warns
    (``RuntimeWarning``) when torch already computes otherwise than a pinned value, naming
    both: the process then gives machine-dependent results (start it with the variables set
    instead). Values the user chose are not checked.

    Returns:
        :func:`arithmetic` (what this process now computes with), None on other architectures.
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    for name, value in PINNED_ARITHMETIC.items():
        os.environ.setdefault(name, value)
    actual = arithmetic()
    off = {name: value for name, value in actual.items() if value is not None
           and os.environ[name] == PINNED_ARITHMETIC[name] and value.upper() != os.environ[name].upper()}
    if off:
        warnings.warn(
            f"torch chose its CPU kernels before mcore-rl could pin them: "
            f"{', '.join(f'{n}={v}' for n, v in off.items())} in this process instead of "
            f"{', '.join(f'{n}={PINNED_ARITHMETIC[n]}' for n in off)}, so its results depend on "
            f"the machine; set these environment variables before the process starts",
            RuntimeWarning, stacklevel=2)
    return actual

"""Run a test function in N gloo processes (torch.multiprocessing spawn) and collect results.

One spawn can run many checks: the function returns a picklable result (a dict of numbers
and tensors, say) and the tests assert on it, so a test module pays the process start-up
(about 10 s on 2 cores) once. Inside the function, :func:`use_layout` switches Megatron's
TP/PP/VPP layout without restarting the processes.

Functions passed to :func:`run_distributed` must be importable (module level) since spawn
pickles them by name.
"""

from __future__ import annotations

import io
import queue
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp

_WORLD: dict = {}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def use_layout(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
               virtual_pipeline_model_parallel_size=None, seed=1234,
               expert_model_parallel_size=1, expert_tensor_parallel_size=None,
               context_parallel_size=1) -> None:
    """In a process started by :func:`run_distributed`: rebuild Megatron's parallel groups
    with these sizes (the gloo process group stays) and reseed Megatron's RNG tracker."""
    from megatron.core import parallel_state

    from mcore_rl.megatron import parallel

    parallel_state.destroy_model_parallel()
    parallel.initialize(
        _WORLD["rank"], _WORLD["world_size"], "127.0.0.1", _WORLD["port"], "cpu",
        tensor_model_parallel_size, pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size, seed,
        expert_model_parallel_size, expert_tensor_parallel_size,
        context_parallel_size=context_parallel_size,
    )


def _worker(rank, world_size, port, fn, args, results, layout):
    from mcore_rl.megatron import parallel

    torch.set_num_threads(1)
    _WORLD.update(rank=rank, world_size=world_size, port=port)
    try:
        parallel.initialize(rank, world_size, "127.0.0.1", port, "cpu", *layout)
        out = fn(*args)
        buffer = io.BytesIO()
        torch.save(out, buffer)  # bytes, not shared-memory tensors: the child exits first
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        parallel.destroy()


def run_distributed(fn, world_size: int, *args, tensor_model_parallel_size=1,
                    pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                    timeout_s: float = 600.0) -> list:
    """Run ``fn(*args)`` on ``world_size`` CPU processes joined by
    :func:`mcore_rl.megatron.parallel.initialize` (gloo, a free port, the given layout).

    Returns the per-rank return values, index = global rank. Raises ``RuntimeError`` with the
    failing ranks' tracebacks if any rank raised, died, or gave no result within
    ``timeout_s`` seconds. A world whose rendezvous port was taken between :func:`free_port`
    and the store's listen (another test process got the same port from the OS:
    ``EADDRINUSE``) is started again on a new port, up to three times.
    """
    for attempt in range(3):
        try:
            return _run_world(fn, world_size, args, tensor_model_parallel_size,
                              pipeline_model_parallel_size, virtual_pipeline_model_parallel_size,
                              timeout_s)
        except RuntimeError as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_world(fn, world_size, args, tensor_model_parallel_size, pipeline_model_parallel_size,
               virtual_pipeline_model_parallel_size, timeout_s) -> list:
    """One try of :func:`run_distributed` on a fresh port."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    layout = (tensor_model_parallel_size, pipeline_model_parallel_size,
              virtual_pipeline_model_parallel_size)
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, layout))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs, errors = {}, {}
    deadline = time.monotonic() + timeout_s
    try:
        # Stop at the first error: the other ranks may wait in a collective with that one.
        while len(outputs) < world_size and not errors:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and r not in outputs:
                        errors[r] = f"process died with exit code {p.exitcode}\n"
                if time.monotonic() > deadline:
                    errors[-1] = f"no result from every rank within {timeout_s} s\n"
                continue
            if ok:
                outputs[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return [outputs[r] for r in range(world_size)]

"""Worker groups: one worker object per rank of a ``torch.distributed`` world, driven by the
single controller.

Two implementations with the same surface:

- :class:`RayWorkerGroup`: each rank is a Ray actor (local cluster by default, or
  ``ray.init(address=...)`` to join one), GPUs assigned by Ray.
- :class:`ProcessWorkerGroup`: each rank is a plain ``torch.multiprocessing`` process with a
  pipe; no Ray needed (tests, GPU checks where Ray is not installed).

The workers themselves are plain classes (:mod:`mcore_rl.workers`); the group only places
them and forwards method calls.
"""

from __future__ import annotations

import socket
import traceback
from typing import Any, Dict, List, Optional, Sequence

import torch.multiprocessing as mp


def free_port() -> int:
    """An unused TCP port on this host (for the rendezvous of a new world)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerError(RuntimeError):
    """A worker method raised; the message carries the rank and the remote traceback."""


class _Host:
    """Holds one rank's worker object and runs methods on it (used by both groups)."""

    def __init__(self, worker_cls, kwargs: Dict[str, Any]):
        self.worker = worker_cls(**kwargs)

    def call(self, method: str, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)


def _process_main(conn, worker_cls, kwargs):
    try:
        host = _Host(worker_cls, kwargs)
        conn.send(("ok", None))
    except BaseException:  # report construction errors to the controller
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the controller is gone
            break
        if msg is None:
            break
        method, args, kw = msg
        try:
            conn.send(("ok", host.call(method, args, kw)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class ProcessWorkerGroup:
    """``world_size`` spawned processes, rank r built with ``worker_cls(**kwargs, rank=r,
    world_size=..., master_addr=..., master_port=...)``. Raises :class:`WorkerError` when a
    worker fails to build or a call raises (the worker stays usable after a call error)."""

    def __init__(self, worker_cls, world_size: int, kwargs: Dict[str, Any]):
        ctx = mp.get_context("spawn")
        port = free_port()
        self._conns = []
        self._procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            kw = dict(kwargs, rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port)
            # Not daemonic: Megatron's checkpoint writer starts processes of its own. A worker
            # exits when its pipe closes, so it does not outlive the controller.
            p = ctx.Process(target=_process_main, args=(child, worker_cls, kw), daemon=False)
            p.start()
            self._conns.append(parent)
            self._procs.append(p)
        self._collect(range(world_size))

    @property
    def world_size(self) -> int:
        return len(self._conns)

    def _collect(self, ranks) -> List[Any]:
        results, errors = [], []
        for r in ranks:
            status, value = self._conns[r].recv()
            if status == "error":
                errors.append(f"[rank {r}]\n{value}")
                results.append(None)
            else:
                results.append(value)
        if errors:
            raise WorkerError("\n".join(errors))
        return results

    def call_each(self, method: str, args_per_rank: Sequence[Sequence[Any]], **kwargs) -> List[Any]:
        """Call ``method(*args_per_rank[r], **kwargs)`` on every rank at once."""
        for r, conn in enumerate(self._conns):
            conn.send((method, tuple(args_per_rank[r]), kwargs))
        return self._collect(range(self.world_size))

    def call(self, method: str, *args, **kwargs) -> List[Any]:
        """Call ``method(*args, **kwargs)`` on every rank at once; one result per rank."""
        return self.call_each(method, [args] * self.world_size, **kwargs)

    def shutdown(self) -> None:
        for conn, p in zip(self._conns, self._procs):
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


class RayWorkerGroup:
    """The same surface as :class:`ProcessWorkerGroup`, one Ray actor per rank.

    Args:
        num_gpus_per_worker: 1 on GPU clusters; 0 on CPU (then actors take no CPU
            reservation either, so a 2-core laptop can hold the whole world).
    """

    def __init__(self, worker_cls, world_size: int, kwargs: Dict[str, Any], num_gpus_per_worker: float = 0):
        import ray

        self._ray = ray
        host_cls = ray.remote(_Host)
        opts = {"num_gpus": num_gpus_per_worker, "num_cpus": 1 if num_gpus_per_worker else 0}
        # Rank 0's node address and a free port there form the rendezvous.
        probe = ray.remote(num_cpus=0)(_node_address_and_port)
        addr, port = ray.get(probe.remote())
        self._actors = [
            host_cls.options(**opts).remote(
                worker_cls,
                dict(kwargs, rank=r, world_size=world_size, master_addr=addr, master_port=port),
            )
            for r in range(world_size)
        ]
        # Construction errors surface here.
        self._get([a.call.remote("layout", (), {}) for a in self._actors])

    @property
    def world_size(self) -> int:
        return len(self._actors)

    def _get(self, refs) -> List[Any]:
        try:
            return self._ray.get(refs)
        except self._ray.exceptions.RayTaskError as e:
            raise WorkerError(str(e)) from None
        except self._ray.exceptions.RayActorError as e:
            raise WorkerError(str(e)) from None

    def call_each(self, method: str, args_per_rank: Sequence[Sequence[Any]], **kwargs) -> List[Any]:
        return self._get([a.call.remote(method, tuple(args_per_rank[r]), kwargs)
                          for r, a in enumerate(self._actors)])

    def call(self, method: str, *args, **kwargs) -> List[Any]:
        return self.call_each(method, [args] * self.world_size, **kwargs)

    def shutdown(self) -> None:
        try:
            self.call("shutdown")
        except WorkerError:
            pass
        for a in self._actors:
            self._ray.kill(a)


def _node_address_and_port():
    import ray

    return ray.util.get_node_ip_address(), free_port()


def make_worker_group(worker_cls, world_size: int, kwargs: Dict[str, Any], use_ray: bool,
                      device: str, ray_address: Optional[str] = None):
    """Build a group (Ray when ``use_ray``; Ray is initialised here if needed)."""
    if not use_ray:
        return ProcessWorkerGroup(worker_cls, world_size, kwargs)
    import ray

    if not ray.is_initialized():
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=True,
                 ignore_reinit_error=True)
    return RayWorkerGroup(worker_cls, world_size, kwargs, num_gpus_per_worker=1 if device == "cuda" else 0)

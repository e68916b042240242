"""Worker groups: one worker object per rank of a ``torch.distributed`` world, driven by the
single controller.

Two implementations with the same surface:

- :class:`RayWorkerGroup`: each rank is a Ray actor (local cluster by default, or
  ``ray.init(address=...)`` to join one), placed by Ray (:mod:`mcore_rl.distributed.placement`
  gives each rank its options: GPU share, placement-group bundle).
- :class:`ProcessWorkerGroup`: each rank is a plain ``torch.multiprocessing`` process with a
  pipe; no Ray needed (tests, GPU checks where Ray is not installed).

Calls return futures (:meth:`call_each_async`: a ``concurrent.futures.Future`` of the per-rank
results), so a controller can keep several groups, or several ranks of one group, busy at once
and wait with the standard library (``future.result()``, ``concurrent.futures.wait`` /
``as_completed``); the blocking :meth:`call` / :meth:`call_each` wait at once. Each rank runs
its calls one at a time, in the order they were made.

:class:`DataParallelGroup` adds the data-parallel layout of a group of Megatron workers: row
sharding over DP ranks, per-row results in row order, the synchronous train step and the split
train step fed micro-batch by micro-batch.

The workers themselves are plain classes (:mod:`mcore_rl.workers`); the group only places
them and forwards method calls. Every way of calling takes the method's name, or in its place
one of the worker protocols of :mod:`mcore_rl.workers.interfaces` and then returns a typed
proxy (:class:`TypedCalls`) whose attributes are the protocol's methods:
``policy.call(PolicyAPI).rebuild_optimizer(lr)`` is ``policy.call("rebuild_optimizer", lr)``,
``policy.call_per_dp_async(PolicyAPI, dp_ranks=[d]).get_logprobs([[rows, mbs]])`` is
``policy.call_per_dp_async("get_logprobs", [[rows, mbs]], dp_ranks=[d])``: the proxy's method
takes the arguments that follow the name, keyword arguments given with the protocol are kept.
A name the protocol does not have fails at attribute access (``AttributeError``, naming the
protocol and its methods), before any call is sent.

For the hang watchdog (:mod:`mcore_rl.controller.watchdog`) every group keeps the calls its
ranks have not answered yet (:meth:`_Group.pending_calls`), can make each rank's process write
its Python stack (:meth:`_Group.dump_stacks`: with a ``dump_dir``, every worker process
registers :data:`DUMP_SIGNAL` with :mod:`faulthandler` at start, appending to
``<dump_dir>/<group>_rank_<r>.txt``) and can kill its processes (:meth:`_Group.kill`); the
groups of this process not shut down yet are :func:`live_groups`.

Partial results (:class:`ProcessWorkerGroup` only): a worker method may send values to the
controller before it returns (:func:`send_partial`, on its rank's pipe, ahead of the call's
answer); the controller hands each to the function :meth:`_Group.listen` registered for its
tag, on the rank's reader thread. The megatron rollout decoder sends rows as they finish, so
their rewards are scored while the others decode. Ray groups have no such channel
(:meth:`_Group.listen` returns False; :func:`send_partial` does nothing in an actor).
"""

from __future__ import annotations

import faulthandler
import functools
import io
import logging
import os
import queue
import signal
import socket
import threading
import time
import traceback
import weakref
from concurrent.futures import Future
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor

from mcore_rl.data import batch as B
from mcore_rl.utils.profiling import profiled_call
from mcore_rl.workers.interfaces import TrainWorkerAPI, WorkerAPI


# The signal that makes a worker process write every thread's Python stack to its dump file
# (faulthandler, so also while the process is stuck in a C call: a collective, a CUDA sync).
# Not SIGTERM or SIGUSR1: those are the controller's preemption signals.
DUMP_SIGNAL = signal.SIGUSR2
_log = logging.getLogger(__name__)

_LIVE_GROUPS: "weakref.WeakSet[_Group]" = weakref.WeakSet()

# In a ProcessWorkerGroup's worker process, while a call runs: sends one partial message on
# the rank's pipe (set by _process_main; None elsewhere).
_partial_sender: Optional[Callable[[Any], None]] = None

# CPU tensors up to this size cross a ProcessWorkerGroup's pipe by value (_PipePickler).
BY_VALUE_BYTES = 1 << 20


def _tensor_from_array(array, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype`` over ``array`` (no copy): :func:`_reduce_tensor`'s rebuild."""
    return torch.from_numpy(array).view(dtype)


def _reduce_tensor(t: torch.Tensor):
    """Pickle a small CPU tensor by value (its elements as a NumPy array, reinterpreted as an
    integer dtype of the same size where NumPy lacks the dtype: bfloat16, float8) instead of
    torch.multiprocessing's reduction, which moves every tensor's storage into its own shared
    memory segment: a message of a GSM8K step's 256 responses (tokens and logprobs) to another
    process and back took 155-161 ms on the CPU machine, 6.1-6.4 ms by value (bench/RESULTS.md,
    issue 37's seventh session). Larger tensors, tensors that require grad, tensors already in
    shared memory (passed as handles: both processes see one storage) and non-CPU ones keep
    torch's reduction."""
    if (t.device.type != "cpu" or t.layout != torch.strided or t.requires_grad or t.is_shared()
            or t.is_conj() or t.is_neg() or t.numel() * t.element_size() > BY_VALUE_BYTES
            or type(t) is not torch.Tensor):
        return reduce_tensor(t)
    if t.dtype.is_floating_point and t.element_size() < 4 and t.dtype != torch.float16:
        as_int = {1: torch.uint8, 2: torch.int16}[t.element_size()]
        return _tensor_from_array, (t.view(as_int).numpy(), t.dtype)
    try:
        return _tensor_from_array, (t.numpy(), t.dtype)
    except TypeError:  # a dtype NumPy has no counterpart for
        return reduce_tensor(t)


class _PipePickler(ForkingPickler):
    """``multiprocessing``'s pickler (what ``Connection.send`` uses: torch's reductions for
    CUDA tensors, shared storages, file descriptors) with small CPU tensors by value
    (:func:`_reduce_tensor`)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.dispatch_table[torch.Tensor] = _reduce_tensor


def _send(conn, obj: Any) -> None:
    """``conn.send(obj)`` through :class:`_PipePickler` (``conn.recv()`` reads it as usual)."""
    buf = io.BytesIO()
    _PipePickler(buf, 5).dump(obj)
    conn.send_bytes(buf.getbuffer())


def send_partial(tag: Any, value: Any) -> bool:
    """From inside a worker method: send ``value`` (picklable) to the controller now, ahead of
    the call's answer, to the function registered there for ``tag`` (:meth:`_Group.listen`).
    Returns False (nothing sent) outside a :class:`ProcessWorkerGroup`'s call (a Ray actor, an
    in-process worker), so a caller sends its values with the answer instead.

    Raises:
        BrokenPipeError: the controller is gone.
    """
    sender = _partial_sender
    if sender is None:
        return False
    sender((tag, value))
    return True


def live_groups() -> List["_Group"]:
    """The worker groups (:class:`ProcessWorkerGroup`, :class:`RayWorkerGroup`) built in this
    process and not shut down yet, in no particular order."""
    return list(_LIVE_GROUPS)


def dump_path(dump_dir: str, group: str, rank: int) -> str:
    """The stack-dump file of rank ``rank`` of worker group ``group``:
    ``<dump_dir>/<group>_rank_<rank>.txt``."""
    return os.path.join(dump_dir, f"{group}_rank_{rank}.txt")


@functools.lru_cache(maxsize=None)
def api_methods(api: type) -> FrozenSet[str]:
    """The public method names of a worker protocol ``api``
    (:mod:`mcore_rl.workers.interfaces`), its base protocols' included."""
    return frozenset(name for cls in api.__mro__ if getattr(cls, "_is_protocol", False)
                     and cls.__module__ != "typing"
                     for name, value in vars(cls).items()
                     if not name.startswith("_") and callable(value))


class TypedCalls:
    """The methods of the worker protocol ``api`` as attributes: ``proxy.<method>(*args,
    **kwargs)`` is ``invoke("<method>", *args, **kwargs)`` (a worker group's way of calling,
    with the keyword arguments given with the protocol bound). The name is checked against the
    protocol at attribute access, once per proxy and name.

    Raises (at attribute access):
        AttributeError: ``api`` has no public method of that name; the message names the
            protocol, the way of calling (``how``) and the protocol's methods.
    """

    def __init__(self, api: type, invoke: Callable[..., Any], how: str = "call"):
        if not getattr(api, "_is_protocol", False):
            raise TypeError(f"{how}: expected a method name or a worker protocol of "
                            f"mcore_rl.workers.interfaces, got {api!r}")
        self._api, self._invoke, self._how = api, invoke, how

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_") or name not in api_methods(self._api):
            raise AttributeError(
                f"{self._how}({self._api.__name__}).{name}: {self._api.__name__} has no method "
                f"{name!r} (mcore_rl/workers/interfaces.py); its methods: "
                f"{', '.join(sorted(api_methods(self._api)))}")
        method = functools.partial(self._invoke, name)
        setattr(self, name, method)  # resolved once
        return method

    def __dir__(self) -> List[str]:
        return sorted(api_methods(self._api))


def typed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Let ``fn(method_name, *args, **kwargs)`` (a way of calling worker methods by name) also
    take a worker protocol in place of the name: ``fn(API, **kwargs)`` returns
    :class:`TypedCalls` of ``API`` through ``fn`` (``kwargs`` bound; positional arguments go
    to the proxy's method). Also for stand-ins of worker groups in tests."""

    @functools.wraps(fn)
    def wrapper(method, *args, **kwargs):
        if isinstance(method, str):
            return fn(method, *args, **kwargs)
        if args:
            raise TypeError(f"{fn.__name__}({getattr(method, '__name__', method)}, ...): the "
                            f"arguments go to the method, as in "
                            f"{fn.__name__}(API).<method>(...)")
        return TypedCalls(method, lambda name, *a, **k: fn(name, *a, **kwargs, **k),
                          fn.__name__)

    return wrapper


def _typed_method(fn: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`typed` for a method ``fn(self, method_name, *args, **kwargs)``."""

    @functools.wraps(fn)
    def wrapper(self, method, *args, **kwargs):
        return typed(functools.wraps(fn)(functools.partial(fn, self)))(method, *args, **kwargs)

    return wrapper


def free_port() -> int:
    """An unused TCP port on this host (for the rendezvous of a new world)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Start-ups of a process group: a retry takes a new rendezvous port when another process took
# the one free_port() found before rank 0 could listen on it (a race between finding and binding).
_START_TRIES = 3


def _port_taken(error: str) -> bool:
    """Whether a start-up error is rank 0 failing to listen on the rendezvous port (torch's
    TCPStore: ``EADDRINUSE``)."""
    return "EADDRINUSE" in error or "ddress already in use" in error


class WorkerError(RuntimeError):
    """A worker method raised (the message carries the rank and the remote traceback), or a
    worker is gone.

    Attributes:
        gone: the ranks whose process (or Ray actor) is gone, as opposed to having raised.
    """

    def __init__(self, message: str, gone: Sequence[int] = ()):
        super().__init__(message)
        self.gone = frozenset(gone)


def then(future: Future, fn: Callable[[Any], Any]) -> Future:
    """A future of ``fn(future.result())``; an exception of either is the new future's."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as e:  # noqa: BLE001 (handed to the caller through the future)
            out.set_exception(e)

    future.add_done_callback(done)
    return out


class _Gather:
    """The future of one call on several ranks: done when every rank has answered; its result
    is the list of answers in the order of the ranks called, its exception a
    :class:`WorkerError` with every failed rank's traceback."""

    def __init__(self, ranks: Sequence[int], method: str = "", fail_fast: bool = False):
        self.future: Future = Future()
        self.method = method
        # fail_fast: the first error fails the future at once (the answers still due are then
        # dropped), for calls whose other ranks may never answer once one failed (start-up:
        # they wait in a rendezvous the failed rank was to host).
        self.fail_fast = fail_fast
        self._finished = False
        self.sent = time.monotonic()
        self._ranks = list(ranks)
        self._answered = [False] * len(self._ranks)
        self._results: List[Any] = [None] * len(self._ranks)
        self._errors: Dict[int, str] = {}
        self._gone: List[int] = []
        self._left = len(self._ranks)
        self._lock = threading.Lock()
        if not self._ranks:
            self.future.set_result([])

    def put(self, slot: int, ok: bool, value: Any, gone: bool = False) -> None:
        """The answer of the rank in ``slot``: its result (``ok``) or its error text; ``gone``:
        the rank's process is gone."""
        with self._lock:
            self._answered[slot] = True
            if ok:
                self._results[slot] = value
            else:
                self._errors[self._ranks[slot]] = value
                if gone:
                    self._gone.append(self._ranks[slot])
            self._left -= 1
            if self._finished or (self._left and not (self.fail_fast and self._errors)):
                return
            self._finished = True
        if self._errors:
            self.future.set_exception(WorkerError(
                "\n".join(f"[rank {r}]\n{e}" for r, e in sorted(self._errors.items())),
                gone=self._gone))
        else:
            self.future.set_result(self._results)

    def pending(self) -> List[int]:
        """The ranks called that have not answered yet."""
        with self._lock:
            return [r for r, done in zip(self._ranks, self._answered) if not done]


class _Group:
    """What both groups share: the blocking calls on top of :meth:`call_each_async`, and what
    the hang watchdog asks of a group (:meth:`pending_calls`, :meth:`dump_stacks`,
    :meth:`kill`).

    Attributes:
        name: the group's name (``policy``, ``generation``, ...): its dump files' prefix.
        dump_dir: where its ranks write their stacks on :data:`DUMP_SIGNAL`; None: nowhere (no
            signal is sent then).
    """

    world_size: int
    name: str = "workers"
    dump_dir: Optional[str] = None

    def _watch(self, name: str, dump_dir: Optional[str]) -> None:
        """Start the bookkeeping of calls not answered; register as a live group."""
        self.name, self.dump_dir = name, dump_dir
        self._calls_lock = threading.Lock()
        self._calls: set = set()
        _LIVE_GROUPS.add(self)

    def listen(self, tag: Any, fn: Optional[Callable[[Any], None]]) -> bool:
        """Hand every partial value a worker sends under ``tag`` (:func:`send_partial`) to
        ``fn(value)``, on a reader thread, until ``listen(tag, None)``. Returns whether this
        group delivers partial values (False: Ray; the workers' values come with the
        answers)."""
        return False

    def _gather(self, ranks: Sequence[int], method: str, fail_fast: bool = False) -> "_Gather":
        """A :class:`_Gather` for a call of ``method`` on ``ranks``, kept until answered."""
        gather = _Gather(ranks, method, fail_fast)
        if not gather.future.done():
            with self._calls_lock:
                self._calls.add(gather)

            def answered(_f: Future) -> None:
                with self._calls_lock:
                    self._calls.discard(gather)

            gather.future.add_done_callback(answered)
        return gather

    def pending_calls(self) -> List[Tuple[int, str, float]]:
        """The calls not answered yet: ``(rank, method, seconds since the call was sent)`` per
        rank and call, oldest first."""
        with self._calls_lock:
            calls = list(self._calls)
        now = time.monotonic()
        out = [(rank, g.method, now - g.sent) for g in calls for rank in g.pending()]
        return sorted(out, key=lambda c: (-c[2], c[0]))

    def _pids(self) -> List[Tuple[Optional[str], Optional[int]]]:
        """Per rank: ``(Ray node id or None, process id or None when unknown or gone)``."""
        raise NotImplementedError

    def dump_stacks(self, header: str) -> List[Tuple[str, int]]:
        """Make every rank's process append its Python stack (all threads) to its dump file
        (:func:`dump_path`), after ``header`` and a line naming the rank and its calls not
        answered. Returns ``(path, size after the header)`` per rank signalled (the stack
        follows within milliseconds, written by the process itself); nothing without a
        :attr:`dump_dir`. Errors (a file or process gone) skip that rank."""
        if self.dump_dir is None:
            return []
        pending: Dict[int, List[str]] = {}
        for rank, method, seconds in self.pending_calls():
            pending.setdefault(rank, []).append(f"{method} (sent {seconds:.1f} s ago)")
        out = []
        for rank, (node, pid) in enumerate(self._pids()):
            if pid is None:
                continue
            path = dump_path(self.dump_dir, self.name, rank)
            try:
                with open(path, "a") as f:
                    f.write(f"{header}\n{self.name} rank {rank} (pid {pid}): calls not answered: "
                            f"{', '.join(pending.get(rank, [])) or 'none'}\n")
                size = os.path.getsize(path)
                self._signal(node, pid, DUMP_SIGNAL)
            except (OSError, RuntimeError):
                continue
            out.append((path, size))
        return out

    def _signal(self, node: Optional[str], pid: int, signum: int) -> None:
        os.kill(pid, signum)

    def gone_ranks(self) -> List[int]:
        """The ranks whose process is known to have ended (exited, killed), found without a
        call (a call to a busy rank would wait behind its queued calls). A rank on another node
        (Ray) is never reported: only its next call can tell."""
        gone = []
        for rank, (node, pid) in enumerate(self._pids()):
            if pid is None:
                gone.append(rank)
            elif node is None or node == self._this_node():
                try:
                    os.kill(pid, 0)  # signal 0: is there such a process (nothing is sent)
                except ProcessLookupError:
                    gone.append(rank)
                except PermissionError:  # there is one, of another user
                    pass
        return gone

    def _this_node(self) -> Optional[str]:
        """This process's Ray node id (None without Ray)."""
        return None

    def kill(self) -> None:
        """Kill every rank's process at once (a hung rank answers nothing else); the group is
        unusable after."""
        raise NotImplementedError

    def call_each_async(self, method: str, args_per_rank: Sequence[Sequence[Any]],
                        ranks: Optional[Sequence[int]] = None, **kwargs) -> Future:
        """Start ``method(*args_per_rank[i], **kwargs)`` on rank ``ranks[i]`` (all ranks by
        default) and return at once. (Every way of calling also takes a worker protocol for
        ``method``: module docstring.)

        Returns:
            a ``concurrent.futures.Future`` whose result is the list of the ranks' return
            values (in the order of ``ranks``), or whose exception is a :class:`WorkerError`
            naming every rank that raised (the workers stay usable) or is gone.
        """
        raise NotImplementedError

    @_typed_method
    def call_async(self, method: str, *args, **kwargs) -> Future:
        """:meth:`call_each_async` with the same arguments on every rank."""
        return self.call_each_async(method, [args] * self.world_size, **kwargs)

    @_typed_method
    def call_each(self, method: str, args_per_rank: Sequence[Sequence[Any]], **kwargs) -> List[Any]:
        """Call ``method(*args_per_rank[r], **kwargs)`` on every rank at once and wait; one
        result per rank. Raises :class:`WorkerError`."""
        return self.call_each_async(method, args_per_rank, **kwargs).result()

    @_typed_method
    def call(self, method: str, *args, **kwargs) -> List[Any]:
        """Call ``method(*args, **kwargs)`` on every rank at once and wait; one result per rank.
        Raises :class:`WorkerError`."""
        return self.call_async(method, *args, **kwargs).result()


class _Host:
    """Holds one rank's worker object and runs methods on it (used by both groups)."""

    def __init__(self, worker_cls, kwargs: Dict[str, Any], dump_file: Optional[str] = None):
        # Registered before the worker is built: a stack dump works from the start.
        self._dump = None
        if dump_file:
            os.makedirs(os.path.dirname(dump_file), exist_ok=True)
            self._dump = open(dump_file, "a")  # appends: the controller's header comes first
            faulthandler.register(DUMP_SIGNAL, file=self._dump, all_threads=True)
        self.worker = worker_cls(**kwargs)
        self.rank = kwargs.get("rank", 0)

    def process(self) -> Tuple[Optional[str], int]:
        """``(Ray node id, or None outside Ray; this process's id)``."""
        node = None
        try:
            import ray

            if ray.is_initialized():
                node = ray.get_runtime_context().get_node_id()
        except ImportError:
            pass
        return node, os.getpid()

    def call(self, method: str, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        # MCORE_RL_PROFILE_DIR set: one steady-state call of each method profiled (a table).
        return profiled_call(method, lambda: getattr(self.worker, method)(*args, **kwargs),
                             self.rank)


def _process_main(conn, env, dump_file=None):
    """A :class:`ProcessWorkerGroup` rank's process: sets ``env``, then takes ``(worker_cls,
    kwargs)`` from ``conn`` (the controller sends them after the start), builds the worker and
    runs the calls that arrive on ``conn``. The spawn arguments carry no worker class: spawn
    unpickles them before the target runs, importing the class's module (and with it, e.g.,
    Megatron-Core and Transformer Engine, which reads its environment at import) before
    ``env`` would be set; the pipe's message is unpickled after."""
    # Preemption (SIGTERM, SIGUSR1: a job scheduler's notice, sent to the whole process group)
    # is the controller's to handle (mcore_rl.controller.preemption): it finishes its step and
    # saves, which needs the workers alive.
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    os.environ.update(env)
    try:
        worker_cls, kwargs = conn.recv()
        host = _Host(worker_cls, kwargs, dump_file)
        _send(conn, ("ok", None))
    except BaseException:  # report construction errors to the controller
        _send(conn, ("error", traceback.format_exc()))
        return
    # A thread takes calls off the pipe while the main thread runs one, so the controller's
    # sends never wait for a busy worker (calls are queued here, run in order).
    inbox: queue.Queue = queue.Queue()

    def receive() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the controller is gone
                msg = None
            inbox.put(msg)
            if msg is None:
                return

    threading.Thread(target=receive, daemon=True).start()
    global _partial_sender
    _partial_sender = lambda value: _send(conn, ("partial", value))  # noqa: E731 (send_partial)
    while True:
        msg = inbox.get()
        if msg is None:
            break
        method, args, kw = msg
        try:
            _send(conn, ("ok", host.call(method, args, kw)))
        except BaseException:
            _send(conn, ("error", traceback.format_exc()))


class ProcessWorkerGroup(_Group):
    """``world_size`` spawned processes, rank r built with ``worker_cls(**kwargs, rank=r,
    world_size=..., master_addr=..., master_port=...)``. Raises :class:`WorkerError` when a
    worker fails to build, at the first rank that fails (the others, which may be waiting in
    the rendezvous it was to host, are killed); a start-up whose rank 0 found the rendezvous
    port taken (``EADDRINUSE``: another process bound it after :func:`free_port` found it
    free) is tried again on a new port, up to :data:`_START_TRIES` times. A call that raises
    fails its future (the worker stays usable).

    Args:
        env_per_rank: environment variables set in rank r's process before its worker's
            class and kwargs are unpickled there, so before the worker's module is imported
            (``LOCAL_RANK``: its GPU, :mod:`mcore_rl.distributed.placement`; Transformer
            Engine's: :func:`mcore_rl.megatron.te.te_environment`); None: none. Only the
            parent's ``__main__`` (spawn re-imports it first) and this module load before.
        name: the group's name (its dump files' prefix).
        dump_dir: where rank r writes its Python stack on :data:`DUMP_SIGNAL`
            (:func:`dump_path`); None: the processes keep the signal's default.
    """

    def __init__(self, worker_cls, world_size: int, kwargs: Dict[str, Any],
                 env_per_rank: Optional[Sequence[Dict[str, str]]] = None,
                 name: str = "workers", dump_dir: Optional[str] = None):
        self._watch(name, dump_dir)
        self._send_lock = threading.Lock()
        self._listeners: Dict[Any, Callable[[Any], None]] = {}
        for attempt in range(1, _START_TRIES + 1):
            built = self._start(worker_cls, world_size, kwargs, env_per_rank, name, dump_dir)
            try:
                built.future.result()
                return
            except WorkerError as e:
                # The other ranks may wait for good in a rendezvous the failed rank was to host:
                # every process is killed, not asked to stop.
                self._stop(kill=True)
                if attempt < _START_TRIES and _port_taken(str(e)):
                    continue  # another process took the rendezvous port first: a new one
                _LIVE_GROUPS.discard(self)
                raise

    def _start(self, worker_cls, world_size: int, kwargs: Dict[str, Any],
               env_per_rank: Optional[Sequence[Dict[str, str]]], name: str,
               dump_dir: Optional[str]) -> "_Gather":
        """Spawn the ranks on a fresh rendezvous port; returns the gather of their start-up
        (failed at the first rank that fails to build)."""
        ctx = mp.get_context("spawn")
        port = free_port()
        self._conns = []
        self._procs = []
        # Per rank: the calls waiting for its answer, in order; a thread per rank reads them.
        self._waiting: List[queue.Queue] = [queue.Queue() for _ in range(world_size)]
        built = self._gather(range(world_size), "__init__", fail_fast=True)
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            env = dict(env_per_rank[rank]) if env_per_rank else {}
            # Not daemonic: Megatron's checkpoint writer starts processes of its own. A worker
            # exits when its pipe closes, so it does not outlive the controller.
            dump_file = dump_path(dump_dir, name, rank) if dump_dir else None
            p = ctx.Process(target=_process_main, args=(child, env, dump_file), daemon=False)
            p.start()
            # The child's end is the child's: held open here too, a dead child's pipe would
            # never report EOF to recv (a call on a dead worker would wait forever).
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
            self._waiting[rank].put((built, rank))
        # The class and kwargs go on the pipe once every rank is started (each process sets its
        # environment before it unpickles them: _process_main); a rank gone already fails the
        # start-up through its reader (EOF); ones that cannot be pickled end the processes.
        for rank, conn in enumerate(self._conns):
            kw = dict(kwargs, rank=rank, world_size=world_size, master_addr="127.0.0.1",
                      master_port=port)
            try:
                _send(conn, (worker_cls, kw))
            except (BrokenPipeError, OSError):
                pass
            except BaseException:
                self._stop(kill=True)
                _LIVE_GROUPS.discard(self)
                raise
        self._readers = [threading.Thread(target=self._read, daemon=True, args=(
            self._conns[r], self._waiting[r], self._procs[r], self._listeners))
            for r in range(world_size)]
        for t in self._readers:
            t.start()
        return built

    @property
    def world_size(self) -> int:
        return len(self._conns)

    def listen(self, tag: Any, fn: Optional[Callable[[Any], None]]) -> bool:
        if fn is None:
            self._listeners.pop(tag, None)
        else:
            self._listeners[tag] = fn
        return True

    @staticmethod
    def _read(conn, waiting: queue.Queue, proc, listeners: Dict[Any, Callable]) -> None:
        """One rank's answers on ``conn``, handed to its calls waiting in ``waiting`` in order
        (``proc``: its process); partial values sent before an answer go to their tag's
        function in ``listeners`` (none registered: dropped; one that raises: logged, the call
        goes on). The objects are the thread's own: a start-up tried again makes new ones."""
        while True:
            item = waiting.get()
            if item is None:
                return
            gather, slot = item
            try:
                status, value = conn.recv()
                while status == "partial":
                    tag, payload = value
                    fn = listeners.get(tag)
                    if fn is not None:
                        try:
                            fn(payload)
                        except Exception:  # noqa: BLE001 (the answer must still be read)
                            _log.exception("worker group: a partial-result listener raised")
                    status, value = conn.recv()
            except (EOFError, OSError):
                proc.join(timeout=5)
                gather.put(slot, False, f"the worker process is gone (exit code "
                                        f"{proc.exitcode})", gone=True)
                continue
            gather.put(slot, status == "ok", value)

    @_typed_method
    def call_each_async(self, method: str, args_per_rank: Sequence[Sequence[Any]],
                        ranks: Optional[Sequence[int]] = None, **kwargs) -> Future:
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        gather = self._gather(ranks, method)
        with self._send_lock:  # the order of sends is the order of answers, per rank
            for slot, r in enumerate(ranks):
                try:
                    _send(self._conns[r], (method, tuple(args_per_rank[slot]), kwargs))
                except (BrokenPipeError, OSError) as e:
                    gather.put(slot, False, f"the worker process is gone: {e!r}", gone=True)
                    continue
                self._waiting[r].put((gather, slot))
        return gather.future

    def _pids(self) -> List[Tuple[Optional[str], Optional[int]]]:
        return [(None, p.pid if p.is_alive() else None) for p in self._procs]

    def kill(self) -> None:
        _LIVE_GROUPS.discard(self)
        for p in self._procs:
            if p.is_alive():
                p.kill()

    def shutdown(self) -> None:
        _LIVE_GROUPS.discard(self)
        self._stop(kill=False)

    def _stop(self, kill: bool) -> None:
        """End the ranks' processes (asked to stop, killed after 30 s; at once with ``kill``)
        and their reader threads."""
        if not kill:
            for conn in self._conns:
                try:
                    _send(conn, None)
                except (BrokenPipeError, OSError):
                    pass
        for p in self._procs:
            if kill and p.is_alive():
                p.kill()
            p.join(timeout=5 if kill else 30)
            if p.is_alive():
                p.kill()
                p.join(timeout=30)  # reaped: no process of the group outlives its stop
        for waiting in self._waiting:
            waiting.put(None)


class RayWorkerGroup(_Group):
    """The same surface as :class:`ProcessWorkerGroup`, one Ray actor per rank.

    Args:
        actor_options: per rank, the Ray options of its actor (``num_gpus``, ``num_cpus``,
            ``scheduling_strategy``: :meth:`mcore_rl.distributed.placement.Placement.
            actor_options`); rank 0's also place the probe that picks the rendezvous address,
            so it is rank 0's node.
        name, dump_dir: as for :class:`ProcessWorkerGroup`; an actor's stack is signalled on
            its own node (a task pinned there when that is not this one).
    """

    def __init__(self, worker_cls, world_size: int, kwargs: Dict[str, Any],
                 actor_options: Sequence[Dict[str, Any]], name: str = "workers",
                 dump_dir: Optional[str] = None):
        import ray

        self._watch(name, dump_dir)

        self._ray = ray
        host_cls = ray.remote(_Host)
        # Rank 0's node address and a free port there form the rendezvous.
        probe_options = {k: v for k, v in actor_options[0].items() if k == "scheduling_strategy"}
        probe = ray.remote(num_cpus=0)(_node_address_and_port).options(**probe_options)
        addr, port = ray.get(probe.remote())
        self._actors = [
            host_cls.options(**actor_options[r]).remote(
                worker_cls,
                dict(kwargs, rank=r, world_size=world_size, master_addr=addr, master_port=port),
                dump_path(dump_dir, name, r) if dump_dir else None,
            )
            for r in range(world_size)
        ]
        # Construction errors surface here.
        self.call(WorkerAPI).layout()
        # Asked now: a hung actor answers nothing (its calls run one at a time).
        self._processes = ray.get([a.process.remote() for a in self._actors])

    @property
    def world_size(self) -> int:
        return len(self._actors)

    @_typed_method
    def call_each_async(self, method: str, args_per_rank: Sequence[Sequence[Any]],
                        ranks: Optional[Sequence[int]] = None, **kwargs) -> Future:
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        gather = self._gather(ranks, method)
        for slot, r in enumerate(ranks):
            ref = self._actors[r].call.remote(method, tuple(args_per_rank[slot]), kwargs)
            ref.future().add_done_callback(
                lambda f, slot=slot: gather.put(slot, *self._outcome(f)))
        return gather.future

    def _outcome(self, f: Future):
        """``(ok, value, gone)`` of one actor call's future (Ray's task and actor errors as
        text; ``gone``: the actor died)."""
        try:
            return True, f.result(), False
        except self._ray.exceptions.RayError as e:  # a raising method, a dead actor, ...
            return False, str(e), isinstance(e, self._ray.exceptions.RayActorError)

    def _pids(self) -> List[Tuple[Optional[str], Optional[int]]]:
        return list(self._processes)

    def _this_node(self) -> Optional[str]:
        return self._ray.get_runtime_context().get_node_id()

    def _signal(self, node: Optional[str], pid: int, signum: int) -> None:
        ray = self._ray
        if node is None or node == self._this_node():
            os.kill(pid, signum)
            return
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = ray.remote(num_cpus=0)(_send_signal).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        try:
            ray.get(task.remote(pid, signum), timeout=10)
        except Exception as e:  # noqa: BLE001 (a node gone, a timeout: that rank is skipped)
            raise RuntimeError(str(e)) from e

    def kill(self) -> None:
        _LIVE_GROUPS.discard(self)
        for a in self._actors:
            self._ray.kill(a)

    def shutdown(self) -> None:
        _LIVE_GROUPS.discard(self)
        try:
            self.call(WorkerAPI).shutdown()
        except WorkerError:
            pass
        for a in self._actors:
            self._ray.kill(a)


def _send_signal(pid: int, signum: int) -> None:
    os.kill(pid, signum)


def _node_address_and_port():
    import ray

    return ray.util.get_node_ip_address(), free_port()


class DataParallelGroup:
    """A worker group with its data-parallel layout: a batch's rows are split over the DP ranks
    (every TP/PP rank of one DP group gets the same shard) and per-row results come back in
    row order.

    Args:
        group: a :class:`ProcessWorkerGroup` or :class:`RayWorkerGroup` of Megatron workers
            (they answer ``layout()``).
    """

    def __init__(self, group):
        self.group = group
        layouts = group.call(TrainWorkerAPI).layout()
        self.dp_size = layouts[0]["dp_size"]
        self.dp_rank_of = [lay["dp_rank"] for lay in layouts]

    @_typed_method
    def call(self, method: str, *args) -> List[Any]:
        """``method(*args)`` on every rank; the per-rank results."""
        return self.group.call(method, *args)

    def listen(self, tag: Any, fn: Optional[Callable[[Any], None]]) -> bool:
        """The group's :meth:`_Group.listen` (False for a group without the channel)."""
        listen = getattr(self.group, "listen", None)
        return bool(listen(tag, fn)) if listen is not None else False

    @_typed_method
    def call_sharded(self, method: str, batch: B.Batch, *args) -> List[Any]:
        """``method(shard, *args)`` on every rank with its DP shard of ``batch``; the per-rank
        results."""
        return self.call_sharded_async(method, batch, *args).result()

    @_typed_method
    def call_sharded_async(self, method: str, batch: B.Batch, *args) -> Future:
        """:meth:`call_sharded` started: a future of the per-rank results."""
        shards = B.shard(batch, self.dp_size)
        return self.group.call_each_async(method, [[shards[d], *args] for d in self.dp_rank_of])

    @_typed_method
    def call_per_dp_async(self, method: str, args_per_dp: Sequence[Sequence[Any]],
                          dp_ranks: Optional[Sequence[int]] = None, **kwargs) -> Future:
        """Start ``method(*args_per_dp[i], **kwargs)`` on every rank of DP rank ``dp_ranks[i]``
        (all DP ranks by default; their TP/PP ranks answer alike; other DP ranks get no call).

        Returns:
            a future of one result per DP rank called, in the order of ``dp_ranks``
            (:class:`WorkerError` when a rank raised).
        """
        dp_ranks = list(range(self.dp_size)) if dp_ranks is None else list(dp_ranks)
        slot_of = {d: i for i, d in enumerate(dp_ranks)}
        ranks = [r for r, d in enumerate(self.dp_rank_of) if d in slot_of]
        future = self.group.call_each_async(
            method, [args_per_dp[slot_of[self.dp_rank_of[r]]] for r in ranks], ranks=ranks, **kwargs)

        def one_per_dp(outs: List[Any]) -> List[Any]:
            by_dp: Dict[int, Any] = {}
            for r, out in zip(ranks, outs):
                by_dp.setdefault(self.dp_rank_of[r], out)
            return [by_dp[d] for d in dp_ranks]

        return then(future, one_per_dp)

    @_typed_method
    def call_per_dp(self, method: str, args_per_dp: Sequence[Sequence[Any]], **kwargs) -> List[Any]:
        """``method(*args_per_dp[d], **kwargs)`` on every rank of DP rank ``d`` (its TP/PP
        ranks answer alike); one result per DP rank, in DP order."""
        return self.call_per_dp_async(method, args_per_dp, **kwargs).result()

    @_typed_method
    def gather_rows(self, method: str, batch: B.Batch, *args) -> torch.Tensor:
        """A per-row method (``get_logprobs``, ``get_values``: ``[rows, S]``) over the whole
        batch: each DP shard's result once, concatenated in row order."""
        shards = B.shard(batch, self.dp_size)
        return torch.cat(self.call_per_dp(method, [[s, *args] for s in shards]))

    def train(self, batch: B.Batch, loss_fn, micro_batch_size: int) -> Dict[str, float]:
        """One optimizer step on ``batch`` (the global batch); the step's metrics."""
        return self.train_async(batch, loss_fn, micro_batch_size).result()

    def train_async(self, batch: B.Batch, loss_fn, micro_batch_size: int) -> Future:
        """:meth:`train` started (the group's calls run in the order sent, so several steps may
        be queued): a future of the step's metrics."""
        future = self.call_sharded_async(TrainWorkerAPI).train(batch, loss_fn, B.batch_size(batch),
                                                               micro_batch_size)
        return then(future, lambda outs: outs[0])

    # The split train step (the workers' begin_train_step / train_microbatch /
    # finish_train_step / abort_train_step): one optimizer step whose rows arrive over time,
    # each part sent to a DP rank of the controller's choosing. The gradient is that of
    # ``train`` on the same rows, however they are spread (up to fp32 summation order).
    def begin_train_step(self, loss_fn, global_batch_size: int, micro_batch_size: int) -> None:
        """Open a split step on every rank (``MegatronTrainWorker.begin_train_step``).

        Args:
            loss_fn: as for :meth:`train`.
            global_batch_size: rows of the whole step (all DP ranks); the LR schedule advances
                by it.
            micro_batch_size: rows per forward/backward in each :meth:`train_microbatch`.

        Raises:
            WorkerError: a step is already open, or a size is below 1.
        """
        self.group.call(TrainWorkerAPI).begin_train_step(loss_fn, global_batch_size, micro_batch_size)

    def train_microbatch(self, rows: B.Batch, dp_rank: int) -> Future:
        """Start forward and backward of ``rows`` on DP rank ``dp_rank`` (all its TP/PP ranks)
        and return at once; other DP ranks are not involved, so parts may go to the DP ranks in
        any number and order (an empty share included).

        Returns:
            a future of None; its :class:`WorkerError` means the worker aborted the open step
            (hooks restored, gradients zeroed): call :meth:`abort_train_step` to close it on
            the other ranks too.
        """
        return then(self.call_per_dp_async(TrainWorkerAPI, dp_ranks=[dp_rank]).train_microbatch(
            [[rows]]), lambda _: None)

    def finish_train_step(self) -> Dict[str, float]:
        """Reduce the step's gradient over DP, scale it by the global count, step the
        optimizer (every rank; waits for the parts still running). Returns the metrics of
        :meth:`train` on the same rows. Raises :class:`WorkerError` (the step is then closed on
        every rank that raised)."""
        return self.group.call(TrainWorkerAPI).finish_train_step()[0]

    def abort_train_step(self) -> None:
        """Drop the open step on every rank: hooks restored, gradients zeroed, weights and
        optimizer untouched; idempotent."""
        self.group.call(TrainWorkerAPI).abort_train_step()

    def shutdown(self) -> None:
        """Shut the group's workers down (:meth:`ProcessWorkerGroup.shutdown`)."""
        self.group.shutdown()

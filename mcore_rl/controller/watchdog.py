"""The hang watchdog: a phase of the RL step that overruns its deadline ends the run with
:data:`EXIT_CODE` (4) and every process's Python stack, instead of waiting for an NCCL timeout
(30 minutes and more, or forever on gloo and in Python).

Phases. The controller's timed phases (:class:`~mcore_rl.utils.timers.PhaseTimer`, which tells
the watchdog of each start and end: ``generation``, ``reward``, ``logprobs``, ``values``,
``train``, ``train_critic``, ``finish``, ``refit``), plus ``validation``, ``checkpoint`` (a
save) and the start-up ``refit``; in the streaming loop each worker call is a phase of its own
(:meth:`Watchdog.track`: a generation call, a chunk's logprob or value forward, a
``train_microbatch``), from when it is sent until it is answered. The step itself (``step``,
the sum of its phases) is not watched: its phases are.

Deadline (:func:`deadline_seconds`). A phase's deadline, fixed when it starts, is
``max(watchdog.floor_seconds, watchdog.factor x the longest of its last watchdog.history
durations)``; a phase that has not finished once yet gets ``factor x floor_seconds`` (its
first run carries the one-time costs: compilation, CUDA graph capture, communicator set-up).
Durations count every run of the phase, the first included, in this process (a resumed run
starts without any). The defaults (600 s, 3, 10) leave any live phase alone.

Overrun (:meth:`Watchdog._fire`). The watchdog's thread sleeps on a condition until the
earliest deadline of the open phases (no polling); when one passes with its phase still open:

1. ``<run.output_dir>/hang/controller.txt``: the controller's threads' stacks;
   ``hang/<group>_rank_<r>.txt``: each worker process's, written by the process itself
   (:data:`~mcore_rl.distributed.worker_group.DUMP_SIGNAL`, SIGUSR2, registered with
   :mod:`faulthandler` when it started, so also from inside a collective), after a header
   naming the phase and that rank's calls not answered;
2. one line on stderr: the phase, how long it ran against its deadline, the calls not answered
   (group, rank, method: the stalled ranks) and where the stacks are;
3. the worker processes are killed (a hung rank answers nothing else) and the process exits
   with :data:`EXIT_CODE`, not 2 (input error), 3 (logprob budget) or 75 (preemption: a
   requeue would hang again). Checkpoints of earlier steps are untouched; nothing of the open
   step was saved.

The watchdog only reads clocks and sets timers: it changes no numbers of the run.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future
from typing import Callable, Deque, Dict, Iterator, List, Optional, Sequence

from mcore_rl.config.schema import WatchdogConfig
from mcore_rl.distributed.worker_group import live_groups

_log = logging.getLogger(__name__)

# Exit status of a run stopped by the hang watchdog.
EXIT_CODE = 4
# Phases that are not watched: the RL step is the sum of its phases, each watched (watching it
# too would name the step instead of the phase that hangs).
UNWATCHED = frozenset({"step"})
# Seconds to wait for the workers' stack dumps before the run ends.
DUMP_WAIT_SECONDS = 5.0
# Seconds the clean-up callback may take before the run ends without it.
CLEANUP_SECONDS = 10.0


def hang_dir(run_dir: str) -> str:
    """The directory of the stack dumps: ``<run_dir>/hang``."""
    return os.path.join(run_dir, "hang")


def deadline_seconds(durations: Sequence[float], floor: float, factor: float) -> float:
    """The deadline of a phase, in seconds from its start.

    Args:
        durations: the phase's recent durations in seconds (the last ``watchdog.history``),
            empty before it has finished once.
        floor: ``watchdog.floor_seconds``, > 0.
        factor: ``watchdog.factor``, >= 1.

    Returns:
        ``max(floor, factor * max(durations))``; ``factor * floor`` without durations.
    """
    if not durations:
        return factor * floor
    return max(floor, factor * max(durations))


class Phase:
    """One open phase: its ``name``, ``start`` (``time.monotonic()`` seconds) and
    ``deadline`` (seconds after ``start``)."""

    __slots__ = ("name", "start", "deadline")

    def __init__(self, name: str, start: float, deadline: float):
        self.name, self.start, self.deadline = name, start, deadline

    @property
    def due(self) -> float:
        return self.start + self.deadline


class Watchdog:
    """Deadlines of the run's phases and the thread that acts when one passes (module
    docstring).

    Args:
        cfg: the ``watchdog`` section; ``enabled=false``: :meth:`begin` watches nothing and
            no thread starts.
        run_dir: the run directory (dumps go to :func:`hang_dir`).
        groups: the worker groups to name, dump and kill on a hang (default: every live group
            of this process, :func:`~mcore_rl.distributed.worker_group.live_groups`).
        cleanup: called on a hang before the workers are killed (the reward pool's processes,
            say); given :data:`CLEANUP_SECONDS`, then skipped.
        exit: ends the process with a status (``os._exit``: the controller's main thread may
            be stuck where no exception reaches it; tests pass their own).

    Attributes:
        fired: set once a deadline passed (the run is ending).
    """

    def __init__(self, cfg: WatchdogConfig, run_dir: str,
                 groups: Callable[[], Sequence] = live_groups,
                 cleanup: Optional[Callable[[], None]] = None,
                 exit: Callable[[int], None] = os._exit):
        self.cfg = cfg
        self.run_dir = run_dir
        self._groups = groups
        self._cleanup = cleanup
        self._exit = exit
        self._history: Dict[str, Deque[float]] = {}
        self._open: set = set()
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self.fired = threading.Event()

    # ------------------------------------------------------------------ phases
    def deadline(self, name: str) -> float:
        """The deadline in seconds a run of phase ``name`` starting now gets
        (:func:`deadline_seconds` of its recent durations)."""
        with self._cond:
            durations = list(self._history.get(name, ()))
        return deadline_seconds(durations, self.cfg.floor_seconds, self.cfg.factor)

    def begin(self, name: str) -> Optional[Phase]:
        """Phase ``name`` starts now; returns its token for :meth:`end` (None: not watched,
        as with ``enabled=false`` or a name in :data:`UNWATCHED`)."""
        if not self.cfg.enabled or name in UNWATCHED:
            return None
        phase = Phase(name, time.monotonic(), self.deadline(name))
        with self._cond:
            self._open.add(phase)
            self._cond.notify()
        return phase

    def end(self, phase: Optional[Phase]) -> None:
        """The phase of :meth:`begin`'s token ended (however): its duration joins its
        history. None does nothing."""
        if phase is None:
            return
        seconds = time.monotonic() - phase.start
        with self._cond:
            if phase in self._open:
                self._open.discard(phase)
                self._history.setdefault(
                    phase.name, collections.deque(maxlen=self.cfg.history)).append(seconds)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Watch the block as phase ``name`` (for phases the
        :class:`~mcore_rl.utils.timers.PhaseTimer` does not time)."""
        token = self.begin(name)
        try:
            yield
        finally:
            self.end(token)

    def track(self, name: str, future: Future) -> Future:
        """Watch a call from now until ``future`` is done (its result or error) as phase
        ``name``; returns ``future``."""
        token = self.begin(name)
        if token is not None:
            future.add_done_callback(lambda _f: self.end(token))
        return future

    # ------------------------------------------------------------------ the thread
    def start(self) -> None:
        """Start the thread that watches the deadlines (idempotent; nothing when disabled)."""
        if not self.cfg.enabled or (self._thread is not None and self._thread.is_alive()):
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="mcore-rl-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (phases still open are not acted on); idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def close(self) -> None:
        """:meth:`stop`, and remove the dump files that stayed empty (every worker process
        creates its own at start) and the dump directory when nothing is left in it."""
        self.stop()
        if self.fired.is_set():
            return
        directory = hang_dir(self.run_dir)
        with contextlib.suppress(OSError):
            for name in os.listdir(directory):
                path = os.path.join(directory, name)
                if os.path.isfile(path) and os.path.getsize(path) == 0:
                    os.remove(path)
            os.rmdir(directory)

    def hold_if_fired(self) -> None:
        """Wait for the end of the process when a deadline passed (the controller's main
        thread, woken by an error of a killed worker, must not end the run with another
        status first); returns at once otherwise."""
        if self.fired.is_set():
            while True:
                time.sleep(3600)

    def _run(self) -> None:
        with self._cond:
            while True:
                if self._stopping:
                    return
                first = min(self._open, key=lambda p: p.due, default=None)
                now = time.monotonic()
                if first is None:
                    self._cond.wait()
                elif first.due > now:
                    self._cond.wait(first.due - now)
                else:
                    break
        self._fire(first, now)

    # ------------------------------------------------------------------ on a hang
    def _fire(self, phase: Phase, now: float) -> None:
        """Dump every stack, name the phase and the calls not answered on stderr, kill the
        workers, end the process with :data:`EXIT_CODE` (module docstring)."""
        self.fired.set()
        directory = hang_dir(self.run_dir)
        ran = now - phase.start
        history = list(self._history.get(phase.name, ()))
        basis = (f"longest of its last {len(history)}: {max(history):.1f} s" if history
                 else "no earlier run")
        header = (f"hang watchdog: phase {phase.name} ran {ran:.1f} s, past its deadline of "
                  f"{phase.deadline:.1f} s (watchdog.floor_seconds={self.cfg.floor_seconds:g}, "
                  f"watchdog.factor={self.cfg.factor:g}, {basis})")
        groups = list(self._groups())
        stalled: List[str] = []
        for group in groups:
            try:
                calls = group.pending_calls()
            except Exception:  # noqa: BLE001 (a broken group: the others are still named)
                continue
            stalled += [f"{group.name} rank {rank} ({method}, {seconds:.1f} s)"
                        for rank, method, seconds in calls]
        written: List[tuple] = []
        try:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, "controller.txt"), "w") as f:
                f.write(f"{header}\ncalls not answered: {', '.join(stalled) or 'none'}\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            for group in groups:
                written += group.dump_stacks(header)
        except Exception:  # noqa: BLE001 (the run ends all the same)
            _log.exception("hang watchdog: writing the stack dumps failed")
        give_up = time.monotonic() + DUMP_WAIT_SECONDS
        for path, size in written:
            while time.monotonic() < give_up:
                with contextlib.suppress(OSError):
                    if os.path.getsize(path) > size:
                        break
                time.sleep(0.05)
        print(f"mcore-rl: error: {header}; stalled (calls not answered): "
              f"{', '.join(stalled) or 'none: the controller itself'}; Python stacks in "
              f"{directory} (exit code {EXIT_CODE})", file=sys.stderr, flush=True)
        if self._cleanup is not None:
            worker = threading.Thread(target=self._cleanup, name="mcore-rl-watchdog-cleanup",
                                      daemon=True)
            worker.start()
            worker.join(CLEANUP_SECONDS)
        for group in groups:
            with contextlib.suppress(Exception):
                group.kill()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        self._exit(EXIT_CODE)

"""Environment steps out of the controller's process, each with a deadline.

:class:`EnvironmentExecutor` runs an environment's ``reset`` and ``step`` calls in a pool of
``num_workers`` spawned processes (:class:`concurrent.futures.ProcessPoolExecutor`; the
environment is pickled once into each worker), or in the calling process with
``num_workers=0``. It is the pattern of :mod:`mcore_rl.rewards.pool` for environments: every
call has a hard deadline (``timeout_seconds`` after it was handed to an idle worker; at most
``num_workers`` calls are in flight, so handing over is starting); a call past it fails, the
pool's processes are killed and a new pool takes the other calls. A worker that dies
(``os._exit``, a segfault, the OOM killer) breaks the pool; a new pool is made and the calls that
were in flight are tried once more; a call in flight at two breaks fails.

A failed call never raises into the caller: a failed ``step`` is an ended episode
(``StepResult(observation=<the error>, reward=0.0, done=True)``) whose metadata counts it
(``env_errors``) and says why (``env_error``); a failed ``reset`` gives ``(None, metadata)``
with the same two keys, and :func:`failed` tells the caller not to run that episode. The
sandbox's own subprocess and wall-clock limit (:mod:`mcore_rl.environments.sandbox`) sit inside
this: a tool that hangs is stopped by its own limit first, an environment that hangs by this
deadline.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import multiprocessing
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mcore_rl.data.example import Example
from mcore_rl.environments.base import (ENV_ERROR, ENV_ERRORS, Environment, EpisodeState,
                                        StepResult)
from mcore_rl.utils.pools import kill_process_pool

logger = logging.getLogger("mcore_rl.environments")

# Tries a call gets when the pool breaks while it is in flight (a worker died).
MAX_TRIES = 2

_ENV: Optional[Environment] = None  # the environment of a pool worker (set by _init)


def _init(env: Environment) -> None:
    """Pool initializer: keep the environment for the worker's calls."""
    global _ENV
    _ENV = env


def _ready() -> bool:
    """Pool task that does nothing: the worker has spawned and unpickled the environment."""
    return _ENV is not None


def _call(method: str, args: tuple) -> Tuple[Any, Optional[str]]:
    """Pool task: ``(value, None)`` of the worker's environment's ``method(*args)``, or
    ``(None, repr(exception))`` if it raised."""
    return _apply(_ENV, method, args)


def _apply(env: Any, method: str, args: tuple) -> Tuple[Any, Optional[str]]:
    try:
        return getattr(env, method)(*args), None
    except (Exception, SystemExit) as e:  # an environment's bug or odd input must not stop
        return None, repr(e)              # training (nor its sys.exit the controller)


def failed(metadata: Dict[str, Any]) -> bool:
    """Whether the executor's reset of this episode failed (the episode must not be run)."""
    return ENV_ERROR in metadata


class EnvironmentExecutor:
    """Runs ``env``'s calls with deadlines, in a process pool or in this process.

    Args:
        env: the environment (picklable, its functions module-level: spawned workers import
            them by name).
        num_workers: pool processes (``env.num_workers``); 0 runs the calls in the calling
            process (exceptions still caught; no deadline).
        timeout_seconds: hard deadline of one call in the pool (``env.step_timeout_seconds``).

    Raises:
        ValueError: ``num_workers < 0`` or ``timeout_seconds <= 0``.

    :meth:`reset`, :meth:`step` and :meth:`warm_up` raise ``RuntimeError`` only when the
    pool's workers cannot start at all (the environment does not unpickle in a spawned
    process): a bug of the environment's code, not of an episode.
    """

    def __init__(self, env: Environment, num_workers: int = 2, timeout_seconds: float = 60.0):
        if num_workers < 0:
            raise ValueError(f"env.num_workers={num_workers}: expected >= 0")
        if timeout_seconds <= 0:
            raise ValueError(f"env.step_timeout_seconds={timeout_seconds}: expected > 0")
        self.env, self.num_workers, self.timeout_seconds = env, num_workers, float(timeout_seconds)
        self._pool: Optional[cf.ProcessPoolExecutor] = None
        self._lock = threading.Lock()  # one batch of calls drives the pool at a time
        self.pools_made = 0  # pools created so far (1 + restarts after a hang or a dead worker)

    # ------------------------------------------------------------------ public
    def reset(self, examples: Sequence[Example]) -> List[Tuple[Optional[str], Dict[str, Any]]]:
        """``env.reset`` of each example, in order; a failed one gives ``(None, {"env_error":
        why, "env_errors": 1})`` (:func:`failed`)."""
        out = []
        for example, (value, error) in zip(examples, self._run(
                [("reset", (example,)) for example in examples])):
            if error is None and not (isinstance(value, tuple) and len(value) == 2
                                      and isinstance(value[1], dict)):
                error = f"reset returned {value!r:.80}, not (observation, metadata)"
            out.append((None, {ENV_ERROR: error, ENV_ERRORS: 1}) if error is not None else value)
        return out

    def step(self, states: Sequence[EpisodeState], texts: Sequence[str]) -> List[StepResult]:
        """``env.step`` of each episode with its model turn, in order; a failed one gives an
        ended episode with reward 0, the error as its observation, ``env_error`` and one more
        ``env_errors`` in the metadata.

        Raises:
            ValueError: ``states`` and ``texts`` differ in length (a caller's bug).
        """
        if len(states) != len(texts):
            raise ValueError(f"EnvironmentExecutor.step: {len(states)} episodes, "
                             f"{len(texts)} model turns")
        out = []
        for state, (value, error) in zip(states, self._run(
                [("step", (state, text)) for state, text in zip(states, texts)])):
            if error is None and not isinstance(value, StepResult):
                error = f"step returned {type(value).__name__}, not a StepResult"
            if error is None:
                out.append(value)
            else:
                metadata = {**state.metadata, ENV_ERROR: error,
                            ENV_ERRORS: state.metadata.get(ENV_ERRORS, 0) + 1}
                out.append(StepResult(f"environment error: {error}", 0.0, True, metadata))
        return out

    def warm_up(self) -> None:
        """Start the pool's processes now (spawning takes a second or more)."""
        if self.num_workers:
            with self._lock:
                if self._pool is None:
                    self._new_pool()

    def close(self) -> None:
        """Stop the pool (idempotent)."""
        with self._lock:
            self._kill_pool()

    def __enter__(self) -> "EnvironmentExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ pool
    def _new_pool(self) -> cf.ProcessPoolExecutor:
        self._kill_pool()
        self._pool = cf.ProcessPoolExecutor(self.num_workers,
                                            mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_init, initargs=(self.env,))
        self.pools_made += 1
        # Spawning and unpickling (imports) take seconds: done before any deadline runs.
        ready = [self._pool.submit(_ready) for _ in range(self.num_workers)]
        cf.wait(ready)
        problems = [f.exception() for f in ready if f.exception() is not None]
        if problems:
            self._kill_pool()
            raise RuntimeError(f"environment workers failed to start (does the environment "
                               f"pickle, are its functions module-level?): {problems[0]!r}")
        return self._pool

    def _kill_pool(self) -> None:
        """Kill the pool's processes (a hung call ignores everything else) and drop it."""
        pool, self._pool = self._pool, None
        kill_process_pool(pool)

    def _run(self, calls: List[Tuple[str, tuple]]) -> List[Tuple[Any, Optional[str]]]:
        """``(value, error)`` per call, in order: error None, or why the call failed."""
        if not self.num_workers:
            return [_apply(self.env, method, args) for method, args in calls]
        with self._lock:
            return self._run_pool(calls)

    def _run_pool(self, calls: List[Tuple[str, tuple]]) -> List[Tuple[Any, Optional[str]]]:
        """Feed the pool (at most ``num_workers`` calls in flight), enforce the deadlines,
        recover from hung and dead workers."""
        n = len(calls)
        results: List[Tuple[Any, Optional[str]]] = [(None, "not run")] * n
        tries = [0] * n
        todo = list(range(n - 1, -1, -1))  # a stack, popped from the end: index order
        in_flight: Dict[cf.Future, Tuple[int, float]] = {}  # future -> (call, deadline)
        pool = self._pool or self._new_pool()
        while todo or in_flight:
            while todo and len(in_flight) < self.num_workers:
                i = todo.pop()
                try:
                    fut = pool.submit(_call, *calls[i])
                except BrokenProcessPool:  # a worker died while idle (between calls, say)
                    todo.append(i)
                    pool = self._new_pool()
                    continue
                tries[i] += 1
                in_flight[fut] = (i, time.monotonic() + self.timeout_seconds)
            wait_for = max(0.0, min(d for _, d in in_flight.values()) - time.monotonic())
            done, _ = cf.wait(in_flight, timeout=wait_for, return_when=cf.FIRST_COMPLETED)
            broken = False
            for fut in done:
                i, _ = in_flight.pop(fut)
                try:
                    results[i] = fut.result()
                except BrokenProcessPool:
                    broken = True
                    self._retry_or_fail(i, tries, todo, results, "its worker process died")
                except Exception as e:  # an unpicklable result, say
                    results[i] = (None, repr(e))
            now = time.monotonic()
            hung = [f for f, (_, d) in in_flight.items() if d <= now and not f.done()]
            for fut in hung:
                i, _ = in_flight.pop(fut)
                results[i] = (None, f"no result within env.step_timeout_seconds="
                                    f"{self.timeout_seconds:g}")
            if hung or broken:
                # The other calls in flight go back to the queue of a new pool; after a break
                # they are suspects and spend a try, after a hang they do not.
                for fut, (i, _) in in_flight.items():
                    if broken:
                        self._retry_or_fail(i, tries, todo, results, "its worker process died")
                    else:
                        tries[i] -= 1
                        todo.append(i)
                in_flight.clear()
                pool = self._new_pool()
        errors = [i for i, (_, error) in enumerate(results) if error is not None]
        if errors:
            logger.warning("environment: %d of %d calls failed (raised, hung or lost with a "
                           "worker); first (%s): %s", len(errors), n, calls[errors[0]][0],
                           results[errors[0]][1])
        return results

    @staticmethod
    def _retry_or_fail(i: int, tries: List[int], todo: List[int],
                       results: List[Tuple[Any, Optional[str]]], why: str) -> None:
        if tries[i] >= MAX_TRIES:
            results[i] = (None, f"{why} ({tries[i]} tries)")
        else:
            todo.append(i)

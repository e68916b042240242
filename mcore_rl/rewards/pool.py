"""Reward scoring in a process pool, off the controller's critical path.

:class:`RewardScorer` scores a rollout's decoded responses with the run's rewards (one, or
several weighted: :func:`mcore_rl.rewards.reward_components`) either in the controller process
(``num_workers=0``) or with the plain (not async, not batched) ones in a pool of
``num_workers`` spawned processes (:class:`concurrent.futures.ProcessPoolExecutor`); async and
batched rewards (remote scorers, models) run in the controller's scoring thread.
:meth:`RewardScorer.submit` returns at once with a :class:`PendingRewards`; a background thread
in the controller feeds the pool, so the controller can run the policy's logprob forward
meanwhile and collect the rewards with :meth:`PendingRewards.result` just before the
advantages.

Each sample runs in a worker's main thread, so math-verify's own ``signal.alarm`` timeouts
work there. On top of that every sample has a hard deadline (``timeout_seconds`` after it was
handed to an idle worker; at most ``num_workers`` samples are in flight at once, so handing over
is starting): a sample past it scores 0 and counts an error, the pool's processes are killed
and a new pool takes the other samples. A worker that dies (``os._exit``, a segfault, the OOM
killer) breaks the pool; a new pool is made and the samples that were in flight (suspects) are
tried once more, each alone in the pool, so a sample that breaks it again is the one that kills
its worker: it scores 0 and counts an error, and the samples that were beside it are not charged
a second break. Nothing of this stops the run.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from mcore_rl.data.example import Example
from mcore_rl.rewards import (SYNC, RewardComponent, RewardFn, Scores, score_components,
                              warn_errors, weighted_total)
from mcore_rl.utils.pools import kill_process_pool


# Tries a sample gets when the pool breaks while it is in flight (a worker died).
MAX_TRIES = 2


def default_num_workers(rewards: Union[str, Sequence[RewardComponent]]) -> int:
    """Pool size for ``reward.num_workers: null``: 0 (score in the controller) when every plain
    reward is ``"exact"`` (a regex costs less than a round trip to a worker) or there is none
    (async and batched rewards run in the controller); ``min(8, os.cpu_count())`` otherwise
    (math-verify: milliseconds of sympy per sample; a user's function: out of the controller,
    with a deadline). ``rewards``: the rewards, or one reward's name."""
    if isinstance(rewards, str):
        names = [rewards]
    else:
        names = [c.name for c in rewards if c.style == SYNC]
    if all(n == "exact" for n in names):
        return 0
    return min(8, os.cpu_count() or 1)


def _ready() -> int:
    """Pool task that does nothing: the worker has spawned and imported the verifiers."""
    return os.getpid()


def _score_one(fns: Tuple[Callable, ...], response: str, example: Example
               ) -> Tuple[List[float], List[Optional[str]], float]:
    """Pool task (top-level, so spawn can pickle it): ``(rewards, errors, busy_seconds)`` of
    one sample under each plain reward of ``fns``; an error is the repr of what that reward
    raised (its reward 0), or None."""
    start = time.perf_counter()
    rewards: List[float] = []
    errors: List[Optional[str]] = []
    for fn in fns:
        try:
            reward, error = float(fn(response, example)), None
        except Exception as e:  # a verifier bug or odd input must not stop training
            reward, error = 0.0, repr(e)
        rewards.append(reward)
        errors.append(error)
    return rewards, errors, time.perf_counter() - start


class PendingRewards:
    """Rewards being computed; :meth:`result` waits for them."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Optional[Tuple[torch.Tensor, int, float]] = None
        self._components: Dict[str, torch.Tensor] = {}
        self._exception: Optional[BaseException] = None

    def _set(self, value=None, exception=None, components=None) -> None:
        self._value, self._exception = value, exception
        self._components = components or {}
        self._done.set()

    def components(self) -> Dict[str, torch.Tensor]:
        """Each reward's own scores, unweighted: its :attr:`RewardComponent.metric`
        (``reward/<name>``) -> ``[B]`` float32 (0 where it failed); waits like
        :meth:`result`."""
        self.result()
        return self._components

    def done(self) -> bool:
        """Whether :meth:`result` would return without waiting."""
        return self._done.is_set()

    def result(self) -> Tuple[torch.Tensor, int, float]:
        """``(rewards, num_errors, busy_seconds)``: rewards ``[B]`` float32 on CPU in the order
        submitted, how many samples raised, hung past the deadline or were lost with a dead
        worker (each scored 0), and the seconds the verifier itself ran summed over samples
        (the scoring's own work, however much of it overlapped other phases)."""
        self._done.wait()
        if self._exception is not None:
            raise self._exception
        return self._value


class RewardScorer:
    """Scores responses with the run's rewards in the controller or in a process pool.

    Args:
        rewards: the rewards (:class:`~mcore_rl.rewards.RewardComponent`, from
            :func:`~mcore_rl.rewards.reward_components`), or one reward function
            (:data:`mcore_rl.rewards.RewardFn`, weight 1); module-level functions (the pool's
            spawned processes import them by name).
        num_workers: pool processes (``reward.num_workers``) for the plain rewards; 0 scores
            in the calling process (no deadline beyond the verifier's own).
        timeout_seconds: hard per-sample deadline in the pool, and of each async call
            (``reward.timeout_seconds``).

    A sample's reward is the weighted sum of its rewards' scores
    (:func:`~mcore_rl.rewards.weighted_total`); each reward's own scores come with it
    (:meth:`PendingRewards.components`). Errors count each (sample, reward) that failed.

    Raises:
        ValueError: ``num_workers < 0`` or ``timeout_seconds <= 0``.
    """

    def __init__(self, rewards: Union[RewardFn, Sequence[RewardComponent]], num_workers: int = 0,
                 timeout_seconds: float = 10.0):
        self.components: List[RewardComponent] = (
            list(rewards) if isinstance(rewards, (list, tuple))
            else [RewardComponent("reward", rewards, 1.0, "reward/reward")])
        self.weights = [c.weight for c in self.components]
        # The plain rewards (their indices), scored in the pool when there is one.
        self.pooled = [k for k, c in enumerate(self.components) if c.style == SYNC]
        self.num_workers = num_workers
        if self.num_workers < 0:
            raise ValueError(f"reward.num_workers={num_workers}: expected >= 0")
        if timeout_seconds <= 0:
            raise ValueError(f"reward.timeout_seconds={timeout_seconds}: expected > 0")
        self.timeout_seconds = float(timeout_seconds)
        self._pool: Optional[cf.ProcessPoolExecutor] = None
        self._lock = threading.Lock()  # one scoring job drives the pool at a time
        self.pools_made = 0  # pools created so far (1 + restarts after a hang or a dead worker)

    # ------------------------------------------------------------------ pool
    def _new_pool(self) -> cf.ProcessPoolExecutor:
        self._kill_pool()
        self._pool = cf.ProcessPoolExecutor(self.num_workers,
                                            mp_context=multiprocessing.get_context("spawn"))
        self.pools_made += 1
        # Spawning and importing (torch, sympy) takes seconds: done before any deadline runs.
        cf.wait([self._pool.submit(_ready) for _ in range(self.num_workers)])
        return self._pool

    def _kill_pool(self) -> None:
        """Kill the pool's processes (a hung verifier ignores everything else) and drop it."""
        pool, self._pool = self._pool, None
        kill_process_pool(pool)

    def warm_up(self, background: bool = False) -> None:
        """Start the pool's processes now (spawn and imports take seconds), so the first
        step does not wait for them; in a thread of its own with ``background`` (a scoring
        call waits for it). Nothing with ``num_workers=0``."""
        def start():
            with self._lock:
                if self._pool is None:
                    self._new_pool()

        if self.num_workers and self.pooled:
            if background:
                threading.Thread(target=start, name="reward-pool-start", daemon=True).start()
            else:
                start()

    def close(self) -> None:
        """Stop the pool (idempotent)."""
        with self._lock:
            self._kill_pool()

    # ------------------------------------------------------------------ scoring
    def score(self, responses: Sequence[str], examples: Sequence[Example]
              ) -> Tuple[torch.Tensor, int, float]:
        """:meth:`submit` and wait: ``(rewards [B] float32, num_errors, busy_seconds)``."""
        return self.submit(responses, examples).result()

    def submit(self, responses: Sequence[str], examples: Sequence[Example]) -> PendingRewards:
        """Start scoring ``B`` responses against their examples; returns at once (with
        ``num_workers=0`` the work is done before it returns).

        Raises:
            ValueError: ``responses`` and ``examples`` differ in length.
        """
        if len(responses) != len(examples):
            raise ValueError(f"score_responses: {len(responses)} responses for "
                             f"{len(examples)} examples")
        pending = PendingRewards()
        if not (self.num_workers and self.pooled):
            pending._set(*self._score(list(responses), list(examples), pool=False))
            return pending
        responses, examples = list(responses), list(examples)

        def job():
            try:
                with self._lock:
                    pending._set(*self._score(responses, examples, pool=True))
            except BaseException as e:  # surfaced by result()
                pending._set(exception=e)

        threading.Thread(target=job, name="reward-scoring", daemon=True).start()
        return pending

    def _score(self, responses: List[str], examples: List[Example], pool: bool
               ) -> Tuple[Tuple[torch.Tensor, int, float], None, Dict[str, torch.Tensor]]:
        """``((rewards, errors, busy seconds), no exception, components)`` for
        :meth:`PendingRewards._set`: the plain rewards in the pool with ``pool``, the others
        (all of them without) here."""
        start = time.perf_counter()
        here = [k for k in range(len(self.components)) if not (pool and k in self.pooled)]
        scores = score_components(self.components, responses, examples, self.timeout_seconds,
                                  only=here)
        busy = time.perf_counter() - start
        if pool:
            busy += self._run(responses, examples, scores)
        warn_errors(scores, len(responses))
        components = {c.metric: torch.tensor([row[k] for row in scores.values],
                                             dtype=torch.float32)
                      for k, c in enumerate(self.components)}
        return ((weighted_total(scores.values, self.weights), sum(scores.errors), busy), None,
                components)

    def _run(self, responses: List[str], examples: List[Example], scores: Scores) -> float:
        """Score the plain rewards in the pool into ``scores`` (at most ``num_workers`` samples
        in flight), enforce the deadlines, recover from hung and dead workers. Returns the
        seconds the rewards ran, summed over samples."""
        fns = tuple(self.components[k].fn for k in self.pooled)
        n = len(responses)
        busy = 0.0
        errors: Dict[int, str] = {}
        tries = [0] * n
        todo = list(range(n - 1, -1, -1))  # a stack, popped from the end: index order
        in_flight: Dict[cf.Future, Tuple[int, float]] = {}  # future -> (sample, deadline)
        suspects: set = set()  # in flight when a worker died: tried again alone
        pool = self._pool or self._new_pool()
        while todo or in_flight:
            while todo and len(in_flight) < self.num_workers:
                if in_flight and (todo[-1] in suspects
                                  or any(j in suspects for j, _ in in_flight.values())):
                    break  # a suspect runs alone
                i = todo.pop()
                try:
                    fut = pool.submit(_score_one, fns, responses[i], examples[i])
                except BrokenProcessPool:  # a worker died while idle (between calls, say)
                    todo.append(i)
                    pool = self._new_pool()
                    continue
                tries[i] += 1
                in_flight[fut] = (i, time.monotonic() + self.timeout_seconds)
                if i in suspects:
                    break
            wait_for = max(0.0, min(d for _, d in in_flight.values()) - time.monotonic())
            done, _ = cf.wait(in_flight, timeout=wait_for, return_when=cf.FIRST_COMPLETED)
            broken = False
            for fut in done:
                i, _ = in_flight.pop(fut)
                try:
                    values, row_errors, seconds = fut.result()
                    busy += seconds
                    for k, value, error in zip(self.pooled, values, row_errors):
                        scores.values[i][k] = value
                        if error is not None:
                            scores.fail(i, k, examples[i].source, error)
                except BrokenProcessPool:
                    broken = True
                    suspects.add(i)
                    self._retry_or_fail(i, tries, todo, errors, "its worker process died")
            now = time.monotonic()
            hung = [f for f, (_, d) in in_flight.items() if d <= now and not f.done()]
            for fut in hung:
                i, _ = in_flight.pop(fut)
                errors[i] = f"no result within reward.timeout_seconds={self.timeout_seconds:g}"
                busy += self.timeout_seconds
            if hung or broken:
                # The other samples in flight go back to the queue of a new pool; after a
                # break they are suspects and spend a try, after a hang they do not.
                for fut, (i, _) in in_flight.items():
                    if broken:
                        suspects.add(i)
                        self._retry_or_fail(i, tries, todo, errors, "its worker process died")
                    else:
                        tries[i] -= 1
                        todo.append(i)
                in_flight.clear()
                pool = self._new_pool()
        for i in sorted(errors):  # hung, or lost with a worker: every plain reward of it
            for k in self.pooled:
                scores.fail(i, k, examples[i].source, errors[i])
        return busy

    @staticmethod
    def _retry_or_fail(i: int, tries: List[int], todo: List[int], errors: Dict[int, str],
                       why: str) -> None:
        if tries[i] >= MAX_TRIES:
            errors[i] = f"{why} ({tries[i]} tries)"
        else:
            todo.append(i)

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
A rollout can also be scored while it is decoded (:meth:`RewardScorer.open`, a
:class:`StreamingRewards`): rows go to the pool as the rollout backend finishes them, so after
generation only the last rows are left to score (``reward.score_while_decoding``).

Each process of the pool imports the rewards and runs their ``warm_up`` (a plain reward's
optional attribute: a function of no arguments, :func:`mcore_rl.rewards.math.warm_up`) when it
starts, before it takes a sample, then freezes the garbage collector's view of what it holds
(:func:`gc.freeze`). A verifier's first use of a code path (math-verify's LaTeX parser, SymPy's
numeric comparison: 20-400 ms each, against under 10 ms a response after it) would otherwise
land on some sample of a later step, in each process, and that sample's scoring is the wait
after generation (bench/reward_wait.py); a full collection over the imported modules (~150 ms)
would be another such pause, frozen it scans none of them.

Each sample runs in a worker's main thread, so math-verify's own ``signal.alarm`` timeouts work
there. The samples waiting when a worker is free go to it in one task of up to :data:`MAX_CHUNK`
(the waiting samples spread over the free workers): a task a sample cost the controller's threads
0.1-0.2 ms of CPU each (bench/RESULTS.md), beside the step's decoding and training batches. On top
of that every sample has a hard deadline of ``timeout_seconds``: a task's is the sum of its
samples' (handed to an idle worker: at most ``num_workers`` tasks are in flight at once, so handing
over is starting), and a sample whose own seconds passed its limit scores 0 and counts an error; a
task past its deadline has its pool's processes killed, a new pool takes the other tasks, and a
one-sample task's sample scores 0 and counts an error, while the samples of a longer one are tried
again each alone (which of them hung is not known). A worker that dies (``os._exit``, a segfault,
the OOM killer) breaks the pool; a new pool is made and the samples that were in flight (suspects)
are tried once more, each alone in the pool, so a sample that breaks it again is the one that kills
its worker: it scores 0 and counts an error, and the samples that were beside it are not charged a
second break. Nothing of this stops the run.
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import multiprocessing
import os
import sys
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
# The most samples one pool task scores (module docstring).
MAX_CHUNK = 8


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


def _start_worker(fns: Tuple[Callable, ...], warm: bool) -> None:
    """Pool initializer (each process, once, before its first task): ``fns`` are imported by
    unpickling them; with ``warm`` each one's ``warm_up`` attribute (when it has one) is called,
    and then what the process holds is frozen out of the garbage collector's full collections
    (:func:`gc.freeze`). A ``warm_up`` that raises is reported on stderr and skipped: the
    process scores as without it (an initializer that raised would break the pool)."""
    if not warm:
        return
    for fn in fns:
        warm_up = getattr(fn, "warm_up", None)
        if warm_up is None:
            continue
        try:
            warm_up()
        except Exception as e:  # noqa: BLE001 (an optimisation only)
            print(f"mcore_rl reward pool: {getattr(fn, '__qualname__', fn)}.warm_up raised "
                  f"{e!r}; scoring without it", file=sys.stderr, flush=True)
    gc.collect()
    gc.freeze()


def _ready() -> int:
    """Pool task that does nothing: a worker has spawned, imported the rewards and warmed them
    up (:func:`_start_worker`)."""
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


def _score_chunk(fns: Tuple[Callable, ...], responses: List[str], examples: List[Example]
                 ) -> List[Tuple[List[float], List[Optional[str]], float]]:
    """Pool task: :func:`_score_one` of each sample, in order."""
    return [_score_one(fns, r, e) for r, e in zip(responses, examples)]


def _take(todo: List[int], suspects: set, free: int) -> List[int]:
    """The next task's samples, popped from the end of the stack ``todo``: a suspect alone,
    else up to :data:`MAX_CHUNK` samples that are not suspects, ``len(todo) / free`` of them
    (the waiting samples spread over the ``free`` workers)."""
    if todo[-1] in suspects:
        return [todo.pop()]
    size = max(1, min(MAX_CHUNK, len(todo) // max(1, free)))
    chunk: List[int] = []
    while todo and len(chunk) < size and todo[-1] not in suspects:
        chunk.append(todo.pop())
    return chunk


class PendingRewards:
    """Rewards being computed; :meth:`result` waits for them."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Optional[Tuple[torch.Tensor, int, float]] = None
        self._components: Dict[str, torch.Tensor] = {}
        self._values: List[List[float]] = []
        self._exception: Optional[BaseException] = None

    def _set(self, value=None, exception=None, components=None, values=None) -> None:
        self._value, self._exception = value, exception
        self._components, self._values = components or {}, values or []
        self._done.set()

    def components(self) -> Dict[str, torch.Tensor]:
        """Each reward's own scores, unweighted: its :attr:`RewardComponent.metric`
        (``reward/<name>``) -> ``[B]`` float32 (0 where it failed); waits like
        :meth:`result`."""
        self.result()
        return self._components

    def values(self) -> List[List[float]]:
        """``[B][K]`` each sample's score from each of the ``K`` rewards, unweighted, as the
        rewards returned them (Python floats, 0 where one failed; what the weighted sum is
        taken of: :func:`~mcore_rl.rewards.weighted_total`); waits like :meth:`result`."""
        self.result()
        return self._values

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
        warm_workers: each pool process runs the plain rewards' ``warm_up`` when it starts
            (module docstring); False: they are imported, not warmed up (to measure without
            it: bench/reward_wait.py).

    A sample's reward is the weighted sum of its rewards' scores
    (:func:`~mcore_rl.rewards.weighted_total`); each reward's own scores come with it
    (:meth:`PendingRewards.components`). Errors count each (sample, reward) that failed.

    Raises:
        ValueError: ``num_workers < 0`` or ``timeout_seconds <= 0``.
    """

    def __init__(self, rewards: Union[RewardFn, Sequence[RewardComponent]], num_workers: int = 0,
                 timeout_seconds: float = 10.0, warm_workers: bool = True):
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
        self.warm_workers = warm_workers
        self._pool: Optional[cf.ProcessPoolExecutor] = None
        self._lock = threading.Lock()  # one scoring job drives the pool at a time
        self.pools_made = 0  # pools created so far (1 + restarts after a hang or a dead worker)

    # ------------------------------------------------------------------ pool
    def _new_pool(self) -> cf.ProcessPoolExecutor:
        self._kill_pool()
        fns = tuple(self.components[k].fn for k in self.pooled)
        self._pool = cf.ProcessPoolExecutor(self.num_workers,
                                            mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_start_worker,
                                            initargs=(fns, self.warm_workers))
        self.pools_made += 1
        # Spawning, importing (torch, sympy) and warming up take seconds: done before any
        # deadline runs (num_workers tasks at once spawn every process; a process takes tasks
        # only once warm, so the pool's first answers come from warm processes).
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

    def _score(self, responses: List[str], examples: List[Example], pool: bool) -> tuple:
        """``((rewards, errors, busy seconds), no exception, components, values)`` for
        :meth:`PendingRewards._set`: the plain rewards in the pool with ``pool``, the others
        (all of them without) here."""
        start = time.perf_counter()
        here = [k for k in range(len(self.components)) if not (pool and k in self.pooled)]
        scores = score_components(self.components, responses, examples, self.timeout_seconds,
                                  only=here)
        busy = time.perf_counter() - start
        if pool:
            busy += self._run(responses, examples, scores)
        return self._finish(scores, busy)

    def _finish(self, scores: Scores, busy: float) -> tuple:
        """What :meth:`PendingRewards._set` takes for the finished ``scores`` (a warning first
        when some failed)."""
        warn_errors(scores, len(scores.values))
        components = {c.metric: torch.tensor([row[k] for row in scores.values],
                                             dtype=torch.float32)
                      for k, c in enumerate(self.components)}
        return ((weighted_total(scores.values, self.weights), sum(scores.errors), busy), None,
                components, scores.values)

    def open(self, examples: Sequence[Example]) -> "StreamingRewards":
        """Start scoring a rollout whose ``B`` responses come in pieces (rows scored as the
        decoder finishes them, while the rest decode): :meth:`StreamingRewards.add` each piece,
        :meth:`StreamingRewards.close` once all have come, then ``result()`` as for
        :meth:`submit`. The rewards are those :meth:`submit` gives for the same responses
        (docs/design.md, "Rollout floor").

        Args:
            examples: the ``B`` examples the responses will answer, in row order.
        """
        return StreamingRewards(self, list(examples))

    def _run(self, responses: List[str], examples: List[Example], scores: Scores,
             feed: Optional["_Feed"] = None,
             on_scored: Optional[Callable[[], None]] = None) -> float:
        """Score the plain rewards in the pool into ``scores`` (at most ``num_workers`` tasks in
        flight, each of up to :data:`MAX_CHUNK` samples), enforce the deadlines, recover from
        hung and dead workers (module docstring). Returns the seconds the rewards ran, summed
        over samples. With ``feed``, the samples to score are those its :meth:`_Feed.put`
        hands over (``responses[i]`` set before), in that order, until it is closed; without,
        all of them. ``on_scored`` is called for each sample whose result came back."""
        fns = tuple(self.components[k].fn for k in self.pooled)
        n = len(responses)
        busy = 0.0
        errors: Dict[int, str] = {}
        tries = [0] * n
        # a stack, popped from the end: index order
        todo = list(range(n - 1, -1, -1)) if feed is None else []
        closed = feed is None
        in_flight: Dict[cf.Future, Tuple[List[int], float]] = {}  # future -> (samples, deadline)
        suspects: set = set()  # in flight when a worker died: tried again alone
        pool = self._pool or self._new_pool()
        while todo or in_flight or not closed:
            if not closed:
                new, closed = feed.take()
                todo[:0] = new[::-1]  # after those waiting: arrival order
                if not (todo or in_flight):
                    feed.wait()
                    continue
            while todo and len(in_flight) < self.num_workers:
                if in_flight and (todo[-1] in suspects or any(
                        j in suspects for chunk, _ in in_flight.values() for j in chunk)):
                    break  # a suspect runs alone
                chunk = _take(todo, suspects, self.num_workers - len(in_flight))
                try:
                    fut = pool.submit(_score_chunk, fns, [responses[i] for i in chunk],
                                      [examples[i] for i in chunk])
                except BrokenProcessPool:  # a worker died while idle (between calls, say)
                    todo.extend(reversed(chunk))
                    pool = self._new_pool()
                    continue
                for i in chunk:
                    tries[i] += 1
                in_flight[fut] = (chunk, time.monotonic() + self.timeout_seconds * len(chunk))
                if chunk[0] in suspects:
                    break
            wait_for = max(0.0, min(d for _, d in in_flight.values()) - time.monotonic())
            arrivals = [] if closed else [feed.signal]  # new samples wake the wait too
            done, _ = cf.wait([*in_flight, *arrivals], timeout=wait_for,
                              return_when=cf.FIRST_COMPLETED)
            broken = False
            for fut in done:
                if fut not in in_flight:  # the feed's signal
                    continue
                chunk, _ = in_flight.pop(fut)
                try:
                    results = fut.result()
                except BrokenProcessPool:
                    broken = True
                    for i in chunk:
                        suspects.add(i)
                        self._retry_or_fail(i, tries, todo, errors, "its worker process died")
                    continue
                for i, (values, row_errors, seconds) in zip(chunk, results):
                    if seconds > self.timeout_seconds:  # past its own limit: as if alone
                        errors[i] = self._late
                        busy += self.timeout_seconds
                        continue
                    busy += seconds
                    for k, value, error in zip(self.pooled, values, row_errors):
                        scores.values[i][k] = value
                        if error is not None:
                            scores.fail(i, k, examples[i].source, error)
                    if on_scored is not None:
                        on_scored()
            now = time.monotonic()
            hung = [f for f, (_, d) in in_flight.items() if d <= now and not f.done()]
            for fut in hung:
                chunk, _ = in_flight.pop(fut)
                if len(chunk) == 1:
                    errors[chunk[0]] = self._late
                    busy += self.timeout_seconds
                    continue
                for i in chunk:  # which one hung is not known: each is tried again alone
                    tries[i] -= 1
                    suspects.add(i)
                    todo.append(i)
            if hung or broken:
                # The other samples in flight go back to the queue of a new pool; after a
                # break they are suspects and spend a try, after a hang they do not.
                for fut, (chunk, _) in in_flight.items():
                    for i in chunk:
                        if broken:
                            suspects.add(i)
                            self._retry_or_fail(i, tries, todo, errors,
                                                "its worker process died")
                        else:
                            tries[i] -= 1
                            todo.append(i)
                in_flight.clear()
                pool = self._new_pool()
        for i in sorted(errors):  # hung, or lost with a worker: every plain reward of it
            for k in self.pooled:
                scores.fail(i, k, examples[i].source, errors[i])
        return busy

    @property
    def _late(self) -> str:
        """A sample's error past its deadline."""
        return f"no result within reward.timeout_seconds={self.timeout_seconds:g}"

    @staticmethod
    def _retry_or_fail(i: int, tries: List[int], todo: List[int], errors: Dict[int, str],
                       why: str) -> None:
        if tries[i] >= MAX_TRIES:
            errors[i] = f"{why} ({tries[i]} tries)"
        else:
            todo.append(i)


class _Feed:
    """Sample indices handed to a scoring job as they arrive (:meth:`RewardScorer._run`):
    :meth:`put` and :meth:`close` on one side; :meth:`take`, :meth:`wait` and :attr:`signal`
    (a future set when something arrived or the feed closed) on the other."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._new: List[int] = []
        self._closed = False
        self.signal: cf.Future = cf.Future()

    def put(self, indices: Sequence[int]) -> None:
        with self._lock:
            self._new.extend(indices)
            if not self.signal.done():
                self.signal.set_result(None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if not self.signal.done():
                self.signal.set_result(None)

    def take(self) -> Tuple[List[int], bool]:
        """``(indices arrived since the last call, whether the feed is closed)``; a new
        :attr:`signal` while it is open."""
        with self._lock:
            new, self._new = self._new, []
            if not self._closed:
                self.signal = cf.Future()
            return new, self._closed

    def wait(self) -> None:
        """Until something arrives or the feed closes (at once if either happened since the
        last :meth:`take`)."""
        self.signal.result()


class StreamingRewards(PendingRewards):
    """The rewards of one rollout scored as its responses arrive (:meth:`RewardScorer.open`).

    :meth:`add` hands over responses by row; each plain reward scores them at once, in the
    reward pool (one job thread feeds it for the whole rollout, at most ``num_workers`` tasks
    in flight, deadlines and dead workers as in :meth:`RewardScorer.submit`) or, without a
    pool, in the calling thread. The async and batched rewards score the whole rollout at
    :meth:`close` (a batched reward's numbers may depend on its batch: it gets the batch
    :meth:`RewardScorer.submit` would give it). :meth:`result` then gives the rewards, errors and
    busy seconds :meth:`RewardScorer.submit` gives for the same responses (the scores are the
    same; the first error logged may be another one).

    Attributes:
        early_fraction: after :meth:`close`, the fraction of samples whose plain rewards were
            scored before it was called (how much scoring overlapped generation), or None
            before it and when there is no plain reward.
    """

    def __init__(self, scorer: RewardScorer, examples: List[Example]):
        super().__init__()
        self._scorer, self._examples = scorer, examples
        n, k = len(examples), len(scorer.components)
        self._texts: List[Optional[str]] = [None] * n
        self._scores = Scores([[0.0] * k for _ in range(n)], [0] * k)
        self._busy = 0.0
        self._scored = 0  # samples whose plain rewards are done
        self._count_lock = threading.Lock()
        self._closed = False
        self.early_fraction: Optional[float] = None
        self._feed: Optional[_Feed] = None
        if scorer.num_workers and scorer.pooled:
            self._feed = _Feed()
            threading.Thread(target=self._pool_job, name="reward-scoring", daemon=True).start()

    def add(self, rows: Sequence[int], texts: Sequence[str]) -> None:
        """Responses ``texts`` (decoded) of rows ``rows`` of the rollout; scored now.

        Raises:
            ValueError: a row outside the rollout or already added, lengths differ, or after
                :meth:`close`.
        """
        if self._closed or len(rows) != len(texts):
            raise ValueError(f"StreamingRewards.add: {len(rows)} rows for {len(texts)} texts"
                             + (" after close()" if self._closed else ""))
        for row, text in zip(rows, texts):
            if not 0 <= row < len(self._texts) or self._texts[row] is not None:
                raise ValueError(f"StreamingRewards.add: row {row} outside [0, "
                                 f"{len(self._texts)}) or added twice")
            self._texts[row] = text
        if self._feed is not None:
            self._feed.put(list(rows))
            return
        self._score_here(list(rows), self._scorer.pooled)
        self._scored += len(rows)

    def close(self) -> None:
        """Every row has been added: the async and batched rewards score the rollout, and
        :meth:`result` returns once all are done.

        Raises:
            ValueError: rows never added (the pool's job is stopped first).
        """
        missing = [i for i, t in enumerate(self._texts) if t is None]
        if missing:
            self.cancel()
            raise ValueError(f"StreamingRewards.close: rows {missing[:8]} were never added "
                             f"({len(missing)} of {len(self._texts)})")
        with self._count_lock:
            self._closed = True
            if self._scorer.pooled:
                self.early_fraction = self._scored / max(1, len(self._texts))
        if self._feed is not None:
            self._feed.close()  # the job thread scores the rest, then the others
            return
        try:
            self._set(*self._rest())
        except BaseException as e:  # noqa: BLE001 (surfaced by result())
            self._set(exception=e)

    def cancel(self) -> None:
        """Give up (generation failed): stop the pool's job; :meth:`result` raises."""
        self._closed = True
        if self._feed is not None:
            self._feed.close()
        else:
            self._set(exception=RuntimeError("StreamingRewards: cancelled before close()"))

    # ------------------------------------------------------------------ internals
    def _score_here(self, rows: List[int], only: List[int]) -> None:
        """Score ``rows`` with the rewards ``only`` in this thread, into the rollout's scores."""
        if not rows or not only:
            return
        start = time.perf_counter()
        scorer = self._scorer
        part = score_components(scorer.components, [self._texts[i] for i in rows],
                                [self._examples[i] for i in rows], scorer.timeout_seconds,
                                only=only)
        self._busy += time.perf_counter() - start
        scores = self._scores
        for j, row in enumerate(rows):
            for k in only:
                scores.values[row][k] = part.values[j][k]
        for k in only:
            scores.errors[k] += part.errors[k]
        scores.failed_rows.update(rows[j] for j in part.failed_rows)
        if scores.first_error is None:
            scores.first_error = part.first_error

    def _rest(self):
        """Score the rewards not scored as rows came (async, batched) over the whole rollout;
        the finished result for :meth:`PendingRewards._set`."""
        scorer = self._scorer
        rest = [k for k in range(len(scorer.components)) if k not in scorer.pooled]
        self._score_here(list(range(len(self._texts))), rest)
        return scorer._finish(self._scores, self._busy)

    def _pool_job(self) -> None:
        scorer = self._scorer

        try:
            with scorer._lock:
                self._busy += scorer._run(self._texts, self._examples, self._scores, self._feed,
                                          on_scored=self._count)
                if any(t is None for t in self._texts):  # cancelled
                    raise RuntimeError("StreamingRewards: cancelled before close()")
                self._set(*self._rest())
        except BaseException as e:  # noqa: BLE001 (surfaced by result())
            self._set(exception=e)

    def _count(self) -> None:
        with self._count_lock:
            if not self._closed:
                self._scored += 1

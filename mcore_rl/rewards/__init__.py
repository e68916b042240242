"""Rewards: verifiers and the user's own reward functions, alone or weighted.

A reward function scores one response: ``(response_text, example) -> float``, with the data
set's extra columns in ``example.fields``. Two other styles serve remote scorers and models:
an ``async def`` function (its calls of a step awaited together, :data:`ASYNC_CONCURRENCY` at a
time, each within ``reward.timeout_seconds``), and a batched one, marked ``batched = True``
(:func:`batched`), that takes a step's ``(responses, examples)`` and returns their floats. A
plain function may carry a ``warm_up`` attribute, a function of no arguments that each process
of the reward pool calls once when it starts (:mod:`mcore_rl.rewards.pool`): what the reward
builds on first use is then built before the first step (``"math"``'s:
:func:`mcore_rl.rewards.math.warm_up`).

Built in (chosen by name from the ``VERIFIERS`` table of :mod:`mcore_rl.config.registry`):
``"exact"`` (:func:`~mcore_rl.rewards.exact.exact_reward`, the synthetic task) and ``"math"``
(:func:`~mcore_rl.rewards.math.math_reward`, GSM8K); a user's function by its import path
(``reward.name=my_pkg.rewards:score``). Several are summed with weights (``reward.names``,
``reward.weights``: :func:`reward_components`), each one also logged as ``reward/<name>``
(:attr:`RewardComponent.metric`); one of them may be a learned reward (``model``, ``judge``),
scored and weighted in by :mod:`mcore_rl.controller.learned_rewards`. A sample whose reward raises scores 0 for that reward and is
counted (``train/reward_errors``); the run goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import inspect
import logging
from typing import Any, Callable, Collection, List, Optional, Sequence, Set, Tuple

import torch

from mcore_rl.config.checks import ConfigError
from mcore_rl.config.plugins import one_line
from mcore_rl.config.registry import VERIFIERS, is_import_path, load, path_of
from mcore_rl.data.example import Example

logger = logging.getLogger("mcore_rl.rewards")

RewardFn = Callable[[str, Example], float]

# Reward styles (reward_style): a plain function, an `async def` one, a batched one.
SYNC, ASYNC, BATCHED = "sync", "async", "batched"
# Calls of one async reward in flight at once (a remote scorer's connections).
ASYNC_CONCURRENCY = 64


def batched(fn: Callable) -> Callable:
    """Mark ``fn`` as a batched reward, ``(responses: List[str], examples: List[Example]) ->
    Sequence[float]`` (one call per step's samples); the same as ``fn.batched = True``."""
    fn.batched = True
    return fn


def reward_style(fn: Callable) -> str:
    """:data:`BATCHED` when ``fn.batched`` is true, :data:`ASYNC` for a coroutine function (or
    an object whose ``__call__`` is one), else :data:`SYNC`."""
    if getattr(fn, "batched", False):
        return BATCHED
    call = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else getattr(fn, "__call__", fn)
    return ASYNC if inspect.iscoroutinefunction(call) else SYNC


def get_reward_fn(name: str) -> RewardFn:
    """The reward called ``name``: a ``VERIFIERS`` entry of :mod:`mcore_rl.config.registry`, or
    the function a ``"module:attribute"`` import path names.

    Raises:
        ValueError: neither (the message names ``reward.name`` and the choices); ImportError or
            AttributeError from an import path (the config load reports those first, one line
            each: :mod:`mcore_rl.config.plugins`).
    """
    path = path_of(VERIFIERS, name)
    if path is None:
        raise ValueError(f"reward.name={name!r}: expected one of {sorted(VERIFIERS)} or a "
                         f"'module:attribute' import path")
    return load(path)


@dataclasses.dataclass(frozen=True)
class RewardComponent:
    """One reward of the run.

    Attributes:
        name: as the config gives it (``"math"``, ``"my_pkg.rewards:format_bonus"``).
        fn: the reward function (module-level: the pool's processes import it by name).
        weight: its weight in the sum.
        metric: its logged key, ``reward/<short name>`` (a built-in's name, an import path's
            attribute; the whole path, ``.`` for ``:``, where two would clash).
    """

    name: str
    fn: Callable
    weight: float = 1.0
    metric: str = ""

    @property
    def style(self) -> str:
        """:func:`reward_style` of :attr:`fn`."""
        return reward_style(self.fn)


def weighted_names(reward: Any) -> List[Tuple[str, float, str]]:
    """``(name, weight, metric)`` of each reward of the ``reward`` config section
    (:class:`~mcore_rl.config.schema.RewardConfig`), in order: ``reward.names`` (else
    ``reward.name``) with ``reward.weights`` (else 1 each) and the logged key
    ``reward/<short name>`` (:attr:`RewardComponent.metric`). Learned rewards (``model``,
    ``judge``) included: nothing is resolved here.

    Raises:
        ValueError: weights not one per reward (the config load reports that first).
    """
    names = list(reward.names) if reward.names is not None else [reward.name]
    weights = list(reward.weights) if reward.weights is not None else [1.0] * len(names)
    if len(weights) != len(names):
        raise ValueError(f"reward.weights: {len(weights)} weights for {len(names)} rewards")
    short = [n.rpartition(":")[2].rpartition(".")[2] if is_import_path(n) else n for n in names]
    metrics = [s if short.count(s) == 1 else n.replace(":", ".") for s, n in zip(short, names)]
    return [(n, float(w), f"reward/{m}") for n, w, m in zip(names, weights, metrics)]


def reward_components(reward: Any, exclude: Collection[str] = ()) -> List[RewardComponent]:
    """The rewards of the ``reward`` config section (:func:`weighted_names`), functions
    resolved by :func:`get_reward_fn`, leaving out the names in ``exclude`` (a learned reward,
    scored elsewhere: :mod:`mcore_rl.controller.learned_rewards`).

    Raises:
        ValueError: as :func:`get_reward_fn` and :func:`weighted_names`.
    """
    return [RewardComponent(n, get_reward_fn(n), w, m)
            for n, w, m in weighted_names(reward) if n not in exclude]


@dataclasses.dataclass
class Scores:
    """What :func:`score_components` found.

    Attributes:
        values: ``[B][K]`` each sample's score from each of the ``K`` rewards (0 where it
            failed).
        errors: ``[K]`` the samples each reward failed on (raised, timed out, returned no
            number).
        first_error: ``(source of the example, what happened)`` of the first failure, or None.
        failed_rows: the samples some reward failed on.
    """

    values: List[List[float]]
    errors: List[int]
    first_error: Optional[Tuple[str, str]] = None
    failed_rows: Set[int] = dataclasses.field(default_factory=set)

    def fail(self, row: int, k: int, source: str, error: str) -> None:
        """Sample ``row`` scored 0 by reward ``k``, counted, ``error`` kept if it is the
        first."""
        self.values[row][k] = 0.0
        self.errors[k] += 1
        self.failed_rows.add(row)
        if self.first_error is None:
            self.first_error = (source, error)


def weighted_total(values: Sequence[Sequence[float]], weights: Sequence[float]) -> torch.Tensor:
    """``[B]`` float32: ``sum_k weights[k] * values[b][k]`` per sample (summed in Python
    floats, then rounded once; one reward of weight 1 is its own scores exactly)."""
    return torch.tensor([sum(w * v for w, v in zip(weights, row)) for row in values],
                        dtype=torch.float32)


def _score_sync(fn: Callable, responses: Sequence[str], examples: Sequence[Example],
                k: int, scores: Scores) -> None:
    for row, (response, example) in enumerate(zip(responses, examples)):
        try:
            scores.values[row][k] = float(fn(response, example))
        except Exception as e:  # a verifier bug or odd input must not stop training
            scores.fail(row, k, example.source, repr(e))


def _score_batched(fn: Callable, responses: Sequence[str], examples: Sequence[Example],
                   k: int, scores: Scores) -> None:
    try:
        out = [float(v) for v in fn(list(responses), list(examples))]
        if len(out) != len(responses):
            raise ValueError(f"returned {len(out)} scores for {len(responses)} responses")
    except Exception as e:  # every sample of the call failed
        for row, example in enumerate(examples):
            scores.fail(row, k, example.source, repr(e))
        return
    for row, value in enumerate(out):
        scores.values[row][k] = value


def run_coroutine(make: Callable[[], Any]) -> Any:
    """``asyncio.run(make())``, in a thread of its own when this one already runs an event
    loop (a notebook, an async caller)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with cf.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


def _score_async(fn: Callable, responses: Sequence[str], examples: Sequence[Example],
                 k: int, scores: Scores, timeout: Optional[float]) -> None:
    async def one(row: int, gate: asyncio.Semaphore) -> None:
        async with gate:
            try:
                value = await asyncio.wait_for(fn(responses[row], examples[row]), timeout)
                scores.values[row][k] = float(value)
            except asyncio.TimeoutError:
                scores.fail(row, k, examples[row].source,
                            f"no result within reward.timeout_seconds={timeout:g}")
            except Exception as e:
                scores.fail(row, k, examples[row].source, repr(e))

    async def all_rows() -> None:
        gate = asyncio.Semaphore(ASYNC_CONCURRENCY)
        await asyncio.gather(*(one(row, gate) for row in range(len(responses))))

    run_coroutine(all_rows)


def score_components(components: Sequence[RewardComponent], responses: Sequence[str],
                     examples: Sequence[Example], timeout_seconds: Optional[float] = None,
                     scores: Optional[Scores] = None,
                     only: Optional[Sequence[int]] = None) -> Scores:
    """Score each response against its example with each reward, in this process (the reward
    pool, :mod:`mcore_rl.rewards.pool`, sends the plain ones to its processes instead).

    Args:
        components: the ``K`` rewards.
        responses: ``B`` decoded responses.
        examples: the ``B`` examples they answer.
        timeout_seconds: each async call's deadline (None: none); plain and batched calls have
            none here.
        scores: fill these (``[B][K]``) rather than new ones.
        only: the indices of the components to score (default: all).

    Returns:
        the :class:`Scores`; a failed sample scores 0 for that reward and is counted.
    """
    if scores is None:
        scores = Scores([[0.0] * len(components) for _ in responses], [0] * len(components))
    for k in range(len(components)) if only is None else only:
        fn, style = components[k].fn, components[k].style
        if style == BATCHED:
            _score_batched(fn, responses, examples, k, scores)
        elif style == ASYNC:
            _score_async(fn, responses, examples, k, scores, timeout_seconds)
        else:
            _score_sync(fn, responses, examples, k, scores)
    return scores


def score_responses(fn: RewardFn, responses: Sequence[str],
                    examples: Sequence[Example]) -> Tuple[torch.Tensor, int]:
    """Score each response against its example with one reward function (any style).

    A sample whose verifier raises gets reward 0 and is counted; the call then logs one
    warning (logger ``mcore_rl.rewards``) with the count and the first error, and training
    goes on.

    Args:
        fn: the verifier.
        responses: ``B`` decoded responses.
        examples: the ``B`` examples they answer (a prompt's example repeated per generation).

    Returns:
        ``(rewards, num_errors)``: rewards ``[B]`` float32 on CPU, and how many samples raised.

    Raises:
        ValueError: ``responses`` and ``examples`` differ in length.
    """
    if len(responses) != len(examples):
        raise ValueError(f"score_responses: {len(responses)} responses for "
                         f"{len(examples)} examples")
    scores = score_components([RewardComponent("reward", fn)], responses, examples)
    warn_errors(scores, len(responses))
    return weighted_total(scores.values, [1.0]), scores.errors[0]


def warn_errors(scores: Scores, num_samples: int) -> None:
    """One warning (logger ``mcore_rl.rewards``) with the failures' count and the first one;
    nothing when none failed."""
    if scores.first_error is not None:
        source, first = scores.first_error
        logger.warning("reward: %d of %d samples scored 0 by a reward (it raised, hung or was "
                       "lost with a worker); first error (%s): %s", len(scores.failed_rows),
                       num_samples, source, first)


@dataclasses.dataclass(frozen=True)
class WeightedReward:
    """Several rewards as one reward function, ``(response_text, example) -> float``: the
    weighted sum of :attr:`components` (what environments score with; the one-turn path
    scores them apart in the reward pool, :mod:`mcore_rl.rewards.pool`). Picklable when the
    functions are module-level. A reward that raises makes the call raise (an environment's
    step then fails and is counted)."""

    components: Tuple[RewardComponent, ...]

    def __call__(self, response: str, example: Example) -> float:
        total = 0.0
        for c in self.components:
            style = c.style
            if style == BATCHED:
                value = c.fn([response], [example])[0]
            elif style == ASYNC:
                value = run_coroutine(lambda: c.fn(response, example))
            else:
                value = c.fn(response, example)
            total += c.weight * float(value)
        return total


def build_reward(reward: Any) -> RewardFn:
    """The run's reward as one function (for environments): the function itself for one
    plain reward of weight 1 (``reward.name``, as before), else a :class:`WeightedReward` of
    :func:`reward_components`."""
    components = reward_components(reward)
    if len(components) == 1 and components[0].weight == 1.0 and components[0].style == SYNC:
        return components[0].fn
    return WeightedReward(tuple(components))


def check_on_example(components: Sequence[RewardComponent], example: Example) -> None:
    """Score ``example``'s reference solution with each reward once, before the run starts: a
    reward that raises on it, or returns no number, is a user error found at load rather than
    a run of zero rewards.

    Raises:
        ConfigError: one line naming the reward (its config name), the example and what it
            raised or returned.
    """
    for c in components:
        try:
            if c.style == BATCHED:
                out = list(c.fn([example.solution], [example]))
                if len(out) != 1:
                    raise ValueError(f"returned {len(out)} scores for 1 response")
                value = out[0]
            elif c.style == ASYNC:
                value = run_coroutine(lambda: c.fn(example.solution, example))
            else:
                value = c.fn(example.solution, example)
            float(value)
        except Exception as e:
            raise ConfigError(f"reward {c.name}: {getattr(c.fn, '__qualname__', c.fn)} raised on "
                              f"the first training example ({example.source}) given its "
                              f"reference solution: {one_line(e)}") from None

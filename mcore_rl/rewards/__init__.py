"""Reward verifiers: ``RewardFn(response_text, example) -> float`` and batch scoring.

Verifiers: ``"exact"`` (:func:`~mcore_rl.rewards.exact.exact_reward`, the synthetic task) and
``"math"`` (:func:`~mcore_rl.rewards.math.math_reward`, GSM8K), chosen by ``reward.name`` from
the ``VERIFIERS`` table of :mod:`mcore_rl.config.registry` (a new verifier: its module here and
one line there).
"""

from __future__ import annotations

import logging
from typing import Callable, List, Sequence, Tuple

import torch

from mcore_rl.config.registry import VERIFIERS, load
from mcore_rl.data.example import Example

logger = logging.getLogger("mcore_rl.rewards")

RewardFn = Callable[[str, Example], float]


def get_reward_fn(name: str) -> RewardFn:
    """The verifier called ``name`` (its ``VERIFIERS`` entry in :mod:`mcore_rl.config.registry`).

    Raises:
        ValueError: an unknown name (the message names ``reward.name`` and the choices).
    """
    if name not in VERIFIERS:
        raise ValueError(f"reward.name={name!r}: expected one of {sorted(VERIFIERS)}")
    return load(VERIFIERS[name])


def score_responses(fn: RewardFn, responses: Sequence[str],
                    examples: Sequence[Example]) -> Tuple[torch.Tensor, int]:
    """Score each response against its example.

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
    rewards: List[float] = []
    errors: List[Tuple[str, Exception]] = []
    for response, example in zip(responses, examples):
        try:
            rewards.append(float(fn(response, example)))
        except Exception as e:  # a verifier bug or odd input must not stop training
            errors.append((example.source, e))
            rewards.append(0.0)
    if errors:
        source, first = errors[0]
        logger.warning("reward: %d of %d samples raised and scored 0; first error (%s): %r",
                       len(errors), len(responses), source, first)
    return torch.tensor(rewards, dtype=torch.float32), len(errors)

"""The policy losses (config key ``loss.name``) and advantage estimators (``grpo.advantage_estimator``)
by name, imported only when used.

Adding one is a line in :data:`POLICY_LOSSES` or :data:`ADVANTAGE_ESTIMATORS`. The schema takes
the valid names from :func:`policy_loss_names` and :func:`advantage_estimator_names`, the config
loader runs :func:`config_errors`, and the controllers build a loss with
:func:`build_policy_loss` and look an estimator up with :func:`advantage_estimator`. This module
imports neither torch nor the schema at import time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, Dict, List, Tuple

if TYPE_CHECKING:
    import torch

    from mcore_rl.config.schema import TrainConfig

# name -> "module:class"; the class takes (LossConfig, max_response_length) and has
# ClippedPGLoss's interface (loss_type, metric_kinds, __call__).
POLICY_LOSSES: Dict[str, str] = {
    "ppo_clip": "mcore_rl.algorithms.losses:ClippedPGLoss",
    "gspo": "mcore_rl.algorithms.losses:GSPOLoss",
}

# name -> "module:function"; the function maps (rollout, TrainConfig) to [B, S] float32
# advantages (mcore_rl.algorithms.estimators).
ADVANTAGE_ESTIMATORS: Dict[str, str] = {
    "grpo": "mcore_rl.algorithms.estimators:grpo",
    "rloo": "mcore_rl.algorithms.estimators:rloo",
    "reinforce_plus_plus": "mcore_rl.algorithms.estimators:reinforce_plus_plus",
}


def policy_loss_names() -> Tuple[str, ...]:
    """The valid values of ``loss.name``."""
    return tuple(POLICY_LOSSES)


def advantage_estimator_names() -> Tuple[str, ...]:
    """The valid values of ``grpo.advantage_estimator``."""
    return tuple(ADVANTAGE_ESTIMATORS)


def _lookup(table: Dict[str, str], key: str, name: str):
    if name not in table:
        raise ValueError(f"{key}: unknown name {name!r}; choose one of {', '.join(table)}")
    module, _, attribute = table[name].partition(":")
    return getattr(importlib.import_module(module), attribute)


def build_policy_loss(cfg: "TrainConfig"):
    """The policy loss ``cfg.loss.name``, built from ``cfg.loss`` (and
    ``cfg.generation.max_new_tokens``, the constant of ``seq-mean-token-sum-norm``).

    Raises:
        ValueError: an unknown name (names ``loss.name``); ``ConfigError`` for a ``loss.*``
            value outside its declared bounds.
    """
    return _lookup(POLICY_LOSSES, "loss.name", cfg.loss.name)(
        cfg.loss, max_response_length=cfg.generation.max_new_tokens)


def advantage_estimator(name: str) -> Callable[[Dict[str, "torch.Tensor"], "TrainConfig"], "torch.Tensor"]:
    """The advantage estimator ``name`` (a value of ``grpo.advantage_estimator``).

    Raises:
        ValueError: an unknown name (names ``grpo.advantage_estimator``).
    """
    return _lookup(ADVANTAGE_ESTIMATORS, "grpo.advantage_estimator", name)


def config_errors(cfg: "TrainConfig") -> List[str]:
    """Combinations of ``loss.*`` and ``grpo.*`` keys no run can use, one message each naming
    its keys (the config loader's check): a reward KL without the estimator that reads it, an
    overlong buffer longer than the response budget."""
    g, out = cfg.grpo, []
    if cfg.algorithm == "grpo" and g.reward_kl_coef > 0 and g.advantage_estimator != "reinforce_plus_plus":
        out.append(f"grpo.reward_kl_coef ({g.reward_kl_coef}) is read by "
                   f"grpo.advantage_estimator=reinforce_plus_plus only (got "
                   f"{g.advantage_estimator!r}); use loss.kl_coef for a KL term in the loss")
    if g.overlong_buffer_length > cfg.generation.max_new_tokens:
        out.append(f"grpo.overlong_buffer_length ({g.overlong_buffer_length}) must be <= "
                   f"generation.max_new_tokens ({cfg.generation.max_new_tokens})")
    return out

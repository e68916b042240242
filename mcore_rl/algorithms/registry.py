"""The policy losses (config key ``loss.name``) and advantage estimators
(``grpo.advantage_estimator``), found by name in the plugin tables of
:mod:`mcore_rl.config.registry` (:data:`~mcore_rl.config.registry.POLICY_LOSSES`,
:data:`~mcore_rl.config.registry.ADVANTAGE_ESTIMATORS`), or by the ``"module:attribute"``
import path of the user's own, and imported only when used.

Adding one is its function or class in :mod:`mcore_rl.algorithms` plus one line in its table.
The schema takes the valid names from the tables; the controllers build a loss with
:func:`build_policy_loss` and look an estimator up with :func:`advantage_estimator`. This module
imports neither torch nor the schema at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, Tuple

from mcore_rl.config import registry as tables

if TYPE_CHECKING:
    import torch

    from mcore_rl.config.schema import TrainConfig

# The tables, by their names here (name -> "module:attribute" / an Estimator entry).
POLICY_LOSSES = tables.POLICY_LOSSES
ADVANTAGE_ESTIMATORS = tables.ADVANTAGE_ESTIMATORS


def policy_loss_names() -> Tuple[str, ...]:
    """The valid values of ``loss.name``."""
    return tables.names(POLICY_LOSSES)


def advantage_estimator_names() -> Tuple[str, ...]:
    """The valid values of ``grpo.advantage_estimator``."""
    return tables.names(ADVANTAGE_ESTIMATORS)


def _check_name(table: Dict, key: str, name: str) -> None:
    if name not in table and not tables.is_import_path(name):
        raise ValueError(f"{key}: unknown name {name!r}; choose one of {', '.join(table)} or a "
                         f"'module:attribute' import path")


def build_policy_loss(cfg: "TrainConfig"):
    """The policy loss ``cfg.loss.name`` (a table name or an import path), built from
    ``cfg.loss`` (and ``cfg.generation.max_new_tokens``, the constant of
    ``seq-mean-token-sum-norm``).

    Raises:
        ValueError: an unknown name (names ``loss.name``); ``ConfigError`` for a ``loss.*``
            value outside its declared bounds.
    """
    _check_name(POLICY_LOSSES, "loss.name", cfg.loss.name)
    return tables.load(tables.path_of(POLICY_LOSSES, cfg.loss.name))(
        cfg.loss, max_response_length=cfg.generation.max_new_tokens)


def advantage_estimator(name: str) -> Callable[[Dict[str, "torch.Tensor"], "TrainConfig"], "torch.Tensor"]:
    """The advantage estimator ``name`` (a value of ``grpo.advantage_estimator``: a table name
    or an import path).

    Raises:
        ValueError: an unknown name (names ``grpo.advantage_estimator``).
    """
    _check_name(ADVANTAGE_ESTIMATORS, "grpo.advantage_estimator", name)
    return tables.load(ADVANTAGE_ESTIMATORS[name].fn if name in ADVANTAGE_ESTIMATORS else name)

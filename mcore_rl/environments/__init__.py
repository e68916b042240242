"""Environments: episodes over data examples, stepped one model turn at a time (issue 24).

- :mod:`~mcore_rl.environments.base`: the contract (:class:`Environment`, :class:`StepResult`,
  :class:`EpisodeState`), after NeMo RL's environments and verl's agent loop;
- :mod:`~mcore_rl.environments.single_turn`: today's verifiers as one-turn environments;
- :mod:`~mcore_rl.environments.tools`: the Hermes / Qwen tool-call format, a safe calculator;
- :mod:`~mcore_rl.environments.sandbox`: a resource-limited Python tool, isolated by
  bubblewrap (:mod:`~mcore_rl.environments.isolation`) unless ``env.sandbox`` says otherwise;
- :mod:`~mcore_rl.environments.tool_use`: tools until an answer, scored by the verifier;
- :mod:`~mcore_rl.environments.executor`: calls in a process pool with deadlines, never raising
  into the caller.

Environments are found by name (``env.name``) in
:data:`mcore_rl.config.registry.ENVIRONMENTS`, or by the ``"module:Class"`` import path of the
user's own, and built with :func:`build_environment`. Nothing here imports torch at import time
(the verifiers do, when an environment is built).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mcore_rl.config import registry as tables
from mcore_rl.environments.base import Environment, EpisodeState, StepResult

if TYPE_CHECKING:
    from mcore_rl.config.schema import TrainConfig

__all__ = ["Environment", "EpisodeState", "StepResult", "build_environment"]


def build_environment(cfg: "TrainConfig") -> Environment:
    """The environment ``cfg.env.name`` names (a table name or an import path), built by its
    class's ``from_config(cfg)``.

    Raises:
        ValueError: ``env.name`` is neither in :data:`~mcore_rl.config.registry.ENVIRONMENTS`
            nor an import path (names the key), or the environment's own ``from_config``
            refuses ``cfg``.
    """
    name = cfg.env.name
    path = tables.path_of(tables.ENVIRONMENTS, name)
    if path is None:
        raise ValueError(f"env.name: unknown environment {name!r}; choose one of "
                         f"{', '.join(tables.ENVIRONMENTS)} or a 'module:Class' import path")
    return tables.load(path).from_config(cfg)

"""The environment contract: an episode over one data example, stepped one model turn at a time.

In the field's terms (NeMo RL's ``EnvironmentInterface``: ``step(message_logs, metadata) ->
(observations, metadata, rewards, terminateds)``, with per-episode metadata carried by the
caller; verl's agent loop: a model turn, then a tool's response as the next observation, until
the episode ends). An episode starts from a :class:`~mcore_rl.data.example.Example`:

- ``reset(example) -> (observation, metadata)``: the first observation (text the caller puts
  after the prompt, before the first model turn; None: the prompt alone) and the episode's
  metadata;
- ``step(state, model_turn_text) -> StepResult``: the model's turn (decoded text, without
  special tokens) in, the next observation, the reward of this step, whether the episode is
  done, and the metadata to carry to the next step.

Environments are stateless between calls: everything an episode needs is in its
:class:`EpisodeState` (the example, the metadata, the turn count), so one environment object
serves many episodes at once, in this process or in the worker processes of
:class:`~mcore_rl.environments.executor.EnvironmentExecutor` (which pickles the environment
once per worker: keep it picklable, its functions module-level). The metadata must be
picklable too (plain dicts, lists, numbers, strings).

The history of the conversation is the caller's (the multi-turn rollout loop keeps the token
ids); an environment that needs more than the latest turn keeps what it needs in the metadata.
Metrics of an episode are metadata keys (:data:`METRIC_KEYS`), read by the caller after the
last step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, Optional, Protocol, Tuple, runtime_checkable

from mcore_rl.data.example import Example

# Metadata keys every environment of this package keeps as per-episode metrics (ints): model
# turns stepped, tool calls made, tool calls that failed (bad call, tool error), tool calls
# past their time limit. The executor adds ENV_ERRORS (steps that raised or timed out).
TURNS, TOOL_CALLS, TOOL_ERRORS, TOOL_TIMEOUTS = "turns", "tool_calls", "tool_errors", "tool_timeouts"
ENV_ERRORS = "env_errors"
METRIC_KEYS = (TURNS, TOOL_CALLS, TOOL_ERRORS, TOOL_TIMEOUTS, ENV_ERRORS)
# Metadata key of the last error of the environment itself (a step or reset that raised or
# timed out in the executor), as text.
ENV_ERROR = "env_error"


@dataclass(frozen=True)
class StepResult:
    """What one step returns.

    Attributes:
        observation: text for the next turn (a tool's response, feedback), which the caller
            puts into a ``tool`` or ``user`` chat turn; None when there is none (always when
            ``done``, unless the environment reports a final message).
        reward: this step's reward; an episode's return is the sum over its steps (the
            environments of this package give all of it at the last step).
        done: the episode has ended; no further step may be taken.
        metadata: the episode's metadata after this step, for the next step.
    """

    observation: Optional[str]
    reward: float
    done: bool
    metadata: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EpisodeState:
    """One episode between steps (what :meth:`Environment.step` is given).

    Attributes:
        example: the data example the episode started from.
        metadata: what :meth:`Environment.reset` or the last step returned.
        turn: model turns already stepped (0 at the first step).
    """

    example: Example
    metadata: Dict[str, Any]
    turn: int = 0

    def advance(self, result: StepResult) -> "EpisodeState":
        """The state after ``result`` (one more turn, its metadata).

        Raises:
            ValueError: ``result.done`` (an ended episode takes no further step).
        """
        if result.done:
            raise ValueError(f"{self.example.source}: the episode ended at turn {self.turn + 1}")
        return replace(self, metadata=result.metadata, turn=self.turn + 1)


@runtime_checkable
class Environment(Protocol):
    """An environment (``env.name`` in the config: a class named in
    :data:`mcore_rl.config.registry.ENVIRONMENTS`, built with a classmethod
    ``from_config(cfg: TrainConfig) -> Environment``).

    Both methods may raise on a bug or bad input (a verifier's ``ValueError`` on a malformed
    answer, say); :class:`~mcore_rl.environments.executor.EnvironmentExecutor` turns that into
    an ended episode with reward 0 and the error in the metadata, never into an exception in the
    caller.
    """

    def reset(self, example: Example) -> Tuple[Optional[str], Dict[str, Any]]:
        """Start an episode on ``example``: ``(observation or None, metadata)``."""
        ...

    def step(self, state: EpisodeState, model_turn_text: str) -> StepResult:
        """The environment's answer to the model's turn ``model_turn_text`` (decoded text) in
        the episode ``state``."""
        ...


def new_metrics() -> Dict[str, int]:
    """The per-episode metric keys of this package's environments, all 0."""
    return {key: 0 for key in (TURNS, TOOL_CALLS, TOOL_ERRORS, TOOL_TIMEOUTS)}

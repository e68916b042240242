"""Today's verifiers as one-turn environments: reset gives no observation, the one step scores
the model's turn with the verifier and ends the episode (what the RL loops do today with
``reward.name``'s verifier, in the environment contract)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

from mcore_rl.data.example import Example
from mcore_rl.environments.base import TURNS, EpisodeState, StepResult, new_metrics

if TYPE_CHECKING:
    from mcore_rl.config.schema import TrainConfig


@dataclass(frozen=True)
class SingleTurnEnvironment:
    """``env.name=single_turn``: one model turn scored by a verifier.

    Attributes:
        reward_fn: the verifier, ``(response_text, example) -> float``
            (:data:`mcore_rl.rewards.RewardFn`; module-level, so the executor's workers can
            import it by name).
    """

    reward_fn: Callable[[str, Example], float]

    @classmethod
    def from_config(cls, cfg: "TrainConfig") -> "SingleTurnEnvironment":
        """The environment of the run's reward (``reward.name``'s verifier, or the weighted
        ``reward.names``: :func:`mcore_rl.rewards.build_reward`).

        Raises:
            ValueError: unknown ``reward.name`` (names the key).
        """
        from mcore_rl.rewards import build_reward  # torch: imported when the env is built

        return cls(build_reward(cfg.reward))

    def reset(self, example: Example) -> Tuple[Optional[str], Dict[str, Any]]:
        """No observation; the metric keys at 0."""
        return None, new_metrics()

    def step(self, state: EpisodeState, model_turn_text: str) -> StepResult:
        """The verifier's reward of ``model_turn_text``; done.

        Raises:
            Exception: whatever the verifier raises (``exact``: ``ValueError`` for an example
                whose answer is not an integer).
        """
        reward = float(self.reward_fn(model_turn_text, state.example))
        return StepResult(None, reward, True, {**state.metadata, TURNS: state.turn + 1})

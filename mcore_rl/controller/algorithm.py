"""What the RL loops ask of an algorithm: the :class:`Algorithm` strategy protocol.

The loops (:class:`~mcore_rl.controller.loops.SyncLoop`,
:class:`~mcore_rl.controller.streaming.StreamingLoop`) run an RL step on the shared machinery
of :class:`~mcore_rl.controller.trainer.RLTrainer` (worker groups, rollout backend,
colocation, rewards, checkpoints) and call an algorithm's hooks for everything GRPO and PPO do
differently: the worker groups beyond the policy, the policy's LR schedule, reward shaping and
advantages, the synchronous update, the streamed split steps, the policy version and the
algorithm's own metrics. An algorithm is built from the config alone (``ALGORITHMS[name](cfg)``,
:data:`mcore_rl.config.registry.ALGORITHMS`) and holds its losses; what it needs of a run it
reads from the ``trainer`` passed to a hook. GRPO is :class:`mcore_rl.controller.grpo.GRPO`,
PPO :class:`mcore_rl.controller.ppo.PPO`; ``docs/design.md``, "Algorithms as strategy objects".

The class is a :class:`typing.Protocol` with default bodies: an algorithm subclasses it and
overrides what it changes (a class that only matches the signatures gets no defaults).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Protocol, Tuple

from mcore_rl.config.schema import TrainConfig
from mcore_rl.data import batch as B
from mcore_rl.distributed.worker_group import DataParallelGroup

if TYPE_CHECKING:
    from mcore_rl.controller.trainer import RLTrainer


@dataclasses.dataclass(frozen=True)
class SplitStep:
    """One worker group's split train step in a streamed RL step: the ``group``, its
    ``loss_fn`` and ``micro_batch_size`` (rows per forward/backward), and the ``prefix`` of its
    metrics."""

    group: DataParallelGroup
    loss_fn: Callable
    micro_batch_size: int
    prefix: str


# What Algorithm.sample returns: the rollout (with an all-ones sample_mask), the pending
# rewards (None when the rollout already has its rewards), the reward errors counted so far,
# and metrics of the sampling (named, e.g. train/dynamic_sampling_tries).
Sampled = Tuple[B.Batch, Optional[Any], int, Dict[str, float]]


class Algorithm(Protocol):
    """An RL algorithm as the loops call it.

    Attributes:
        name: its config section (``"grpo"``, ``"ppo"``: ``num_prompts_per_step``,
            ``num_generations``, ``max_steps``, the streaming keys, ...), the value of the
            config key ``algorithm``.
        group_names: the Megatron worker groups it trains, the policy first; each name is also
            the config section of that group's ``megatron`` layout (``policy``, ``value``).
        cfg: the run's config.
        loss_fn: the policy's loss (``loss.name``, :mod:`mcore_rl.algorithms.registry`).
    """

    name: str
    group_names: Tuple[str, ...] = ("policy",)
    cfg: TrainConfig
    loss_fn: Callable

    @property
    def section(self) -> Any:
        """The algorithm's config section (``cfg.<name>``)."""
        return getattr(self.cfg, self.name)

    # ------------------------------------------------------------------ construction
    def build_loop(self) -> Optional[Any]:
        """A run of its own for an algorithm that is no RL loop over a policy (``rm``: the
        reward model's supervised training), with the :class:`~mcore_rl.controller.trainer.
        Loop` methods the entry points call (``fit``, ``evaluate``, ``close``); None (the
        default): the RL loops on an :class:`~mcore_rl.controller.trainer.RLTrainer`."""
        return None

    def needs_reference(self) -> bool:
        """Whether the policy keeps a frozen reference (KL terms): ``loss.kl_coef > 0``."""
        return self.cfg.loss.kl_coef > 0

    def policy_schedule(self) -> Tuple[int, int]:
        """``(total optimizer steps, sequences per optimizer step)`` of the policy's (and the
        other groups') LR schedule."""
        raise NotImplementedError

    def build_groups(self, trainer: "RLTrainer") -> Dict[str, DataParallelGroup]:
        """The worker groups beyond the policy, by name (built with
        :meth:`RLTrainer.megatron_group` after the policy and the rollout backend): none."""
        return {}

    def warm_started(self, trainer: "RLTrainer") -> None:
        """After the policy's supervised warm start (``sft.steps``): nothing."""

    # ------------------------------------------------------------------ one rollout
    def sample(self, trainer: "RLTrainer") -> Sampled:
        """The RL step's rollout for the synchronous loop: ``num_generations`` responses to
        each of the step's prompts (:meth:`RLTrainer.generate_and_submit`), scored in the
        reward pool while the loop runs the forward passes."""
        rollout, pending = trainer.generate_and_submit(self.section.num_generations)
        return rollout, pending, 0, {}

    def shape_rewards(self, rollout: B.Batch) -> None:
        """Change ``rollout["rewards"]`` in place once they are in (synchronous loop):
        nothing."""

    def rollout_forwards(self, trainer: "RLTrainer", rollout: B.Batch) -> None:
        """Forward passes of the synchronous loop beyond the policy's logprobs, their results
        put in ``rollout`` (after the logprob budget's check): none."""

    def set_advantages(self, rollout: B.Batch) -> None:
        """``advantages`` (and what else the update reads) of a whole rollout with its
        rewards and forward results (synchronous loop)."""
        raise NotImplementedError

    def trains_policy(self, step: int) -> bool:
        """Whether RL step ``step`` (0-based) updates the policy (then the rollout backend is
        refit after it): always."""
        return True

    def train_step(self, trainer: "RLTrainer", rollout: B.Batch) -> Dict[str, float]:
        """The synchronous update of RL step ``trainer.step`` on ``rollout`` (every worker
        group's optimizer steps, timed by phase); their metrics, named (``train/``,
        ``critic/``)."""
        raise NotImplementedError

    def batch_metrics(self, rollout: B.Batch) -> Dict[str, float]:
        """The algorithm's figures on the step's rows (either loop): none."""
        return {}

    # ------------------------------------------------------------------ streaming
    def score_group(self, rows: B.Batch) -> None:
        """What a streamed prompt group adds to its ``rows`` (with ``rewards``) in place as
        soon as it is scored: nothing."""

    def chunk_calls(self, trainer: "RLTrainer", chunk: B.Batch,
                    dp_ranks: Dict[str, int]) -> Dict[str, Future]:
        """Forward passes a streamed chunk needs beyond the policy's logprobs, started on the
        DP ranks ``dp_ranks`` (by worker group name); each call by the batch key its result
        ``[rows, S]`` goes under: none."""
        return {}

    def prepare_chunk(self, chunk: B.Batch) -> None:
        """What a streamed chunk computes in place once its forward passes are in, before it
        trains: nothing."""

    def split_steps(self, trainer: "RLTrainer", step: int) -> Dict[str, SplitStep]:
        """The split steps of streamed RL step ``step``, by worker group name, in the order
        they finish: the policy's."""
        return {"policy": SplitStep(trainer.policy, self.loss_fn,
                                    self.cfg.policy.micro_batch_size, "train/")}

    def policy_version(self, step: int) -> int:
        """The policy updates before RL step ``step`` (0-based): the version of its weights;
        ``step``."""
        return step

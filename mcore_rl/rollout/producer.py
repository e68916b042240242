"""The rollout producer: the step's prompts in, a scored rollout out (``docs/design.md``,
"Rollout floor").

:class:`RolloutProducer` is what :class:`~mcore_rl.controller.trainer.RLTrainer` delegates its
rollouts to (``generate_and_submit`` / ``collect_rewards`` / ``validate``):

- ``env.name=single_turn``: today's path, call for call: one ``backend.generate`` of the
  prompts, the responses decoded without special tokens and scored by ``reward.name``'s
  verifier in the reward pool (:class:`~mcore_rl.rewards.pool.RewardScorer`), overlapping
  whatever the caller does before it collects them;
- a multi-turn environment (``tool_use``): the episodes of
  :func:`~mcore_rl.rollout.multi_turn.run_episodes`, their environment steps in an
  :class:`~mcore_rl.environments.executor.EnvironmentExecutor`; the rewards (sums of step
  rewards) are known when generation ends, and the episode metrics
  (:func:`~mcore_rl.rollout.multi_turn.episode_metrics`) wait in :meth:`pop_metrics`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

from mcore_rl.data import batch as B
from mcore_rl.data.prompts import prompt_messages
from mcore_rl.rollout.multi_turn import ChatFormat, episode_metrics, run_episodes
from mcore_rl.utils.logging import pop_prefixed

if TYPE_CHECKING:
    from mcore_rl.config.schema import TrainConfig

_log = logging.getLogger(__name__)

# env.name of today's one-turn path (the verifier in the reward pool).
SINGLE_TURN = "single_turn"


class ScoredNow:
    """Rewards already computed (a multi-turn rollout's), with the interface of
    :class:`~mcore_rl.rewards.pool.PendingRewards`: :meth:`result` gives ``(rewards [B]
    float32, num_errors, busy_seconds)`` at once."""

    def __init__(self, rewards: torch.Tensor, errors: int, busy: float = 0.0):
        self._value = (rewards, int(errors), float(busy))

    def done(self) -> bool:
        return True

    def result(self) -> Tuple[torch.Tensor, int, float]:
        return self._value


class RolloutProducer:
    """Turns prompts of a data set into a rollout and its (pending) rewards.

    Args:
        cfg: the run's config (``env``, ``data.max_total_length``, ``data.prompt_template``,
            ``data.use_chat_template``).
        backend: the rollout :class:`~mcore_rl.generation.base.GenerationBackend`.
        tokenizer: the run's tokenizer.
        scorer: the reward pool (:class:`~mcore_rl.rewards.pool.RewardScorer`) of the one-turn
            path.

    Raises:
        ValueError: ``env.name`` unknown or refused by its environment's ``from_config``; a
            multi-turn environment with a chat template the loop cannot append turns to.
    """

    def __init__(self, cfg: "TrainConfig", backend, tokenizer, scorer):
        self.cfg, self.backend, self.tokenizer, self.scorer = cfg, backend, tokenizer, scorer
        self.multi_turn = cfg.env.name != SINGLE_TURN
        self.executor = None
        self.format: Optional[ChatFormat] = None
        self._metrics: List[Dict[str, float]] = []
        self._unsafe: Optional[str] = None  # warned every generate: env.sandbox=unsafe_subprocess
        if self.multi_turn:
            from mcore_rl.environments import build_environment
            from mcore_rl.environments.executor import EnvironmentExecutor
            from mcore_rl.environments.sandbox import unsafe_warning

            env = build_environment(cfg)
            self._unsafe = unsafe_warning(env)
            schemas = env.tool_schemas() if hasattr(env, "tool_schemas") else None
            use_chat = cfg.data.use_chat_template and tokenizer.chat_template is not None
            self.format = ChatFormat(tokenizer, use_chat, schemas)
            self.executor = EnvironmentExecutor(env, cfg.env.num_workers,
                                                cfg.env.step_timeout_seconds)

    # ------------------------------------------------------------------ one-turn helpers
    def texts(self, rollout: B.Batch) -> List[str]:
        """The rollout's responses (after the prompt) decoded without special tokens."""
        texts = []
        for row in range(B.batch_size(rollout)):
            p, n = int(rollout["prompt_lengths"][row]), int(rollout["input_lengths"][row])
            texts.append(self.tokenizer.decode(rollout["input_ids"][row, p:n].tolist(),
                                               skip_special_tokens=True))
        return texts

    def _first_prompts(self, dataset, indices: Sequence[int]) -> List[List[int]]:
        if not self.multi_turn:
            return [list(dataset.input_ids[i]) for i in indices]
        data = self.cfg.data
        return [self.format.prompt_ids(
            prompt_messages(dataset.examples[i], data.prompt_template, data.system_prompt),
            dataset.input_ids[i]) for i in indices]

    # ------------------------------------------------------------------ public
    def generate(self, dataset, indices: Sequence[int], seed: int, greedy: bool = False,
                 metrics_prefix: str = "env/") -> B.Batch:
        """The rollout of ``dataset``'s prompts ``indices`` (one row each, in order): the
        backend's batch (:meth:`GenerationBackend.generate`) for one turn, the episodes' batch
        (:func:`run_episodes`, with ``rewards`` [B] float32 already in it) for several, whose
        episode metrics wait under ``metrics_prefix`` for :meth:`pop_metrics`. Logs a warning
        first while the environment's tools run code without isolation
        (``env.sandbox=unsafe_subprocess``).

        Raises:
            ValueError: as the backend's ``generate`` (prompts with no room for a response).
        """
        prompts = self._first_prompts(dataset, indices)
        if not self.multi_turn:
            return self.backend.generate(prompts, seed=seed, greedy=greedy)
        if self._unsafe:
            _log.warning(self._unsafe)
        e = self.cfg.env
        rollout, episodes = run_episodes(
            self.backend, self.executor, self.format, [dataset.examples[i] for i in indices],
            prompts, seed, e.max_turns, self.cfg.data.max_total_length, greedy=greedy)
        self._last_errors = int(sum(ep.metadata.get("env_errors", 0) for ep in episodes))
        self._metrics.append(episode_metrics(episodes, metrics_prefix))
        return rollout

    def generate_scored(self, dataset, indices: Sequence[int], seed: int,
                        examples: Sequence[Any]) -> Tuple[B.Batch, Any]:
        """One turn (``env.name=single_turn``): :meth:`generate` and :meth:`submit` at once,
        each prompt group's responses handed to the reward pool as the backend finishes it
        (:meth:`RewardScorer.open`), so scoring overlaps the rest of the decoding
        (``reward.score_while_decoding``; the megatron backend hands over rows as its decoder
        marks them done, the others per part of the call they finish: docs/design.md,
        "Rollout floor"). The rollout and the rewards equal those of :meth:`generate` then
        :meth:`submit` for the same seed.

        Returns:
            ``(rollout, pending)``: the backend's batch, and a
            :class:`~mcore_rl.rewards.pool.StreamingRewards` (``result()`` as :meth:`submit`'s).

        Raises:
            ValueError: a multi-turn environment (its rewards come with the episodes), or as
                :meth:`generate`.
        """
        from mcore_rl.generation.base import assemble_rollout

        if self.multi_turn:
            raise ValueError("generate_scored: one-turn rollouts only (env.name=single_turn)")
        prompts = self._first_prompts(dataset, indices)
        pending = self.scorer.open(examples)
        responses: List[Any] = [None] * len(prompts)
        try:
            for group in self.backend.generate_async(prompts, seed):
                responses[group.rows.start:group.rows.stop] = group.responses
                pending.add(list(group.rows), [
                    self.tokenizer.decode(r.tokens.tolist(), skip_special_tokens=True)
                    for r in group.responses])
        except BaseException:
            pending.cancel()
            raise
        pending.close()
        return assemble_rollout(prompts, responses, self.backend.pad_token_id), pending

    def submit(self, rollout: B.Batch, examples: Sequence[Any]):
        """Start scoring ``rollout`` (from :meth:`generate`) against its ``examples``: the
        verifier in the reward pool for one turn (:meth:`RewardScorer.submit`), the episodes'
        rewards (already summed) for several. Returns an object whose ``result()`` gives
        ``(rewards [B] float32, num_errors, busy_seconds)``; errors of a multi-turn rollout are
        its environment errors."""
        if not self.multi_turn:
            return self.scorer.submit(self.texts(rollout), examples)
        return ScoredNow(rollout["rewards"].clone(), getattr(self, "_last_errors", 0))

    def pop_metrics(self, prefix: str = "env/") -> Dict[str, float]:
        """The episode metrics under ``prefix`` of the rollouts since the last call (means over
        those rollouts), cleared; empty for the one-turn path."""
        out, self._metrics = pop_prefixed(self._metrics, prefix)
        return out

    def close(self) -> None:
        """Stop the executor's processes (if any)."""
        if self.executor is not None:
            self.executor.close()

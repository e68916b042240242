"""What every RL loop of the single controller shares (GRPO, PPO): :class:`RLTrainer` and the
loops' base :class:`Loop`.

:class:`RLTrainer` holds the run's pieces: tokenizer, prompt data and sampler, the placement of
its worker groups (:mod:`~mcore_rl.distributed.placement`), the policy worker group, the rollout
backend (built by name from :mod:`mcore_rl.generation.registry`), the device hand-over between
them (:mod:`~mcore_rl.controller.colocation`), the verifier and the logger; it generates and
scores rollouts, refits the rollout backend, validates (greedy accuracy on held-out prompts),
runs the optional supervised warm start (``sft.steps``), saves and resumes checkpoints of every
worker group. What differs between algorithms comes from the
:class:`~mcore_rl.controller.algorithm.Algorithm` it is built with: its config section (which
has ``num_prompts_per_step``, ``max_steps``, ``val_every``, ``val_num_prompts`` and
``val_at_start``), its worker groups beyond the policy, the policy's LR schedule, whether a
reference policy is kept.

:class:`Loop` runs a trainer with an algorithm (:meth:`Loop.fit`: resume, warm start, RL
steps with validation, logging, checkpoints and preemption); its subclasses are the
synchronous loop (:class:`~mcore_rl.controller.loops.SyncLoop`) and the streaming loop
(:class:`~mcore_rl.controller.streaming.StreamingLoop`), which implement :meth:`Loop.rl_step`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from mcore_rl.algorithms.losses import NLLLoss
from mcore_rl.config.schema import TrainConfig
from mcore_rl.config import registry
from mcore_rl.controller.checkpoints import CheckpointManager
from mcore_rl.controller.learned_rewards import LearnedRewards
from mcore_rl.controller.logprob_budget import LogprobBudget, LogprobBudgetExceeded, mismatch_figures
from mcore_rl.controller.preemption import EXIT_CODE, Preempted, PreemptionSignals
from mcore_rl.controller.watchdog import Watchdog, hang_dir
from mcore_rl.data import batch as B
from mcore_rl.distributed.worker_group import DataParallelGroup
from mcore_rl.megatron.te import te_environment
from mcore_rl.utils.logging import Progress, RunLogger
from mcore_rl.utils.timers import PhaseTimer
from mcore_rl.workers.interfaces import PolicyAPI

_log = logging.getLogger(__name__)


_CANARY_SALT = 104729  # step_seed salt of the start-up logprob canary's rollouts


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """Seed of one step's randomness (rollouts; ``salt`` tells other uses apart): depends on
    the run seed and step only, so a resumed run samples exactly what a straight run would."""
    return (seed * 1_000_003 + step * 7919 + salt) % (2**31 - 1)


def megatron_group(placement, cfg: TrainConfig, name: str, worker_cls,
                   kwargs: Dict[str, Any]) -> DataParallelGroup:
    """The worker group ``name`` of ``placement`` (its ``cluster.num_workers`` ranks):
    ``worker_cls(**kwargs)`` per rank with the run's seed, CPU threads and garbage-collection
    interval (``run.seed``, ``cluster.threads_per_worker``, ``cluster.manual_gc_interval``)
    added, in a :class:`~mcore_rl.distributed.worker_group.DataParallelGroup`. Its processes
    get the Transformer Engine environment of ``kwargs["megatron"]`` (the section's
    :class:`~mcore_rl.config.schema.MegatronConfig`: :func:`mcore_rl.megatron.te.
    te_environment`) before they import the worker's module."""
    return DataParallelGroup(placement.make_group(name, worker_cls, dict(
        seed=cfg.run.seed, threads=cfg.cluster.threads_per_worker,
        manual_gc_interval=cfg.cluster.manual_gc_interval, **kwargs),
        env=te_environment(kwargs["megatron"])))


def run_logger(cfg: TrainConfig, run_dir: str, total_steps: int, start_step: int) -> RunLogger:
    """The run's :class:`~mcore_rl.utils.logging.RunLogger` with the ``logging.*`` switches
    (W&B: a run named ``run.name`` with the whole config; the progress named ``algorithm``)."""
    wandb = None
    if cfg.logging.wandb:
        wandb = dict(project=cfg.logging.wandb_project, entity=cfg.logging.wandb_entity,
                     name=cfg.run.name, config=dataclasses.asdict(cfg))
    return RunLogger(run_dir, total_steps, start_step, cfg.logging.progress,
                     cfg.logging.tensorboard, cfg.logging.jsonl, wandb, desc=cfg.algorithm)


class RLTrainer:
    """The shared controller of a run of ``algorithm`` (a loop, :class:`Loop`, drives it).
    ``algorithm`` is an :class:`~mcore_rl.controller.algorithm.Algorithm` (not imported here:
    that module imports this one).

    Attributes:
        algorithm: the :class:`~mcore_rl.controller.algorithm.Algorithm`; its
            ``group_names`` are the Megatron worker groups built (the policy first), each of
            ``cluster.num_workers`` ranks, placed together (:attr:`placement`).
        section: its config section (``cfg.grpo``, ``cfg.ppo``).
        placement: the :class:`~mcore_rl.distributed.placement.Placement` of the worker groups.
        policy: the policy's :class:`~mcore_rl.distributed.worker_group.DataParallelGroup`.
        groups: every worker group by name (checkpoint sub-directory): the policy and those
            of :meth:`Algorithm.build_groups` (PPO: ``value``).
        generation: the rollout backend (:class:`~mcore_rl.generation.base.GenerationBackend`).
        colocation: the device hand-over between them
            (:class:`~mcore_rl.controller.colocation.Colocation`).
        offload_note: how ``cluster.offload_train_state`` resolved and why, one line (empty
            without colocation); :meth:`Loop.fit` writes it to the log first.
        step: the RL steps done.
    """

    def __init__(self, cfg: TrainConfig, algorithm: Any):
        from mcore_rl.controller.colocation import Colocation
        from mcore_rl.data.prompts import PromptSampler, load_task
        from mcore_rl.data.tokenizer import load_tokenizer
        from mcore_rl.distributed.placement import Placement, config_plan
        from mcore_rl.generation.base import BackendContext
        from mcore_rl.generation.registry import backend_class, build_backend
        from mcore_rl.megatron.conversion import arch_to_hf_config, hf_config_to_arch
        from mcore_rl.config.checks import ConfigError
        from mcore_rl.config.families import parallel_shape_errors
        from mcore_rl.megatron.parallel import resolve_device
        from mcore_rl.megatron.te import runtime_errors as te_runtime_errors
        from mcore_rl.config.learned import learned_reward_name
        from mcore_rl.rewards import check_on_example, reward_components, weighted_names
        from mcore_rl.rewards.pool import RewardScorer, default_num_workers
        from mcore_rl.workers.policy import PolicyWorker

        self.cfg = cfg
        self.algorithm = algorithm
        self.section = algorithm.section
        self.device = resolve_device(cfg.cluster.device)
        # Transformer Engine where the GPU is: it imports, the GPU runs the FP8 recipe (the
        # loader checked what it can without torch).
        problems = [p for section in algorithm.group_names for p in te_runtime_errors(
            getattr(cfg, section).megatron, f"{section}.megatron", self.device)]
        if problems:
            raise ConfigError("; ".join(problems))
        self.run_dir = cfg.run.output_dir
        if not cfg.checkpoint.resume and os.path.exists(os.path.join(self.run_dir, "metrics.jsonl")):
            raise FileExistsError(
                f"run.output_dir={self.run_dir} already holds a run (metrics.jsonl); continue it "
                f"with checkpoint.resume=latest or start a new one with another run.output_dir"
            )
        # Every input is read and checked before the run directory is written to: a run that
        # fails on bad input leaves it as it was.
        self.tokenizer = load_tokenizer(cfg.model, cfg.data.use_chat_template)
        self.train_data, self.test_data = load_task(cfg.data, self.tokenizer, cfg.run.seed)
        self.sampler = PromptSampler(len(self.train_data), self.section.num_prompts_per_step, cfg.run.seed)
        r = cfg.reward
        # A learned reward (model or judge, in reward.name or reward.names) reads and checks its
        # inputs now; its worker groups start after the policy's. The reward pool holds the
        # other rewards of reward.name / reward.names, weighted (None when the learned reward is
        # the only one); the tracked pool holds reward.verifier (beside a learned reward only).
        learned = learned_reward_name(r)
        self.learned_reward = (registry.load(registry.LEARNED_REWARDS[learned])(cfg, self.tokenizer)
                               if learned else None)
        components = reward_components(r, exclude=registry.LEARNED_REWARDS)
        tracked = [] if r.verifier is None else reward_components(
            dataclasses.replace(r, name=r.verifier, names=None, weights=None))
        # a reward that fails on the first example's reference solution
        check_on_example(components + tracked, self.train_data.examples[0])
        self.rewards, self.tracked = (None if not c else RewardScorer(
            c, default_num_workers(c) if r.num_workers is None else r.num_workers,
            r.timeout_seconds) for c in (components, tracked))
        # Each reward's own scores since they were last logged: metric -> [sum, count].
        self._reward_sums: Dict[str, List[float]] = {}
        for scorer in self._scorers():
            scorer.warm_up(background=True)  # spawning overlaps building the model

        if cfg.model.hf_path:
            from transformers import AutoConfig

            try:  # an unreadable config.json, or a model this trainer does not build
                self.hf_config = AutoConfig.from_pretrained(cfg.model.hf_path)
                self.arch = hf_config_to_arch(self.hf_config)
            except (OSError, ValueError) as e:
                reason = " ".join(str(e).split())
                raise ConfigError(f"model.hf_path: {cfg.model.hf_path}: {reason}") from e
            # The checkpoint's shape against each Megatron layout (config validation checks
            # model.arch, which hf_path replaces).
            problems = [p for section in algorithm.group_names for p in parallel_shape_errors(
                self.arch, getattr(cfg, section).megatron, f"{section}.megatron",
                f"model.hf_path={cfg.model.hf_path}")]
            if problems:
                raise ConfigError("; ".join(problems))
        else:
            arch = cfg.model.arch
            if arch.vocab_size is None:
                arch.vocab_size = len(self.tokenizer)
            self.arch = arch
            self.hf_config = arch_to_hf_config(arch, arch.vocab_size)
        self.hf_config.eos_token_id = self.tokenizer.eos_token_id
        self.hf_config.pad_token_id = self.tokenizer.pad_token_id
        self.vocab_size = self.arch.vocab_size
        if self.device == "cuda" and not cfg.cluster.skip_memory_check:
            from mcore_rl.megatron.memory import memory_error

            problem = memory_error(cfg, self.arch, self.vocab_size)
            if problem:
                raise ConfigError(problem)
        os.makedirs(self.run_dir, exist_ok=True)
        self.tokenizer.save_pretrained(os.path.join(self.run_dir, "tokenizer"))
        # The policy's shape for `mcore-rl export` (mcore_rl.export reads both).
        self.hf_config.to_json_file(os.path.join(self.run_dir, "hf_config.json"), use_diff=False)

        self.use_reference = algorithm.needs_reference()
        # The hang watchdog (mcore_rl.controller.watchdog): watches the phases while fit runs.
        self.watchdog = Watchdog(cfg.watchdog, self.run_dir, cleanup=self._close_scorers)
        backend = backend_class(cfg.generation.backend)
        training = {name: cfg.cluster.num_workers for name in algorithm.group_names}
        generation = backend.worker_groups(cfg)
        if self.learned_reward is not None:  # placed with the policy's groups and engines
            training.update(self.learned_reward.training_groups())
            generation.update(self.learned_reward.generation_groups())
        self.placement = Placement(
            config_plan(cfg.cluster, training, generation),
            use_ray=cfg.cluster.use_ray, gpus=self.device == "cuda",
            ray_address=cfg.cluster.ray_address,
            dump_dir=hang_dir(self.run_dir) if cfg.watchdog.enabled else None)
        self.policy = self.megatron_group(
            "policy", PolicyWorker, cfg.policy.megatron, cfg.policy.optimizer,
            *algorithm.policy_schedule(), hf_path=cfg.model.hf_path, init=cfg.model.init,
            temperature=cfg.generation.temperature, use_reference=self.use_reference,
            max_tokens_per_microbatch=cfg.policy.max_tokens_per_microbatch,
            sequence_packing=cfg.policy.sequence_packing)
        try:
            self.generation = build_backend(BackendContext(
                cfg=cfg, hf_config=self.hf_config, eos_token_id=self.tokenizer.eos_token_id,
                pad_token_id=self.tokenizer.pad_token_id, vocab_size=self.vocab_size,
                device=self.device, policy=self.policy, placement=self.placement))
        except BaseException:  # e.g. an engine that fails to start: no worker outlives the error
            self.policy.shutdown()
            self.placement.shutdown()
            self.watchdog.close()
            raise
        from mcore_rl.rollout.producer import RolloutProducer

        # The step's rollouts: one turn scored in the reward pool, or an environment's episodes.
        self.producer = RolloutProducer(cfg, self.generation, self.tokenizer, self.rewards)
        # Streaming generates while it trains: colocated engines then share the policy's GPUs
        # with everything resident, so the offload lifecycle is off.
        colocated = cfg.cluster.colocate_generation and not cfg.streaming
        # What of the policy's training state leaves the GPU for generation; the log's line.
        offload, self.offload_note = "true", ""
        if colocated and self.device != "cuda" and cfg.cluster.offload_train_state == "auto":
            self.offload_note = ("cluster.offload_train_state=auto -> true: the cpu device (the "
                                 "planner plans GPU memory)")
        elif colocated:
            from mcore_rl.megatron.memory import offload_train_state_decision

            offload, self.offload_note = offload_train_state_decision(cfg, self.arch,
                                                                      self.vocab_size)
        self.colocation = Colocation(self.policy, self.generation, colocated, offload)
        self.timer = PhaseTimer(self.watchdog)
        self.step = 0
        self.sft_done = cfg.sft.steps == 0
        self.history: List[Dict[str, float]] = []
        # Seconds per phase summed over this process's RL steps (validation included), and
        # how many steps: the summary's per-phase breakdown.
        self.phase_totals: Dict[str, float] = {}
        self.steps_timed = 0
        self.logprob_budget = LogprobBudget(cfg)
        self.groups: Dict[str, DataParallelGroup] = {"policy": self.policy}
        self.learned: Optional[LearnedRewards] = None
        try:
            self.groups.update(algorithm.build_groups(self))
            if self.learned_reward is not None:  # frozen: not in the checkpointed groups
                weighted = weighted_names(r)
                index = [n for n, _, _ in weighted].index(learned)
                self.learned = LearnedRewards(self.learned_reward, self.tracked, self.rewards,
                                              [w for _, w, _ in weighted], index,
                                              weighted[index][2])
                self.learned_reward.start(self)
        except BaseException:  # no worker outlives the error
            self.close()
            raise

    def _groups(self) -> Dict[str, DataParallelGroup]:
        """:attr:`groups` (all are saved, resumed, shut down)."""
        return self.groups

    def _scorers(self) -> List[Any]:
        """The reward pools: the run's rewards' and the tracked ``reward.verifier``'s."""
        return [s for s in (self.rewards, self.tracked) if s is not None]

    def _close_scorers(self) -> None:
        """Stop the reward pools' processes (the close, and the watchdog's cleanup)."""
        for scorer in self._scorers():
            scorer.close()

    # ------------------------------------------------------------------ helpers
    def megatron_group(self, name: str, worker_cls, megatron, optimizer, total_steps: int,
                        global_batch_size: int, **kwargs) -> DataParallelGroup:
        """The worker group ``name`` (one of the algorithm's ``group_names``, or a learned
        reward's): ``cluster.num_workers`` Megatron workers of the run's model (or of the
        ``hf_config``, ``arch`` and ``vocab_size`` in ``kwargs``), placed by :attr:`placement`
        (:func:`megatron_group`)."""
        return megatron_group(self.placement, self.cfg, name, worker_cls, {**dict(
            hf_config=self.hf_config.to_dict(), vocab_size=self.vocab_size, arch=self.arch,
            megatron=megatron, optimizer=optimizer, device=self.device,
            total_optimizer_steps=total_steps, global_batch_size=global_batch_size), **kwargs})

    def policy_logprobs(self, batch: B.Batch, reference: bool = False) -> torch.Tensor:
        """The policy's per-token logprobs of ``batch`` ``[B, S]`` (with ``reference`` the
        reference policy's), the device prepared for them
        (:meth:`Colocation.prepare_for_lp_inference`)."""
        self.colocation.prepare_for_lp_inference()
        rows = self.policy.gather_rows(PolicyAPI)
        forward = rows.get_reference_logprobs if reference else rows.get_logprobs
        return forward(batch, self.cfg.policy.logprob_micro_batch_size)

    def train_policy(self, batch: B.Batch, loss_fn) -> Dict[str, float]:
        """One optimizer step of the policy on ``batch`` with ``loss_fn``, the device prepared
        for it (:meth:`Colocation.prepare_for_training`); the step's metrics."""
        self.colocation.prepare_for_training()
        return self.policy.train(batch, loss_fn, self.cfg.policy.micro_batch_size)

    def refit(self) -> Dict[str, float]:
        """The policy's weights into the rollout backend through the backend's refit channel
        (:meth:`GenerationBackend.refit`: pulled, shared in place, or streamed), in colocation
        order (:meth:`Colocation.refit`). Returns the backend's stats (``refit/gbytes``) and
        ``refit/seconds``."""
        start = time.perf_counter()
        stats = self.colocation.refit()
        return {"refit/seconds": time.perf_counter() - start, **stats}

    def _prompts(self, dataset, indices) -> List[List[int]]:
        return [list(dataset.input_ids[i]) for i in indices]

    def _score(self, rollout: B.Batch, examples, prefix: str = "") -> tuple:
        """The one-turn rollout's responses scored by the rewards now (in this process's
        reward pool call; a learned reward by :class:`LearnedRewards`, its metrics then waiting
        under ``prefix``, ``train/`` by default): ``(rewards [B] float32, reward errors,
        texts)``; each reward's own scores kept for :meth:`reward_timing` under ``prefix``
        (validation: ``val/``)."""
        texts = self.producer.texts(rollout)
        if self.learned is not None:
            pending = self.learned.submit(rollout, texts, examples, prefix or "train/")
        else:
            pending = self.rewards.submit(texts, examples)
        rewards, errors, busy = pending.result()
        self.reward_busy_seconds += busy
        self._add_reward_components(pending, prefix)
        return rewards, errors, texts

    def _add_reward_components(self, pending, prefix: str = "") -> None:
        """Add each reward's own scores of ``pending`` to the sums :meth:`reward_means`
        reports (only with several rewards: one is ``train/reward_mean`` itself)."""
        components = pending.components()
        if len(components) < 2:
            return
        for metric, values in components.items():
            total = self._reward_sums.setdefault(prefix + metric, [0.0, 0.0])
            total[0] += float(values.sum())
            total[1] += values.numel()

    def reward_means(self, prefix: str = "") -> Dict[str, float]:
        """Each reward's mean score (unweighted) over the samples scored since the last call,
        keyed ``<prefix>reward/<name>``; cleared. Empty with one reward."""
        keys = [k for k in self._reward_sums if k.startswith(prefix + "reward/")]
        return {k: total / count for k in keys
                for total, count in [self._reward_sums.pop(k)] if count}

    reward_busy_seconds = 0.0  # the verifiers' own seconds since the last rl_step's metrics
    # reward.score_while_decoding: the fraction of the last rollout's samples scored before
    # generation ended (StreamingRewards.early_fraction), logged as train/reward_early_fraction
    reward_early: Optional[float] = None

    def generate_and_submit(self, num_generations: int):
        """Sample the step's prompts, generate ``num_generations`` responses each (rows of a
        prompt adjacent) and start scoring them (:meth:`RewardScorer.submit`: in the reward
        pool, overlapping whatever the caller does next). Returns the rollout with an all-ones
        ``sample_mask`` added, and the :class:`~mcore_rl.rewards.pool.PendingRewards` for
        :meth:`collect_rewards`. Timed as ``generation``."""
        idx = self.sampler.next_batch()
        prompt_idx = [i for i in idx for _ in range(num_generations)]
        examples = [self.train_data.examples[i] for i in prompt_idx]
        seed = step_seed(self.cfg.run.seed, self.step)
        with self.timer.phase("generation"):  # a multi-turn env's steps included
            # a learned reward scores the whole rollout after it; the others while decoding
            if (self.cfg.reward.score_while_decoding and not self.producer.multi_turn
                    and self.rewards is not None):
                rollout, pending = self.producer.generate_scored(self.train_data, prompt_idx,
                                                                 seed, examples)
            else:
                rollout = self.producer.generate(self.train_data, prompt_idx, seed=seed)
                pending = None
        rollout["sample_mask"] = torch.ones(B.batch_size(rollout))
        if self.learned is not None:
            return rollout, self.learned.submit(rollout, self.producer.texts(rollout), examples,
                                                others=pending)
        if pending is None:
            pending = self.producer.submit(rollout, examples)
        return rollout, pending

    def collect_rewards(self, rollout: B.Batch, pending) -> int:
        """Wait for the rewards of :meth:`generate_and_submit` and put them in
        ``rollout["rewards"]`` [B] float32; returns the count of reward errors. The wait (the
        scoring not hidden behind other work) is timed as ``reward``; the verifiers' own
        seconds add to ``reward_busy_seconds`` (logged as ``timing/reward_busy_s``)."""
        with self.timer.phase("reward"):
            rewards, errors, busy = pending.result()
        self.reward_busy_seconds += busy
        if getattr(pending, "early_fraction", None) is not None:  # scored while decoding
            self.reward_early = pending.early_fraction
        if hasattr(pending, "components"):  # the reward pool's (not a multi-turn rollout's)
            self._add_reward_components(pending)
        rollout["rewards"] = rewards
        return errors

    def generate_and_score(self, num_generations: int) -> Tuple[B.Batch, int]:
        """Sample the step's prompts, generate ``num_generations`` responses each (rows of a
        prompt adjacent) and score them. Returns the rollout with ``rewards`` and an all-ones
        ``sample_mask`` added, and the count of reward errors. Timed as ``generation`` and
        ``reward``."""
        rollout, pending = self.generate_and_submit(num_generations)
        return rollout, self.collect_rewards(rollout, pending)

    def reward_timing(self) -> Dict[str, float]:
        """``{"timing/reward_busy_s": seconds}``: the verifiers' own seconds since the last
        call (summed over samples, overlapped with other phases or not); clears them. With
        several rewards also each one's mean (``reward/<name>``: :meth:`reward_means`);
        with a multi-turn environment its episode metrics since the last call (``env/turns``,
        ``env/tool_calls``, ... : :meth:`RolloutProducer.pop_metrics`)."""
        out = {"timing/reward_busy_s": self.reward_busy_seconds, **self.reward_means(),
               **self.producer.pop_metrics()}
        if self.learned is not None:  # the learned reward's, and the tracked verifier's
            out.update(self.learned.pop_metrics("train/"))
        if self.reward_early is not None:
            out["train/reward_early_fraction"] = self.reward_early
        self.reward_busy_seconds, self.reward_early = 0.0, None
        return out

    def throughput(self, metrics: Dict[str, float]) -> Dict[str, float]:
        """``perf/tokens_per_s_per_gpu`` of a step's metrics: the tokens of its rollouts
        (prompt + response, ``train/num_tokens``) per second of the whole step
        (``timing/step_s``) per GPU the run reserves (the placement's, engines on GPUs of their
        own included; on CPU, per worker slot). NeMo RL's "Tokens / sec / GPU" of its
        performance summary (docs/about/performance-summary.md, v0.5: total tokens in the
        step's batch / step time / number of GPUs). Empty when either figure is missing."""
        tokens, seconds = metrics.get("train/num_tokens"), metrics.get("timing/step_s")
        gpus = max(1, self.placement.plan.num_gpus)
        if not tokens or not seconds:
            return {}
        return {"perf/tokens_per_s_per_gpu": tokens / seconds / gpus}

    @staticmethod
    def rollout_metrics(rollout: B.Batch, reward_errors: int,
                        generation_seconds: float) -> Dict[str, float]:
        """Reward, length, generation speed and trainer/rollout logprob-mismatch figures of a
        scored rollout that has ``prev_logprobs`` (from :meth:`generate_and_score`).

        Mismatch over the sampled (response) tokens: ``train/logprob_mismatch_max`` and
        ``_mean`` are the max and mean of ``|prev_logprobs - generation_logprobs|``;
        ``train/token_mult_prob_error`` is the mean of ``exp(|...|)`` (1 when the rollout
        engine and the trainer agree; NeMo RL's multiplicative probability error, its
        docs/adding-new-models.md). ``generation/tokens_per_s``: the rollout's response tokens
        per ``generation_seconds`` (the wall seconds spent generating them; absent when 0, as
        in a streamed step whose groups were all decoded before it)."""
        rewards = rollout["rewards"]
        out = {
            # without prev_logprobs (loss.prev_logprobs=train_forward) the loss measures them
            **(mismatch_figures(rollout) if "prev_logprobs" in rollout else {}),
            "train/reward_mean": float(rewards.mean()),
            "train/reward_std": float(rewards.std()),
            "train/reward_errors": float(reward_errors),
            "train/response_length": float(rollout["response_lengths"].float().mean()),
            "train/truncated_fraction": float(rollout["truncated"].mean()),
            "train/num_tokens": float(rollout["input_lengths"].sum()),
        }
        if generation_seconds > 0:
            out["generation/tokens_per_s"] = (float(rollout["response_lengths"].sum())
                                              / generation_seconds)
        return out

    # ------------------------------------------------------------------ logprob budget
    def check_logprob_budget(self, rollout: B.Batch) -> None:
        """The open RL step's trainer/rollout mismatch (``rollout`` with ``prev_logprobs``)
        against ``generation.logprob_budget``, before its optimizer step
        (:meth:`LogprobBudget.observe`).

        Raises:
            LogprobBudgetExceeded: the ``generation.logprob_budget_steps``-th consecutive step
                over budget; the caller has not trained on it.
        """
        self.logprob_budget.observe(self.step + 1, mismatch_figures(rollout))

    def logprob_canary(self) -> Dict[str, float]:
        """Before the first RL step of this process: the first
        ``generation.logprob_canary_prompts`` training prompts, one response each sampled by
        the configured backend (a seed of their own: the run's rollouts and sampler are
        untouched), scored by the policy; their :func:`mismatch_figures`, checked against
        ``generation.logprob_budget``. Nothing without a budget or with 0 canary prompts.

        Raises:
            LogprobBudgetExceeded: over budget (:meth:`LogprobBudget.check_canary`).
        """
        prompts = self.canary_prompts()
        if not prompts:
            return {}
        rollout = self.generation.generate(prompts, seed=self.canary_seed(0))
        rollout["prev_logprobs"] = self.policy_logprobs(rollout)
        self.colocation.prepare_for_generation()
        figures = mismatch_figures(rollout)
        self.logprob_budget.check_canary(figures, len(prompts))
        return figures

    def canary_prompts(self) -> List[List[int]]:
        """The logprob canary's prompts (:meth:`logprob_canary`; the streaming loop's canary
        after a refit, :mod:`mcore_rl.controller.streaming`): the first
        ``generation.logprob_canary_prompts`` training prompts (all of them when there are
        fewer), as token-id lists; none without a budget (``generation.logprob_budget=null``)
        or with 0 canary prompts."""
        n = min(self.cfg.generation.logprob_canary_prompts, len(self.train_data))
        if self.logprob_budget.budget is None or n == 0:
            return []
        return self._prompts(self.train_data, range(n))

    def canary_seed(self, step: int) -> int:
        """Sampling seed of the logprob canary measuring the weights of RL step ``step``
        (0-based; 0: the start-up canary): a seed of its own, so the run's rollouts and prompt
        order are untouched."""
        return step_seed(self.cfg.run.seed, step, salt=_CANARY_SALT)

    # ------------------------------------------------------------------ phases
    def validate(self) -> Dict[str, float]:
        """Greedy accuracy (mean reward; with several rewards their weighted sum, and each one's
        mean as ``val/reward/<name>``) on up to ``val_num_prompts`` held-out prompts. With a
        learned reward (alone or one of several): ``val/reward`` the run's reward's mean,
        ``val/accuracy`` the mean of the tracked ``reward.verifier`` (without one, the run's
        reward's), and the learned reward's own figures."""
        if self.test_data is None or len(self.test_data) == 0:
            return {}
        n = min(self.section.val_num_prompts, len(self.test_data))
        idx = list(range(n))
        rollout = self.producer.generate(self.test_data, idx, seed=0,
                                         greedy=self.cfg.generation.greedy_validation,
                                         metrics_prefix="val/env/")
        if self.producer.multi_turn:  # the episodes' rewards; their metrics under val/env/
            rewards, env = rollout["rewards"], self.producer.pop_metrics("val/env/")
        else:
            rewards = self._score(rollout, [self.test_data.examples[i] for i in idx], "val/")[0]
            env = self.reward_means("val/")
        out = {"val/accuracy": float(rewards.mean()),
               "val/response_length": float(rollout["response_lengths"].float().mean()), **env}
        if self.learned is not None:  # the learned reward as val/reward; the verifier's accuracy
            learned = self.learned.pop_metrics("val/")
            out["val/reward"] = out["val/accuracy"]
            out["val/accuracy"] = learned.pop("val/verifier_reward", out["val/reward"])
            out.update(learned)
        return out

    def warm_start(self, logger: RunLogger) -> None:
        """Supervised steps on reference solutions (``sft.*``), then the reference policy is
        set to the warm-started weights, then the algorithm's
        :meth:`~mcore_rl.controller.algorithm.Algorithm.warm_started` (PPO: the critic's
        backbone takes them)."""
        from mcore_rl.data.prompts import PromptSampler, sft_batch

        s = self.cfg.sft
        sampler = PromptSampler(len(self.train_data), s.batch_size, self.cfg.run.seed + 1)
        loss = NLLLoss()
        self.policy.call(PolicyAPI).rebuild_optimizer(s.lr)
        # A line every tenth of the steps: with the progress's timing where it prints lines
        # (not a terminal), plain above the bar or without progress.
        every = max(1, s.steps // 10)
        progress = logger.stage("sft", s.steps, every=every)
        progress.phase("train")
        for i in range(s.steps):
            idx = sampler.next_batch()
            batch = sft_batch(self.train_data, idx, self.tokenizer.eos_token_id)
            m = self.train_policy(batch, loss)
            progress.advance({"nll": f"{m['loss']:.4f}"})
            if ((i + 1) % every == 0 or i == s.steps - 1) and progress.mode != "lines":
                progress.write(f"sft step {i + 1}/{s.steps}: nll {m['loss']:.4f}")
        progress.close()
        self.policy.call(PolicyAPI).rebuild_optimizer()
        if self.use_reference:
            self.policy.call(PolicyAPI).set_reference_to_current()
        self.sft_done = True
        self.algorithm.warm_started(self)

    # ------------------------------------------------------------------ checkpoints
    @functools.cached_property
    def checkpoints(self) -> CheckpointManager:
        """The run's checkpoints (:mod:`mcore_rl.controller.checkpoints`), of every group of
        :meth:`_groups`."""
        return CheckpointManager(self.run_dir, self.cfg.checkpoint, self._groups)

    def save(self, state: Optional[Dict[str, Any]] = None, tensors: Any = None) -> str:
        """Save every worker group and the controller state at the current RL step (atomic;
        with ``checkpoint.async_save`` completed later, see :class:`CheckpointManager`);
        returns the step directory. ``state`` (default :meth:`controller_state`) and
        ``tensors`` are what the loop keeps (:meth:`Loop.controller_state`)."""
        with self.watchdog.phase("checkpoint"):
            self.colocation.prepare_for_training()
            path = self.checkpoints.save(
                self.step, self.controller_state() if state is None else state, tensors)
            self.colocation.prepare_for_generation()
        return path

    def controller_state(self) -> Dict[str, Any]:
        """What a checkpoint keeps of the controller (JSON-serializable): the RL step, the
        prompt sampler, whether the warm start ran, the validation history."""
        return {"step": self.step, "sampler": self.sampler.state_dict(), "sft_done": self.sft_done,
                "history": self.history}

    def load_controller_state(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`controller_state`."""
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        self.sft_done = state["sft_done"]
        self.history = state["history"]

    def resume(self, path: str, warn_schedule: bool = True,
               load_state: Optional[Callable[[Dict[str, Any]], None]] = None) -> str:
        """Load a checkpoint directory (or ``"latest"``); returns the directory loaded. Each
        worker group's LR schedule keeps the checkpoint's progress and takes its settings from
        the configuration; with ``warn_schedule`` a warning names the settings that changed.
        ``"latest"`` is the newest complete checkpoint that loads (a warning names each one
        skipped and why). The controller's state goes to ``load_state`` (default
        :meth:`load_controller_state`; a loop's :meth:`Loop.load_controller_state`).

        Raises:
            DamagedCheckpointError: ``path`` is incomplete, damaged or does not load (naming
                the file); a ``FileNotFoundError``.
            FileNotFoundError: ``path`` is no directory, or ``"latest"`` and no checkpoint
                loads.
        """
        path, state = self.checkpoints.load(path, warn_schedule)
        (load_state or self.load_controller_state)(state)
        return path

    def summary(self) -> Dict[str, Any]:
        """The run's summary: run directory, RL steps, held-out accuracy at the start and the
        end (and the curve), the prompts ``data.filter_long_prompts`` dropped, seconds per step
        of each phase."""
        vals = [h for h in self.history if "val/accuracy" in h]
        out: Dict[str, Any] = {"run_dir": self.run_dir, "steps": self.step}
        if vals:
            out["val_accuracy_start"] = vals[0]["val/accuracy"]
            out["val_accuracy_end"] = vals[-1]["val/accuracy"]
            out["val_accuracy_gain"] = vals[-1]["val/accuracy"] - vals[0]["val/accuracy"]
            out["val_curve"] = [(h["step"], h["val/accuracy"]) for h in vals]
        dropped = {split: data.dropped for split, data in (("train", self.train_data),
                                                           ("test", self.test_data))
                   if data is not None and data.dropped}
        if dropped:  # data.filter_long_prompts
            out["prompts_dropped"] = dropped
        if self.steps_timed:
            out["seconds_per_step"] = {k[len("timing/"):-len("_s")]: v / self.steps_timed
                                       for k, v in self.phase_totals.items()}
        return out

    def close(self) -> None:
        """Shut down the worker groups and the rollout backend, release their placement."""
        for group in self._groups().values():
            group.shutdown()
        self.generation.shutdown()
        if self.learned is not None:
            self.learned.close()
        self.placement.shutdown()
        self._close_scorers()
        self.producer.close()
        self.watchdog.close()


class Loop:
    """An RL loop: runs :meth:`rl_step` on ``trainer`` (the shared machinery) with
    ``algorithm`` (its hooks) from resume to the last step (:meth:`fit`), or evaluates
    (:meth:`evaluate`). Subclasses implement :meth:`rl_step` and extend what a checkpoint
    keeps (:meth:`controller_state`) and how the rollout backend is refit (:meth:`refit`).

    Attributes:
        trainer: the :class:`RLTrainer`.
        algorithm: the :class:`~mcore_rl.controller.algorithm.Algorithm` (``trainer``'s).
    """

    def __init__(self, trainer: RLTrainer, algorithm: Any):
        self.trainer = trainer
        self.algorithm = algorithm

    def rl_step(self) -> Dict[str, float]:
        """One RL step (rollout, updates, refit) at ``trainer.step``; returns its metrics."""
        raise NotImplementedError

    def refit(self) -> Dict[str, float]:
        """The policy's weights into the rollout backend (:meth:`RLTrainer.refit`)."""
        return self.trainer.refit()

    # ------------------------------------------------------------------ checkpoints
    def controller_state(self) -> Dict[str, Any]:
        """What a checkpoint keeps of the controller (JSON-serializable):
        :meth:`RLTrainer.controller_state`."""
        return self.trainer.controller_state()

    def controller_tensors(self) -> Any:
        """What a checkpoint keeps of the controller beyond JSON (``controller.pt``, back in
        the loaded state's ``tensors``): None here (nothing; the streaming loop keeps its
        finished, untrained rollouts)."""
        return None

    def load_controller_state(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`controller_state` (and :meth:`controller_tensors`, under the state's
        ``tensors``)."""
        self.trainer.load_controller_state(state)

    def save(self) -> str:
        """:meth:`RLTrainer.save` with this loop's :meth:`controller_state` and
        :meth:`controller_tensors`; returns the step directory."""
        return self.trainer.save(self.controller_state(), self.controller_tensors())

    def resume(self, path: str, warn_schedule: bool = True) -> str:
        """:meth:`RLTrainer.resume` into this loop's :meth:`load_controller_state`; returns
        the directory loaded."""
        return self.trainer.resume(path, warn_schedule, self.load_controller_state)

    def close(self) -> None:
        """:meth:`RLTrainer.close`."""
        self.trainer.close()

    def _checkpoint_for_preemption(self, signal_name: str) -> Preempted:
        """A complete checkpoint of the current RL step (saved now unless one was saved or
        loaded at this step), and the exception that ends the run for ``signal_name``."""
        tr = self.trainer
        if tr.checkpoints.last_step != tr.step:
            self.save()
        tr.checkpoints.wait()
        path = tr.checkpoints.step_dir(tr.step)
        _log.warning("%s: stopped after RL step %d with checkpoint %s; exit code %d (continue "
                     "with checkpoint.resume=latest)", signal_name, tr.step, path, EXIT_CODE)
        return Preempted(signal_name, path)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> Dict[str, Any]:
        """Resume if asked, warm start, then RL steps with validation, logging and checkpoints
        (every ``checkpoint.every`` steps, and after the last with ``checkpoint.save_final``);
        writes and returns the summary (held-out accuracy at the start and the end).

        Raises:
            Preempted: SIGTERM or SIGUSR1 came (:mod:`mcore_rl.controller.preemption`): the
                open RL step finished and a checkpoint of it is complete; the process exits
                with ``preemption.EXIT_CODE`` unless the caller catches it.
            LogprobBudgetExceeded: the start-up canary, or ``generation.logprob_budget_steps``
                consecutive RL steps, over ``generation.logprob_budget``
                (:mod:`mcore_rl.controller.logprob_budget`): the process exits with its
                ``EXIT_CODE`` (3); nothing of the aborted step was trained or saved.

        A phase past its deadline (:mod:`mcore_rl.controller.watchdog`) ends the process from
        the watchdog's thread with exit code 4, the stacks in ``<run.output_dir>/hang``.
        """
        tr = self.trainer
        cfg, loop = tr.cfg, tr.section
        if cfg.checkpoint.resume:
            self.resume(cfg.checkpoint.resume)
        logger = run_logger(cfg, tr.run_dir, loop.max_steps, tr.step)
        if tr.offload_note:
            logger.write(tr.offload_note)
        preemption = PreemptionSignals()
        try:
            preemption.install()
            if not tr.sft_done:
                tr.warm_start(logger)
            tr.timer.listener = logger.phase  # the progress shows the step's phase
            tr.watchdog.start()
            with tr.watchdog.phase("refit"):
                self.refit()
            if tr.step < loop.max_steps:
                canary = tr.logprob_canary()
                if canary:
                    logger.write(f"logprob canary within generation.logprob_budget="
                                 f"{cfg.generation.logprob_budget:g}: " + ", ".join(
                                     f"{k[len('train/'):]} {v:.4f}" for k, v in canary.items()))
            if tr.step == 0 and loop.val_at_start:
                logger.phase("validation")
                with tr.watchdog.phase("validation"):
                    val = tr.validate()
                if val:
                    tr.history.append({"step": 0, **val})
                    logger.log(0, val, advance=False)
            while tr.step < loop.max_steps:
                if preemption.received:
                    raise self._checkpoint_for_preemption(preemption.received)
                metrics = self.rl_step()
                metrics.update(tr.throughput(metrics))
                tr.step += 1
                if loop.val_every > 0 and (tr.step % loop.val_every == 0 or tr.step == loop.max_steps):
                    start = time.perf_counter()
                    logger.phase("validation")
                    with tr.watchdog.phase("validation"):
                        val = tr.validate()
                    metrics.update(val)
                    metrics["timing/validation_s"] = time.perf_counter() - start
                    if val:
                        tr.history.append({"step": tr.step, **val})
                for k, v in metrics.items():
                    if k.startswith("timing/"):
                        tr.phase_totals[k] = tr.phase_totals.get(k, 0.0) + v
                tr.steps_timed += 1
                logger.log(tr.step, metrics)
                tr.checkpoints.after_step(tr.step, self.save)
            tr.checkpoints.finish(tr.step, self.save)
        except LogprobBudgetExceeded as e:
            tr.checkpoints.wait()  # earlier complete steps' saves; none of the aborted step
            print(f"mcore-rl: error: {e} (exit code {e.code})", file=sys.stderr, flush=True)
            raise
        except BaseException:
            tr.watchdog.hold_if_fired()  # a hang: the watchdog ends the process (exit code 4)
            raise
        finally:
            tr.watchdog.stop()
            preemption.restore()
            tr.timer.listener = None
            logger.close()
        summary = tr.summary()
        with open(os.path.join(tr.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        return summary

    @property
    def eval_stages(self) -> Tuple[str, ...]:
        """The stages of :meth:`evaluate`, as its progress counts them."""
        return ("resume",) * bool(self.trainer.cfg.checkpoint.resume) + ("refit", "validation")

    def evaluate(self, progress: Optional[Progress] = None) -> Dict[str, Any]:
        """``mcore-rl eval``: :meth:`RLTrainer.validate` (greedy with
        ``generation.greedy_validation``, the first ``<algorithm>.val_num_prompts`` held-out
        prompts) for the policy of
        ``checkpoint.resume`` when set, else for the initial weights (``model.hf_path`` or the
        seeded random init); no warm start, no training. Writes ``<run_dir>/eval.json`` and
        returns its contents: the metrics plus ``checkpoint`` (the directory loaded, or None),
        ``step`` (its RL step, 0 without one) and ``num_prompts``. ``progress`` (stages) is told
        of each of :attr:`eval_stages`.

        Raises:
            ConfigError: the task has no held-out prompts.
            FileNotFoundError: ``checkpoint.resume`` names no checkpoint.
        """
        from mcore_rl.config.loader import ConfigError

        tr = self.trainer
        if tr.test_data is None or len(tr.test_data) == 0:
            raise ConfigError("mcore-rl eval needs held-out prompts: data.test_path (gsm8k) or "
                              "data.synthetic.num_test > 0")
        progress = progress or Progress("eval", 0, enabled=False)
        resume = tr.cfg.checkpoint.resume
        checkpoint = None
        if resume:  # no training
            progress.phase("resume")
            checkpoint = self.resume(resume, warn_schedule=False)
            progress.advance({"step": str(tr.step)})
        progress.phase("refit")
        self.refit()
        progress.advance()
        progress.phase("validation")
        val = tr.validate()
        progress.advance({"val_acc": f"{val['val/accuracy']:.3f}"} if val else {})
        out = {"checkpoint": checkpoint, "step": tr.step,
               "num_prompts": min(tr.section.val_num_prompts, len(tr.test_data)), **val}
        with open(os.path.join(tr.run_dir, "eval.json"), "w") as f:
            json.dump(out, f, indent=2)
        return out

"""The single controller of a GRPO run.

Per RL step: sample prompts -> generate ``num_generations`` responses each (rollout backend)
-> score with the verifier -> GRPO group advantages -> old (and reference) logprobs from the
policy -> ``optimizer_steps_per_rollout`` policy updates -> refit the rollout backend with the
new weights -> log. Validation (greedy accuracy on held-out prompts) every ``grpo.val_every``
steps; checkpoints every ``checkpoint.every`` steps. An optional supervised warm start on the
task's reference answers runs first (``sft.steps``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import asdict
from typing import Any, Dict, List, Optional

import torch

from mcore_rl.algorithms.advantages import grpo_advantages
from mcore_rl.algorithms.losses import ClippedPGLoss, NLLLoss
from mcore_rl.config.schema import TrainConfig
from mcore_rl.controller.worker_group import make_worker_group
from mcore_rl.data import batch as B
from mcore_rl.utils.logging import RunLogger
from mcore_rl.utils.timers import PhaseTimer

log = logging.getLogger("mcore_rl.grpo")


def _step_seed(seed: int, step: int, salt: int = 0) -> int:
    """Rollout seed of one step: depends on the run seed and step only, so a resumed run
    samples exactly what a straight run would."""
    return (seed * 1_000_003 + step * 7919 + salt) % (2**31 - 1)


class GRPOTrainer:
    """Holds the run's pieces: tokenizer, prompt data, policy worker group, rollout backend,
    verifier, logger. :meth:`fit` runs the loop; :func:`run` is the CLI entry."""

    def __init__(self, cfg: TrainConfig):
        from mcore_rl.data.prompts import PromptSampler, load_task
        from mcore_rl.data.tokenizer import load_tokenizer
        from mcore_rl.generation.base import get_backend
        from mcore_rl.megatron.conversion import arch_to_hf_config, hf_config_to_arch
        from mcore_rl.megatron.parallel import resolve_device
        from mcore_rl.rewards import get_reward_fn
        from mcore_rl.workers.policy import PolicyWorker

        self.cfg = cfg
        self.device = resolve_device(cfg.cluster.device)
        self.run_dir = cfg.run.output_dir
        os.makedirs(self.run_dir, exist_ok=True)
        self.tokenizer = load_tokenizer(cfg.model)
        self.train_data, self.test_data = load_task(cfg.data, self.tokenizer, cfg.run.seed)
        self.sampler = PromptSampler(len(self.train_data), cfg.grpo.num_prompts_per_step, cfg.run.seed)
        self.reward_fn = get_reward_fn(cfg.reward.name)

        if cfg.model.hf_path:
            from transformers import AutoConfig

            self.hf_config = AutoConfig.from_pretrained(cfg.model.hf_path)
            self.arch = hf_config_to_arch(self.hf_config)
        else:
            arch = cfg.model.arch
            if arch.vocab_size is None:
                arch.vocab_size = len(self.tokenizer)
            self.arch = arch
            self.hf_config = arch_to_hf_config(arch, arch.vocab_size)
        self.hf_config.eos_token_id = self.tokenizer.eos_token_id
        self.hf_config.pad_token_id = self.tokenizer.pad_token_id
        self.vocab_size = self.arch.vocab_size
        self.tokenizer.save_pretrained(os.path.join(self.run_dir, "tokenizer"))

        g = cfg.grpo
        rollout_size = g.num_prompts_per_step * g.num_generations
        self.global_batch_size = rollout_size // g.optimizer_steps_per_rollout
        total_steps = g.max_steps * g.optimizer_steps_per_rollout
        self.use_reference = cfg.loss.kl_coef > 0
        self.policy = make_worker_group(
            PolicyWorker,
            cfg.cluster.num_workers,
            dict(
                hf_path=cfg.model.hf_path,
                hf_config=self.hf_config.to_dict(),
                vocab_size=self.vocab_size,
                temperature=cfg.generation.temperature,
                use_reference=self.use_reference,
                arch=self.arch,
                megatron=cfg.policy.megatron,
                optimizer=cfg.policy.optimizer,
                device=self.device,
                seed=cfg.run.seed,
                total_optimizer_steps=total_steps,
                global_batch_size=self.global_batch_size,
                threads=cfg.cluster.threads_per_worker,
            ),
            use_ray=cfg.cluster.use_ray,
            device=self.device,
            ray_address=cfg.cluster.ray_address,
        )
        layouts = self.policy.call("layout")
        self.dp_size = layouts[0]["dp_size"]
        self.dp_rank_of = [lay["dp_rank"] for lay in layouts]
        self.generation = get_backend(
            cfg.generation.backend,
            hf_config=self.hf_config,
            cfg=cfg.generation,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            max_total_length=cfg.data.max_total_length,
            device="cuda" if self.device == "cuda" else "cpu",
        )
        self.loss_fn = ClippedPGLoss(cfg.loss)
        self.timer = PhaseTimer()
        self.step = 0
        self.sft_done = cfg.sft.steps == 0
        self.history: List[Dict[str, float]] = []

    # ------------------------------------------------------------------ helpers
    def _per_rank(self, batch: B.Batch) -> List[List[Any]]:
        """Split a global batch into DP shards; each rank gets its DP group's shard."""
        shards = B.shard(batch, self.dp_size)
        return [[shards[d]] for d in self.dp_rank_of]

    def _logprobs(self, batch: B.Batch, method: str = "get_logprobs") -> torch.Tensor:
        shards = B.shard(batch, self.dp_size)
        out = self.policy.call_each(method, [[shards[d], self.cfg.policy.logprob_micro_batch_size]
                                             for d in self.dp_rank_of])
        by_dp = {}
        for d, lp in zip(self.dp_rank_of, out):
            by_dp.setdefault(d, lp)
        return torch.cat([by_dp[d] for d in range(self.dp_size)])

    def _train(self, batch: B.Batch, loss_fn) -> Dict[str, float]:
        n = B.batch_size(batch)
        out = self.policy.call_each("train", [[s, loss_fn, n, self.cfg.policy.micro_batch_size]
                                              for [s] in self._per_rank(batch)])
        return out[0]

    def refit(self) -> Dict[str, float]:
        """Stream the policy's Hugging Face-named weights into the rollout backend."""
        start = time.perf_counter()
        weights = self.policy.call("get_hf_weights")[0]
        self.generation.update_weights(weights.items())
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        return {"refit/seconds": time.perf_counter() - start, "refit/gbytes": nbytes / 1e9}

    def _prompts(self, dataset, indices) -> List[List[int]]:
        return [list(dataset.input_ids[i]) for i in indices]

    def _score(self, rollout: B.Batch, examples) -> tuple:
        from mcore_rl.rewards import score_responses

        texts = []
        for row in range(B.batch_size(rollout)):
            p, n = int(rollout["prompt_lengths"][row]), int(rollout["input_lengths"][row])
            texts.append(self.tokenizer.decode(rollout["input_ids"][row, p:n].tolist(),
                                               skip_special_tokens=True))
        rewards, errors = score_responses(self.reward_fn, texts, examples)
        return rewards, errors, texts

    # ------------------------------------------------------------------ phases
    def validate(self) -> Dict[str, float]:
        """Greedy accuracy (mean reward) on up to ``grpo.val_num_prompts`` held-out prompts."""
        if self.test_data is None or len(self.test_data) == 0:
            return {}
        n = min(self.cfg.grpo.val_num_prompts, len(self.test_data))
        idx = list(range(n))
        rollout = self.generation.generate(self._prompts(self.test_data, idx), seed=0,
                                           greedy=self.cfg.generation.greedy_validation)
        rewards, _, _ = self._score(rollout, [self.test_data.examples[i] for i in idx])
        return {"val/accuracy": float(rewards.mean()),
                "val/response_length": float(rollout["response_lengths"].float().mean())}

    def warm_start(self, logger: RunLogger) -> None:
        """Supervised steps on reference solutions (``sft.*``), then the reference policy is
        set to the warm-started weights."""
        from mcore_rl.data.prompts import PromptSampler, sft_batch

        s = self.cfg.sft
        sampler = PromptSampler(len(self.train_data), s.batch_size, self.cfg.run.seed + 1)
        loss = NLLLoss()
        self.policy.call("rebuild_optimizer", s.lr)
        for i in range(s.steps):
            idx = sampler.next_batch()
            batch = sft_batch(self.train_data, idx, self.tokenizer.eos_token_id)
            m = self._train(batch, loss)
            if (i + 1) % max(1, s.steps // 10) == 0 or i == s.steps - 1:
                logger.write(f"sft step {i + 1}/{s.steps}: nll {m['loss']:.4f}")
        self.policy.call("rebuild_optimizer")
        if self.use_reference:
            self.policy.call("set_reference_to_current")
        self.sft_done = True

    def grpo_step(self) -> Dict[str, float]:
        """One RL step; returns its metrics."""
        cfg, g = self.cfg, self.cfg.grpo
        t = self.timer
        with t.phase("step"):
            idx = self.sampler.next_batch()
            prompt_idx = [i for i in idx for _ in range(g.num_generations)]
            with t.phase("generation"):
                rollout = self.generation.generate(self._prompts(self.train_data, prompt_idx),
                                                   seed=_step_seed(cfg.run.seed, self.step))
            with t.phase("reward"):
                rewards, reward_errors, _ = self._score(
                    rollout, [self.train_data.examples[i] for i in prompt_idx])
            n = B.batch_size(rollout)
            rollout["rewards"] = rewards
            rollout["sample_mask"] = torch.ones(n)
            adv = grpo_advantages(rewards, g.num_generations, rollout["sample_mask"],
                                  normalize_std=g.normalize_std, leave_one_out=g.leave_one_out)
            rollout["advantages"] = adv[:, None] * rollout["token_mask"]
            with t.phase("logprobs"):
                rollout["prev_logprobs"] = self._logprobs(rollout)
                if self.use_reference:
                    rollout["reference_logprobs"] = self._logprobs(rollout, "get_reference_logprobs")
            with t.phase("train"):
                train_metrics = [self._train(part, self.loss_fn)
                                 for part in B.shard(rollout, g.optimizer_steps_per_rollout)]
            with t.phase("refit"):
                refit = self.refit()
        mask = rollout["token_mask"][:, 1:]
        mismatch = ((rollout["prev_logprobs"] - rollout["generation_logprobs"]).abs()[:, 1:] * mask)
        metrics = {
            "train/reward_mean": float(rewards.mean()),
            "train/reward_std": float(rewards.std()),
            "train/reward_errors": float(reward_errors),
            "train/response_length": float(rollout["response_lengths"].float().mean()),
            "train/truncated_fraction": float(rollout["truncated"].mean()),
            "train/logprob_mismatch_max": float(mismatch.max()) if mask.sum() > 0 else 0.0,
            "train/num_tokens": float(rollout["input_lengths"].sum()),
        }
        for k in train_metrics[-1]:
            metrics[f"train/{k}"] = sum(m[k] for m in train_metrics) / len(train_metrics)
        metrics.update(refit)
        metrics.update(self.timer.pop())
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def _ckpt_root(self) -> str:
        return os.path.join(self.run_dir, "checkpoints")

    def save(self) -> str:
        path = os.path.join(self._ckpt_root(), f"step_{self.step}")
        self.policy.call("save_checkpoint", os.path.join(path, "policy"))
        state = {"step": self.step, "sampler": self.sampler.state_dict(), "sft_done": self.sft_done,
                 "history": self.history}
        with open(os.path.join(path, "controller.json"), "w") as f:
            json.dump(state, f)
        self._prune_checkpoints()
        return path

    def _prune_checkpoints(self) -> None:
        keep = self.cfg.checkpoint.keep_last
        steps = sorted(int(d.split("_")[1]) for d in os.listdir(self._ckpt_root()) if d.startswith("step_"))
        for s in steps[:-keep] if keep > 0 else []:
            shutil.rmtree(os.path.join(self._ckpt_root(), f"step_{s}"), ignore_errors=True)

    def resume(self, path: str) -> None:
        """Load a checkpoint directory (or ``"latest"``). Raises ``FileNotFoundError`` naming
        ``checkpoint.resume`` when there is none."""
        if path == "latest":
            root = self._ckpt_root()
            steps = sorted(int(d.split("_")[1]) for d in os.listdir(root) if d.startswith("step_")) \
                if os.path.isdir(root) else []
            if not steps:
                raise FileNotFoundError(f"checkpoint.resume=latest: no checkpoint under {root}")
            path = os.path.join(root, f"step_{steps[-1]}")
        state_file = os.path.join(path, "controller.json")
        if not os.path.isfile(state_file):
            raise FileNotFoundError(f"checkpoint.resume={path}: no controller.json there")
        with open(state_file) as f:
            state = json.load(f)
        self.policy.call("load_checkpoint", os.path.join(path, "policy"))
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        self.sft_done = state["sft_done"]
        self.history = state["history"]

    # ------------------------------------------------------------------ the loop
    def fit(self) -> Dict[str, Any]:
        cfg, g = self.cfg, self.cfg.grpo
        if cfg.checkpoint.resume:
            self.resume(cfg.checkpoint.resume)
        logger = RunLogger(self.run_dir, g.max_steps, self.step, cfg.logging.progress,
                           cfg.logging.tensorboard, cfg.logging.jsonl)
        try:
            if not self.sft_done:
                self.warm_start(logger)
            self.refit()
            if self.step == 0 and g.val_at_start:
                val = self.validate()
                if val:
                    self.history.append({"step": 0, **val})
                    logger.log(0, val, advance=False)
            while self.step < g.max_steps:
                metrics = self.grpo_step()
                self.step += 1
                if g.val_every > 0 and (self.step % g.val_every == 0 or self.step == g.max_steps):
                    val = self.validate()
                    metrics.update(val)
                    if val:
                        self.history.append({"step": self.step, **val})
                logger.log(self.step, metrics)
                if cfg.checkpoint.every > 0 and self.step % cfg.checkpoint.every == 0:
                    self.save()
        finally:
            logger.close()
        summary = self._summary()
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        return summary

    def _summary(self) -> Dict[str, Any]:
        vals = [h for h in self.history if "val/accuracy" in h]
        out: Dict[str, Any] = {"run_dir": self.run_dir, "steps": self.step}
        if vals:
            out["val_accuracy_start"] = vals[0]["val/accuracy"]
            out["val_accuracy_end"] = vals[-1]["val/accuracy"]
            out["val_accuracy_gain"] = vals[-1]["val/accuracy"] - vals[0]["val/accuracy"]
            out["val_curve"] = [(h["step"], h["val/accuracy"]) for h in vals]
        return out

    def close(self) -> None:
        self.policy.shutdown()


def run(cfg: TrainConfig) -> Dict[str, Any]:
    """``mcore-rl train``: build, train, print the summary. Returns the summary dict."""
    trainer = GRPOTrainer(cfg)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    if "val_accuracy_start" in summary:
        print(
            f"held-out accuracy: {summary['val_accuracy_start']:.3f} at step 0 -> "
            f"{summary['val_accuracy_end']:.3f} at step {summary['steps']} "
            f"({summary['val_accuracy_gain']:+.3f})"
        )
    print(f"run directory: {summary['run_dir']}")
    return summary

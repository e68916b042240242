"""Exact resume of the streaming loop (GRPO and PPO, DP=2, ``max_staleness=1``): a run saved
mid-stream at step J, thrown away and resumed from that checkpoint ends with the parameters of
a straight run; restored groups train at the staleness they had in the straight run, a restored
group too old for ``max_staleness`` is dropped and generated again, and a checkpoint without the
finished groups (saved before they were kept) still loads (they are generated again). On the
same deterministic GRPO run: ``loss.prev_logprobs=train_forward`` against ``recompute``, and
the logprob budget: on the rows a step's weights decoded, else on the canary decoded after each
refit (steps 2.. here), which a refit that broke the engine's weights sets off.

Determinism. Which groups a streamed step trains with ``max_staleness >= 1`` depends on when
generation calls finish wherever a process may hold fewer calls than the loop wants in flight
(a slot freed in the middle of a step is refilled with this step's weights, one freed after it
with the next step's). Here one generation process decodes a whole step's prompt groups per
call (``generation.batch_size`` = ``num_prompts_per_step * num_generations`` rows), so the
loop's ``max_staleness + 1`` steps' worth of groups fit in the two calls a process holds: every
call is dispatched at the start of a step (with the weights pushed at the end of the step
before), calls finish in the order they were dispatched, and step s trains the groups drawn for
step s - 1 at staleness 1, whatever the timing. The save waits for the calls in flight
(:meth:`StreamingLoop.drain`), so the checkpoint's state does not depend on timing either.

"Thrown away": after the save the run goes on one step, then the same trainer is reset to the
checkpoint as a fresh one would be (the in-flight calls waited for and forgotten, the worker
groups and the controller state loaded from the checkpoint, the generation processes refit),
as tests/test_streaming.py's ``Run.reset`` does.

Tolerance: that of tests/test_streaming.py (``PARITY_RTOL`` of each tensor's update plus
``PARITY_ULPS`` ulps of its largest parameter); the resumed run trains the same rows in the
same chunks as the straight one, and the metrics that count rows, tokens, rewards and
staleness are equal.
"""

from __future__ import annotations

import contextlib
import json
import os
from concurrent.futures import wait

import pytest
import test_streaming_ppo
import torch
from test_streaming import BASE, Run, _assert_same_updates

from mcore_rl.algorithms.registry import build_policy_loss
from mcore_rl.controller.logprob_budget import MISMATCH_KEYS, MISMATCH_TOKENS, LogprobBudgetExceeded

STEPS = 4
SAVE_AT = 2
EXACT = ("train/reward_mean", "train/num_tokens", "stream/staleness_0", "stream/staleness_1",
         "stream/dropped_stale")


def restart(run, path):
    """The trainer as a fresh one resumed from checkpoint ``path`` (module docstring)."""
    loop = run.loop
    wait(list(loop.generating))
    loop.generating.clear()
    loop.resume(path, warn_schedule=False)
    loop.refit()


def worst_ratio(run, actual, expected):
    """Max over tensors of |actual - expected| over the tensor's largest update."""
    e = run.update(expected)
    return max((actual[k] - expected[k]).abs().max().item() / e[k].abs().max().item() for k in e)


class Scenario:
    """A straight run of ``steps`` steps, then from the same start a run saved at ``save_at``
    (``path``; ``state``: its controller.json) that goes on one step (thrown away)."""

    def __init__(self, run, steps=STEPS, save_at=SAVE_AT):
        self.run, self.n, self.save_at = run, steps, save_at
        run.reset()
        self.straight = run.steps(steps)
        self.straight_weights = run.weights()
        run.reset()
        self.saved_run = run.steps(save_at)
        self.path = run.loop.save()
        with open(os.path.join(self.path, "controller.json")) as f:
            self.state = json.load(f)
        run.steps(1)  # the run goes on past its checkpoint, then is thrown away

    def check_exact_resume(self, need):
        """The resumed run's parameters and per-step figures are the straight run's; the
        checkpoint held the ``need`` groups finished for the next step, nothing in flight."""
        run = self.run
        for m, e in zip(self.saved_run, self.straight):  # the straight run is deterministic
            assert all(m[k] == e[k] for k in EXACT)
        restart(run, self.path)
        resumed = run.steps(self.n - self.save_at)
        weights = run.weights()
        print(f"\nresumed vs straight: worst |diff| / update = "
              f"{worst_ratio(run, weights, self.straight_weights):.3g}")
        _assert_same_updates(run, weights, self.straight_weights)
        for m, e in zip(resumed, self.straight[self.save_at:]):
            assert {k: m[k] for k in EXACT} == {k: e[k] for k in EXACT}
        # The restored groups trained at the straight run's staleness, within the bound.
        assert resumed[0]["stream/staleness_1"] == need and resumed[0]["stream/dropped_stale"] == 0
        assert len(self.state["ready"]) == need and self.state["pending"] == []  # drained


@pytest.fixture(scope="module")
def grpo(tmp_path_factory):
    run = Run(tmp_path_factory.mktemp("resume_grpo"),
              ["cluster.num_workers=2", "generation.num_workers=1", "generation.batch_size=16",
               "grpo.max_staleness=1", "checkpoint.keep_last=0"])
    yield Scenario(run)
    run.trainer.close()


def test_streaming_grpo_resume_is_exact(grpo):
    grpo.check_exact_resume(need=4)


def test_restored_group_too_stale_is_dropped(grpo):
    """Resumed with max_staleness=0: the restored groups (version SAVE_AT - 1) would train at
    staleness 1, so the loop drops them and generates them again (``stream/dropped_stale``)."""
    t = grpo.run.trainer
    t.cfg.grpo.max_staleness = 0
    try:
        restart(grpo.run, grpo.path)
        assert [sg.version for sg in grpo.run.loop.ready] == [SAVE_AT - 1] * 4
        m = grpo.run.steps(1)[0]
    finally:
        t.cfg.grpo.max_staleness = 1
    assert m["stream/dropped_stale"] == 4 and m["stream/staleness_0"] == 4


def test_checkpoint_without_ready_groups_loads(grpo):
    """A controller state as saved before the finished groups were kept (every untrained group
    a prompt in ``pending``): it loads, and those groups are generated again."""
    loop = grpo.run.loop
    restart(grpo.run, grpo.path)
    old = {k: v for k, v in grpo.state.items() if k != "ready"}
    old["pending"] = [r[:4] for r in grpo.state["ready"]] + grpo.state["pending"]
    loop.load_controller_state(old)
    assert not loop.ready and len(loop.todo) == 4
    m = grpo.run.steps(1)[0]
    assert m["stream/staleness_0"] == 4  # generated again with the resumed weights


@contextlib.contextmanager
def prev_logprobs(run, mode):
    """``run`` with ``loss.prev_logprobs=mode`` (the config the loops read and the policy loss
    built from it), put back on leaving."""
    t = run.trainer
    was = t.cfg.loss.prev_logprobs
    t.cfg.loss.prev_logprobs = mode
    t.algorithm.loss_fn = build_policy_loss(t.cfg)
    try:
        yield
    finally:
        t.cfg.loss.prev_logprobs = was
        t.algorithm.loss_fn = build_policy_loss(t.cfg)


def test_train_forward_equals_recompute_at_staleness_1(grpo):
    """loss.prev_logprobs=train_forward against recompute on the same streamed run: step 1
    trains rows decoded by its own weights, steps 2..4 rows decoded one version back (staleness
    1). The weights are those of the step's start until its one optimizer step, after every
    chunk's logprob forward and training forward, so the old logprobs are the same numbers
    either way (each chunk is one micro-batch of 4 rows in both forwards, the same fp32
    kernels on CPU): the losses, grad norms and parameters after every step agree to float
    rounding (measured: bitwise). The budget's figures come from the training forward over the
    rows the trained weights decoded: step 1's are recompute's (all its rows count); steps
    2..4 measure no token and log no figures, as recompute's check skips them."""
    run, out = grpo.run, {}
    for mode in ("recompute", "train_forward"):
        with prev_logprobs(run, mode):
            run.reset()
            weights = []
            metrics = run.steps(STEPS, between=lambda i: weights.append(run.weights()) if i else None)
            out[mode] = metrics, weights + [run.weights()]
    (expected, expected_weights), (actual, actual_weights) = out["recompute"], out["train_forward"]
    assert [m["stream/staleness_1"] for m in actual] == [0, 4, 4, 4]
    for step, (m, e) in enumerate(zip(actual, expected), 1):
        assert {k: m[k] for k in EXACT} == {k: e[k] for k in EXACT}, step
        for k in ("train/loss", "train/pg_loss", "train/grad_norm", "train/ratio_mean"):
            assert m[k] == pytest.approx(e[k], rel=1e-6, abs=1e-9), (step, k)
    for step, (a, e) in enumerate(zip(actual_weights, expected_weights), 1):
        print(f"\nstep {step}: train_forward vs recompute, worst |diff| / update = "
              f"{worst_ratio(run, a, e):.3g}")
        _assert_same_updates(run, a, e)
    first, later = actual[0], actual[1:]
    assert first[f"train/{MISMATCH_TOKENS}"] > 0
    for k in MISMATCH_KEYS:  # the trainer against the hf engine: both ~1 (fp32)
        assert first[f"train/{k}"] == pytest.approx(expected[0][f"train/{k}"], rel=1e-5, abs=1e-6), k
    assert first["train/token_mult_prob_error"] < 1.0001
    for m in later:
        assert m[f"train/{MISMATCH_TOKENS}"] == 0 and not set(MISMATCH_KEYS) & {
            k[len("train/"):] for k in m}


def test_train_forward_budget_counts_rows_the_trained_weights_decoded(grpo):
    """train_forward, generation.logprob_budget_steps=1, every chunk's rollout logprobs shifted
    by 0.2 nats before it trains (the loss reads them for its figures only): steps 2..4, whose
    rows were all decoded one version back, measure no token and go on (no canary either:
    grpo.max_steps=0, the loop starts none for a step to come); step 1, decoded by the weights
    it trains, stops the run after its update (the error says it is in memory only)."""
    run, t = grpo.run, grpo.run.trainer
    prepare = t.algorithm.prepare_chunk
    drifting = [False]

    def drift(chunk):
        prepare(chunk)
        if drifting[0]:
            chunk["generation_logprobs"] = chunk["generation_logprobs"] + 0.2 * chunk["token_mask"]

    t.algorithm.prepare_chunk = drift
    t.logprob_budget.steps = 1
    try:
        with prev_logprobs(run, "train_forward"):
            run.reset()
            run.steps(STEPS, between=lambda i: drifting.__setitem__(0, i >= 1))
            assert t.logprob_budget.over == 0
            run.reset()
            with pytest.raises(LogprobBudgetExceeded, match="RL step 1 has.*in memory only") as stop:
                run.steps(1)
        assert stop.value.figures["train/token_mult_prob_error"] == pytest.approx(
            float(torch.tensor(0.2).exp()), rel=1e-4)
    finally:
        del t.algorithm.prepare_chunk
        t.logprob_budget.steps, t.logprob_budget.over = t.cfg.generation.logprob_budget_steps, 0


@contextlib.contextmanager
def counted(run, **cfg):
    """``run`` with ``grpo.max_steps`` set (the loop starts a canary only for a step to come)
    and the ``generation`` keys ``cfg``; yields the budget's observations ``(step, figures,
    canary)`` (:meth:`LogprobBudget.observe`, which ``observe_trained`` calls too). All put
    back on leaving, the count of steps over budget too."""
    t = run.trainer
    budget, gen = t.logprob_budget, t.cfg.generation
    was = {k: getattr(gen, k) for k in cfg}, t.cfg.grpo.max_steps
    seen = []
    observe = budget.observe

    def spy(step, figures, trained=False, canary=0):
        seen.append((step, figures, canary))
        return observe(step, figures, trained, canary)

    for k, v in cfg.items():
        setattr(gen, k, v)
    budget.steps = gen.logprob_budget_steps
    t.cfg.grpo.max_steps = 6
    budget.observe = spy
    try:
        yield seen
    finally:
        del budget.observe
        for k, v in was[0].items():
            setattr(gen, k, v)
        t.cfg.grpo.max_steps = was[1]
        budget.steps, budget.over = gen.logprob_budget_steps, 0


@pytest.mark.parametrize("mode", ["recompute", "train_forward"])
def test_canary_counts_every_stale_step(grpo, mode):
    """Staleness 1: step 1 trains rows decoded by its own weights, steps 2..4 only rows decoded
    one version back. The budget counts step 1 on its rows and steps 2..4 on the canary the
    loop decodes after each refit with the pushed weights (generation.logprob_canary_prompts
    prompts, one response each) and scores with the policy at the same weights: ~1 on fp32,
    logged as canary/*. Without canary prompts steps 2..4 are not counted (the gap it fills).
    With train_forward step 1 is counted after its update, the others before it."""
    run = grpo.run
    with prev_logprobs(run, mode):
        for prompts in (8, 0):
            with counted(run, logprob_canary_prompts=prompts) as seen:
                run.reset()
                metrics = run.steps(STEPS)
            assert [m["stream/staleness_1"] for m in metrics] == [0, 4, 4, 4]
            if not prompts:
                assert [step for step, _, _ in seen] == [1]
                assert not any(k.startswith("canary/") for m in metrics for k in m)
                continue
            assert [(step, canary) for step, _, canary in seen] == [(1, 0), (2, 8), (3, 8), (4, 8)]
            assert not any(k.startswith("canary/") for k in metrics[0])
            for m, (_, figures, _) in zip(metrics[1:], seen[1:]):
                assert 1.0 <= m["canary/token_mult_prob_error"] < 1.0001
                assert m["canary/token_mult_prob_error"] == figures["train/token_mult_prob_error"]
                assert m["canary/logprob_mismatch_max"] < 1e-4 and m["timing/canary_wait_s"] >= 0


def test_corrupted_refit_stops_the_run_on_the_canary(grpo, capsys):
    """The generation process loads the weights of policy versions >= 2 scaled by 1.2 (a refit
    that broke the engine's weights; versions 0 and 1 load clean), generation.
    logprob_budget_steps=2: the rows steps 2..4 train were all decoded one version back, so
    only the canary measures the refits. Step 2 (version 1) is within budget, step 3 (version
    2) over, step 4 the second over: fit stops with exit code 3 before step 4's optimizer step
    (the parameters are those after step 3), the error naming the canary."""
    from test_streaming import CORRUPT_SCALE

    from mcore_rl.controller.logprob_budget import EXIT_CODE

    run, t, loop = grpo.run, grpo.run.trainer, grpo.run.loop
    before = {}
    rl_step = loop.rl_step

    def record_then_step():
        before[t.step + 1] = run.weights()
        return rl_step()

    with counted(run, logprob_budget_steps=2) as seen:
        run.reset()
        t.generation.group.call_each("set_fault", [["corrupt", 2]], ranks=[0])
        loop.rl_step = record_then_step
        try:
            with pytest.raises(SystemExit) as stop:
                loop.fit()
        finally:
            del loop.rl_step
            t.generation.group.call_each("set_fault", [[None, None]], ranks=[0])
        assert isinstance(stop.value, LogprobBudgetExceeded)
        assert stop.value.code == EXIT_CODE == 3 and stop.value.step == 4 and t.step == 3
        after = run.weights()
        run.reset()  # clean weights into the engine again
    assert [(step, canary) for step, _, canary in seen] == [(1, 0), (2, 8), (3, 8), (4, 8)]
    mult = [figures["train/token_mult_prob_error"] for _, figures, _ in seen]
    assert mult[0] < 1.0001 and mult[1] < 1.0001 and min(mult[2:]) > 1.05, (CORRUPT_SCALE, mult)
    assert all(torch.equal(after[k], before[4][k]) for k in after)  # step 4 trained nothing
    assert any(not torch.equal(before[3][k], before[4][k]) for k in after)  # step 3 did
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("mcore-rl: error: logprob budget exceeded for 2 consecutive RL steps")
    assert "RL step 4 has" in err and "on a canary of 8 prompts decoded after the refit" in err
    assert err.endswith("(exit code 3)")


@pytest.fixture(scope="module")
def ppo(tmp_path_factory):
    run = Run(tmp_path_factory.mktemp("resume_ppo"),
              ["generation.batch_size=16", "ppo.max_staleness=1", "checkpoint.keep_last=0"],
              config="ppo_synthetic", base=test_streaming_ppo.BASE)
    yield Scenario(run, steps=3)  # a critic warm-up step, then 2 policy steps
    run.trainer.close()


def test_streaming_ppo_resume_is_exact(ppo):
    """PPO (one critic warm-up step): the policy's and the critic's parameters."""
    assert any(k.startswith("value/") for k in ppo.straight_weights)
    ppo.check_exact_resume(need=8)

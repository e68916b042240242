"""The logprob budget (``generation.logprob_budget``): a planted drift of the rollout logprobs
stops the run at start-up (the canary) or after ``logprob_budget_steps`` consecutive RL steps,
before an optimizer step, with one line naming backend, precision, layout and the figures and
exit code 3; a clean run passes. The drift: the hf backend's ``generation_logprobs`` shifted by
0.2 nats on the response tokens (token_mult_prob_error exp(0.2) = 1.22 > 1.05), which leaves the
rollouts and the loss (ppo_clip uses the trainer's ``prev_logprobs``) as they were."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.cli import main
from mcore_rl.config.loader import load_config
from mcore_rl.controller.loops import build
from mcore_rl.controller.logprob_budget import EXIT_CODE, LogprobBudget, LogprobBudgetExceeded
from mcore_rl.generation.hf import HFGenerationBackend

SMALL = [
    "cluster.use_ray=false",
    # the tests plant their drift on the backend's generate(); scoring while decoding takes the
    # rollout through generate_async instead (the same rollouts and rewards)
    "reward.score_while_decoding=false",
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations=2",
    "grpo.val_every=0",
    "grpo.val_at_start=false",
    "sft.steps=0",
    "logging.progress=false",
    "logging.tensorboard=false",
    "data.synthetic.num_train=20",
    "data.synthetic.num_test=4",
    "policy.micro_batch_size=4",
    "generation.logprob_canary_prompts=4",
    "model.arch.num_layers=2",
    "model.arch.hidden_size=32",
    "model.arch.ffn_hidden_size=64",
    "policy.optimizer.weight_decay=0.1",  # every optimizer step moves the weights
]
SHIFT = 0.2


def _drifting(generate, when):
    """``generate`` whose rollouts' response logprobs are shifted by :data:`SHIFT` while
    ``when()`` holds."""

    def wrapped(*args, **kwargs):
        rollout = generate(*args, **kwargs)
        if when():
            rollout["generation_logprobs"] = rollout["generation_logprobs"] + SHIFT * rollout["token_mask"]
        return rollout

    return wrapped


def _alternating_drift(generate, expected):
    """``generate`` whose rollouts' response logprobs are shifted by ``2 * SHIFT`` at odd
    positions and not at even ones; appends to ``expected`` the token_mult_prob_error this drift
    alone gives each rollout: the mean of ``exp(drift)`` over its response tokens (1.197 and
    1.295 in the two-step runs below, where ``exp`` of the mean |gap| gives 1.174 and 1.271, and
    the trainer's logprobs against themselves 1.0)."""

    def wrapped(*args, **kwargs):
        rollout = generate(*args, **kwargs)
        mask = rollout["token_mask"]
        drift = 2 * SHIFT * (torch.arange(mask.shape[1]) % 2) * mask
        rollout["generation_logprobs"] = rollout["generation_logprobs"] + drift
        expected.append(float((drift.exp() * mask).sum() / mask.sum()))
        return rollout

    return wrapped


def test_drift_refused_at_start_up_with_exit_code_3(tmp_path, monkeypatch, capsys):
    original = HFGenerationBackend.generate
    monkeypatch.setattr(HFGenerationBackend, "generate",
                        lambda self, *a, **k: _drifting(lambda *b, **c: original(self, *b, **c),
                                                        lambda: True)(*a, **k))
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:
        main(["train", *SMALL, "grpo.max_steps=2", "checkpoint.every=1", f"run.output_dir={out}"])
    assert stop.value.code == EXIT_CODE == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("mcore-rl: error: logprob budget exceeded at start-up")
    for part in ("generation.backend=hf", "policy.megatron.precision=fp32", "layout TP=1 PP=1 DP=1",
                 "> generation.logprob_budget=1.05", "canary of 4 prompts",
                 f"train/token_mult_prob_error {torch.tensor(SHIFT).exp():.4f}",
                 f"max {SHIFT:.4f}"):
        assert part in err, part
    assert not (out / "checkpoints").exists()  # nothing trained, nothing saved


def test_drift_from_step_2_stops_at_step_3_before_its_optimizer_step(tmp_path):
    """k = 2: step 2 (the first over budget) trains, step 3 (the second) is aborted before its
    optimizer step: the policy's parameters are those after step 2 and no step_3 checkpoint
    exists. Steps within budget (the canary, step 1) pass."""
    cfg = load_config("grpo_synthetic", SMALL + [
        "grpo.max_steps=5", "checkpoint.every=1", "checkpoint.save_final=false",
        "generation.logprob_budget_steps=2", f"run.output_dir={tmp_path / 'run'}"])
    loop = build(cfg)
    trainer = loop.trainer
    after = {}  # RL step -> the rollout engine's weights at its start (refit: the policy's)
    generate = trainer.generation.generate

    def record_then_generate(*args, **kwargs):
        after[trainer.step] = {k: v.clone() for k, v in trainer.generation.model.state_dict().items()}
        return generate(*args, **kwargs)

    trainer.generation.generate = _drifting(record_then_generate, lambda: trainer.step + 1 >= 2)
    try:
        with pytest.raises(LogprobBudgetExceeded) as stop:
            loop.fit()
        assert stop.value.step == 3 and trainer.step == 2
        assert trainer.logprob_budget.over == 2
        assert "for 2 consecutive RL steps" in stop.value.message
        assert stop.value.figures["train/token_mult_prob_error"] == pytest.approx(
            float(torch.tensor(SHIFT).exp()), rel=1e-4)
        checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
        assert checkpoints == ["step_1", "step_2"]
        trainer.refit()  # the policy's current weights into the rollout engine
        now = trainer.generation.model.state_dict()
        assert any(not torch.equal(after[1][k], after[2][k]) for k in now)  # steps do train
        for k, v in now.items():
            assert torch.equal(v, after[2][k]), k  # step 3 did not
    finally:
        trainer.close()


def test_budget_counts_consecutive_steps_and_null_disables():
    cfg = load_config("grpo_synthetic", ["generation.logprob_budget_steps=2"])
    budget = LogprobBudget(cfg)
    over = {"train/token_mult_prob_error": 1.2, "train/logprob_mismatch_mean": 0.2,
            "train/logprob_mismatch_max": 0.2}
    within = {**over, "train/token_mult_prob_error": 1.01}
    budget.observe(1, over)
    budget.observe(2, within)  # resets the count
    budget.observe(3, over)
    with pytest.raises(LogprobBudgetExceeded, match="RL step 4 has"):
        budget.observe(4, over)
    unchecked = LogprobBudget(load_config("grpo_synthetic", ["generation.logprob_budget=null"]))
    for step in range(1, 5):
        unchecked.observe(step, over)
    unchecked.check_canary(over, 8)


def test_trained_figures_of_no_token_are_not_counted():
    """observe_trained (loss.prev_logprobs=train_forward): the update's figures count as
    observe's after the step; a step that measured no token (every streamed row decoded one
    version back) neither counts nor resets, and its 0-over-0 figures leave the metrics."""
    from mcore_rl.controller.logprob_budget import MISMATCH_TOKENS

    budget = LogprobBudget(load_config("grpo_synthetic", ["generation.logprob_budget_steps=2"]))
    over = {"train/token_mult_prob_error": 1.2, "train/logprob_mismatch_mean": 0.2,
            "train/logprob_mismatch_max": 0.2, f"train/{MISMATCH_TOKENS}": 30.0, "train/loss": 0.1}
    budget.observe_trained(1, dict(over))
    none = {k: 0.0 for k in over}
    budget.observe_trained(2, none)
    assert budget.over == 1 and none == {f"train/{MISMATCH_TOKENS}": 0.0, "train/loss": 0.0}
    with pytest.raises(LogprobBudgetExceeded, match="RL step 3 has.*in memory only"):
        budget.observe_trained(3, dict(over))


def test_ppo_step_over_budget_trains_neither_policy_nor_critic(tmp_path):
    """PPO, k = 1, drift from RL step 1 (the canary, the first generate call, is clean): step
    1 stops right after the policy's logprobs, before the critic's values and any update."""
    cfg = load_config("ppo_synthetic", [
        *[o for o in SMALL if not o.startswith("grpo.")], "ppo.num_prompts_per_step=4",
        "ppo.ppo_epochs=1", "ppo.num_mini_batches=1", "ppo.val_every=0", "ppo.val_at_start=false",
        "ppo.max_steps=2", "value.micro_batch_size=4", "value.optimizer.weight_decay=0.1",
        "generation.logprob_budget_steps=1", f"run.output_dir={tmp_path / 'run'}"])
    loop = build(cfg)
    trainer = loop.trainer
    calls = []
    generate = trainer.generation.generate
    trainer.generation.generate = _drifting(lambda *a, **k: calls.append(1) or generate(*a, **k),
                                            lambda: len(calls) > 1)

    def weights():
        return {f"{name}/{k}": v for name, group in trainer._groups().items()
                for k, v in group.call("get_hf_weights")[0].items()}

    try:
        before = weights()
        with pytest.raises(LogprobBudgetExceeded, match="RL step 1 has") as stop:
            loop.fit()
        assert stop.value.step == 1 and trainer.step == 0 and len(calls) == 2
        after = weights()
        assert any(k.startswith("value/") for k in after)
        assert all(torch.equal(before[k], after[k]) for k in before)
    finally:
        trainer.close()


def test_train_forward_loss_equals_recompute_with_detached_logprobs():
    """loss.prev_logprobs=train_forward: the loss and its gradient are those of the recompute
    path given prev_logprobs = the logprobs detached (ratio 1), and the loss's mismatch
    metrics are mismatch_figures' numbers on the same batch (with a padded row and a masked
    token); with the streaming loop's on_policy rows, those of its on_policy rows alone (the
    loss unchanged), divided by their own token count."""
    from mcore_rl.algorithms.losses import ClippedPGLoss
    from mcore_rl.config.schema import LossConfig
    from mcore_rl.controller.logprob_budget import MISMATCH_KEYS, MISMATCH_TOKENS, mismatch_figures

    g = torch.Generator().manual_seed(0)
    b, s = 3, 7
    mask = torch.ones(b, s)
    mask[:, 0] = 0
    mask[1, 5:] = 0
    batch = {"token_mask": mask, "sample_mask": torch.ones(b),
             "advantages": torch.randn(b, s, generator=g) * mask,
             "generation_logprobs": -torch.rand(b, s, generator=g) * mask}
    base = torch.randn(b, s, generator=g) * mask - 1.0

    def run(loss, extra):
        lp = base.clone().requires_grad_(True)
        total, count, metrics = loss(lp, {**batch, **extra(lp)})
        (grad,) = torch.autograd.grad(total, lp)
        return total.detach(), grad, metrics

    ref_total, ref_grad, _ = run(ClippedPGLoss(LossConfig()),
                                 lambda lp: {"prev_logprobs": lp.detach().clone()})
    total, grad, metrics = run(ClippedPGLoss(LossConfig(prev_logprobs="train_forward")),
                               lambda lp: {})
    assert torch.equal(total, ref_total) and torch.equal(grad, ref_grad)
    figures = mismatch_figures({**batch, "prev_logprobs": base})
    tokens = float(metrics["num_valid_tokens"])
    assert float(metrics["token_mult_prob_error"]) / tokens == pytest.approx(
        figures["train/token_mult_prob_error"], rel=1e-6)
    assert float(metrics["logprob_mismatch_mean"]) / tokens == pytest.approx(
        figures["train/logprob_mismatch_mean"], rel=1e-6)
    assert float(metrics["logprob_mismatch_max"]) == pytest.approx(
        figures["train/logprob_mismatch_max"], rel=1e-6)
    assert float(metrics[MISMATCH_TOKENS]) == tokens
    kinds = ClippedPGLoss(LossConfig(prev_logprobs="train_forward")).metric_kinds
    assert set(MISMATCH_KEYS) | {MISMATCH_TOKENS} <= set(kinds)
    assert not set(MISMATCH_KEYS) & set(ClippedPGLoss(LossConfig()).metric_kinds)

    rows = [0, 2]  # rows 0 and 2 decoded by the weights being trained, row 1 one version back
    on_policy = torch.tensor([1.0, 0.0, 1.0])
    part_total, part_grad, part = run(ClippedPGLoss(LossConfig(prev_logprobs="train_forward")),
                                      lambda lp: {"on_policy": on_policy})
    assert torch.equal(part_total, ref_total) and torch.equal(part_grad, ref_grad)
    figures = mismatch_figures({k: v[rows] for k, v in {**batch, "prev_logprobs": base}.items()})
    measured = float(part[MISMATCH_TOKENS])
    assert measured == float(mask[rows, 1:].sum()) < tokens
    for key in MISMATCH_KEYS:
        divide = measured if kinds[key] == MISMATCH_TOKENS else 1.0
        assert float(part[key]) / divide == pytest.approx(figures[f"train/{key}"], rel=1e-6), key


def test_train_forward_same_update_as_recompute_and_budget_stops_after_the_step(tmp_path):
    """Two RL steps with loss.prev_logprobs=train_forward give the parameters of the recompute
    path (fp32; the recomputed logprobs differ from the training forward's only by summation
    order) and the same mismatch figures: those of a drift planted per token, which moves the
    figures and not the loss (generation.logprob_budget=null lets it train); a drift from step 2
    with k = 2 stops the run at step 3 after its optimizer step (the error says so), saving
    nothing of step 3."""
    import json

    finals, figures, expected = {}, {}, {}
    for mode in ("recompute", "train_forward"):
        cfg = load_config("grpo_synthetic", SMALL + [
            "grpo.max_steps=2", "checkpoint.every=0", "checkpoint.save_final=false",
            "generation.logprob_budget=null",
            f"loss.prev_logprobs={mode}", f"run.output_dir={tmp_path / mode}"])
        loop = build(cfg)
        trainer = loop.trainer
        expected[mode] = []
        trainer.generation.generate = _alternating_drift(trainer.generation.generate, expected[mode])
        try:
            loop.fit()
            trainer.refit()  # the policy's weights into the hf rollout model
            finals[mode] = {k: v.clone() for k, v in trainer.generation.model.state_dict().items()}
        finally:
            trainer.close()
        rows = [json.loads(line) for line in open(tmp_path / mode / "metrics.jsonl")]
        figures[mode] = [r["train/token_mult_prob_error"] for r in rows
                         if "train/token_mult_prob_error" in r]
    assert len(figures["train_forward"]) == len(expected["train_forward"]) == 2
    assert expected["train_forward"] == pytest.approx(expected["recompute"], rel=1e-6)  # same rollouts
    for mode in ("recompute", "train_forward"):  # the trainer's own gap: ~1e-7 nats (fp32)
        assert figures[mode] == pytest.approx(expected[mode], rel=1e-5), mode
    assert figures["train_forward"] == pytest.approx(figures["recompute"], rel=1e-5)
    for k, v in finals["recompute"].items():
        torch.testing.assert_close(finals["train_forward"][k], v, rtol=1e-5, atol=1e-6, msg=k)
    cfg = load_config("grpo_synthetic", SMALL + [
        "grpo.max_steps=5", "checkpoint.every=1", "checkpoint.save_final=false",
        "loss.prev_logprobs=train_forward", "generation.logprob_budget_steps=2",
        f"run.output_dir={tmp_path / 'run'}"])
    loop = build(cfg)
    trainer = loop.trainer
    trainer.generation.generate = _drifting(trainer.generation.generate,
                                            lambda: trainer.step + 1 >= 2)
    try:
        with pytest.raises(LogprobBudgetExceeded) as stop:
            loop.fit()
        assert stop.value.step == 3 and "in memory only" in stop.value.message
        assert stop.value.figures["train/token_mult_prob_error"] == pytest.approx(
            float(torch.tensor(SHIFT).exp()), rel=1e-4)
        checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
        assert checkpoints == ["step_1", "step_2"]
    finally:
        trainer.close()


def test_train_forward_refused_where_the_old_policy_is_not_the_trained_one():
    """Refused, in one line naming the keys, where the weights change between the logprob
    forward and the training forward or the old logprobs are read before training, streamed
    or not (streaming refuses these keys on its own line as well); allowed with
    grpo.streaming=true otherwise."""
    from mcore_rl.config.checks import ConfigError

    streamed = ["grpo.streaming=true", "generation.num_workers=1"]
    for bad, key in (("grpo.optimizer_steps_per_rollout=2", "grpo.optimizer_steps_per_rollout=2"),
                     ("grpo.reward_kl_coef=0.1", "grpo.reward_kl_coef=0.1")):
        for extra in ([], streamed):
            with pytest.raises(ConfigError, match="loss.prev_logprobs=train_forward") as err:
                load_config("grpo_synthetic", ["loss.prev_logprobs=train_forward", bad, *extra])
            ours = [line for line in str(err.value).splitlines()
                    if "loss.prev_logprobs=train_forward needs" in line]
            assert len(ours) == 1 and key in ours[0] and "grpo.streaming" not in ours[0]
    with pytest.raises(ConfigError, match="algorithm=ppo"):
        load_config("ppo_synthetic", ["loss.prev_logprobs=train_forward"])
    cfg = load_config("grpo_synthetic", ["loss.prev_logprobs=train_forward", "loss.kl_coef=0.1",
                                         "grpo.max_staleness=1", *streamed])
    assert cfg.grpo.streaming and cfg.loss.prev_logprobs == "train_forward"

"""The algorithms behind ``loss.name`` and ``grpo.advantage_estimator`` (GSPO, RLOO,
REINFORCE++, Dr. GRPO through the registry) and DAPO's rollout-side functions, against numbers
worked out by hand in the comments."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mcore_rl.algorithms import dapo, registry
from mcore_rl.algorithms.advantages import reinforce_plus_plus_advantages
from mcore_rl.algorithms.losses import ClippedPGLoss, GSPOLoss
from mcore_rl.config.checks import ConfigError
from mcore_rl.config.loader import validate
from mcore_rl.config.schema import LossConfig, TrainConfig

T = torch.tensor


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual).float(),
                               torch.as_tensor(expected, dtype=torch.float32), rtol=tol, atol=tol)


def config(**sections):
    """TrainConfig with the given sections' fields replaced: config(grpo=dict(...))."""
    cfg = TrainConfig()
    for name, fields in sections.items():
        setattr(cfg, name, dataclasses.replace(getattr(cfg, name), **fields))
    return cfg


# --------------------------------------------------------------------------- GSPO

def gspo_batch():
    """Row 0: tokens t=1,2 with log ratios 0.2, 0.0 (mean 0.1: s = e^0.1 = 1.10517), A = +1.
    Row 1: t=1..3 with log ratios 0.1, -0.1, -0.3 (mean -0.1: s = e^-0.1 = 0.904837), A = +1,
    and a hole at t=2 of row 0's width (token_mask 0 at t=3 of row 0).
    Row 2: sample_mask 0, garbage."""
    token_mask = T([[0, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.float32)
    prev = torch.full((3, 5), -1.0)
    log_ratio = T([[0, 0.2, 0.0, 9.0, 0], [0, 0.1, -0.1, -0.3, 0], [0, 50, 50, 50, 50]])
    logprobs = prev + log_ratio
    logprobs[:, 0] = 0.0
    adv = T([[0, 1, 1, 1, 0], [0, 1, 1, 1, 0], [float("nan")] * 5])
    batch = {"token_mask": token_mask, "sample_mask": T([1.0, 1, 0]), "advantages": adv,
             "prev_logprobs": prev}
    return logprobs, batch


def test_gspo_sequence_ratio_clipping_and_gradient():
    # Clip range [0.95, 1.05]: row 0's s = 1.10517 > 1.05 with A > 0 -> clipped, per-token
    # loss -1.05, gradient 0; row 1's s = 0.904837 < 0.95 with A > 0 -> unclipped (PPO's
    # pessimism), per-token loss -0.904837, gradient of the sequence mean -A*s/3 per token.
    # seq-mean-token-mean: -1.05 + -0.904837 over 2 sequences.
    logprobs, batch = gspo_batch()
    fn = GSPOLoss(LossConfig(name="gspo", ratio_clip_low=0.05, ratio_clip_high=0.05,
                             aggregation="seq-mean-token-mean"))
    lp = logprobs.clone().requires_grad_(True)
    loss_sum, count, metrics = fn(lp, batch)
    s1 = math.exp(-0.1)
    close(loss_sum, -1.05 - s1)
    close(count, 2.0)
    close(metrics["clip_fraction"], 2.0)                  # both tokens of row 0
    close(metrics["ratio_mean"], 2 * math.exp(0.1) + 3 * s1)
    (grad,) = torch.autograd.grad(loss_sum, lp)
    expected = torch.zeros(3, 5)
    expected[1, 1:4] = -s1 / 3
    close(grad, expected)


def test_gspo_differs_from_token_ratios_and_equals_them_on_policy():
    # On policy (logprobs == prev) every ratio is 1: GSPO and PPO-clip agree, value and grad.
    logprobs, batch = gspo_batch()
    batch["prev_logprobs"] = logprobs.detach().clone()
    cfg = LossConfig(aggregation="seq-mean-token-mean")
    lp = logprobs.clone().requires_grad_(True)
    gspo_sum = GSPOLoss(dataclasses.replace(cfg, name="gspo"))(lp, batch)[0]
    ppo_sum = ClippedPGLoss(cfg)(lp, batch)[0]
    close(gspo_sum, ppo_sum)
    close(torch.autograd.grad(gspo_sum, lp)[0], torch.autograd.grad(ppo_sum, lp)[0])
    # Off policy, row 1's token ratios e^0.1, e^-0.1, e^-0.3 differ from its sequence ratio.
    logprobs, batch = gspo_batch()
    assert not torch.isclose(GSPOLoss(cfg)(logprobs, batch)[0], ClippedPGLoss(cfg)(logprobs, batch)[0])


# --------------------------------------------------------------------------- estimators

def group_rollout(rewards, sample_mask=None, width=4):
    n = len(rewards)
    token_mask = torch.zeros(n, width)
    token_mask[:, 1:3] = 1
    return {"rewards": T(rewards), "token_mask": token_mask,
            "sample_mask": T(sample_mask) if sample_mask else torch.ones(n),
            "prev_logprobs": torch.zeros(n, width)}


@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_estimator_both_normalizations(normalize_std):
    # Group [3, 1, 2, 6]: mean 3, deviations 0, -2, -1, 3; unbiased var 14/3.
    rollout = group_rollout([3.0, 1, 2, 6])
    adv = registry.advantage_estimator("grpo")(
        rollout, config(grpo=dict(num_generations=4, normalize_std=normalize_std)))
    scale = math.sqrt(14 / 3) + 1e-6 if normalize_std else 1.0
    expected = torch.tensor([0.0, -2, -1, 3])[:, None] / scale * rollout["token_mask"]
    close(adv, expected)


def test_rloo_estimator_leave_one_out_without_std():
    # Group [3, 1, 2, 6] with the third masked: valid 3, 1, 6 (sum 10); baselines are the means
    # of the other two: 3.5, 4.5, 2 -> -0.5, -3.5, 4; masked sample 0. Not divided by any std,
    # whatever grpo.normalize_std says.
    rollout = group_rollout([3.0, 1, 2, 6], sample_mask=[1.0, 1, 0, 1])
    adv = registry.advantage_estimator("rloo")(
        rollout, config(grpo=dict(num_generations=4, normalize_std=True)))
    close(adv[:, 1], [-0.5, -3.5, 0, 4])
    close(adv[:, 0], [0, 0, 0, 0])                         # off the response tokens


def test_reinforce_plus_plus_hand_values_with_kl_and_a_hole():
    # Row 0 rewarded 1, tokens t=1, 2, 4 (hole at 3); row 1 rewarded 0, tokens t=1, 2; KL 1 per
    # token, coefficient 0.1. Token rewards: row 0 -0.1, -0.1, 0.9 (outcome on t=4); row 1
    # -0.1, -0.1. Reward-to-go (gamma 1): row 0 0.7, 0.8, 0.9; row 1 -0.2, -0.1. Whitened over
    # the 5 valid tokens: mean 0.42, deviations .28 .38 .48 -.62 -.52, unbiased var 1.108 / 4.
    mask = T([[0, 1, 1, 0, 1], [0, 1, 1, 0, 0]], dtype=torch.float32)
    kl = torch.ones(2, 5)
    adv = reinforce_plus_plus_advantages(T([1.0, 0.0]), mask, kl, kl_coef=0.1)
    std = math.sqrt(1.108 / 4 + 1e-8)
    close(adv, T([[0, 0.28, 0.38, 0, 0.48], [0, -0.62, -0.52, 0, 0]]) / std)
    # Without the KL: returns 1, 1, 1 | 0, 0: mean 0.6, deviations .4 x3, -.6 x2, var 1.2 / 4.
    adv = reinforce_plus_plus_advantages(T([1.0, 0.0]), mask)
    std = math.sqrt(0.3 + 1e-8)
    close(adv, T([[0, 0.4, 0.4, 0, 0.4], [0, -0.6, -0.6, 0, 0]]) / std)


def test_reinforce_plus_plus_estimator_takes_kl_from_the_logprobs():
    # prev - reference = 0.5 per token, k1 = 0.5, coefficient 0.2: the same as an explicit KL.
    # Global normalization mixes the groups (no per-prompt baseline); sample 2 is dropped.
    rollout = group_rollout([1.0, 0, 1, 0.5], sample_mask=[1.0, 1, 0, 1])
    rollout["reference_logprobs"] = rollout["prev_logprobs"] - 0.5
    cfg = config(grpo=dict(num_generations=2, advantage_estimator="reinforce_plus_plus",
                           reward_kl_coef=0.2))
    adv = registry.advantage_estimator("reinforce_plus_plus")(rollout, cfg)
    mask = rollout["token_mask"] * rollout["sample_mask"][:, None]
    mask[:, 0] = 0
    expected = reinforce_plus_plus_advantages(rollout["rewards"], mask, 0.5 * torch.ones(4, 4), 0.2)
    close(adv, expected)
    assert adv[2].abs().sum() == 0


# --------------------------------------------------------------------------- DAPO

def test_overlong_penalty_hand_values():
    # L_max 5, L_cache 2: soft zone 4..5: lengths 3 -> 0, 4 -> (3 - 4) / 2 = -0.5, 5 -> -1.
    lengths = T([1, 3, 4, 5])
    close(dapo.overlong_penalty(lengths, 5, 2), [0, 0, -0.5, -1])
    close(dapo.overlong_penalty(lengths, 5, 2, penalty_factor=0.5), [0, 0, -0.25, -0.5])
    close(dapo.overlong_penalty(lengths, 5, 0), [0, 0, 0, 0])
    with pytest.raises(ValueError, match="grpo.overlong_buffer_length"):
        dapo.overlong_penalty(lengths, 5, 6)


def test_informative_groups_ignore_masked_samples():
    rewards = T([1.0, 1, 1, 0, 1, float("nan"), 0.5, 0.5])
    mask = T([1.0, 1, 1, 1, 1, 0, 1, 1])
    # [1, 1] equal; [1, 0] differ; [1, masked] one valid: equal; [.5, .5] equal.
    assert dapo.informative_groups(rewards, mask, 2).tolist() == [False, True, False, False]
    with pytest.raises(ValueError, match="divisible"):
        dapo.informative_groups(rewards, mask, 3)


def draws_of(reward_lists):
    """A draw function returning scored rollouts with the given rewards in turn (row ids in
    ``id``)."""
    it = iter(reward_lists)
    counter = [0]

    def draw():
        rewards = T(next(it))
        ids = torch.arange(counter[0], counter[0] + len(rewards))
        counter[0] += len(rewards)
        return {"rewards": rewards, "sample_mask": torch.ones(len(rewards)), "id": ids,
                "token_mask": torch.ones(len(rewards), 3)}
    return draw


def test_dynamic_sampling_keeps_informative_groups_until_full():
    # Groups of 2, 3 needed. Draw 1: [1,1] [0,1] [0,0] -> 1 kept (ids 2, 3); draw 2: [1,0]
    # [0,1] [1,1] -> 2 kept (ids 6..9): full after 2 tries; 3 of 6 groups informative.
    draw = draws_of([[1.0, 1, 0, 1, 0, 0], [1.0, 0, 0, 1, 1, 1], [0.0, 1, 0, 1, 0, 1]])
    batch, metrics = dapo.dynamic_sampling(draw, num_groups=3, group_size=2, max_tries=4)
    assert batch["id"].tolist() == [2, 3, 6, 7, 8, 9]
    assert metrics == {"dynamic_sampling_tries": 2.0, "dynamic_sampling_kept_fraction": 0.5,
                       "dynamic_sampling_filled": 0.0}


def test_dynamic_sampling_cap_fills_with_dropped_groups():
    # One try allowed: 1 informative group (ids 2, 3); 2 fillers from the dropped groups.
    draw = draws_of([[1.0, 1, 0, 1, 0, 0], [1.0, 0, 1, 0, 1, 0]])
    batch, metrics = dapo.dynamic_sampling(draw, num_groups=3, group_size=2, max_tries=1)
    assert batch["id"].tolist() == [2, 3, 0, 1, 4, 5]
    assert metrics["dynamic_sampling_tries"] == 1 and metrics["dynamic_sampling_filled"] == 2
    # More informative groups than needed: the first ones are kept.
    draw = draws_of([[1.0, 0, 0, 1, 1, 0]])
    batch, _ = dapo.dynamic_sampling(draw, num_groups=2, group_size=2, max_tries=1)
    assert batch["id"].tolist() == [0, 1, 2, 3]


# --------------------------------------------------------------------------- registry and config

def test_registry_names_are_the_schema_choices_and_build_their_classes():
    from mcore_rl.config import checks

    fields = {f.name: f for f in dataclasses.fields(LossConfig)}
    assert fields["name"].metadata[checks.CHOICES] == tuple(registry.POLICY_LOSSES)
    assert type(registry.build_policy_loss(config(loss=dict(name="gspo")))) is GSPOLoss
    loss = registry.build_policy_loss(config(loss=dict(aggregation="seq-mean-token-sum-norm"),
                                             generation=dict(max_new_tokens=7)))
    assert type(loss) is ClippedPGLoss and loss.max_response_length == 7
    for name in registry.advantage_estimator_names():
        assert callable(registry.advantage_estimator(name))
    with pytest.raises(ValueError, match="grpo.advantage_estimator: unknown name 'ppo'"):
        registry.advantage_estimator("ppo")


@pytest.mark.parametrize("sections, expected", [
    (dict(grpo=dict(reward_kl_coef=0.1)), "grpo.reward_kl_coef (0.1) is read by "
     "grpo.advantage_estimator=reinforce_plus_plus (or your estimator with reads_reward_kl = "
     "True) only (got 'grpo'); use loss.kl_coef for a KL term in the loss"),
    (dict(grpo=dict(overlong_buffer_length=20)),
     "grpo.overlong_buffer_length (20) must be <= generation.max_new_tokens (16)"),
    (dict(loss=dict(aggregation="sum")), "loss.aggregation must be one of token-mean, "
     "seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm (got 'sum')"),
    (dict(grpo=dict(advantage_estimator="gae")), "grpo.advantage_estimator must be one of grpo, "
     "rloo, reinforce_plus_plus, or a \"module:attribute\" import path (got 'gae')"),
])
def test_bad_combinations_fail_at_load_time(sections, expected):
    with pytest.raises(ConfigError) as info:
        validate(config(**sections))
    assert str(info.value) == f"invalid config: {expected}"


# --------------------------------------------------------------------------- the GRPO loop

@pytest.mark.slow
def test_dapo_gspo_reinforce_plus_plus_and_mis_run_in_the_grpo_loop(tmp_path):
    """Every new path of the GRPO step at once, two RL steps of a tiny run: dynamic sampling
    with its cap, the overlong penalty and filtering, REINFORCE++ with the KL in the reward (a
    reference policy), GSPO's loss and sequence MIS."""
    from mcore_rl.config.loader import load_config
    from mcore_rl.controller.loops import run
    from mcore_rl.utils.logging import read_metrics

    run(load_config("dapo_synthetic", [
        "cluster.use_ray=false", "logging.progress=false", "logging.tensorboard=false",
        "grpo.num_prompts_per_step=4", "grpo.num_generations=4", "grpo.max_steps=2",
        "grpo.val_every=0", "grpo.val_at_start=false", "sft.steps=5", "sft.batch_size=16",
        "data.synthetic.max_value=4", "data.synthetic.num_train=20", "data.synthetic.num_test=5",
        "policy.micro_batch_size=8", "checkpoint.save_final=false",
        "grpo.dynamic_sampling_max_tries=2", "grpo.overlong_filtering=true",
        "grpo.advantage_estimator=reinforce_plus_plus", "grpo.reward_kl_coef=0.05",
        "loss.name=gspo", "loss.importance_mask=sequence", f"run.output_dir={tmp_path}"]))
    steps = read_metrics(tmp_path)
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert 1 <= r["train/dynamic_sampling_tries"] <= 2
        assert r["train/dynamic_sampling_filled"] <= 4 * (r["train/dynamic_sampling_tries"] == 2)
        assert math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0
        assert r["train/is_weight_max"] > 0 and 0 <= r["train/is_masked_fraction"] <= 1
        assert r["train/kl"] >= 0

"""Advantage estimators, KL estimators and the clipped policy-gradient loss, against numbers
worked out by hand (in the comments) or by plain-Python loops of the textbook definitions."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.algorithms.advantages import gae, grpo_advantages, masked_whiten
from mcore_rl.algorithms.kl import kl_estimate
from mcore_rl.algorithms.losses import ClippedPGLoss, NLLLoss, valid_token_mask
from mcore_rl.config.schema import LossConfig
from mcore_rl.data.batch import select

T = torch.tensor


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(actual.float(), torch.as_tensor(expected, dtype=torch.float32),
                               rtol=tol, atol=tol)


# --------------------------------------------------------------------------- GRPO advantages

def test_grpo_group_mean_and_unbiased_std():
    # Group [1,0,1,0]: mean .5, unbiased var (4 * .25) / 3 = 1/3 -> A = +-.5 / sqrt(1/3).
    # Group [1,1,1,0]: mean .75, devs .25,.25,.25,-.75, sumsq .75, var .25, std .5.
    a = 0.5 / math.sqrt(1 / 3)
    out = grpo_advantages(T([1.0, 0, 1, 0, 1, 1, 1, 0]), group_size=4)
    close(out, [a, -a, a, -a, 0.5, 0.5, 0.5, -1.5])
    assert out.dtype == torch.float32 and out.shape == (8,)


def test_grpo_masked_samples_and_single_valid_group():
    # Group 1 valid: [1, 0, 0] (third is masked, reward NaN must not leak): mean 1/3,
    # devs 2/3, -1/3, -1/3, sumsq 6/9, unbiased var 1/3.
    # Group 2 has one valid sample -> all 0.
    s = math.sqrt(1 / 3)
    rewards = T([1.0, 0, float("nan"), 0, 2, 9, 9, 9])
    mask = T([1.0, 1, 0, 1, 1, 0, 0, 0])
    out = grpo_advantages(rewards, group_size=4, sample_mask=mask)
    close(out, [(2 / 3) / s, (-1 / 3) / s, 0, (-1 / 3) / s, 0, 0, 0, 0])


def test_grpo_identical_rewards_give_zero():
    close(grpo_advantages(T([0.7, 0.7, 0.7]), group_size=3), [0, 0, 0])


def test_grpo_dr_grpo_mean_centering():
    # normalize_std=False: r - mean, mean of [3,1,2,6] = 3.
    close(grpo_advantages(T([3.0, 1, 2, 6]), 4, normalize_std=False), [0, -2, -1, 3])


def test_grpo_leave_one_out():
    # Baselines: mean of the others: 3 -> (1+2+6)/3 = 3; 1 -> 11/3; 2 -> 10/3; 6 -> 2.
    r = T([3.0, 1, 2, 6])
    loo = [0, 1 - 11 / 3, 2 - 10 / 3, 4]
    close(grpo_advantages(r, 4, normalize_std=False, leave_one_out=True), loo)
    # Divided by the unbiased group std: devs 0,-2,-1,3 -> sumsq 14, var 14/3.
    std = math.sqrt(14 / 3)
    close(grpo_advantages(r, 4, leave_one_out=True), [x / (std + 1e-6) for x in loo])
    # Masked third sample: others of 3 -> (1+6)/2; of 1 -> (3+6)/2; of 6 -> (3+1)/2.
    close(grpo_advantages(r, 4, sample_mask=T([1.0, 1, 0, 1]), normalize_std=False,
                          leave_one_out=True), [3 - 3.5, 1 - 4.5, 0, 6 - 2])


def test_grpo_errors():
    with pytest.raises(ValueError, match="grpo.num_generations"):
        grpo_advantages(torch.zeros(6), group_size=4)
    with pytest.raises(ValueError, match="sample_mask"):
        grpo_advantages(torch.zeros(4), group_size=2, sample_mask=torch.ones(3))


# --------------------------------------------------------------------------- KL estimators

def test_kl_estimators_known_values():
    # log r = ref - logp = [-0.5, 1.0, 0.0]
    logp, ref = T([[-1.0, -2.0, -0.5]]), T([[-1.5, -1.0, -0.5]])
    close(kl_estimate(logp, ref, "k1"), [[0.5, -1.0, 0.0]])
    close(kl_estimate(logp, ref, "k2"), [[0.125, 0.5, 0.0]])
    close(kl_estimate(logp, ref, "k3"), [[math.exp(-0.5) - 1 + 0.5, math.e - 1 - 1, 0.0]])


def test_kl_k1_k3_unbiased_over_a_categorical():
    # Sum_x pi(x) k(x) equals KL(pi || pi_ref) = sum_x pi log(pi / pi_ref) for k1 and k3.
    pi, ref = [0.5, 0.3, 0.2], [0.2, 0.2, 0.6]
    exact = sum(p * math.log(p / q) for p, q in zip(pi, ref))
    logp, logq = torch.log(T([pi])), torch.log(T([ref]))
    for name in ("k1", "k3"):
        assert float((T([pi]) * kl_estimate(logp, logq, name)).sum()) == pytest.approx(exact, abs=1e-6)


def test_kl_unknown_estimator():
    with pytest.raises(ValueError, match="loss.kl_estimator"):
        kl_estimate(torch.zeros(1, 2), torch.zeros(1, 2), "k4")


# --------------------------------------------------------------------------- GAE and whitening

def gae_double_loop(r, v, m, gamma, lam):
    """Textbook GAE (Schulman et al. 2016, eq. 16) over the valid positions of each row."""
    adv = [[None] * len(row) for row in r]
    for b in range(len(r)):
        steps = [t for t in range(len(r[b])) if m[b][t]]
        for i, t in enumerate(steps):
            total = 0.0
            for j in range(i, len(steps)):
                next_v = v[b][steps[j + 1]] if j + 1 < len(steps) else 0.0
                delta = r[b][steps[j]] + gamma * next_v - v[b][steps[j]]
                total += (gamma * lam) ** (j - i) * delta
            adv[b][t] = total
    return adv


@pytest.mark.parametrize("gamma", [1.0, 0.99])
@pytest.mark.parametrize("lam", [1.0, 0.95, 0.0])
def test_gae_matches_double_loop_with_mask_holes(gamma, lam):
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 9, generator=g), torch.randn(3, 9, generator=g)
    mask = T([[0, 0, 1, 1, 0, 1, 1, 0, 0],      # a hole inside the response, padding after
              [0, 1, 1, 1, 1, 1, 1, 1, 1],      # response to the end
              [0, 0, 0, 1, 0, 0, 1, 0, 1]], dtype=torch.float32)
    adv, ret = gae(rewards, values, mask, gamma, lam)  # rewards at holes must be ignored
    ref = gae_double_loop(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    for b, t in mask.nonzero().tolist():
        assert float(adv[b, t]) == pytest.approx(ref[b][t], abs=1e-5)
        assert float(ret[b, t]) == pytest.approx(ref[b][t] + float(values[b, t]), abs=1e-5)
    if gamma == 1.0 and lam == 1.0:  # returns = reward-to-go over the valid tokens
        for b, t in mask.nonzero().tolist():
            to_go = float((rewards[b, t:] * mask[b, t:]).sum())
            assert float(ret[b, t]) == pytest.approx(to_go, abs=1e-5)


def test_masked_whiten():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, generator=g) * 3 + 2
    mask = (torch.rand(3, 7, generator=g) > 0.4).float()
    sel = x[mask.bool()]
    out = masked_whiten(x, mask)
    expected = (sel - sel.mean()) / torch.sqrt(sel.var() + 1e-8)  # torch.var: unbiased
    close(out[mask.bool()], expected)
    close(masked_whiten(x, mask, shift_mean=False)[mask.bool()], expected + sel.mean())
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten(x, torch.zeros_like(x))


# --------------------------------------------------------------------------- Clipped PG loss

def hand_batch():
    """4 rows, S=6. Ratios r on valid tokens, with prev_logprobs = -1, logprobs = -1 + log r.

    Row 0 (valid): t=0 has token_mask=1 but is excluded by convention; t=5 is padding with
        garbage that would overflow exp if it were used.
        t=1: A=+1, r=1.5 > 1.3 -> clipped, L = -1.3
        t=2: A=-1, r=0.5 < 0.8 -> clipped, L = max(0.5, 0.8) = 0.8
        t=3: A=-2, r=4.0 -> max(8, 2.6) = 8, dual clip c=3: min(8, 6) = 6
        t=4: A=+2, r=1.1 inside the range -> L = -2.2 (not counted as clipped)
    Row 1: sample_mask 0, garbage everywhere (NaN advantages, huge logprobs).
    Row 2 (valid): t=2: A=0.5, r=1 -> -0.5; t=3: A=-1, r=1.2 -> 1.2.
    Row 3: sample_mask 1 but no response tokens: not a valid sequence.
    Token sum: -1.3 + 0.8 + 6 - 2.2 - 0.5 + 1.2 = 4.0 over 6 tokens.
    Sequence: row 0 mean 3.3 / 4 = 0.825, row 2 mean 0.7 / 2 = 0.35; sum 1.175 over 2.
    """
    token_mask = T([[1, 1, 1, 1, 1, 0],
                    [0, 1, 1, 1, 1, 1],
                    [0, 0, 1, 1, 0, 0],
                    [0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    ratio = T([[1.0, 1.5, 0.5, 4.0, 1.1, 1.0],
               [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
               [1.0, 1.0, 1.0, 1.2, 1.0, 1.0],
               [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    prev = torch.full((4, 6), -1.0)
    logprobs = prev + torch.log(ratio)
    advantages = T([[5.0, 1, -1, -2, 2, 7],
                    [float("nan")] * 6,
                    [0, 0, 0.5, -1, 0, 0],
                    [3.0] * 6])
    logprobs[:, 0] = 0.0
    prev[0, 0] = -4.0            # would give a ratio e^4 at t=0 if t=0 were used
    logprobs[0, 5], prev[0, 5] = 100.0, -100.0
    logprobs[1], prev[1] = 90.0, -90.0
    logprobs[1, 0] = 0.0
    batch = {"token_mask": token_mask, "sample_mask": T([1.0, 0, 1, 1]),
             "advantages": advantages, "prev_logprobs": prev}
    return logprobs, batch


def loss_config(**kw):
    base = dict(ratio_clip_low=0.2, ratio_clip_high=0.3, dual_clip=3.0)
    base.update(kw)
    return LossConfig(**base)


def test_valid_token_mask():
    _, batch = hand_batch()
    close(valid_token_mask(batch), [[0, 1, 1, 1, 1, 0], [0] * 6, [0, 0, 1, 1, 0, 0], [0] * 6])


def test_clipped_pg_token_hand_values_and_metrics():
    logprobs, batch = hand_batch()
    fn = ClippedPGLoss(loss_config())
    loss_sum, count, metrics = fn(logprobs, batch)
    close(loss_sum, 4.0)
    close(count, 6.0)
    close(metrics["loss"], 4.0)
    close(metrics["pg_loss"], 4.0)
    close(metrics["clip_fraction"], 2.0)        # row 0, t=1 and t=2
    close(metrics["dual_clip_fraction"], 1.0)   # row 0, t=3
    close(metrics["ratio_mean"], 1.5 + 0.5 + 4.0 + 1.1 + 1.0 + 1.2)
    close(metrics["num_valid_tokens"], 6.0)
    close(metrics["num_valid_sequences"], 2.0)
    assert "kl" not in metrics  # no reference_logprobs in the batch
    assert fn.loss_type == "token"
    assert set(metrics) <= set(fn.metric_kinds)
    assert fn.metric_kinds["loss"] == "tokens" and fn.metric_kinds["num_valid_tokens"] == "none"
    assert all(not v.requires_grad for v in metrics.values())


@pytest.mark.parametrize("aggregation, expected", [
    # Per-token losses: row 0 [-1.3, 0.8, 6, -2.2] (sum 3.3, 4 tokens), row 2 [-0.5, 1.2]
    # (sum 0.7, 2 tokens); the worker divides by the 2 valid sequences.
    ("seq-mean-token-mean", 3.3 / 4 + 0.7 / 2),
    ("seq-mean-token-sum", 3.3 + 0.7),
    ("seq-mean-token-sum-norm", (3.3 + 0.7) / 5),    # Dr. GRPO: / max_response_length = 5
])
def test_clipped_pg_sequence_aggregations(aggregation, expected):
    logprobs, batch = hand_batch()
    fn = ClippedPGLoss(loss_config(aggregation=aggregation), max_response_length=5)
    loss_sum, count, metrics = fn(logprobs, batch)
    close(loss_sum, expected)
    close(count, 2.0)
    assert fn.loss_type == "sequence" and fn.metric_kinds["pg_loss"] == "sequences"
    close(metrics["num_valid_tokens"], 6.0)


def test_dr_grpo_aggregation_gradient_is_length_independent():
    # seq-mean-token-sum-norm: every unclipped token's gradient is -A r / L_max, whatever its
    # response's length (seq-mean-token-mean divides row 0 by 4 and row 2 by 2 instead).
    logprobs, batch = hand_batch()
    logprobs.requires_grad_(True)
    fn = ClippedPGLoss(loss_config(aggregation="seq-mean-token-sum-norm"), max_response_length=5)
    (grad,) = torch.autograd.grad(fn(logprobs, batch)[0], logprobs)
    expected = torch.zeros(4, 6)
    expected[0, 4] = -2.2 / 5
    expected[2, 2], expected[2, 3] = -0.5 / 5, 1.2 / 5
    close(grad, expected)
    with pytest.raises(ValueError, match="max_response_length"):
        ClippedPGLoss(loss_config(aggregation="seq-mean-token-sum-norm"))


def test_clipped_pg_without_dual_clip():
    # Row 0, t=3 keeps L = 8 instead of 6: token sum 4.0 + 2.
    logprobs, batch = hand_batch()
    loss_sum, _, metrics = ClippedPGLoss(loss_config(dual_clip=None))(logprobs, batch)
    close(loss_sum, 6.0)
    close(metrics["dual_clip_fraction"], 0.0)


def test_clipped_pg_importance_cap():
    # Weights exp(old - gen): row 0 t=1 -> e^{ln 3} = 3, capped at 2; row 0 t=2 -> 0.5;
    # row 2 t=3 -> 0.5; others 1.
    # Token sum: 2*(-1.3) + 0.5*0.8 + 6 - 2.2 - 0.5 + 0.5*1.2 = 1.7.
    logprobs, batch = hand_batch()
    gen = batch["prev_logprobs"].clone()
    gen[0, 1] -= math.log(3.0)
    gen[0, 2] += math.log(2.0)
    gen[2, 3] += math.log(2.0)
    gen[1] = 1e4                 # dropped sample: garbage must not matter
    batch["generation_logprobs"] = gen
    fn = ClippedPGLoss(loss_config(importance_ratio_cap=2.0))
    loss_sum, _, _ = fn(logprobs, batch)
    close(loss_sum, 1.7)
    # Unclipped tokens: dL/dlogp = -A*r*w: row 0 t=4 -> -2*1.1*1; row 2 t=3 -> 1*1.2*0.5.
    logprobs.requires_grad_(True)
    (grad,) = torch.autograd.grad(fn(logprobs, batch)[0], logprobs)
    close(grad[0, 4], -2.2)
    close(grad[2, 3], 0.6)
    with pytest.raises(ValueError, match="generation_logprobs"):
        del batch["generation_logprobs"]
        fn(logprobs, batch)


def test_clipped_pg_kl_term():
    # reference = logprobs - 0.5 on the valid tokens: k1 = logp - ref = 0.5 per token,
    # 6 tokens -> kl sum 3.0, loss 4.0 + 0.1 * 3.0.
    logprobs, batch = hand_batch()
    ref = logprobs - 0.5
    ref[1] = -1e4                # garbage on the dropped sample
    batch["reference_logprobs"] = ref
    loss_sum, _, metrics = ClippedPGLoss(loss_config(kl_coef=0.1, kl_estimator="k1"))(logprobs, batch)
    close(loss_sum, 4.3)
    close(metrics["pg_loss"], 4.0)
    close(metrics["kl"], 3.0)
    # kl_coef = 0 still reports the KL when the reference is present, without adding it.
    loss_sum, _, metrics = ClippedPGLoss(loss_config(kl_estimator="k1"))(logprobs, batch)
    close(loss_sum, 4.0)
    close(metrics["kl"], 3.0)


def test_clipped_pg_gradient_hand_values():
    # Clipped and dual-clipped tokens get 0; unclipped d(-A r)/dlogp = -A r; masked 0.
    # Sequence type divides row 0 by its 4 tokens and row 2 by 2.
    logprobs, batch = hand_batch()
    logprobs.requires_grad_(True)
    fn = ClippedPGLoss(loss_config(aggregation="seq-mean-token-mean"))
    (grad,) = torch.autograd.grad(fn(logprobs, batch)[0], logprobs)
    expected = torch.zeros(4, 6)
    expected[0, 4] = -2.2 / 4
    expected[2, 2], expected[2, 3] = -0.5 / 2, 1.2 / 2
    close(grad, expected)


def test_clipped_pg_gradient_with_kl_against_formula():
    # Inside the clip range, per token L = -A r + beta * k3, with r = exp(lp - old) and
    # k3 = exp(ref - lp) - 1 - (ref - lp): dL/dlp = -A r + beta * (1 - exp(ref - lp)).
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(2, 5, generator=g) - 0.5
    logprobs = old + 0.05 * torch.randn(2, 5, generator=g)  # ratio within [0.8, 1.3]
    logprobs[:, 0] = 0.0
    ref = old + 0.3 * torch.randn(2, 5, generator=g)
    adv = torch.randn(2, 5, generator=g)
    mask = T([[0, 1, 1, 1, 0], [0, 1, 0, 1, 1]], dtype=torch.float32)
    batch = {"token_mask": mask, "sample_mask": torch.ones(2), "advantages": adv,
             "prev_logprobs": old, "reference_logprobs": ref}
    lp = logprobs.clone().requires_grad_(True)
    fn = ClippedPGLoss(loss_config(kl_coef=0.2, kl_estimator="k3"))
    (grad,) = torch.autograd.grad(fn(lp, batch)[0], lp)
    expected = (-adv * torch.exp(logprobs - old) + 0.2 * (1 - torch.exp(ref - logprobs))) * mask
    expected[:, 0] = 0.0
    close(grad, expected)


def python_reference_loss(logprobs, batch, cfg, max_length=5):
    """Plain-Python loop of the per-token loss (token ratios, truncated and masked importance
    weights, dual clip, k3 KL); returns {aggregation: (loss_sum, count)}."""
    lp, old, adv = logprobs.tolist(), batch["prev_logprobs"].tolist(), batch["advantages"].tolist()
    gen, ref = batch["generation_logprobs"].tolist(), batch["reference_logprobs"].tolist()
    tm, sm = batch["token_mask"].tolist(), batch["sample_mask"].tolist()
    sums = dict.fromkeys(("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                          "seq-mean-token-sum-norm"), 0.0)
    tokens = seqs = 0
    for b in range(len(lp)):
        ts = [t for t in range(1, len(lp[b])) if tm[b][t] and sm[b]]
        seq_weight = math.exp(sum(old[b][t] - gen[b][t] for t in ts))
        row = []
        for t in ts:
            r = math.exp(lp[b][t] - old[b][t])
            a = adv[b][t]
            loss = max(-a * r, -a * min(max(r, 1 - cfg.ratio_clip_low), 1 + cfg.ratio_clip_high))
            if a < 0:
                loss = min(loss, -a * cfg.dual_clip)
            w = math.exp(old[b][t] - gen[b][t])
            tested = {"token": w, "sequence": seq_weight}.get(cfg.importance_mask)
            if tested is not None and not cfg.importance_mask_low <= tested <= cfg.importance_mask_high:
                loss = 0.0
            loss *= min(w, cfg.importance_ratio_cap)
            log_r = ref[b][t] - lp[b][t]
            loss += cfg.kl_coef * (math.exp(log_r) - 1 - log_r)
            row.append(loss)
        sums["token-mean"] += sum(row)
        sums["seq-mean-token-sum"] += sum(row)
        sums["seq-mean-token-sum-norm"] += sum(row) / max_length
        tokens += len(row)
        if row:
            sums["seq-mean-token-mean"] += sum(row) / len(row)
            seqs += 1
    return {k: (v, tokens if k == "token-mean" else seqs) for k, v in sums.items()}


def random_batch(seed, rows=7, width=8):
    g = torch.Generator().manual_seed(seed)
    old = -2 * torch.rand(rows, width, generator=g)
    logprobs = old + 0.4 * torch.randn(rows, width, generator=g)
    logprobs[:, 0] = 0.0
    lengths = torch.randint(0, width - 1, (rows,), generator=g)
    starts = torch.randint(1, 4, (rows,), generator=g)
    pos = torch.arange(width)
    token_mask = ((pos >= starts[:, None]) & (pos < starts[:, None] + lengths[:, None])).float()
    batch = {"token_mask": token_mask,
             "sample_mask": (torch.rand(rows, generator=g) > 0.2).float(),
             "advantages": torch.randn(rows, width, generator=g),
             "prev_logprobs": old,
             "generation_logprobs": old + 0.3 * torch.randn(rows, width, generator=g),
             "reference_logprobs": old + 0.3 * torch.randn(rows, width, generator=g)}
    return logprobs, batch


AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("mis", [None, "token", "sequence"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_clipped_pg_random_against_python_loop(aggregation, mis):
    cfg = loss_config(aggregation=aggregation, dual_clip=1.5, importance_ratio_cap=1.2,
                      kl_coef=0.05, kl_estimator="k3", importance_mask=mis,
                      importance_mask_low=0.7, importance_mask_high=1.3)
    fn = ClippedPGLoss(cfg, max_response_length=5)
    for seed in range(3):
        logprobs, batch = random_batch(seed)
        loss_sum, count, _ = fn(logprobs, batch)
        expected_sum, expected_count = python_reference_loss(logprobs, batch, cfg)[aggregation]
        close(loss_sum, expected_sum)
        close(count, expected_count)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_clipped_pg_microbatches_give_exact_global_mean(aggregation):
    # Sum of loss_sum over microbatches / sum of counts == whole-batch loss_sum / count,
    # and so are the gradients.
    fn = ClippedPGLoss(loss_config(aggregation=aggregation, kl_coef=0.1, importance_mask="token"),
                       max_response_length=5)
    logprobs, batch = random_batch(seed=5, rows=9)
    logprobs.requires_grad_(True)
    whole_sum, whole_count, whole_metrics = fn(logprobs, batch)
    parts = [fn(logprobs[s], select(batch, s)) for s in (slice(0, 2), slice(2, 6), slice(6, 9))]
    total_sum = sum(p[0] for p in parts)
    total_count = sum(p[1] for p in parts)
    close(total_count, whole_count)
    close(total_sum / total_count, whole_sum / whole_count)
    for key in whole_metrics:
        combine = max if fn.metric_kinds[key] == "max" else sum
        close(combine(p[2][key] for p in parts), whole_metrics[key])
    (g_parts,) = torch.autograd.grad(total_sum / total_count, logprobs)
    (g_whole,) = torch.autograd.grad(whole_sum / whole_count, logprobs)
    close(g_parts, g_whole)


def test_clipped_pg_padding_garbage_gives_finite_gradients():
    logprobs, batch = hand_batch()
    logprobs.requires_grad_(True)
    (grad,) = torch.autograd.grad(ClippedPGLoss(loss_config())(logprobs, batch)[0], logprobs)
    assert torch.isfinite(grad).all()


def test_clipped_pg_errors():
    logprobs, batch = hand_batch()
    with pytest.raises(ValueError, match="reference_logprobs"):
        ClippedPGLoss(loss_config(kl_coef=0.1))(logprobs, batch)
    with pytest.raises(ValueError, match="loss.kl_estimator"):
        ClippedPGLoss(loss_config(kl_estimator="k5"))
    with pytest.raises(ValueError, match="loss.aggregation"):
        ClippedPGLoss(loss_config(aggregation="token"))
    with pytest.raises(ValueError, match="loss.importance_mask"):
        ClippedPGLoss(loss_config(importance_mask="row"))
    with pytest.raises(ValueError, match="loss.dual_clip"):
        ClippedPGLoss(loss_config(dual_clip=0.9))
    with pytest.raises(ValueError, match="loss.ratio_clip_low"):
        ClippedPGLoss(loss_config(ratio_clip_low=1.0))
    with pytest.raises(ValueError, match="advantages"):
        del batch["advantages"]
        ClippedPGLoss(loss_config())(logprobs, batch)
    _, batch = hand_batch()
    with pytest.raises(ValueError, match="prev_logprobs"):
        batch["prev_logprobs"] = batch["prev_logprobs"][:, :5]
        ClippedPGLoss(loss_config())(logprobs, batch)


def test_nll_loss():
    # Valid tokens of hand_batch: row 0 t=1..4 and row 2 t=2..3 (t=0 and padding excluded).
    logprobs, batch = hand_batch()
    logprobs.requires_grad_(True)
    loss_sum, count, metrics = NLLLoss()(logprobs, batch)
    valid = [(0, 1), (0, 2), (0, 3), (0, 4), (2, 2), (2, 3)]
    close(loss_sum, -sum(float(logprobs[b, t]) for b, t in valid))
    close(count, 6.0)
    close(metrics["num_valid_sequences"], 2.0)
    (grad,) = torch.autograd.grad(loss_sum, logprobs)
    expected = torch.zeros(4, 6)
    for b, t in valid:
        expected[b, t] = -1.0
    close(grad, expected)


# --------------------------------------------------------------------------- importance weights

def mismatched_hand_batch():
    """hand_batch with generation logprobs: weights exp(old - gen) of row 0 t=1..4 are
    3, 0.5, 1, 1 and of row 2 t=2..3 are 1, 0.5; the dropped row 1 holds garbage."""
    logprobs, batch = hand_batch()
    gen = batch["prev_logprobs"].clone()
    gen[0, 1] -= math.log(3.0)
    gen[0, 2] += math.log(2.0)
    gen[2, 3] += math.log(2.0)
    gen[1] = 1e4
    batch["generation_logprobs"] = gen
    return logprobs, batch


@pytest.mark.parametrize("mis, loss, masked", [
    # Per-token losses -1.3, 0.8, 6, -2.2 | -0.5, 1.2 (token sum 4.0).
    (None, 4.0, 0.0),
    # Token MIS keeps weights in [0.6, 2]: drops row 0 t=1 (3), t=2 (0.5), row 2 t=3 (0.5).
    ("token", 6 - 2.2 - 0.5, 3.0),
    # Sequence MIS: row 0's weight 3 * 0.5 * 1 * 1 = 1.5 is kept, row 2's 0.5 is not.
    ("sequence", -1.3 + 0.8 + 6 - 2.2, 2.0),
])
def test_masked_importance_sampling_hand_values_and_statistics(mis, loss, masked):
    logprobs, batch = mismatched_hand_batch()
    fn = ClippedPGLoss(loss_config(importance_mask=mis, importance_mask_low=0.6,
                                   importance_mask_high=2.0))
    loss_sum, count, metrics = fn(logprobs, batch)
    close(loss_sum, loss)
    close(count, 6.0)                                  # masked tokens keep their place in N
    close(metrics["is_weight_mean"], 3 + 0.5 + 1 + 1 + 1 + 0.5)   # raw sum over 6 tokens
    close(metrics["is_weight_max"], 3.0)               # the dropped row's garbage is ignored
    close(metrics["is_masked_fraction"], masked)
    close(metrics["is_truncated_fraction"], 0.0)
    assert fn.metric_kinds["is_weight_max"] == "max"
    assert fn.metric_kinds["is_masked_fraction"] == "tokens"


def test_truncated_and_masked_importance_sampling_together():
    # Token MIS in [0.4, 4] keeps every weight; TIS caps row 0 t=1's 3 at 2: the cap test's 1.7.
    logprobs, batch = mismatched_hand_batch()
    fn = ClippedPGLoss(loss_config(importance_ratio_cap=2.0, importance_mask="token",
                                   importance_mask_low=0.4, importance_mask_high=4.0))
    loss_sum, _, metrics = fn(logprobs, batch)
    close(loss_sum, 1.7)
    close(metrics["is_truncated_fraction"], 1.0)
    close(metrics["is_masked_fraction"], 0.0)


def test_on_policy_importance_weights_are_one():
    # generation == prev: every weight is 1, so TIS and MIS leave the loss and gradient alone.
    logprobs, batch = hand_batch()
    batch["generation_logprobs"] = batch["prev_logprobs"].clone()
    plain = ClippedPGLoss(loss_config())
    corrected = ClippedPGLoss(loss_config(importance_ratio_cap=1.0, importance_mask="sequence",
                                          importance_mask_low=1.0, importance_mask_high=1.0))
    lp = logprobs.clone().requires_grad_(True)
    (g_plain,) = torch.autograd.grad(plain(lp, batch)[0], lp)
    loss_sum, _, metrics = corrected(lp, batch)
    (g_corrected,) = torch.autograd.grad(loss_sum, lp)
    close(loss_sum, 4.0)
    close(g_corrected, g_plain)
    close(metrics["is_weight_mean"], 6.0)
    close(metrics["is_weight_max"], 1.0)
    close(metrics["is_masked_fraction"] + metrics["is_truncated_fraction"], 0.0)

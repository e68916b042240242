"""Per-token estimators of KL(pi || pi_ref) from sampled-token logprobs.

Source: J. Schulman, "Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html).
With tokens sampled from pi and the ratio ``r = pi_ref(x) / pi(x)`` (log ratio
``log r = logp_ref - logp``):

* ``k1 = -log r``                  unbiased, high variance, can be negative;
* ``k2 = 0.5 * (log r)^2``         biased, low variance, >= 0;
* ``k3 = (r - 1) - log r``         unbiased, low variance, >= 0.

No clamp is applied to ``log r``: estimates are exact, and ``k3`` overflows to ``inf`` in
float32 once ``log r`` exceeds about 88 (the policy assigning a token e^-88 less mass than
the reference), which is a diverged run rather than a numerical artefact to hide.
"""

from __future__ import annotations

import torch

from mcore_rl.config.schema import KL_ESTIMATORS


def kl_estimate(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) (Schulman 2020; see the module docstring).

    Args:
        logprobs: ``[B, S]`` float32, ``log pi(x_t | x_<t)`` of the policy (differentiable).
        reference_logprobs: ``[B, S]`` float32, ``log pi_ref(x_t | x_<t)`` of the reference.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (config key ``loss.kl_estimator``).

    Returns:
        ``[B, S]`` float32 per-token estimate in nats; no masking is applied.

    Raises:
        ValueError: unknown ``estimator`` (names ``loss.kl_estimator``) or shapes that differ.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"loss.kl_estimator: unknown KL estimator {estimator!r}; "
                         f"expected one of {', '.join(KL_ESTIMATORS)}")
    if logprobs.shape != reference_logprobs.shape:
        raise ValueError(f"kl_estimate: logprobs {tuple(logprobs.shape)} and reference_logprobs "
                         f"{tuple(reference_logprobs.shape)} differ in shape")
    log_ratio = reference_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    return torch.expm1(log_ratio) - log_ratio

"""Training losses: clipped policy gradient with asymmetric and dual clip, truncated importance
weights and a KL penalty; the token negative log-likelihood for supervised warm starts; the
clipped value (critic) loss of PPO. All return raw sums so the worker can form the exact global
mean.

Normalization contract with the Megatron worker (``DESIGN.md``, "Normalization"): a loss
returns, per microbatch, ``loss_sum`` (NOT divided by anything) and ``count`` (valid tokens
for ``loss_type == "token"``, valid sequences for ``"sequence"``); the worker divides the
gradient by the count summed over all microbatches and data-parallel ranks. Metrics are raw
sums too; ``metric_kinds`` says which global count divides each.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from mcore_rl.algorithms.kl import kl_estimate
from mcore_rl.config.checks import check
from mcore_rl.config.schema import LossConfig, ValueLossConfig


def _require(batch: Dict[str, torch.Tensor], key: str, why: str) -> torch.Tensor:
    if key not in batch:
        raise ValueError(f"batch has no {key!r} ({why}); keys: {sorted(batch)}")
    return batch[key]


def valid_token_mask(batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Tokens that enter the loss: ``token_mask * sample_mask`` with column 0 zeroed.

    Args:
        batch: needs ``token_mask`` ``[B, S]`` (1 on response tokens) and ``sample_mask`` ``[B]``
            (0 drops a sample).

    Returns:
        ``[B, S]`` float32 in {0, 1}; ``[:, 0] = 0`` because ``logprobs[:, 0]`` is 0 by convention.

    Raises:
        ValueError: a key is missing, or ``sample_mask`` is not ``[B]`` for ``token_mask [B, S]``.
    """
    token_mask = _require(batch, "token_mask", "valid tokens of the loss")
    sample_mask = _require(batch, "sample_mask", "valid samples of the loss")
    if token_mask.dim() != 2 or sample_mask.shape != token_mask.shape[:1]:
        raise ValueError(f"token_mask must be [B, S] and sample_mask [B]; got "
                         f"{tuple(token_mask.shape)} and {tuple(sample_mask.shape)}")
    mask = (token_mask > 0) & (sample_mask > 0).unsqueeze(1)
    mask[:, 0] = False
    return mask.float()


class ClippedPGLoss:
    """Clipped policy-gradient loss (PPO-clip / GRPO), per token on response tokens.

    With ``r = exp(logp - logp_old)`` and advantage ``A`` (per token):

    * PPO-clip (Schulman et al. 2017, arXiv:1707.06347, eq. 7) with decoupled bounds (DAPO
      "Clip-Higher", Yu et al. 2025, arXiv:2503.14476):
      ``L = max(-A*r, -A*clip(r, 1 - clip_low, 1 + clip_high))``;
    * dual clip for ``A < 0`` (Ye et al. 2020, "Mastering Complex Control in MOBA Games",
      arXiv:1912.09729): ``L = min(L, -A*c)``;
    * truncated importance weight for the rollout engine's mismatch (``importance_ratio_cap``;
      "TIS", Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
      Training"): ``L *= min(exp(logp_old - logp_generation), cap)``, a constant weight;
    * KL penalty: ``+ kl_coef * kl_estimate(logp, logp_ref)`` (see :mod:`mcore_rl.algorithms.kl`).

    Attributes:
        loss_type: ``"token"`` or ``"sequence"`` (config ``loss.normalization``).
        metric_kinds: metric name -> ``"tokens"``, ``"sequences"`` or ``"none"``: which global
            count the worker divides the metric's raw sum by (``"none"``: keep the sum).

    Raises:
        ConfigError (a ``ValueError``) at construction for a ``LossConfig`` value outside what
        the schema declares, naming its ``loss.*`` key (:func:`mcore_rl.config.checks.check`,
        the check config loading runs). ``importance_ratio_cap`` is at least 1: with trainer
        and rollout engine in agreement (ratio 1) a token keeps its full weight, and the loss
        is the plain clipped loss; a cap below 1 would down-weight every token and bias the
        gradient without any mismatch.
    """

    def __init__(self, config: LossConfig):
        check(config, "loss")
        self.config = config
        self.loss_type = config.normalization
        loss_kind = self.loss_type + "s"
        self.metric_kinds: Dict[str, str] = {
            "loss": loss_kind,
            "pg_loss": loss_kind,
            "kl": "tokens",
            "clip_fraction": "tokens",
            "dual_clip_fraction": "tokens",
            "ratio_mean": "tokens",
            "num_valid_tokens": "none",
            "num_valid_sequences": "none",
        }

    def __call__(self, logprobs: torch.Tensor, batch: Dict[str, torch.Tensor]
                 ) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
        """Loss of one microbatch as a raw sum, its count, and raw metric sums.

        Args:
            logprobs: ``[B, S]`` float32 ``log pi(x_t | x_<t)`` of the policy being trained
                (differentiable), ``logprobs[:, 0] = 0``.
            batch: ``token_mask [B, S]``, ``sample_mask [B]``, ``advantages [B, S]``,
                ``prev_logprobs [B, S]`` (old policy); ``reference_logprobs [B, S]`` when
                ``kl_coef > 0`` (also used for the ``kl`` metric when present);
                ``generation_logprobs [B, S]`` when ``importance_ratio_cap`` is set.

        Returns:
            ``(loss_sum, count, metrics)``: ``loss_sum`` a differentiable scalar, the sum over
            valid tokens of the per-token loss (``"token"``) or over valid sequences of their
            per-token mean (``"sequence"``); ``count`` a float scalar, the valid tokens or valid
            sequences of this microbatch; ``metrics`` detached scalar raw sums keyed as in
            ``metric_kinds`` (``kl`` only when ``reference_logprobs`` is in the batch).
            Valid tokens: ``t >= 1`` with ``token_mask = 1`` and ``sample_mask = 1``; a valid
            sequence has ``sample_mask = 1`` and at least one valid token.

        Raises:
            ValueError: a needed batch key is missing (named, with the config key needing it),
                or a tensor's shape differs from ``logprobs``'s.
        """
        cfg = self.config
        mask = valid_token_mask(batch)
        tensors = {"advantages": _require(batch, "advantages", "policy-gradient loss"),
                   "prev_logprobs": _require(batch, "prev_logprobs", "old policy of the ratio")}
        if cfg.kl_coef > 0:
            tensors["reference_logprobs"] = _require(batch, "reference_logprobs", "loss.kl_coef > 0")
        elif "reference_logprobs" in batch:
            tensors["reference_logprobs"] = batch["reference_logprobs"]
        if cfg.importance_ratio_cap is not None:
            tensors["generation_logprobs"] = _require(batch, "generation_logprobs",
                                                      "loss.importance_ratio_cap is set")
        for key, value in {"token_mask": mask, **tensors}.items():
            if value.shape != logprobs.shape:
                raise ValueError(f"batch[{key!r}] has shape {tuple(value.shape)}, logprobs "
                                 f"{tuple(logprobs.shape)}")

        # Loss terms use [:, 1:]; masked positions are zeroed BEFORE exp so padding garbage
        # never yields inf/NaN values or gradients.
        m = mask[:, 1:]
        valid = m > 0
        zero = torch.zeros_like(m)

        def masked(x: torch.Tensor) -> torch.Tensor:
            return torch.where(valid, x[:, 1:].float(), zero)

        logp = masked(logprobs)
        old = masked(tensors["prev_logprobs"])
        adv = masked(tensors["advantages"])

        ratio = torch.exp(logp - old)
        unclipped = -adv * ratio
        clipped = -adv * torch.clamp(ratio, 1.0 - cfg.ratio_clip_low, 1.0 + cfg.ratio_clip_high)
        pg = torch.maximum(unclipped, clipped)
        clip_active = clipped > unclipped
        if cfg.dual_clip is not None:
            dual_bound = -adv * cfg.dual_clip
            dual_active = (adv < 0) & (pg > dual_bound)
            pg = torch.where(dual_active, dual_bound, pg)
        else:
            dual_active = torch.zeros_like(valid)
        if cfg.importance_ratio_cap is not None:
            gen = masked(tensors["generation_logprobs"])
            weight = torch.clamp(torch.exp(old - gen), max=cfg.importance_ratio_cap)
            pg = pg * weight

        per_token = pg
        kl = None
        if "reference_logprobs" in tensors:
            kl = kl_estimate(logp, masked(tensors["reference_logprobs"]), cfg.kl_estimator)
            if cfg.kl_coef > 0:
                per_token = pg + cfg.kl_coef * kl

        tokens_per_seq = m.sum(dim=1)
        seq_valid = tokens_per_seq > 0
        num_tokens = m.sum()
        num_seqs = seq_valid.float().sum()

        def reduce(x: torch.Tensor) -> torch.Tensor:
            """Raw sum by the loss type: token sum, or sum of per-sequence token means."""
            if self.loss_type == "token":
                return (x * m).sum()
            return ((x * m).sum(dim=1) / tokens_per_seq.clamp(min=1)).sum()

        loss_sum = reduce(per_token)
        count = num_tokens if self.loss_type == "token" else num_seqs

        def token_sum(x: torch.Tensor) -> torch.Tensor:
            return (x.float() * m).sum().detach()

        metrics = {
            "loss": loss_sum.detach(),
            "pg_loss": reduce(pg).detach(),
            "clip_fraction": token_sum(clip_active),
            "dual_clip_fraction": token_sum(dual_active),
            "ratio_mean": token_sum(ratio),
            "num_valid_tokens": num_tokens.detach(),
            "num_valid_sequences": num_seqs.detach(),
        }
        if kl is not None:
            metrics["kl"] = token_sum(kl)
        return loss_sum, count.detach(), metrics


class NLLLoss:
    """Token-level negative log-likelihood ``-sum log pi(x_t | x_<t)`` over the valid tokens
    (supervised warm start on reference solutions), with :class:`ClippedPGLoss`'s interface.

    Attributes:
        loss_type: ``"token"``: the worker divides by the global count of valid tokens.
        metric_kinds: ``loss`` per token; ``num_valid_tokens``/``num_valid_sequences`` raw.
    """

    loss_type = "token"
    metric_kinds = {"loss": "tokens", "num_valid_tokens": "none", "num_valid_sequences": "none"}

    def __call__(self, logprobs: torch.Tensor, batch: Dict[str, torch.Tensor]
                 ) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
        """Args: ``logprobs [B, S]`` float32 (``[:, 0] = 0``); ``batch`` with ``token_mask [B, S]``
        and ``sample_mask [B]``. Returns ``(loss_sum, count, metrics)`` as :class:`ClippedPGLoss`:
        the NLL summed over valid tokens (nats), the valid tokens, raw metric sums.
        Raises ``ValueError`` for a missing key or a ``token_mask`` shape unlike ``logprobs``."""
        mask = valid_token_mask(batch)
        if mask.shape != logprobs.shape:
            raise ValueError(f"batch['token_mask'] has shape {tuple(mask.shape)}, logprobs "
                             f"{tuple(logprobs.shape)}")
        valid = mask > 0
        loss_sum = -torch.where(valid, logprobs.float(), torch.zeros_like(mask)).sum()
        num_tokens = mask.sum()
        metrics = {"loss": loss_sum.detach(), "num_valid_tokens": num_tokens,
                   "num_valid_sequences": valid.any(dim=1).float().sum()}
        return loss_sum, num_tokens, metrics


class ClippedValueLoss:
    """Clipped squared-error value loss of PPO, per token on response tokens.

    With the critic's values ``V`` (being trained), the rollout's values ``V_old`` and the GAE
    returns ``R`` (computed before advantage whitening), over the valid tokens ``m``::

        Vc  = clamp(V, V_old - eps, V_old + eps)
        L_V = coef * 0.5 * sum(m * max((V - R)^2, (Vc - R)^2)) / N

    (value clipping of the PPO reference implementation, OpenAI baselines ``ppo2``; Schulman et
    al. 2017, arXiv:1707.06347, use the unclipped ``(V - R)^2`` of eq. 9, which
    ``cliprange = None`` gives). ``N``, the valid tokens of the global batch, is applied by the
    worker: this returns the raw sum.

    Attributes:
        loss_type: ``"token"``.
        metric_kinds: ``loss``, ``vf_clipfrac`` (fraction of tokens where the clipped error is
            the larger, so the gradient is cut) and ``value_mean`` (mean ``V``) per token;
            ``num_valid_tokens``/``num_valid_sequences`` raw.

    Raises:
        ConfigError (a ``ValueError``) at construction: ``value.loss.cliprange`` not null and
        <= 0, or ``value.loss.coef`` <= 0 (the schema's bounds,
        :func:`mcore_rl.config.checks.check`).
    """

    loss_type = "token"
    metric_kinds = {"loss": "tokens", "vf_clipfrac": "tokens", "value_mean": "tokens",
                    "num_valid_tokens": "none", "num_valid_sequences": "none"}

    def __init__(self, config: ValueLossConfig):
        check(config, "value.loss")
        self.config = config

    def __call__(self, values: torch.Tensor, batch: Dict[str, torch.Tensor]
                 ) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
        """Loss of one microbatch as a raw sum, its count, and raw metric sums.

        Args:
            values: ``[B, S]`` float32 right-shifted values of the critic being trained
                (differentiable), ``values[:, t] = V(x_<t)``.
            batch: ``token_mask [B, S]``, ``sample_mask [B]``, ``returns [B, S]`` (GAE
                returns), ``prev_values [B, S]`` (the rollout's values, ``V_old``).

        Returns:
            ``(loss_sum, count, metrics)`` as :class:`ClippedPGLoss` with ``loss_type ==
            "token"``: the summed per-token loss (differentiable), the valid tokens, detached
            raw metric sums keyed as in ``metric_kinds``.

        Raises:
            ValueError: a batch key is missing or its shape differs from ``values``'s.
        """
        mask = valid_token_mask(batch)
        tensors = {"token_mask": mask,
                   "returns": _require(batch, "returns", "value-loss targets"),
                   "prev_values": _require(batch, "prev_values", "rollout values of the value clip")}
        for key, value in tensors.items():
            if value.shape != values.shape:
                raise ValueError(f"batch[{key!r}] has shape {tuple(value.shape)}, values "
                                 f"{tuple(values.shape)}")
        valid = mask > 0
        zero = torch.zeros_like(mask)

        def masked(x: torch.Tensor) -> torch.Tensor:
            return torch.where(valid, x.float(), zero)

        v, ret, old = masked(values), masked(tensors["returns"]), masked(tensors["prev_values"])
        error = (v - ret).square()
        if self.config.cliprange is not None:
            eps = self.config.cliprange
            clipped = (torch.clamp(v, old - eps, old + eps) - ret).square()
            clip_active = clipped > error
            error = torch.maximum(error, clipped)
        else:
            clip_active = torch.zeros_like(valid)
        loss_sum = self.config.coef * 0.5 * (error * mask).sum()
        num_tokens = mask.sum()
        metrics = {
            "loss": loss_sum.detach(),
            "vf_clipfrac": (clip_active.float() * mask).sum(),
            "value_mean": (v * mask).sum().detach(),
            "num_valid_tokens": num_tokens,
            "num_valid_sequences": valid.any(dim=1).float().sum(),
        }
        return loss_sum, num_tokens, metrics

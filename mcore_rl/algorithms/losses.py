"""Training losses: clipped policy gradient with asymmetric and dual clip, truncated and masked
importance weights, a KL penalty and the field's loss aggregations, with token ratios (PPO-clip)
or GSPO's sequence ratio; the token negative log-likelihood for supervised warm starts; the
clipped value (critic) loss of PPO. All return raw sums so the worker can form the exact global
mean.

Normalization contract with the Megatron worker (``docs/design.md``, "Normalization"): a loss
returns, per microbatch, ``loss_sum`` (NOT divided by anything) and ``count`` (valid tokens
for ``loss_type == "token"``, valid sequences for ``"sequence"``); the worker divides the
gradient by the count summed over all microbatches and data-parallel ranks. Metrics are raw
sums too; ``metric_kinds`` says which global count divides each.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

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
    """Clipped policy-gradient loss (PPO-clip / GRPO / DAPO), per token on response tokens.

    With ``r = exp(log_ratio)``, ``log_ratio = logp - logp_old`` per token (:meth:`log_ratio`;
    :class:`GSPOLoss` takes it per sequence) and advantage ``A`` (per token):

    * PPO-clip (Schulman et al. 2017, arXiv:1707.06347, eq. 7) with decoupled bounds (DAPO
      "Clip-Higher", Yu et al. 2025, arXiv:2503.14476, sec. 3.1):
      ``L = max(-A*r, -A*clip(r, 1 - clip_low, 1 + clip_high))``;
    * dual clip for ``A < 0`` (Ye et al. 2020, "Mastering Complex Control in MOBA Games",
      arXiv:1912.09729): ``L = min(L, -A*c)``;
    * importance weights for the rollout engine's mismatch, ``w = exp(logp_old -
      logp_generation)`` per token (constants): truncated, ``L *= min(w, cap)``
      (``importance_ratio_cap``; "TIS", Yao et al. 2025, "Your Efficient RL Framework Secretly
      Brings You Off-Policy RL Training"), and/or masked, ``L *= [low <= w <= high]`` per token
      or with the sequence's weight ``prod_t w_t`` per sequence (``importance_mask``; "MIS",
      Liu et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
      Training-Inference Mismatch"). A masked token keeps its place in the count of the
      aggregation (its weight is 0, as in an importance-sampling estimate);
    * KL penalty: ``+ kl_coef * kl_estimate(logp, logp_ref)`` (see :mod:`mcore_rl.algorithms.kl`).

    Aggregation (``loss.aggregation``, the field's names; ``m`` the valid-token mask, ``T_i``
    the valid tokens of sequence ``i``, over the global batch of ``N`` valid tokens and ``M``
    valid sequences): ``token-mean`` ``sum_i,t m*L / N`` (DAPO's token-level loss, sec. 3.3);
    ``seq-mean-token-mean`` ``sum_i (sum_t m*L / T_i) / M`` (GRPO, Shao et al. 2024, eq. 3);
    ``seq-mean-token-sum`` ``sum_i (sum_t m*L) / M``; ``seq-mean-token-sum-norm``
    ``sum_i (sum_t m*L / L_max) / M`` with the constant ``L_max`` = ``max_response_length``
    (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783, sec. 3.2: no per-response length
    normalization).

    Attributes:
        loss_type: ``"token"`` (``token-mean``: the worker divides by ``N``) or ``"sequence"``
            (the others: by ``M``).
        metric_kinds: metric name -> ``"tokens"``, ``"sequences"``, ``"none"`` (which global
            count the worker divides the metric's raw sum by; ``"none"``: keep the sum),
            ``"max"`` (the maximum over micro-batches and DP ranks), or the name of a metric of
            kind ``"none"`` (its global sum divides: the mismatch figures of
            ``loss.prev_logprobs=train_forward`` over ``logprob_mismatch_tokens``).

    Raises:
        ConfigError (a ``ValueError``) at construction for a ``LossConfig`` value outside what
        the schema declares, naming its ``loss.*`` key (:func:`mcore_rl.config.checks.check`,
        the check config loading runs); ``ValueError`` for ``seq-mean-token-sum-norm`` without
        ``max_response_length``. ``importance_ratio_cap`` is at least 1: with trainer
        and rollout engine in agreement (ratio 1) a token keeps its full weight, and the loss
        is the plain clipped loss; a cap below 1 would down-weight every token and bias the
        gradient without any mismatch.
    """

    def __init__(self, config: LossConfig, max_response_length: Optional[int] = None):
        check(config, "loss")
        if config.aggregation == "seq-mean-token-sum-norm" and not max_response_length:
            raise ValueError("loss.aggregation=seq-mean-token-sum-norm needs the constant "
                             "max_response_length (generation.max_new_tokens)")
        self.config = config
        self.max_response_length = max_response_length
        self.loss_type = "token" if config.aggregation == "token-mean" else "sequence"
        loss_kind = self.loss_type + "s"
        self.metric_kinds: Dict[str, str] = {
            "loss": loss_kind,
            "pg_loss": loss_kind,
            "kl": "tokens",
            "clip_fraction": "tokens",
            "dual_clip_fraction": "tokens",
            "ratio_mean": "tokens",
            "is_weight_mean": "tokens",
            "is_weight_max": "max",
            "is_truncated_fraction": "tokens",
            "is_masked_fraction": "tokens",
            "num_valid_tokens": "none",
            "num_valid_sequences": "none",
        }
        # loss.prev_logprobs=train_forward: no logprob forward before training measured the
        # trainer/rollout mismatch; this forward does (mcore_rl.controller.logprob_budget's
        # figures, under the same names), over the valid tokens of the rows the batch's
        # on_policy marks (all without it), logprob_mismatch_tokens of them.
        self.train_forward = config.prev_logprobs == "train_forward"
        if self.train_forward:
            self.metric_kinds.update({"token_mult_prob_error": "logprob_mismatch_tokens",
                                      "logprob_mismatch_mean": "logprob_mismatch_tokens",
                                      "logprob_mismatch_max": "max",
                                      "logprob_mismatch_tokens": "none"})

    def log_ratio(self, logp: torch.Tensor, old: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """``log(pi / pi_old)`` per token: ``logp - old`` (``[B, S-1]`` float32, 0 off the valid
        tokens ``m``)."""
        return logp - old

    def __call__(self, logprobs: torch.Tensor, batch: Dict[str, torch.Tensor]
                 ) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
        """Loss of one microbatch as a raw sum, its count, and raw metric sums.

        Args:
            logprobs: ``[B, S]`` float32 ``log pi(x_t | x_<t)`` of the policy being trained
                (differentiable), ``logprobs[:, 0] = 0``.
            batch: ``token_mask [B, S]``, ``sample_mask [B]``, ``advantages [B, S]``,
                ``prev_logprobs [B, S]`` (old policy; with ``loss.prev_logprobs=train_forward``
                ``logprobs`` detached instead, and the mismatch metrics
                ``token_mult_prob_error``, ``logprob_mismatch_mean`` / ``_max`` of
                ``generation_logprobs``, over the valid tokens of the rows with ``on_policy
                [B]`` float32 1 when the batch has it: the streaming loop's rows decoded by the
                weights being trained; ``logprob_mismatch_tokens`` counts those tokens);
                ``reference_logprobs [B, S]`` when
                ``kl_coef > 0`` (also used for the ``kl`` metric when present);
                ``generation_logprobs [B, S]`` when ``importance_ratio_cap`` or
                ``importance_mask`` is set (also used for the ``is_*`` metrics when present).

        Returns:
            ``(loss_sum, count, metrics)``: ``loss_sum`` a differentiable scalar, the sum over
            valid tokens of the per-token loss (``token-mean``) or over valid sequences of
            their aggregated loss (the ``seq-mean-*`` modes); ``count`` a float scalar, the
            valid tokens or valid sequences of this microbatch; ``metrics`` detached scalar
            raw sums keyed as in ``metric_kinds`` (``kl`` only when ``reference_logprobs`` is
            in the batch, ``is_*`` only when ``generation_logprobs`` is: the raw weights'
            mean and max, and the fractions of tokens whose weight the cap truncated or the
            mask zeroed). Valid tokens: ``t >= 1`` with ``token_mask = 1`` and
            ``sample_mask = 1``; a valid sequence has ``sample_mask = 1`` and at least one
            valid token.

        Raises:
            ValueError: a needed batch key is missing (named, with the config key needing it),
                or a tensor's shape differs from ``logprobs``'s.
        """
        cfg = self.config
        mask = valid_token_mask(batch)
        tensors = {"advantages": _require(batch, "advantages", "policy-gradient loss"),
                   "prev_logprobs": logprobs.detach() if self.train_forward else
                   _require(batch, "prev_logprobs", "old policy of the ratio")}
        if cfg.kl_coef > 0:
            tensors["reference_logprobs"] = _require(batch, "reference_logprobs", "loss.kl_coef > 0")
        elif "reference_logprobs" in batch:
            tensors["reference_logprobs"] = batch["reference_logprobs"]
        if cfg.importance_ratio_cap is not None or cfg.importance_mask is not None:
            tensors["generation_logprobs"] = _require(
                batch, "generation_logprobs", "loss.importance_ratio_cap or loss.importance_mask is set")
        elif "generation_logprobs" in batch:
            tensors["generation_logprobs"] = batch["generation_logprobs"]
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

        ratio = torch.exp(self.log_ratio(logp, old, m))
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
        is_metrics = {}
        if "generation_logprobs" in tensors:
            pg, is_metrics = self._importance_weighting(
                pg, old - masked(tensors["generation_logprobs"]), m)

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
            """Raw sum by the aggregation: token sum, or sum of per-sequence aggregates."""
            mode = cfg.aggregation
            if mode in ("token-mean", "seq-mean-token-sum"):
                return (x * m).sum()
            if mode == "seq-mean-token-sum-norm":
                return (x * m).sum() / self.max_response_length
            return ((x * m).sum(dim=1) / tokens_per_seq.clamp(min=1)).sum()

        loss_sum = reduce(per_token)
        count = num_tokens if self.loss_type == "token" else num_seqs

        metrics = {
            "loss": loss_sum.detach(),
            "pg_loss": reduce(pg).detach(),
            "clip_fraction": _token_sum(clip_active, m),
            "dual_clip_fraction": _token_sum(dual_active, m),
            "ratio_mean": _token_sum(ratio, m),
            "num_valid_tokens": num_tokens.detach(),
            "num_valid_sequences": num_seqs.detach(),
            **is_metrics,
        }
        if kl is not None:
            metrics["kl"] = _token_sum(kl, m)
        if self.train_forward and "generation_logprobs" in tensors:
            measured = m * batch["on_policy"][:, None] if "on_policy" in batch else m
            gap = (old - masked(tensors["generation_logprobs"])).abs() * measured  # 0 elsewhere
            metrics.update(token_mult_prob_error=_token_sum(torch.exp(gap), measured),
                           logprob_mismatch_mean=_token_sum(gap, measured),
                           logprob_mismatch_max=gap.max().detach() if gap.numel() else gap.sum(),
                           logprob_mismatch_tokens=measured.sum().detach())
        return loss_sum, count.detach(), metrics

    def _importance_weighting(self, pg: torch.Tensor, log_weight: torch.Tensor, m: torch.Tensor
                              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """``pg`` times the truncated and/or masked importance weights of ``log_weight =
        logp_old - logp_generation`` (``[B, S-1]``, 0 off the valid tokens ``m``) as the
        config asks (unchanged when it asks for neither), and the weights' raw metric sums."""
        cfg = self.config
        valid = m > 0
        weight = torch.exp(log_weight)
        if cfg.importance_mask == "sequence":
            seq_weight = torch.exp(log_weight.sum(dim=1, keepdim=True)).expand_as(weight)
            kept = (seq_weight >= cfg.importance_mask_low) & (seq_weight <= cfg.importance_mask_high)
        elif cfg.importance_mask == "token":
            kept = (weight >= cfg.importance_mask_low) & (weight <= cfg.importance_mask_high)
        else:
            kept = torch.ones_like(valid)
        truncated = torch.zeros_like(valid)
        if cfg.importance_ratio_cap is not None:
            truncated = weight > cfg.importance_ratio_cap
            pg = pg * torch.clamp(weight, max=cfg.importance_ratio_cap)
        if cfg.importance_mask is not None:
            pg = torch.where(kept, pg, torch.zeros_like(pg))
        metrics = {
            "is_weight_mean": _token_sum(weight, m),
            "is_weight_max": torch.where(valid, weight, torch.zeros_like(weight)).max().detach(),
            "is_truncated_fraction": _token_sum(truncated, m),
            "is_masked_fraction": _token_sum(~kept, m),
        }
        return pg, metrics


def _token_sum(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Detached sum of ``x`` over the valid tokens ``m`` (a metric's raw sum)."""
    return (x.float() * m).sum().detach()


class GSPOLoss(ClippedPGLoss):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071): the
    clipped loss of :class:`ClippedPGLoss` with the sequence-level, length-normalized ratio
    ``s_i = (pi(y_i|x) / pi_old(y_i|x))^(1/|y_i|) = exp(mean_t (logp - logp_old))`` (sec. 4.1,
    eq. 7) in place of the token ratios, so clipping acts on whole sequences.

    Written as GSPO-token (sec. 4.3, eq. 13): token ``t`` of sequence ``i`` has the ratio
    ``s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)]``, whose value is ``s_i`` and whose gradient
    is ``s_i * grad log pi(y_i,t)``. With ``loss.aggregation=seq-mean-token-mean`` and one
    advantage per sequence this is GSPO's objective (eq. 5) exactly; another aggregation weighs
    the same per-token terms otherwise. The paper's clip ranges are small (3e-4 below, 4e-4
    above). Importance weights, dual clip, KL and metrics are :class:`ClippedPGLoss`'s.
    """

    def log_ratio(self, logp: torch.Tensor, old: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """``log s_i,t = sg[mean_t (logp - old)] + logp - sg[logp]`` per token (``[B, S-1]``;
        the mean over the valid tokens ``m`` of each sequence)."""
        seq = ((logp - old) * m).sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1)
        return seq.detach() + logp - logp.detach()


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

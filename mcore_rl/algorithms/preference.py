"""The reward model's preference loss: Bradley-Terry on (chosen, rejected) pairs, with an
optional margin.

The Bradley-Terry model (Bradley & Terry 1952, "Rank analysis of incomplete block designs: I.
The method of paired comparisons") gives ``P(chosen > rejected) = sigmoid(r_c - r_r)`` for
scalar rewards ``r``; a reward model is trained by the negative log-likelihood of the human
(or verifier) choices, ``L = -log sigmoid(r_c - r_r)`` per pair (Stiennon et al. 2020,
"Learning to summarize from human feedback", eq. 1; Ouyang et al. 2022, "Training language
models to follow instructions with human feedback", eq. 1). With a margin ``m >= 0`` per pair
(how much better the chosen answer is rated; Touvron et al. 2023, "Llama 2", sec. 3.2.2, eq. 2):
``L = -log sigmoid(r_c - r_r - m)``.

Batch layout (:func:`mcore_rl.data.preferences.pair_batch`): a pair is two adjacent rows, the
chosen one first (``chosen`` 1, then 0), both with the pair's ``margin``; micro-batches of the
reward-model worker keep pairs whole (fixed micro-batches of an even row count, in row order).
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor,
                       margin: torch.Tensor | float = 0.0) -> torch.Tensor:
    """Per-pair Bradley-Terry loss ``-log sigmoid(r_c - r_r - margin)`` (nats).

    Args:
        chosen, rejected: ``[P]`` scores of the chosen and rejected responses.
        margin: ``[P]`` or a number; 0: the plain Bradley-Terry loss.

    Returns:
        ``[P]`` float32, computed as ``softplus(-(r_c - r_r - margin))`` (the same value without
        overflow for large differences).
    """
    delta = chosen.float() - rejected.float() - margin
    return F.softplus(-delta)


def pair_view(scores: torch.Tensor, batch: Dict[str, torch.Tensor]
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(chosen [P], rejected [P], margin [P], valid [P] bool)`` of a micro-batch of pairs.

    Args:
        scores: ``[2P]`` the rows' scores.
        batch: ``chosen [2P]`` (1, 0 per pair), ``margin [2P]``, ``sample_mask [2P]`` (a pair
            counts when both its rows have 1; padding rows have 0).

    Raises:
        ValueError: an odd row count, missing keys, or a valid pair whose rows are not
            (chosen, rejected) in that order (a micro-batch that split or reordered pairs).
    """
    for key in ("chosen", "margin", "sample_mask"):
        if key not in batch:
            raise ValueError(f"preference batch has no {key!r}; keys: {sorted(batch)}")
    n = scores.shape[0]
    if scores.dim() != 1 or n % 2:
        raise ValueError(f"preference scores must be [2P] (pairs of rows), got {tuple(scores.shape)}")
    is_chosen = batch["chosen"].view(-1, 2)
    valid = (batch["sample_mask"].view(-1, 2) > 0).all(dim=1)
    if not bool(((is_chosen[:, 0] == 1) & (is_chosen[:, 1] == 0))[valid].all()):
        raise ValueError("preference batch: each pair must be two adjacent rows, chosen first "
                         "(micro-batches must keep pairs whole and in order)")
    pairs = scores.view(-1, 2)
    return pairs[:, 0], pairs[:, 1], batch["margin"].view(-1, 2)[:, 0].float(), valid


class BradleyTerryLoss:
    """The reward model's training loss, with the workers' loss interface: per micro-batch the
    raw sum of :func:`bradley_terry_loss` over its valid pairs and their count; the worker
    divides by the pairs of the global batch (``docs/design.md``, "Normalization").

    Attributes:
        loss_type: ``"sequence"``: the count is of pairs (reported as
            ``num_valid_sequences``).
        metric_kinds: ``loss``, ``pair_accuracy`` (``r_c > r_r``), ``reward_margin``
            (``r_c - r_r``), ``chosen_score``, ``rejected_score``: means over pairs;
            ``num_valid_tokens``/``num_valid_sequences`` raw.
    """

    loss_type = "sequence"
    metric_kinds = {"loss": "sequences", "pair_accuracy": "sequences",
                    "reward_margin": "sequences", "chosen_score": "sequences",
                    "rejected_score": "sequences", "num_valid_tokens": "none",
                    "num_valid_sequences": "none"}

    def __call__(self, scores: torch.Tensor, batch: Dict[str, torch.Tensor]
                 ) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
        """Args: ``scores [2P]`` float32 (differentiable; the rows' last-token scores) and the
        micro-batch (:func:`pair_view`'s keys, ``input_lengths``). Returns ``(loss_sum, count,
        metrics)``: the summed per-pair loss over valid pairs, the valid pairs, raw metric sums.
        Raises ``ValueError`` as :func:`pair_view`."""
        chosen, rejected, margin, valid = pair_view(scores, batch)
        v = valid.float()
        loss_sum = (bradley_terry_loss(chosen, rejected, margin) * v).sum()
        diff = (chosen - rejected).detach().float()
        rows = batch["sample_mask"] > 0
        metrics = {"loss": loss_sum.detach(),
                   "pair_accuracy": ((diff > 0).float() * v).sum(),
                   "reward_margin": (diff * v).sum(),
                   "chosen_score": (chosen.detach().float() * v).sum(),
                   "rejected_score": (rejected.detach().float() * v).sum(),
                   "num_valid_tokens": batch["input_lengths"][rows].sum().float(),
                   "num_valid_sequences": v.sum()}
        return loss_sum, v.sum(), metrics


def pair_accuracy(scores: torch.Tensor) -> float:
    """Held-out pair accuracy of the scores ``[2P]`` of pairs laid out as in training (chosen
    first): the fraction of pairs with ``r_c > r_r`` (a tie counts as wrong)."""
    pairs = scores.view(-1, 2)
    return float((pairs[:, 0] > pairs[:, 1]).float().mean())

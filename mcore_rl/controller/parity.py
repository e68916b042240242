"""Layout parity: one policy training step in a parallel layout against a reference layout.

The same model and global batch must give the same numbers whatever the TP x PP x DP layout
(``docs/design.md``, "Tests, in tiers"). :func:`record_step` runs what an RL step runs on a policy
worker group (logprobs, one ``train`` step, the refit export) and keeps the numbers;
:func:`compare` turns two records into the differences that matter; :func:`parity_table`
prints them. The CPU tests (``tests/test_layouts.py``, fp32, gloo) and the GPU check
(``scripts/gpu/layout_parity.py``, bf16, NCCL) share these three.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence

import torch

from mcore_rl.data import batch as B
from mcore_rl.distributed.worker_group import DataParallelGroup
from mcore_rl.workers.interfaces import PolicyAPI

# compare()'s keys, in table order: the relative and largest differences that tolerances hold,
# then the absolute ones of DETAIL_KEYS (largest and mean logprob difference, mean weight
# difference: how far apart two layer specs are, beside how far the worst token is).
DIFF_KEYS = ("logprobs_rel", "loss_rel", "grad_norm_rel", "params_max_abs")
DETAIL_KEYS = ("logprobs_max_abs", "logprobs_mean_abs", "params_mean_abs")


@dataclass
class StepRecord:
    """What one layout computed on one global batch.

    Attributes:
        logprobs: ``[B, S]`` float32, the policy's per-token logprobs before the step.
        metrics: the ``train`` metrics of the step (``loss``, ``grad_norm``, ...).
        weights: the Hugging Face-named weights after the step (CPU tensors, full size).
    """

    logprobs: torch.Tensor
    metrics: Dict[str, float]
    weights: Dict[str, torch.Tensor]


def record_step(group: DataParallelGroup, batch: B.Batch, loss_fn, micro_batch_size: int,
                logprob_micro_batch_size: int) -> StepRecord:
    """Logprobs of ``batch``, one optimizer step on it, the weights after the step.

    Args:
        group: policy workers (:class:`~mcore_rl.workers.policy.PolicyWorker`) in any layout.
        batch: the global batch with everything ``loss_fn`` needs (``prev_logprobs``
            included: pass the reference's, so every layout sees the same loss inputs).
        loss_fn: e.g. :class:`~mcore_rl.algorithms.losses.ClippedPGLoss`.
        micro_batch_size, logprob_micro_batch_size: rows per training / logprob micro-batch.

    Collective over the group (all ranks run each call).
    """
    logprobs = group.gather_rows(PolicyAPI).get_logprobs(batch, logprob_micro_batch_size)
    metrics = group.train(batch, loss_fn, micro_batch_size)
    weights = group.call(PolicyAPI).get_hf_weights()[0]
    return StepRecord(logprobs, metrics, weights)


def relative_diff(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    """``max|a - b| / max|b|`` (0 when both are 0): a difference relative to the reference
    ``b``'s scale, so near-zero entries do not blow it up. Raises ``ValueError`` when the
    shapes differ."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    diff, scale = (a - b).abs().max().item(), b.abs().max().item()
    return diff / scale if scale > 0 else diff


def compare(record: StepRecord, reference: StepRecord,
            mask: Optional[torch.Tensor] = None) -> Dict[str, float]:
    """Differences of ``record`` from ``reference`` (:data:`DIFF_KEYS`, then
    :data:`DETAIL_KEYS`): ``logprobs_rel``, ``loss_rel`` and ``grad_norm_rel`` by
    :func:`relative_diff`; ``params_max_abs`` the largest absolute difference of any weight
    after the step; ``logprobs_max_abs`` and ``logprobs_mean_abs`` over the positions of
    ``mask`` (``[B, S]`` bool; default every position); ``params_mean_abs`` over every weight
    element.

    Raises ``ValueError`` when the two records have different weight names or shapes.
    """
    if record.weights.keys() != reference.weights.keys():
        raise ValueError(f"weight names differ: {sorted(record.weights.keys() ^ reference.weights.keys())}")
    params, total, count = 0.0, 0.0, 0
    for name, ref in reference.weights.items():
        got = record.weights[name]
        if got.shape != ref.shape:
            raise ValueError(f"{name}: shape {tuple(got.shape)} vs reference {tuple(ref.shape)}")
        diff = (got.double() - ref.double()).abs()
        params = max(params, diff.max().item())
        total, count = total + diff.sum().item(), count + diff.numel()
    lp = (record.logprobs.double() - reference.logprobs.double()).abs()
    lp = lp[mask.bool()] if mask is not None else lp.flatten()
    return {
        "logprobs_rel": relative_diff(record.logprobs, reference.logprobs),
        "loss_rel": relative_diff(record.metrics["loss"], reference.metrics["loss"]),
        "grad_norm_rel": relative_diff(record.metrics["grad_norm"], reference.metrics["grad_norm"]),
        "params_max_abs": params,
        "logprobs_max_abs": lp.max().item() if lp.numel() else 0.0,
        "logprobs_mean_abs": lp.mean().item() if lp.numel() else 0.0,
        "params_mean_abs": total / count if count else 0.0,
    }


def parity_table(rows: Mapping[str, Mapping[str, float]],
                 columns: Sequence[str] = DIFF_KEYS) -> str:
    """A plain-text table, one row per layout name: ``columns`` of each row's
    :func:`compare` result in ``%.2e`` (blank where a row lacks the key, e.g. a tolerance row)."""
    width = max([len("layout"), *map(len, rows)])
    widths = [max(14, len(c)) for c in columns]
    lines = ["  ".join([f"{'layout':<{width}}", *(f"{c:>{w}}" for c, w in zip(columns, widths))])]
    for name, diffs in rows.items():
        cells = [f"{diffs[c]:>{w}.2e}" if c in diffs else " " * w for c, w in zip(columns, widths)]
        lines.append("  ".join([f"{name:<{width}}", *cells]).rstrip())
    return "\n".join(lines)

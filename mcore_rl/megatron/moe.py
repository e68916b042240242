"""Router losses of mixture-of-experts models in training: which positions they count, their
weight in the loss, and their metrics.

Megatron-Core's router adds the gradients of its load-balancing loss (Switch Transformer,
Fedus et al. 2022, eq. 4: ``L = E * sum_i f_i P_i`` per MoE layer and micro-batch) and of its
z-loss (ST-MoE, Zoph et al. 2022, eq. 5: the mean of ``logsumexp(router logits)^2``) itself,
through ``MoEAuxLossAutoScaler``. The workers make both count the *loss positions* only (the
positions whose output enters the loss, :func:`router_padding_mask`) and weigh each micro-batch
by its ``n_mb`` loss positions, so that after ``finalize_model_grads`` divides every gradient by
the step's loss count ``N`` (valid tokens; sequences with ``loss.normalization=sequence``) the
training loss gains ``coeff * sum_mb n_mb L_mb / N`` per router loss and MoE layer: a
per-token term like the token-normalized policy loss, whatever the TP/PP/DP/EP layout.

Megatron's own weights, read in ``TopKRouter`` (both versions, with a padding mask): the
load-balancing loss of each TP rank's positions is weighted by the micro-batch's loss-position
count (the rank's count is all-reduced in place over TP before it is read), times the TP size
from megatron-core 0.19 on; the z-loss of a rank is ``coeff / TP`` times its positions' mean,
weighted by the rank's count (times the TP size from 0.19 on). :func:`router_loss_coefficients`
gives the coefficients that make both ``coeff * n_mb * L_mb`` summed over the TP ranks
(``tests/test_moe.py`` checks this against autograd through transformers, and TP = 2 against
one process). A micro-batch without loss positions runs with both losses off
(:func:`router_losses_off`): Megatron would divide by its zero count.

The values Megatron records per layer (its MoE metrics tracker, whose API moved between
megatron-core 0.16 and 0.19) are read back by :func:`router_loss_metrics`.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from mcore_rl.data.batch import Batch

# Megatron's tracker name -> (metric name, reduction over the TP ranks of one micro-batch):
# the load-balancing loss is split into per-rank partial sums under sequence parallelism, the
# z-loss is a mean over each rank's positions.
_TRACKED = {"load_balancing_loss": ("moe_aux_loss", "sum"), "z_loss": ("moe_z_loss", "mean")}


def router_padding_mask(mb: Batch) -> torch.Tensor:
    """``[b, s]`` bool, True at the positions whose output enters no loss term (Megatron's
    ``padding_mask``: the router losses leave them out).

    Position ``t`` produces the logits (and the value) of token ``t + 1``
    (``logprobs[:, t + 1]``), so it counts when token ``t + 1`` is a valid loss token
    (:func:`~mcore_rl.algorithms.losses.valid_token_mask`: ``token_mask`` of a row whose
    ``sample_mask`` is set). Without ``token_mask`` in ``mb`` every position counts.
    """
    ids = mb["input_ids"]
    if "token_mask" not in mb or "sample_mask" not in mb:
        return torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
    from mcore_rl.algorithms.losses import valid_token_mask

    valid = valid_token_mask(mb) > 0
    return ~torch.cat([valid[:, 1:], torch.zeros_like(valid[:, :1])], dim=1)


def router_loss_coefficients(aux_coeff: float, z_coeff: float,
                             tensor_model_parallel_size: int) -> Tuple[float, Optional[float]]:
    """Megatron's ``(moe_aux_loss_coeff, moe_z_loss_coeff)`` (None: off) for the configured
    coefficients ``aux_coeff`` and ``z_coeff`` (``megatron.moe_aux_loss_coeff``,
    ``moe_z_loss_coeff``) under TP size ``tensor_model_parallel_size`` (see the module
    docstring: Megatron's weights differ from ``n_mb`` by a TP factor, which one depends on the
    megatron-core version)."""
    from megatron.core import package_info
    from packaging.version import Version

    tp = tensor_model_parallel_size
    if Version(package_info.__version__) >= Version("0.19"):
        return aux_coeff / tp, z_coeff or None
    return aux_coeff, z_coeff * tp or None


@contextlib.contextmanager
def router_losses_off(config) -> Iterator[None]:
    """Turn the router losses off for the forward passes inside (Megatron's router reads both
    coefficients from the model's ``TransformerConfig`` in its forward; the backward uses what
    the forward attached)."""
    saved = config.moe_aux_loss_coeff, config.moe_z_loss_coeff
    config.moe_aux_loss_coeff, config.moe_z_loss_coeff = 0.0, None
    try:
        yield
    finally:
        config.moe_aux_loss_coeff, config.moe_z_loss_coeff = saved


def _tracked() -> Dict[str, torch.Tensor]:
    """Megatron's per-layer sums ``{name: [num_layers]}`` on this rank (this stage's layers)."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:  # megatron-core < 0.17
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        return {n: e["values"] for n, e in get_moe_layer_wise_logging_tracker().items()}
    return {n: e.values for n, e in get_moe_metrics_tracker().metrics.items()}


def clear_router_losses() -> None:
    """Zero Megatron's recorded router-loss values (at the start of a train step)."""
    for values in _tracked().values():
        values.zero_()


def router_loss_metrics(config, num_microbatches: int, device: torch.device) -> Dict[str, float]:
    """The router losses of the train step just run, the same on every rank: ``moe_aux_loss``
    (load balancing; 1.0 when perfectly balanced) and ``moe_z_loss``, each the mean over MoE
    layers and over the step's micro-batches with loss positions (all DP ranks) of the unscaled
    per-micro-batch loss (the z-loss: the mean over TP ranks of each rank's position mean), for
    the losses whose coefficient is set (none otherwise).

    Args:
        config: the model's ``TransformerConfig`` (all layers are MoE layers).
        num_microbatches: this rank's training micro-batches with loss positions.
        device: where the reduction runs (the worker's device).

    Collective over the model-parallel (TP x PP) and the DP group when a coefficient is set.
    """
    wanted = {"load_balancing_loss": config.moe_aux_loss_coeff > 0,
              "z_loss": bool(config.moe_z_loss_coeff)}
    if not any(wanted.values()):
        return {}
    from megatron.core import parallel_state as ps

    tracked = _tracked()
    mp_group = ps.get_model_parallel_group()
    tp, mp = ps.get_tensor_model_parallel_world_size(), dist.get_world_size(mp_group)
    sums = []
    for name, (_, tp_op) in _TRACKED.items():
        total = (tracked[name].double().sum() if name in tracked
                 else torch.zeros((), dtype=torch.float64))
        sums.append(total.cpu() / (tp if tp_op == "mean" else 1))
    # every TP and PP rank of a DP rank ran all of its micro-batches: count them once
    vec = torch.stack([*sums, torch.tensor(num_microbatches / mp, dtype=torch.float64)])
    vec = vec.to(device)
    dist.all_reduce(vec, group=mp_group)
    dist.all_reduce(vec, group=ps.get_data_parallel_group())
    count = max(vec[-1].item(), 1.0)
    return {metric: vec[i].item() / count / config.num_layers
            for i, (name, (metric, _)) in enumerate(_TRACKED.items()) if wanted[name]}

"""The value (critic) worker: the policy's GPT backbone with a scalar value head, on Megatron.

Adds to :class:`~mcore_rl.workers.scalar_head.ScalarHeadWorker` (the backbone with a
:class:`~mcore_rl.workers.scalar_head.ScalarHead` ``hidden -> 1`` in place of the LM output
layer, shared with the reward model; its module docstring says how the head lives under tensor
parallelism): right-shifted per-token values, the clipped value loss's output, export as a
token-classification model.

Convention (``docs/design.md``, "Values"): ``values[b, t] = V(state before token t)`` = the head applied to
the final hidden state at position ``t - 1``; ``values[:, 0] = 0``. The shift matters: a critic
read at position ``t`` (which has already seen token ``t``) trains without error and silently
costs reward.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from mcore_rl.data.batch import Batch
from mcore_rl.data.packing import CU_SEQLENS, unpack
from mcore_rl.workers.megatron_worker import LossOutput, requires_device_state
from mcore_rl.workers.scalar_head import ScalarHeadWorker


def _values(output: torch.Tensor, mb: Batch) -> torch.Tensor:
    """Right-shifted values ``[b, s]`` float32 of a micro-batch from the head output
    ``[b, s, 1]``; a packed micro-batch (:mod:`mcore_rl.data.packing`, output ``[1, T, 1]``) is
    shifted within each sequence and put back in the ``[b, s]`` layout."""
    if CU_SEQLENS in mb:
        return unpack(output[..., 0].float(), mb[CU_SEQLENS], mb["input_ids"].shape[1], shift=1,
                      num_rows=mb["input_ids"].shape[0], lengths=mb["input_lengths"])
    return shift_right(output[..., 0])


def shift_right(head_values: torch.Tensor) -> torch.Tensor:
    """``values[:, t] = head_values[:, t - 1]``, ``values[:, 0] = 0`` (``docs/design.md``, "Values": the value
    of the state before token ``t`` is read from the hidden state that has seen tokens ``< t``).

    Args:
        head_values: ``[b, s]`` the head at every position.
    Returns:
        ``[b, s]`` float32. Raises ``ValueError`` if the input is not 2-D.
    """
    if head_values.dim() != 2:
        raise ValueError(f"shift_right: expected [b, s], got shape {tuple(head_values.shape)}")
    head_values = head_values.float()
    return torch.cat([torch.zeros_like(head_values[:, :1]), head_values[:, :-1]], dim=1)


class ValueWorker(ScalarHeadWorker):
    """Critic on Megatron-Core: the policy's backbone plus a
    :class:`~mcore_rl.workers.scalar_head.ScalarHead` with a bias.

    Args: those of :class:`~mcore_rl.workers.scalar_head.ScalarHeadWorker` (``hf_path``: a
    Hugging Face causal-LM checkpoint whose backbone initialises the critic, or None for the
    policy's seeded initialisation; the value head is always freshly initialised;
    ``head_fp32``: keep the value head in float32 whatever ``megatron.precision`` is).
    """

    # ------------------------------------------------------------------ values
    def _loss_output(self, output: torch.Tensor, mb: Batch, loss_fn) -> LossOutput:
        loss_sum, count, metrics = loss_fn(_values(output, mb), mb)
        return loss_sum, count.detach().to(torch.int64), metrics

    @requires_device_state(training=False)
    def get_values(self, batch: Batch, micro_batch_size: int) -> torch.Tensor:
        """Right-shifted values of ``batch["input_ids"]``: ``values[b, t] = V(x_<t)``.

        Returns a float32 CPU tensor ``[B, S]`` (S of the input; 0 at ``t = 0`` and past each
        row's length), identical on every rank. Collective over the worker world.
        """
        return self._per_token_forward(batch, micro_batch_size,
                                       _values)

    @requires_device_state(training=False)
    def get_hf_weights(self) -> Optional[Dict[str, torch.Tensor]]:
        """The critic as Hugging Face names of a token-classification model with one label
        (``AutoModelForTokenClassification`` with ``num_labels=1``): the backbone's ``model.*``
        tensors (gathered across TP and PP, vocabulary padding stripped) plus ``score.weight``
        ``[1, h]`` and ``score.bias`` ``[1]``. That model's logits at position ``t`` are the
        head at ``t``; :meth:`get_values` is them shifted right by one.

        Returns CPU tensors on rank 0, None on other ranks. Collective: every rank calls it.
        """
        return super().get_hf_weights()

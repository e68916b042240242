"""The reward-model worker: a GPT backbone with a scalar score head, on Megatron, that scores
a sequence by its last token.

Adds to :class:`~mcore_rl.workers.scalar_head.ScalarHeadWorker` (the backbone with a
:class:`~mcore_rl.workers.scalar_head.ScalarHead`, shared with the critic): a head without a
bias, read from a Hugging Face ``*ForSequenceClassification`` checkpoint with one label
(``score.weight`` ``[1, h]``) or fresh on a causal LM's backbone (reward-model training from a
pretrained model); the score of a row, the head at its last valid token (the field's reward
model: Stiennon et al. 2020, "Learning to summarize from human feedback", sec. 3.4; Ouyang et
al. 2022, sec. 3.5; Hugging Face's ``*ForSequenceClassification`` pools the last non-padding
token the same way); scoring in token-budget micro-batches; training on preference pairs
(:class:`~mcore_rl.algorithms.preference.BradleyTerryLoss`).

Scores: ``scores[b] = w . h_L[b, n_b - 1]`` with ``n_b = input_lengths[b]`` and ``h_L`` the
final norm's output: float32, one per row.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, List, Optional

import torch

from mcore_rl.data.batch import Batch
from mcore_rl.workers.megatron_worker import LossOutput, requires_device_state
from mcore_rl.workers.scalar_head import SCORE_BIAS, SCORE_WEIGHT, ScalarHeadWorker


def last_token(head_values: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
    """The head at each row's last valid token.

    Args:
        head_values: ``[b, s]`` the head at every position (any float dtype).
        input_lengths: ``[b]`` int64 valid tokens per row, each in ``1 .. s``.

    Returns:
        ``[b]`` float32, ``head_values[i, input_lengths[i] - 1]``.

    Raises:
        ValueError: shapes that do not fit, or a length outside ``1 .. s``.
    """
    if head_values.dim() != 2 or input_lengths.shape != head_values.shape[:1]:
        raise ValueError(f"last_token: expected [b, s] and [b], got {tuple(head_values.shape)} "
                         f"and {tuple(input_lengths.shape)}")
    lengths = input_lengths.to(head_values.device)
    if bool(((lengths < 1) | (lengths > head_values.shape[1])).any()):
        raise ValueError(f"last_token: input_lengths {lengths.tolist()} outside 1..{head_values.shape[1]}")
    return head_values.float().gather(1, (lengths - 1).long()[:, None])[:, 0]


class MissingScoreHeadError(ValueError):
    """A reward-model checkpoint without the score head of a ``*ForSequenceClassification``
    model with one label."""


def score_head(hf_state: Dict[str, torch.Tensor], hidden_size: int, where: str) -> torch.Tensor:
    """The ``score.weight`` ``[1, hidden_size]`` of a sequence-classification checkpoint.

    Raises:
        MissingScoreHeadError: no ``score.weight`` (a causal LM, or another head's names), a
            shape other than ``[1, hidden_size]`` (``num_labels`` != 1), or a ``score.bias``
            (the head here has none, as transformers' ``*ForSequenceClassification``); the
            message names ``where``.
    """
    weight = hf_state.get(SCORE_WEIGHT)
    if weight is None:
        heads = sorted(k for k in hf_state if not k.startswith("model."))
        raise MissingScoreHeadError(
            f"{where}: no score head ({SCORE_WEIGHT}; a *ForSequenceClassification checkpoint "
            f"with num_labels=1); its tensors outside the backbone: {heads or 'none'}")
    if tuple(weight.shape) != (1, hidden_size):
        raise MissingScoreHeadError(f"{where}: {SCORE_WEIGHT} has shape {tuple(weight.shape)}, "
                                    f"expected (1, {hidden_size}) (num_labels=1)")
    if SCORE_BIAS in hf_state:
        raise MissingScoreHeadError(f"{where}: has {SCORE_BIAS}; a reward model's score head has "
                                    f"no bias (transformers' *ForSequenceClassification)")
    return weight


class RewardModelWorker(ScalarHeadWorker):
    """Reward model on Megatron-Core: a backbone plus a bias-free
    :class:`~mcore_rl.workers.scalar_head.ScalarHead` scoring the last token.

    Args (beyond :class:`~mcore_rl.workers.scalar_head.ScalarHeadWorker`'s):
        require_score_head: ``hf_path`` must hold the score head (``score.weight``: a reward
            model to score with); False: a checkpoint without one starts a fresh head on its
            backbone (reward-model training from a causal LM), one with one keeps it.
        score_tokens_per_microbatch: the token budget of :meth:`get_scores`'s micro-batches
            (:mod:`mcore_rl.data.microbatching`); None: fixed micro-batches of the call's
            ``micro_batch_size`` rows. Training always runs fixed micro-batches in row order,
            so the rows of a preference pair (adjacent) stay in one micro-batch.

    Raises:
        MissingScoreHeadError: ``require_score_head`` and ``hf_path`` has no score head.
    """

    head_bias = False

    def __init__(self, *, require_score_head: bool = False,
                 score_tokens_per_microbatch: Optional[int] = None, **kwargs):
        self.require_score_head = require_score_head
        self.score_tokens_per_microbatch = score_tokens_per_microbatch
        super().__init__(**kwargs)

    def _load_head(self, chunks: List[torch.nn.Module], hf_state: Dict[str, torch.Tensor]) -> None:
        """``score.weight`` of a sequence-classification checkpoint into the head (every
        stage checks it; the last holds the head); a checkpoint without one leaves the head
        fresh unless :attr:`require_score_head`."""
        if not self.hf_path or (SCORE_WEIGHT not in hf_state and not self.require_score_head):
            return
        weight = score_head(hf_state, self.arch.hidden_size, self.hf_path)
        for chunk in chunks:
            if chunk.post_process:
                with torch.no_grad():
                    chunk.output_layer.weight.copy_(weight)

    # ------------------------------------------------------------------ scores
    def _scores(self, output: torch.Tensor, mb: Batch) -> torch.Tensor:
        return last_token(output[..., 0], mb["input_lengths"])

    def _loss_output(self, output: torch.Tensor, mb: Batch, loss_fn) -> LossOutput:
        loss_sum, count, metrics = loss_fn(self._scores(output, mb), mb)
        return loss_sum, count.detach().to(torch.int64), metrics

    @contextmanager
    def _token_budget(self, budget: Optional[int]):
        saved, self.max_tokens_per_microbatch = self.max_tokens_per_microbatch, budget
        try:
            yield
        finally:
            self.max_tokens_per_microbatch = saved

    @requires_device_state(training=False)
    def get_scores(self, batch: Batch, micro_batch_size: int) -> torch.Tensor:
        """The score of each row of ``batch`` (``input_ids`` ``[B, S]``, ``input_lengths``
        ``[B]``): the head at the row's last valid token.

        Micro-batches: under :attr:`score_tokens_per_microbatch` when set (rows sorted by
        length, padded to each micro-batch's longest), else of ``micro_batch_size`` rows.

        Returns a float32 CPU tensor ``[B]``, identical on every rank. Collective over the
        worker world.
        """
        with self._token_budget(self.score_tokens_per_microbatch):
            head = self._per_token_forward(batch, micro_batch_size,
                                           lambda out, mb: out[..., 0].float())
        return last_token(head, batch["input_lengths"])

    @requires_device_state(training=False)
    def get_hf_weights(self) -> Optional[Dict[str, torch.Tensor]]:
        """The reward model as Hugging Face names of a sequence-classification model with one
        label (``AutoModelForSequenceClassification``, ``num_labels=1``): the backbone's
        ``model.*`` tensors (gathered across TP and PP, vocabulary padding stripped) plus
        ``score.weight`` ``[1, h]``. That model's pooled logit of a right-padded row is
        :meth:`get_scores`'s score.

        Returns CPU tensors on rank 0, None on other ranks. Collective: every rank calls it.
        """
        return super().get_hf_weights()

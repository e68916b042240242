"""Per-token logprobs from vocabulary-parallel logits without full-vocabulary fp32 copies.

``logprob_t = x_t - logsumexp_j x_j`` with ``x = logits / temperature`` over the real
vocabulary (padded columns ``>= vocab_size`` excluded), the max and the sum of exponentials
all-reduced over the tensor-parallel group as in Megatron's ``vocab_parallel_cross_entropy``
(Shoeybi et al. 2019, "Megatron-LM", sec. 3). The difference is memory traffic: Megatron's
function (and a ``.float()`` before it) materializes the logits in fp32 and keeps the fp32
softmax for the backward, about eight fp32 passes over ``[b, s, V/TP]`` per micro-batch.
Here the upcast, masking, max, exp-sum and target gather are one fused kernel pass each on
CUDA (``torch.compile``), only the bf16 logits and the ``[b, s]`` log-normalizer are saved,
and the backward ``d lp_t / d logit_j = (1[j = t] - softmax_j) / temperature`` writes the
gradient in the logits' dtype in one pass. On the CPU the same functions run eagerly.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist


def _scaled(logits: torch.Tensor, vocab_start: int, vocab_size: int, inv_temperature: float):
    x = logits.float() * inv_temperature
    cols = torch.arange(logits.shape[-1], device=logits.device) + vocab_start
    return x.masked_fill(cols >= vocab_size, float("-inf"))


def _row_max(logits, vocab_start: int, vocab_size: int, inv_temperature: float):
    return _scaled(logits, vocab_start, vocab_size, inv_temperature).amax(dim=-1)


def _sumexp_and_target(logits, target, row_max, vocab_start: int, vocab_size: int,
                       inv_temperature: float):
    x = _scaled(logits, vocab_start, vocab_size, inv_temperature)
    sumexp = torch.exp(x - row_max.unsqueeze(-1)).sum(dim=-1)
    local = target - vocab_start
    mine = (local >= 0) & (local < logits.shape[-1])
    picked = x.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return sumexp, torch.where(mine, picked, torch.zeros_like(picked))


def _grad(logits, target, lse, grad_out, vocab_start: int, vocab_size: int, inv_temperature: float):
    x = _scaled(logits, vocab_start, vocab_size, inv_temperature)
    cols = torch.arange(logits.shape[-1], device=logits.device) + vocab_start
    onehot = (cols == target.unsqueeze(-1)).float()
    grad = (onehot - torch.exp(x - lse.unsqueeze(-1))) * (grad_out * inv_temperature).unsqueeze(-1)
    return grad.to(logits.dtype)


@functools.lru_cache(maxsize=None)
def _kernel(name: str, cuda: bool):
    """The fused (compiled, dynamic shapes) version of a helper on CUDA, eager on the CPU."""
    fn = {"max": _row_max, "sumexp": _sumexp_and_target, "grad": _grad}[name]
    return torch.compile(fn, dynamic=True) if cuda else fn


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, inv_temperature, group):
        cuda = logits.is_cuda
        row_max = _kernel("max", cuda)(logits, vocab_start, vocab_size, inv_temperature)
        if group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        sumexp, picked = _kernel("sumexp", cuda)(logits, target, row_max, vocab_start,
                                                 vocab_size, inv_temperature)
        if group is not None:
            both = torch.stack([sumexp, picked])
            dist.all_reduce(both, group=group)
            sumexp, picked = both[0], both[1]
        lse = row_max + torch.log(sumexp)
        ctx.save_for_backward(logits, target, lse)
        ctx.args = (vocab_start, vocab_size, inv_temperature)
        return picked - lse

    @staticmethod
    def backward(ctx, grad_out):
        logits, target, lse = ctx.saved_tensors
        grad = _kernel("grad", logits.is_cuda)(logits, target, lse, grad_out.float(), *ctx.args)
        return grad, None, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, target: torch.Tensor, vocab_size: int,
                            temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)[target]`` over the real vocabulary.

    Args:
        logits: ``[..., V_pad / TP]`` this TP rank's vocabulary shard (rank ``r`` holds columns
            ``r * V_pad/TP ..``), any float dtype (bf16 stays bf16 in memory).
        target: ``[...]`` int64 global token ids (``< vocab_size``).
        vocab_size: real vocabulary; columns ``>= vocab_size`` (TP padding) are excluded.
        temperature: ``> 0``; the rollout's sampling temperature.

    Returns:
        float32 ``[...]``, differentiable w.r.t. ``logits`` (gradient in ``logits.dtype``).
        Collective over Megatron's tensor-parallel group when it has more than one rank.

    Raises:
        ValueError: ``temperature <= 0``, or ``target`` shaped unlike ``logits[..., 0]``.
    """
    from megatron.core import parallel_state

    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} does not match logits "
                         f"{tuple(logits.shape)} without the vocabulary dimension")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    return _VocabParallelLogprobs.apply(logits, target, rank * logits.shape[-1], vocab_size,
                                        1.0 / temperature, group)

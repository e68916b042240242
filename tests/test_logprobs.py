"""``vocab_parallel_logprobs`` against Megatron's ``vocab_parallel_cross_entropy`` (the path it
replaces): values and gradients, TP=1 and TP=2 (2 gloo processes, spawned once), with a
temperature and a padded vocabulary, for fp32 and bf16 logits; bad input raises."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed, use_layout

from mcore_rl.megatron.logprobs import vocab_parallel_logprobs

VOCAB, PADDED = 9, 10  # one padded column (TP 2 shards of 5)


def _compare() -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    out = {}
    for tp in (1, 2):
        if tp == 2:
            use_layout(tensor_model_parallel_size=2)
        g = torch.Generator().manual_seed(0)
        full = 3 * torch.randn(3, 7, PADDED, generator=g)
        target = torch.randint(0, VOCAB, (3, 7), generator=g)
        weight = torch.randn(3, 7, generator=g)
        rank, width = ps.get_tensor_model_parallel_rank(), PADDED // tp
        shard = full[..., rank * width:(rank + 1) * width]
        for dtype in (torch.float32, torch.bfloat16):
            x = shard.clone().to(dtype).requires_grad_(True)
            lp = vocab_parallel_logprobs(x, target, VOCAB, temperature=0.7)
            (lp * weight).sum().backward()
            y = shard.clone().to(dtype).float().requires_grad_(True)
            pad = torch.arange(rank * width, (rank + 1) * width) >= VOCAB
            ref = -vocab_parallel_cross_entropy((y / 0.7).masked_fill(pad, float("-inf")), target)
            (ref * weight).sum().backward()
            out[(tp, str(dtype))] = {
                "value": (lp - ref).abs().max().item(),
                "grad": (x.grad.float() - y.grad).abs().max().item(),
                "grad_scale": y.grad.abs().max().item(),
                "grad_dtype": x.grad.dtype, "lp_dtype": lp.dtype,
            }
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_compare, 2)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_matches_megatron_cross_entropy(results, tp, dtype):
    for rank_out in results:
        r = rank_out[(tp, dtype)]
        assert r["lp_dtype"] == torch.float32
        assert r["value"] < 1e-5, r  # both compute in fp32 from the same inputs
        assert r["grad_dtype"] == getattr(torch, dtype.split(".")[1])
        # fp32: the same maths; bf16: our gradient is rounded to bf16 once
        tol = 1e-6 if dtype == "torch.float32" else 2 ** -8 * r["grad_scale"]
        assert r["grad"] <= tol, r


def test_bad_input():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        vocab_parallel_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), 5, 0.0)
    with pytest.raises(ValueError, match="target shape"):
        vocab_parallel_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long), 5)

"""Megatron's multi-tensor fallbacks on torch's foreach kernels (mcore_rl.megatron.multi_tensor):
the norm against a float64 sum of squares, the scale bit for bit against Megatron's fallback's
``dst.copy_(src * scale)``, bad input named, and the install only where Megatron's local
fallbacks are bound."""

import importlib

import pytest
import torch

from mcore_rl.megatron import multi_tensor


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * s
            for shape, s in (((3, 4), 1.0), ((7,), 1e-3), ((128, 64), 10.0), ((1,), 0.5))]


def test_l2_norm_is_the_norm_of_all_tensors_together():
    tensors = _tensors()
    norm, per_tensor = multi_tensor.l2_norm(2048, None, [tensors[:2], tensors[2:]], False)
    reference = torch.sqrt(sum((t.double() ** 2).sum() for t in tensors))
    assert per_tensor is None and norm.dtype == torch.float32 and norm.shape == (1,)
    assert abs(norm.item() - reference.item()) <= 1e-6 * reference.item()


@pytest.mark.parametrize("factor", [1.0, 0.37])
def test_scale_equals_megatrons_fallback_bit_for_bit(factor):
    sources = _tensors(1)
    ours = [torch.empty_like(t, dtype=torch.bfloat16) for t in sources]
    multi_tensor.scale(2048, None, [sources, ours], factor)
    for source, out in zip(sources, ours):
        theirs = torch.empty_like(out)
        theirs.copy_(source * factor)  # megatron.core.utils.local_multi_tensor_scale
        assert torch.equal(out, theirs)
    in_place = [t.clone() for t in sources]
    multi_tensor.scale(2048, None, [in_place, in_place], factor)
    assert all(torch.equal(a, t * factor) for a, t in zip(in_place, sources))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="per_tensor=False"):
        multi_tensor.l2_norm(2048, None, [_tensors()], True)
    with pytest.raises(ValueError, match="at least one tensor"):
        multi_tensor.l2_norm(2048, None, [[]], False)
    with pytest.raises(ValueError, match=r"equal length, got \[4, 3\]"):
        multi_tensor.scale(2048, None, [_tensors(), _tensors()[:3]], 1.0)


def test_installed_only_over_megatrons_local_fallbacks(monkeypatch):
    from megatron.core import utils

    clip = importlib.import_module("megatron.core.optimizer.clip_grads")
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    fused = object()  # stands for Apex's / TE's kernel
    monkeypatch.setattr(clip, "l2_norm_impl", utils.local_multi_tensor_l2_norm)
    monkeypatch.setattr(clip, "multi_tensor_scale_impl", fused)
    monkeypatch.setattr(optimizer, "multi_tensor_scale_impl", utils.local_multi_tensor_scale)
    assert multi_tensor.use_foreach_fallbacks() == [
        "megatron.core.optimizer.clip_grads.l2_norm_impl",
        "megatron.core.optimizer.optimizer.multi_tensor_scale_impl"]
    assert clip.l2_norm_impl is multi_tensor.l2_norm
    assert optimizer.multi_tensor_scale_impl is multi_tensor.scale
    assert clip.multi_tensor_scale_impl is fused
    assert multi_tensor.use_foreach_fallbacks() == []

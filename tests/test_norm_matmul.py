"""generation.fused_norm_matmul: the residual add, RMSNorm and the matrix product after it in one
Triton kernel, SwiGLU in linear_fc1's (mcore_rl/megatron/norm_matmul.py and its kernel).

- the Triton kernel itself, run on CPU by Triton's interpreter (``TRITON_INTERPRET=1``, in a
  subprocess: the variable must be set before Triton is imported), against the same arithmetic
  by torch's ops (``reference_norm_matmul``) and against the unfused layer's
  (``F.rms_norm`` then ``torch.matmul`` then ``F.silu(gate) * up``): fp32 within 1e-5 per element,
  over rows and columns that are not multiples of the tile (every tile shape of ``CONFIGS``), with
  and without the residual add, with and without SwiGLU; the residual sum bit for bit; bf16
  within a few bf16 units of the fp32 result;
- the op's CPU path against the unfused layer's ops, and its errors;
- the decoder with compile_decode, decode_attention=triton_rope and fused_norm_matmul (nothing of
  the layers compiled, the sampler traced): the same tokens as Megatron's layers in fp32,
  logprobs within 5e-5, with and without shared prompts;
- refusals: a QKV bias, and fused_norm_matmul without triton_rope at load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed
from test_decode_layer import ARCH, _decoder, _run

from mcore_rl.megatron.norm_matmul import norm_matmul, reference_norm_matmul

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _inputs(dtype, m=37, k=96, n=80, delta=True, seed=0):
    """Residual and delta ``[m, k]`` (rows of a wider buffer: a row stride past k), the norm's
    weight ``[k]`` and a weight ``[n, k]``."""
    g = torch.Generator().manual_seed(seed)
    residual = torch.randn(m, k + 8, generator=g)[:, :k].to(dtype)
    d = torch.randn(m, k + 8, generator=g)[:, :k].to(dtype) if delta else None
    norm_weight = (1.0 + 0.3 * torch.randn(k, generator=g)).to(dtype)
    weight = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    return residual, d, norm_weight, weight


def _unfused(residual, delta, norm_weight, weight, eps, swiglu):
    """The compiled decode layer's ops, unfused, in fp32."""
    hidden = residual.float() if delta is None else residual.float() + delta.float()
    out = F.rms_norm(hidden, (hidden.shape[-1],), norm_weight.float(), eps) @ weight.float().t()
    if swiglu:
        gate, up = torch.chunk(out, 2, dim=-1)
        out = F.silu(gate) * up
    return hidden, out


def _kernel_checks() -> dict:
    """Run in a subprocess with TRITON_INTERPRET=1."""
    from mcore_rl.megatron.norm_matmul import CONFIGS, launch

    out = {}
    for delta in (False, True):
        for swiglu in (False, True):
            args = _inputs(torch.float32, delta=delta)
            for config in CONFIGS:
                hidden, got = launch(*args, 1e-5, swiglu, config=config)
                ref_hidden, ref = reference_norm_matmul(*args, 1e-5, swiglu)
                name = f"fp32/{'delta' if delta else 'first'}/{'swiglu' if swiglu else 'plain'}"
                _, unfused = _unfused(*args, 1e-5, swiglu)
                case = out.setdefault(name, {"reference": 0.0, "unfused": 0.0,
                                             "hidden_equal": True, "shape": list(got.shape)})
                case["reference"] = max(case["reference"], float((got - ref).abs().max()))
                case["unfused"] = max(case["unfused"], float((got - unfused).abs().max()))
                case["hidden_equal"] &= bool(torch.equal(hidden, ref_hidden))
    args16 = _inputs(torch.bfloat16, m=64, k=128, n=96)
    for swiglu in (False, True):
        hidden, got = launch(*args16, 1e-5, swiglu)
        _, exact = _unfused(*args16, 1e-5, swiglu)
        out[f"bf16/{swiglu}"] = {"dtype": str(got.dtype), "error": float((got.float() - exact)
                                                                          .abs().max()),
                                 "scale": float(exact.abs().max()),
                                 "hidden": float((hidden.float() - args16[0].float()
                                                  - args16[1].float()).abs().max())}
    errors = []
    r, d, g, w = _inputs(torch.float32)
    for bad in (lambda: launch(r, d[:, :10], g, w, 1e-5),  # delta's shape
                lambda: launch(r, d, g, w[:79], 1e-5, True)):  # an odd gate/up split
        try:
            bad()
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def kernel_checks() -> dict:
    code = (f"import json, sys; sys.path.insert(0, {os.path.join(ROOT, 'tests')!r}); "
            "import test_norm_matmul as t; print('RESULT', json.dumps(t._kernel_checks()))")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_kernel_equals_the_unfused_ops_in_fp32(kernel_checks):
    for name in ("fp32/first/plain", "fp32/first/swiglu", "fp32/delta/plain", "fp32/delta/swiglu"):
        got = kernel_checks[name]
        assert got["reference"] < 1e-5 and got["unfused"] < 1e-5, (name, got)
        assert got["hidden_equal"], (name, got)  # the residual sum, as torch's add
        assert got["shape"] == [37, 40 if name.endswith("swiglu") else 80], (name, got)


def test_kernel_rounds_once_in_bf16(kernel_checks):
    for swiglu in (False, True):
        got = kernel_checks[f"bf16/{swiglu}"]
        assert got["dtype"] == "torch.bfloat16", got
        # the norm's output and the product (and SwiGLU's inputs) rounded to bf16: a few bf16
        # units (2^-8 relative) of the largest output
        assert got["error"] <= 2 ** -5 * got["scale"], got
        assert got["hidden"] <= 2 ** -6 * 4, got  # one rounding of sums of |x| < ~4


def test_kernel_names_bad_input(kernel_checks):
    first, second = kernel_checks["errors"]
    assert "delta" in first and "differs from residual" in first
    assert "even number of weight rows" in second


def test_cpu_path_equals_the_unfused_ops():
    for delta in (False, True):
        for swiglu in (False, True):
            args = _inputs(torch.float32, delta=delta)
            hidden, got = norm_matmul(*args, 1e-6, swiglu)
            ref_hidden, ref = _unfused(*args, 1e-6, swiglu)
            assert torch.equal(hidden, ref_hidden)
            assert float((got - ref).abs().max()) < 1e-5
    r, d, g, w = _inputs(torch.float32)
    with pytest.raises(ValueError, match="norm weight"):
        norm_matmul(r, d, g[:5], w, 1e-6)
    with pytest.raises(ValueError, match=r"weight \(80, 95\) is not \[N, 96\]"):
        norm_matmul(r, d, g, w[:, :95], 1e-6)


NO_BIAS = dataclasses.replace(ARCH, family="llama", qkv_bias=False)


def _fused_rollouts() -> dict:
    """Rollouts with triton_rope and fused_norm_matmul (the ops' CPU paths, the sampler traced)
    against Megatron's layers, fp32, without and with shared prompts; the QKV-bias refusal."""
    import functools

    from torch._dynamo import reset

    from mcore_rl.megatron import decode_layer
    from mcore_rl.megatron.decode_layer import DecodeLayers

    calls = []
    fused = decode_layer.norm_matmul
    decode_layer.norm_matmul = lambda *a, **k: calls.append(k.get("swiglu", False)) or fused(*a, **k)
    dec = _decoder("fp32", NO_BIAS)
    out = {}
    for shared in (False, True):
        megatron = _run(dec, False, shared_prompt_kv=shared)
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        reset()
        got = _run(dec, functools.partial(torch.compile, backend=backend),
                   decode_attention="triton_rope", fused_norm_matmul=True, shared_prompt_kv=shared)
        out["shared" if shared else "rows"] = {
            "lengths": len({len(t) for t in megatron[0]}),
            "tokens_equal": all(torch.equal(x, y) for x, y in zip(got[0], megatron[0])),
            "logprob_diff": max(float((x - y).abs().max()) for x, y in zip(got[1], megatron[1])),
            "graphs": len(graphs), "calls": len(calls), "swiglu_calls": sum(calls)}
        calls.clear()
    biased = _decoder("fp32")  # ARCH: Qwen2's QKV bias
    try:
        DecodeLayers(biased.gpt.decoder.layers, compile=None, attention="triton_rope",
                     fused_norm_matmul=True)
        out["bias_refusal"] = ""
    except NotImplementedError as e:
        out["bias_refusal"] = str(e)
    return out


def test_fused_decode_layers_give_megatrons_tokens():
    (out,) = run_distributed(_fused_rollouts, 1)
    for name in ("rows", "shared"):
        got = out[name]
        assert got["lengths"] > 3, got  # rows end at different steps: compaction into buckets
        assert got["tokens_equal"], got
        assert got["logprob_diff"] < 5e-5, got
        assert got["graphs"] == 1, got  # the sampler's only: nothing of the layers compiled
        # two a layer a decode step (3 layers), one of them linear_fc1's with SwiGLU
        assert got["calls"] > 0 and got["calls"] % 6 == 0, got
        assert got["swiglu_calls"] * 2 == got["calls"], got
    assert "QKV or linear_fc1 biases" in out["bias_refusal"], out


def test_fused_norm_matmul_needs_triton_rope():
    from mcore_rl.config.loader import ConfigError, load_config

    base = ["generation.backend=megatron", "generation.compile_decode=true",
            "generation.fused_norm_matmul=true"]
    cfg = load_config("grpo_synthetic", base + ["generation.decode_attention=triton_rope"])
    assert cfg.generation.fused_norm_matmul
    with pytest.raises(ConfigError, match="fused_norm_matmul=true fuses the layers") as e:
        load_config("grpo_synthetic", base + ["generation.decode_attention=triton"])
    assert "set generation.decode_attention=triton_rope" in str(e.value)

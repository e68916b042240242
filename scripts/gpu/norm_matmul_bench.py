"""The fused residual add + RMSNorm + matrix product (``generation.fused_norm_matmul``,
mcore_rl/megatron/norm_matmul.py) alone on one GPU (issue 37): microseconds a call in a CUDA
graph (the kernel and the gap to the next, as a decode step replays them) per tile shape of
``CONFIGS`` and for the one chosen per shape, against what the compiled decode layer runs for
the same work (Inductor, default mode: the add and RMSNorm as one kernel, cuBLAS's GEMM, and for
``linear_fc1`` the SwiGLU kernel after it). SmolLM2-135M's shapes (hidden 576; QKV 960 columns;
``linear_fc1`` 2 x 1536 with SwiGLU), bf16, at 256, 128 and 32 rows. Each checked against the
fp32 computation of the same inputs (max |error| / max |value|). Prints a table.

    python3 scripts/gpu/norm_matmul_bench.py
"""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from flash_decode_bench import _time  # noqa: E402

from mcore_rl.megatron.norm_matmul import CONFIGS, launch  # noqa: E402


def _unfused(residual, delta, norm_weight, weight, eps, swiglu):
    """The compiled decode layer's ops for the same work (attention_in / projection_mlp)."""
    hidden = residual if delta is None else residual + delta
    out = torch.matmul(F.rms_norm(hidden, (hidden.shape[-1],), norm_weight, eps), weight.t())
    if swiglu:
        gate, up = torch.chunk(out, 2, dim=-1)
        out = F.silu(gate) * up
    return hidden, out


def main() -> None:
    dev, dt, h = "cuda", torch.bfloat16, 576
    g = torch.Generator(device=dev).manual_seed(0)
    compiled = torch.compile(_unfused, dynamic=False)
    shapes = {"qkv (first layer)": (960, False, False), "qkv": (960, True, False),
              "fc1+swiglu": (3072, True, True)}
    cols = ["inductor+cublas", "chosen"] + ["x".join(map(str, c[:3])) + f"w{c[3]}" for c in CONFIGS]
    print(f"{'shape':>18s} {'rows':>5s} " + " ".join(f"{c:>15s}" for c in cols) + "   rel. error")
    for name, (n, has_delta, swiglu) in shapes.items():
        weight = torch.randn(n, h, device=dev, dtype=dt, generator=g) * h ** -0.5
        norm_weight = 1.0 + 0.1 * torch.randn(h, device=dev, dtype=dt, generator=g)
        for rows in (256, 128, 32):
            residual = torch.randn(rows, h, device=dev, dtype=dt, generator=g)
            delta = torch.randn(rows, h, device=dev, dtype=dt, generator=g) if has_delta else None
            args = (residual, delta, norm_weight, weight, 1e-5, swiglu)
            times = [_time(lambda: compiled(*args)), _time(lambda: launch(*args))]
            for config in CONFIGS:
                try:
                    times.append(_time(lambda: launch(*args, config=config)))
                except Exception:  # a tile that does not fit
                    times.append(float("nan"))
            _, exact = _unfused(*(None if t is None else t.float() for t in args[:4]), 1e-5,
                                swiglu)
            errors = [float((out.float() - exact).abs().max() / exact.abs().max())
                      for out in (compiled(*args)[1], launch(*args)[1])]
            print(f"{name:>18s} {rows:5d} " + " ".join(f"{t:15.2f}" for t in times)
                  + f"   inductor {errors[0]:.4f} fused {errors[1]:.4f}")


if __name__ == "__main__":
    main()

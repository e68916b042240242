"""Transformer Engine 2.20.2 on one GPU, as scripts/gpu/te_build.sh built and carried it (issue
34): versions and the GPU, a ``te.Linear`` forward/backward in bf16 against torch, then under each
FP8 recipe mcore-rl offers (``policy.megatron.fp8_recipe``) that this GPU runs by
:func:`mcore_rl.megatron.te.fp8_capability_error` (the others must be refused by TE too), and a
small Megatron GPT on the ``transformer_engine`` layer spec against the ``torch`` spec on the
same weights (logits, bf16). One line per check; exit status 1 when one fails.

    python3 scripts/gpu/te_smoke.py          (session.sh stage te runs it)
"""

from __future__ import annotations

import sys
import time

import torch


def linear_checks(failures: list) -> None:
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    from mcore_rl.config.schema import MegatronConfig
    from mcore_rl.megatron.te import fp8_capability_error

    torch.manual_seed(0)
    layer = te.Linear(1024, 2048, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().square().mean().backward()
    ref = x.detach() @ layer.weight.detach().T
    err = (y.detach() - ref).abs().max().item()
    print(f"te.Linear bf16: max |TE - torch| {err:.3g}, grad norm {x.grad.norm().item():.4g}")
    if err > 0.05:
        failures.append(f"te.Linear bf16 differs from torch by {err}")
    recipes = {"delayed": recipe.DelayedScaling, "tensorwise": recipe.Float8CurrentScaling,
               "blockwise": recipe.Float8BlockScaling, "mxfp8": recipe.MXFP8BlockScaling}
    cap = torch.cuda.get_device_capability()
    for name, make in recipes.items():
        refused = fp8_capability_error(MegatronConfig(fp8="e4m3", fp8_recipe=name), "m", cap)
        try:
            with te.autocast(enabled=True, recipe=make()):
                y8 = layer(x)
            y8.float().square().mean().backward()
            rel = ((y8.detach().float() - ref.float()).norm() / ref.float().norm()).item()
            print(f"fp8 {name}: ran, relative error against bf16 {rel:.3g}"
                  + (f" (mcore-rl refuses it here: {refused})" if refused else ""))
            if refused is None and rel > 0.1:
                failures.append(f"fp8 {name}: relative error {rel}")
        except Exception as e:  # TE refuses a recipe this GPU lacks
            line = " ".join(str(e).split())[:160]
            print(f"fp8 {name}: {type(e).__name__}: {line}"
                  + ("" if refused else " (mcore-rl expected it to run)"))
            if refused is None:
                failures.append(f"fp8 {name} failed on a GPU mcore-rl allows it on")


def gpt_checks(failures: list) -> None:
    """A 4-layer Llama-shaped GPT (bf16, one rank) built by mcore-rl on the TE spec and on the
    torch spec, both loaded with the same Hugging Face weights: logits and token logprobs of the
    TE model against the torch one, and with fp8_recipe=tensorwise against bf16."""
    from mcore_rl.config.schema import MegatronConfig, ModelArchConfig
    from mcore_rl.distributed.worker_group import free_port
    from mcore_rl.megatron import parallel
    from mcore_rl.megatron.conversion import arch_to_hf_config, load_hf_weights
    from mcore_rl.megatron.model import attention_mask, build_model, position_ids, wrap_float16
    from mcore_rl.workers.policy import initial_hf_state_dict

    device = parallel.initialize(0, 1, "127.0.0.1", free_port(), "cuda")
    arch = ModelArchConfig(family="llama", qkv_bias=False, num_layers=4, hidden_size=512,
                           num_attention_heads=8, num_query_groups=4,
                           ffn_hidden_size=1408, vocab_size=4096, max_position_embeddings=1024)
    weights = initial_hf_state_dict(arch_to_hf_config(arch, arch.vocab_size), seed=0)
    ids = torch.randint(0, arch.vocab_size, (4, 512), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    out = {}
    for name, mg in (("torch", MegatronConfig(layer_spec="torch", precision="bf16")),
                     ("te", MegatronConfig(layer_spec="transformer_engine", precision="bf16")),
                     ("te_fp8", MegatronConfig(layer_spec="transformer_engine", precision="bf16",
                                               fp8="hybrid", fp8_recipe="tensorwise"))):
        (model,) = wrap_float16(build_model(arch, mg, arch.vocab_size, device), "bf16")
        load_hf_weights([model], weights, arch)
        with torch.no_grad():
            logits = model(ids, position_ids(4, 512, device),
                           attention_mask(mg.layer_spec, 4, 512, device)).float()
        out[name] = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    for name, tolerance in (("te", 0.05), ("te_fp8", 0.5)):
        diff = (out[name] - out["torch"]).abs()
        print(f"GPT {name} vs torch spec (bf16): token logprob |diff| max {diff.max().item():.4f}, "
              f"mean {diff.mean().item():.5f}")
        if diff.max().item() > tolerance:
            failures.append(f"GPT {name}: logprobs differ from the torch spec by "
                            f"{diff.max().item():.4f} (> {tolerance})")
    parallel.destroy()


def main() -> int:
    import transformer_engine
    import transformer_engine.pytorch  # noqa: F401

    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformer_engine "
          f"{transformer_engine.__version__}, GPU {torch.cuda.get_device_name()} "
          f"(compute capability {'.'.join(map(str, torch.cuda.get_device_capability()))})")
    failures: list = []
    t0 = time.perf_counter()
    linear_checks(failures)
    print(f"linear checks: {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    try:
        gpt_checks(failures)
    except Exception as e:  # report and go on: the table still prints
        failures.append(f"GPT checks: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
    print(f"GPT checks: {time.perf_counter() - t0:.1f} s")
    for failure in failures:
        print(f"FAIL {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

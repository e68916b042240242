"""GPU checks of the bf16 path and the offload lifecycle (one process, one GPU, no Ray).

Each check prints ``PASS``/``FAIL`` with its numbers; the exit code is the number of failures.

1. bf16: the chunks are in Megatron's ``Float16Module``, every model parameter is bf16, the
   DDP grad buffers are fp32 and the optimizer's main params are fp32 (plain and distributed
   optimizer).
2. Offload lifecycle (plain and distributed optimizer): after ``offload_after_refit`` the
   allocated GPU memory drops by >= 90% of the model + grads + optimizer bytes; a guarded
   call raises ``RuntimeError`` (not a CUDA error); after ``prepare_for_training`` the next
   train step gives bit-identical parameters to a worker that was never offloaded (both runs
   with torch's math SDPA backend, whose backward is deterministic).
3. The ``torch`` and ``local`` specs give the same logprobs on the same weights (bf16).
4. ``megatron.compile_layers``: the compiled layers build, train and match the eager ones.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mcore_rl.algorithms.losses import ClippedPGLoss  # noqa: E402
from mcore_rl.config.schema import (  # noqa: E402
    DDPConfig, LossConfig, MegatronConfig, ModelArchConfig, OptimizerConfig)
from mcore_rl.megatron.conversion import arch_to_hf_config  # noqa: E402
from passfail import FAILURES, check  # noqa: E402

ARCH = ModelArchConfig(family="llama", num_layers=4, hidden_size=512, num_attention_heads=8,
                       num_query_groups=2, ffn_hidden_size=1408, max_position_embeddings=512,
                       qkv_bias=False, tie_word_embeddings=False, vocab_size=4096)
PORT = 29400 + os.getpid() % 500


def worker(spec: str = "torch", distributed: bool = False, compile_layers: bool = False):
    from mcore_rl.workers.policy import PolicyWorker

    return PolicyWorker(
        hf_path=None, hf_config=arch_to_hf_config(ARCH, ARCH.vocab_size).to_dict(),
        vocab_size=ARCH.vocab_size, temperature=1.0, use_reference=True, arch=ARCH,
        megatron=MegatronConfig(precision="bf16", layer_spec=spec, compile_layers=compile_layers,
                                ddp=DDPConfig(use_distributed_optimizer=distributed)),
        optimizer=OptimizerConfig(lr=1e-3, clip_grad=1.0), rank=0, world_size=1,
        master_addr="127.0.0.1", master_port=PORT, device="cuda", seed=5,
        total_optimizer_steps=10, global_batch_size=8)


def batch(seed: int, n: int = 8, seq: int = 256):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq // 2, seq + 1, (n,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).float()
    mask[:, :16] = 0
    return {"input_ids": torch.randint(1, ARCH.vocab_size, (n, seq), generator=g),
            "input_lengths": lengths, "token_mask": mask, "sample_mask": torch.ones(n),
            "advantages": torch.randn(n, 1, generator=g) * mask}


LOSS = ClippedPGLoss(LossConfig(kl_coef=0.05))


def step(w, b):
    b = dict(b, prev_logprobs=w.get_logprobs(b, 4), reference_logprobs=w.get_reference_logprobs(b, 4))
    return w.train(b, LOSS, 8, 2)


def bf16_checks(distributed: bool) -> None:
    from megatron.core.transformer.module import Float16Module

    w = worker(distributed=distributed)
    step(w, batch(0))
    tag = "distributed optimizer" if distributed else "optimizer"
    chunk = w.model[0].module
    dtypes = {p.dtype for p in chunk.parameters()}
    grad_dtypes = {b.grad_data.dtype for b in w.model[0].buffers}
    opt = w.optimizer.chained_optimizers[0] if hasattr(w.optimizer, "chained_optimizers") else w.optimizer
    main = [p for g in opt.optimizer.param_groups for p in g["params"]]
    state = [v for st in opt.optimizer.state.values() for k, v in st.items() if k != "step"]
    check(f"bf16 [{tag}]: Float16Module, bf16 params, fp32 grads, fp32 main params and Adam state",
          isinstance(chunk, Float16Module) and dtypes == {torch.bfloat16}
          and grad_dtypes == {torch.float32} and {p.dtype for p in main} == {torch.float32}
          and {t.dtype for t in state} == {torch.float32} and len(state) == 2 * len(main),
          f"{type(opt).__name__}: params {dtypes}, grads {grad_dtypes}, "
          f"main {({p.dtype for p in main})}, {len(main)} main params")
    del w


def lifecycle_checks(distributed: bool) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tag = "distributed optimizer" if distributed else "optimizer"
    with sdpa_kernel([SDPBackend.MATH]):
        plain, life = worker(distributed=distributed), worker(distributed=distributed)
        step(plain, batch(0))
        step(life, batch(0))
        torch.cuda.synchronize()
        n = sum(p.numel() for p in life.model[0].parameters())
        expected = n * (2 + 2 + 4 + 4 + 8)  # weights, reference copy, grads, main params, Adam
        before = torch.cuda.memory_allocated()
        life.offload_before_refit()
        weights = life.get_hf_weights()
        life.offload_after_refit()
        freed = before - torch.cuda.memory_allocated()
        check(f"offload [{tag}]: allocated memory drops >= 90% of model+grads+optimizer",
              freed >= 0.9 * expected, f"freed {freed / 1e6:.1f} MB of {expected / 1e6:.1f} MB "
                                       f"({100 * freed / expected:.1f}%)")
        try:
            life.get_logprobs(batch(1), 4)
            kind = "no error"
        except RuntimeError as e:
            kind = "RuntimeError: " + str(e)
        except Exception as e:  # a CUDA error would land here
            kind = f"{type(e).__name__}: {e}"
        check(f"offload [{tag}]: guarded call raises the RuntimeError",
              kind.startswith("RuntimeError: get_logprobs:") and "prepare_for_lp_inference()" in kind,
              kind[:140])
        life.prepare_for_lp_inference()
        life.prepare_for_training()
        step(plain, batch(1))
        step(life, batch(1))
        a, b = plain.get_hf_weights(), life.get_hf_weights()
        diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
        moved = max(float((a[k].float() - weights[k].float()).abs().max()) for k in a)
        check(f"offload [{tag}]: next train step equals a run without offload", diff == 0.0,
              f"max |diff| {diff} (the step moved weights by up to {moved:.2e})")
    del plain, life


def spec_parity() -> None:
    local, torch_w = worker("local"), worker("torch")
    b = batch(2)
    lp_l, lp_t = local.get_logprobs(b, 4), torch_w.get_logprobs(b, 4)
    diff = (lp_l - lp_t)[:, 1:].abs() * b["token_mask"][:, 1:]
    check("torch vs local spec logprobs (bf16): max |diff| < 0.05 nats",
          float(diff.max()) < 0.05, f"max {float(diff.max()):.3e}, mean {float(diff.mean()):.2e}")
    del local, torch_w


def compile_check() -> None:
    eager, compiled = worker(), worker(compile_layers=True)
    b = batch(3)
    d = (eager.get_logprobs(b, 4) - compiled.get_logprobs(b, 4))[:, 1:].abs() * b["token_mask"][:, 1:]
    m = step(compiled, b)
    check("compile_layers: builds, trains, logprobs match eager layers (bf16) < 0.05 nats",
          float(d.max()) < 0.05 and m["update_successful"] == 1.0,
          f"max {float(d.max()):.3e}, mean {float(d.mean()):.2e}, loss {m['loss']:.4f}")
    del eager, compiled


def main() -> int:
    print(f"device: {torch.cuda.get_device_name()} x{torch.cuda.device_count()}, torch {torch.__version__}")
    for distributed in (False, True):
        bf16_checks(distributed)
        lifecycle_checks(distributed)
    spec_parity()
    compile_check()
    print(f"{len(FAILURES)} failed: {FAILURES}" if FAILURES else "all GPU checks passed")
    return len(FAILURES)


if __name__ == "__main__":
    raise SystemExit(main())

"""GPU benchmark of the training path; prints one table (and writes it as JSON).

What it measures, on one GPU, through the product's own :class:`PolicyWorker` (Megatron DDP,
Megatron optimizer with fp32 main params, bf16 params wrapped in ``Float16Module``; no Ray):

- the dense bf16 matmul peak (8192^3, median of timed products on random data): the MFU
  denominator, measured in the same run;
- train-step time of the 0.85B Llama-style shape (16 layers, hidden 2048, 16 heads / 4 KV
  groups, SwiGLU 5632, vocab 32000, untied embeddings, seq 2048): ``PolicyWorker.train`` with
  ``ClippedPGLoss`` on 16 full-length rows (4 micro-batches of 4), optimizer step included,
  for the ``torch`` spec before the speed levers, with each lever alone (``--levers``: micro-batch
  8, fused AdamW, fused logprobs on bf16 logits, compiled RMSNorm, compiled layers), with the
  product defaults (fused logprobs + fused AdamW), and for the ``local`` spec; the device time
  of a step by kernel kind (``--profile``); tokens/s, TFLOP/s and MFU, with
  model FLOPs per token ``6 * params + 6 * layers * hidden * seq`` (all parameters,
  embeddings included, and causal attention at half the dense count: the convention of
  ``shared/notes/gpu-machines.md``), and the same without the input embedding's 6P term;
- logprob inference tokens/s (``get_logprobs``, forward only);
- refit: ``get_hf_weights`` (device to host, gathered, HF names) and the hf backend's
  ``update_weights`` (host to device), seconds and GB/s;
- hf generation tokens/s (``HFGenerationBackend`` on the GPU, bf16, KV cache);
- offload lifecycle: seconds of each step and the GPU memory freed against the model +
  grads + optimizer bytes, and that a guarded call raises ``RuntimeError`` while offloaded;
- bf16 logprobs of the ``torch`` spec (each SDPA backend), the compiled layers and the
  ``local`` spec against an fp32 reference (the HF model of the same checkpoint in fp32).

``--variants`` (issue 34) replaces all of the above after the matmul peak: the train step of each
named variant with the product defaults, one worker at a time on the same checkpoint and batch,
then one table of step time, tokens/s, MFU and peak memory with each variant's speed-up over the
first. ``--shape`` picks the model (``SHAPES``): ``0.85b`` (above), or ``llama8b-4l`` /
``llama8b-8l``, Llama-3.1-8B's width at 4 or 8 layers (the width where NeMo RL reports FP8's
gain; FP8 did not pay at the 0.85B shape's: 0.92x delayed, 0.79x tensorwise on an H200). A
variant is ``torch``, ``local``, ``te`` (the ``transformer_engine`` spec in bf16) or
``fp8-RECIPE`` (the TE spec with ``fp8=hybrid``: e4m3 forward, e5m2 gradients; RECIPE
``delayed``, ``tensorwise`` or ``blockwise``); ``+mbs8`` after a name trains micro-batches of 8.
``fp8-blockwise`` runs the config's default block scales, fp32 (``fp8_block_scales``: this process
sets ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`` before TE loads unless the environment has it;
the figures of 2026-11-28 in bench/RESULTS.md ran before that, with TE's powers of 2).
MFU keeps the bf16 dense peak as its denominator for FP8 too (what the issue's ">= 1.3x the bf16
train phase" compares). Transformer Engine must import for ``te`` and ``fp8-*`` (scripts/gpu/
session.sh's ``te_env``); with TE on the path Megatron's optimizer is TE's FusedAdam for every
variant, the ``torch`` one included::

    python bench/train_step.py --variants torch,te,fp8-delayed,fp8-tensorwise,fp8-blockwise
    python bench/train_step.py --shape llama8b-4l --variants torch,te,fp8-blockwise

Times are medians over ``--steps`` steps after ``--warmup`` warm-up steps, with a device
synchronize around each. Run ``python bench/train_step.py --help``; ``scripts/gpu/run_bench.sh``
installs the carried wheels and runs it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mcore_rl.config.schema import (  # noqa: E402 (the config layer imports no TE)
    FP8_BLOCK_SCALES_ENV, FP8_BLOCK_SCALES_ENV_VALUES, DDPConfig, GenerationConfig, LossConfig,
    MegatronConfig, ModelArchConfig, OptimizerConfig)

# fp8-blockwise with the config's default block scales (module docstring): TE reads this once,
# at import, so before anything below can import it
os.environ.setdefault(FP8_BLOCK_SCALES_ENV, FP8_BLOCK_SCALES_ENV_VALUES["fp32"])

from mcore_rl.algorithms.losses import ClippedPGLoss  # noqa: E402
from mcore_rl.megatron.conversion import arch_to_hf_config  # noqa: E402

# --shape: the model of every measurement. 0.85b: the benchmark's shape. llama8b-<N>l:
# Llama-3.1-8B's width (hidden 4096, SwiGLU 14336, 32 heads / 8 KV groups, vocab 128256,
# untied, RoPE theta 500000) at N of its 32 layers, so that one 80 GB GPU holds it with the
# optimizer (fp32 main params, Adam: about 18 bytes a parameter): 4 layers are 1.92B parameters
# (34.5 GB of state), 8 layers 2.79B (50 GB: an H200, or an H100 at micro-batch 4 with little
# room). The FP8 speed-up of a few layers understates the whole model's: the embedding and
# output layer (the 128256-word vocabulary, 0.53B parameters each) stay in bf16 under every
# recipe, and they are a larger share of 4 layers' FLOPs than of 32 (the table's note says
# how large).
SHAPES = {
    "0.85b": ModelArchConfig(family="llama", num_layers=16, hidden_size=2048,
                             num_attention_heads=16, num_query_groups=4, ffn_hidden_size=5632,
                             max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
                             qkv_bias=False, tie_word_embeddings=False, vocab_size=32000),
    **{f"llama8b-{n}l": ModelArchConfig(
        family="llama", num_layers=n, hidden_size=4096, num_attention_heads=32,
        num_query_groups=8, ffn_hidden_size=14336, max_position_embeddings=8192,
        rope_theta=500000.0, rms_norm_eps=1e-5, qkv_bias=False, tie_word_embeddings=False,
        vocab_size=128256) for n in (4, 8)},
}
SHAPE = "0.85b"
ARCH = SHAPES[SHAPE]  # main() sets both from --shape
SEQ = 2048
ROWS: List[Dict[str, str]] = []  # the table


def row(section: str, what: str, value, unit: str = "", note: str = "") -> None:
    """Add (and echo) one table row."""
    value = f"{value:.4g}" if isinstance(value, float) else str(value)
    ROWS.append({"section": section, "what": what, "value": value, "unit": unit, "note": note})
    print(f"  {section:10s} {what:46s} {value:>12s} {unit:8s} {note}", flush=True)


def sync() -> None:
    torch.cuda.synchronize()


def median_seconds(fn: Callable[[], object], warmup: int, steps: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peak(n: int = 8192, reps: int = 20) -> float:
    """Dense bf16 matmul TFLOP/s: median of CUDA-event-timed products, rotating inputs."""
    pairs = [(torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
              torch.randn(n, n, device="cuda", dtype=torch.bfloat16)) for _ in range(3)]
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    for a, b in pairs:
        torch.matmul(a, b, out=out)
    times = []
    for i in range(reps):
        a, b = pairs[i % 3]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b, out=out)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del pairs, out
    return 2 * n ** 3 / statistics.median(times) / 1e12


def param_count(arch: ModelArchConfig) -> Dict[str, int]:
    h, f, v, L = arch.hidden_size, arch.ffn_hidden_size, arch.vocab_size, arch.num_layers
    kv = h // arch.num_attention_heads * arch.num_query_groups
    layer = h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h
    total = L * layer + h + v * h * (1 if arch.tie_word_embeddings else 2)
    return {"total": total, "embedding": v * h}


def flops_per_token(arch: ModelArchConfig, seq: int, with_embedding: bool = True) -> float:
    p = param_count(arch)
    params = p["total"] - (0 if with_embedding else p["embedding"])
    return 6 * params + 6 * arch.num_layers * arch.hidden_size * seq


def bf16_share(arch: ModelArchConfig, seq: int) -> float:
    """The share of the step's FLOPs that FP8 leaves in bf16: the output layer's GEMMs
    (Megatron-Core's own linear, not TE's) and attention's score and value products (TE's
    fused attention is bf16 under these recipes), of :func:`flops_per_token` without the input
    embedding (a lookup). An upper bound on the FP8 speed-up follows (Amdahl): with the rest
    twice as fast, ``1 / (share + (1 - share) / 2)``."""
    output = 6 * arch.vocab_size * arch.hidden_size
    attention = 6 * arch.num_layers * arch.hidden_size * seq
    return (output + attention) / flops_per_token(arch, seq, with_embedding=False)


def make_checkpoint(path: str, seed: int = 0) -> None:
    """A seeded random HF Llama checkpoint of ``ARCH`` (bf16 safetensors), built on the GPU."""
    from transformers import AutoModelForCausalLM

    cfg = arch_to_hf_config(ARCH, ARCH.vocab_size)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model


VARIANT_SPECS = {"torch": "torch", "local": "local", "te": "transformer_engine"}
FP8_VARIANT_RECIPES = ("delayed", "tensorwise", "blockwise")


def parse_variant(name: str) -> Dict[str, object]:
    """``--variants`` entry -> ``{"spec", "fp8", "fp8_recipe", "mbs"}`` (module docstring);
    raises ``ValueError`` for an unknown name."""
    base, plus, extra = name.partition("+")
    if plus and extra != "mbs8":
        raise ValueError(f"variant {name!r}: the only suffix is +mbs8")
    mbs = 8 if plus else 4
    if base in VARIANT_SPECS:
        return {"spec": VARIANT_SPECS[base], "fp8": None, "fp8_recipe": "delayed", "mbs": mbs}
    recipe = base[len("fp8-"):] if base.startswith("fp8-") else None
    if recipe not in FP8_VARIANT_RECIPES:
        raise ValueError(f"variant {name!r}: one of {', '.join(VARIANT_SPECS)} or fp8-RECIPE with "
                         f"RECIPE in {', '.join(FP8_VARIANT_RECIPES)} (+mbs8 optional)")
    return {"spec": "transformer_engine", "fp8": "hybrid", "fp8_recipe": recipe, "mbs": mbs}


def variant_megatron(name: str, distributed_optimizer: bool = False) -> MegatronConfig:
    """The ``policy.megatron`` section of one ``--variants`` entry (bf16)."""
    v = parse_variant(name)
    return MegatronConfig(precision="bf16", layer_spec=v["spec"], fp8=v["fp8"],
                          fp8_recipe=v["fp8_recipe"],
                          ddp=DDPConfig(use_distributed_optimizer=distributed_optimizer))


def build_worker(hf_path: str, spec: str, port: int, gbs: int, distributed_optimizer: bool = False,
                 use_reference: bool = False, arch: ModelArchConfig | None = None,
                 megatron: MegatronConfig | None = None):
    from mcore_rl.workers.policy import PolicyWorker

    arch = arch or ARCH
    return PolicyWorker(
        hf_path=hf_path, hf_config=arch_to_hf_config(arch, arch.vocab_size).to_dict(),
        vocab_size=arch.vocab_size, temperature=1.0, use_reference=use_reference, arch=arch,
        megatron=megatron or MegatronConfig(
            precision="bf16", layer_spec=spec,
            ddp=DDPConfig(use_distributed_optimizer=distributed_optimizer)),
        optimizer=OptimizerConfig(lr=1e-5, clip_grad=1.0), rank=0, world_size=1,
        master_addr="127.0.0.1", master_port=port, device="cuda", seed=1,
        total_optimizer_steps=100, global_batch_size=gbs)


def free(*objs) -> None:
    for o in objs:
        del o
    gc.collect()
    torch.cuda.empty_cache()


def rollout(n: int, seq: int, vocab: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Full-length rows: a 256-token prompt and a response to the end; random advantages."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(n, seq)
    mask[:, 256:] = 1
    return {"input_ids": torch.randint(1, vocab, (n, seq), generator=g),
            "input_lengths": torch.full((n,), seq), "token_mask": mask,
            "sample_mask": torch.ones(n),
            "advantages": torch.randn(n, 1, generator=g) * mask}


# ---------------------------------------------------------------------------- speed levers
def set_fused_adam(worker, on: bool) -> None:
    """torch's single-kernel AdamW (``fused=True``) in place of the default multi-tensor
    (``foreach``) one, when Megatron fell back to torch's optimizer (no TE/Apex)."""
    for opt in getattr(worker.optimizer, "chained_optimizers", [worker.optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            group["fused"], group["foreach"] = (True, False) if on else (None, None)
            for p in group["params"]:  # fused keeps the step count on the device, foreach on the host
                state = inner.state.get(p, {})
                if "step" in state:
                    state["step"] = state["step"].to("cuda" if on else "cpu", torch.float32)


def compile_modules(worker, kind: str) -> int:
    """``torch.compile`` in place: ``norm`` = every RMSNorm, ``layer`` = every TransformerLayer
    (what ``megatron.compile_layers`` does at build time)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    cls = torch.nn.RMSNorm if kind == "norm" else TransformerLayer
    n = 0
    for m in worker.model:
        for mod in m.modules():
            if isinstance(mod, cls):
                mod.compile()
                n += 1
    return n


@contextmanager
def megatron_cross_entropy(worker):
    """The logprob path before the fused one: Float16Module's fp32 logits (``fp32_output``
    default), ``.float()`` and Megatron's ``vocab_parallel_cross_entropy`` (its boolean-mask
    writes make two host syncs per micro-batch)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from mcore_rl.megatron.model import attention_mask, position_ids

    def token_logprobs(output, mb):
        target = torch.roll(mb["input_ids"], -1, 1)
        lp = -vocab_parallel_cross_entropy(output.float(), target)
        return torch.cat([torch.zeros_like(lp[:, :1]), lp[:, :-1]], dim=1)

    def model_forward(model, mb):
        ids = mb["input_ids"]
        b, s = ids.shape
        return model(ids, position_ids(b, s, ids.device),
                     attention_mask(worker.megatron_cfg.layer_spec, b, s, ids.device))

    worker._token_logprobs, worker._model_forward = token_logprobs, model_forward
    try:
        yield
    finally:
        del worker._token_logprobs, worker._model_forward


# ---------------------------------------------------------------------------- sections
class Bench:
    def __init__(self, args):
        self.args = args
        self.peak = matmul_peak()
        self.port = 29500 + os.getpid() % 1000
        self.tmp = tempfile.mkdtemp(prefix="mcore_rl_bench_")
        self.hf_path = os.path.join(self.tmp, "hf")
        make_checkpoint(self.hf_path)
        self.loss = ClippedPGLoss(LossConfig(kl_coef=0.0))
        self.batch = rollout(args.gbs, SEQ, ARCH.vocab_size)
        self.batch["prev_logprobs"] = torch.zeros(args.gbs, SEQ)
        self.parity_batch = rollout(8, SEQ, ARCH.vocab_size, seed=2)
        self.lp: Dict[str, torch.Tensor] = {}
        gpu = torch.cuda.get_device_name()
        row("machine", "GPU", f"{gpu} x{torch.cuda.device_count()}", "", "one used")
        row("machine", "torch / CUDA", f"{torch.__version__} / {torch.version.cuda}")
        row("machine", "bf16 matmul peak (8192^3)", self.peak, "TFLOP/s", "MFU denominator")
        p = param_count(ARCH)
        row("model", "parameters", f"{p['total'] / 1e9:.4f}e9", "",
            f"{SHAPE} shape ({ARCH.num_layers} layers, hidden {ARCH.hidden_size}), untied")
        share = bf16_share(ARCH, SEQ)
        row("model", "bf16 share of the FLOPs", f"{100 * share:.1f}%", "",
            f"output layer + attention products, bf16 under FP8: FP8 at 2x the rest gives at "
            f"most {1 / (share + (1 - share) / 2):.2f}x")

    def variants(self) -> None:
        """``--variants``: each variant's train step on the same checkpoint and batch, one
        worker at a time (built, 3 untimed steps, timed, freed), then a table of them all; a
        variant that fails is a row saying so."""
        args, results = self.args, []
        for name in args.variants.split(","):
            w = None
            try:
                mbs = parse_variant(name)["mbs"]
                w = build_worker(self.hf_path, "", self.port, args.gbs,
                                 megatron=variant_megatron(name))
                for _ in range(3):  # allocator, kernels and FP8 scales out of the timings
                    w.train(self.batch, self.loss, args.gbs, mbs)
                mfu = self.train_row(w, name, mbs)
                results.append((name, self.last_step))
                row("variants", f"{name}: MFU", f"{100 * mfu:.1f}%")
            except Exception as e:  # a variant that does not run is a result, not a crash
                row("variants", name, "failed", "", " ".join(repr(e).split())[:160])
                results.append((name, None))
            finally:
                if w is not None:
                    free(w)
                self.port += 1  # a fresh rendezvous port for the next worker
        base = next((r for _, r in results if r), None)
        print(f"\n== variants: the train step of the {SHAPE} shape, "
              f"{args.gbs}x{SEQ} tokens, optimizer included (bf16 peak {self.peak:.0f} TFLOP/s)")
        print(f"{'variant':22s} {'step ms':>9s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'MFU':>6s} "
              f"{'peak GiB':>8s} {'speed-up':>8s}")
        for name, r in results:
            if r is None:
                print(f"{name:22s} failed")
                continue
            up = base["seconds"] / r["seconds"]
            print(f"{name:22s} {1e3 * r['seconds']:9.1f} {r['tokens']:10.0f} {r['tflops']:8.1f} "
                  f"{100 * r['tflops'] / self.peak:5.1f}% {r['mem']:8.1f} {up:7.2f}x")

    def train_row(self, worker, label: str, mbs: int) -> float:
        gbs = self.args.gbs
        torch.cuda.reset_peak_memory_stats()
        step = lambda: worker.train(self.batch, self.loss, gbs, mbs)  # noqa: E731
        seconds = median_seconds(step, self.args.warmup, self.args.steps)
        tokens = gbs * SEQ / seconds
        tflops = tokens * flops_per_token(ARCH, SEQ) / 1e12
        strict = tokens * flops_per_token(ARCH, SEQ, with_embedding=False) / 1e12
        mem = torch.cuda.max_memory_allocated() / 2**30
        self.last_step = {"seconds": seconds, "tokens": tokens, "tflops": tflops, "mem": mem}
        row("train", f"{label}: step", seconds * 1e3, "ms",
            f"{gbs}x{SEQ} tokens, mbs {mbs}, optimizer incl.")
        row("train", f"{label}: tokens/s", tokens, "tok/s")
        row("train", f"{label}: TFLOP/s | MFU", f"{tflops:.1f} | {100 * tflops / self.peak:.1f}%",
            "", f"MFU w/o input-embedding FLOPs {100 * strict / self.peak:.1f}%; "
                f"peak mem {mem:.1f} GiB")
        return tflops / self.peak

    def spec_and_levers(self) -> None:
        """The torch spec before the levers, each lever alone, and the product defaults."""
        args = self.args
        levers = args.levers.split(",") if args.levers else []
        w = build_worker(self.hf_path, "torch", self.port, args.gbs)
        sections = args.sections.split(",") if args.sections else []
        if "local" in sections:  # on the checkpoint's weights, before any step changes them
            self.torch_logprobs(w, "torch spec")
        for _ in range(3):  # allocator, cuDNN plans, compiled logprob kernels: out of the timings
            w.train(self.batch, self.loss, args.gbs, 4)
        set_fused_adam(w, False)
        with megatron_cross_entropy(w):
            self.train_row(w, "torch spec, no levers", 4)
            if args.profile:
                self.profile(w, 4, "no levers")
            if "mbs8" in levers:
                self.train_row(w, "no levers + micro-batch 8", 8)
            if "fused_adam" in levers:
                set_fused_adam(w, True)
                self.train_row(w, "no levers + fused AdamW", 4)
                set_fused_adam(w, False)
        if "logprobs" in levers:
            self.train_row(w, "no levers + fused logprobs, bf16 logits", 4)
        set_fused_adam(w, True)
        self.train_row(w, "torch spec (defaults: fused logprobs + AdamW)", 4)
        if args.profile:
            self.profile(w, 4, "defaults")
        self.train_row(w, "torch spec defaults, micro-batch 8", 8)
        if "compile_norm" in levers:
            n = compile_modules(w, "norm")
            self.train_row(w, f"defaults + compiled RMSNorm ({n})", 4)
        if "compile_layer" in levers:
            try:
                eager = w.get_logprobs(self.parity_batch, 4)
                n = compile_modules(w, "layer")
                d = (w.get_logprobs(self.parity_batch, 4) - eager)[:, 1:].abs()
                row("parity", "compiled vs eager layers (bf16, same weights)", float(d.max()),
                    "nats", f"|logprob diff| max; mean {float(d.mean()):.2e}")
                self.train_row(w, f"defaults + compiled layers ({n})", 4)
                self.train_row(w, "defaults + compiled layers, micro-batch 8", 8)
            except Exception as e:  # a lever that does not run is a result, not a crash
                row("train", "defaults + compiled layers", "failed", "", repr(e)[:120])
        self.logprob_inference(w)
        if "refit" in sections:
            self.refit_and_generation(w)
        if "offload" in sections:
            self.offload(w)
        if "local" in sections:
            self.local_spec(w)
        free(w)

    def profile(self, worker, mbs: int, label: str) -> None:
        """Device time of one train step by kernel kind (GEMM, attention, other)."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            worker.train(self.batch, self.loss, self.args.gbs, mbs)
            sync()
        kinds: Dict[str, float] = {}
        for e in prof.key_averages():
            t = e.self_device_time_total
            name = e.key.lower()
            kind = ("attention" if any(k in name for k in ("sdpa", "flash", "fmha", "attention"))
                    else "gemm" if any(k in name for k in ("gemm", "nvjet", "cutlass", "xmma"))
                    else "triton (compiled)" if "triton" in name
                    else "optimizer" if "multi_tensor" in name or "adam" in name
                    else "other (eager elementwise, norms, copies)")
            kinds[kind] = kinds.get(kind, 0.0) + t
        total = sum(kinds.values())
        for kind, t in sorted(kinds.items(), key=lambda kv: -kv[1]):
            row("profile", f"{label}: device time, {kind}", t / 1e3, "ms",
                f"{100 * t / total:.1f}% of busy")
        row("profile", f"{label}: device busy per step", total / 1e3, "ms",
            "compare the step's wall time: the rest the GPU waits on the host")
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, f"profile_{label.replace(' ', '_')}.txt"), "w") as f:
                f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=60))

    def logprob_inference(self, worker) -> None:
        n = self.args.logprob_rows
        batch = rollout(n, SEQ, ARCH.vocab_size, seed=1)
        seconds = median_seconds(lambda: worker.get_logprobs(batch, 8), 1, 3)
        row("logprobs", "get_logprobs (torch spec, mbs 8)", n * SEQ / seconds, "tok/s",
            f"{n}x{SEQ}, forward only")

    def refit_and_generation(self, worker) -> None:
        from mcore_rl.generation.hf import HFGenerationBackend

        sync()
        start = time.perf_counter()
        weights = worker.get_hf_weights()
        export = time.perf_counter() - start
        gb = sum(t.numel() * t.element_size() for t in weights.values()) / 1e9
        gen_cfg = GenerationConfig(max_new_tokens=self.args.new_tokens, batch_size=self.args.gen_rows)
        gen = HFGenerationBackend(arch_to_hf_config(ARCH, ARCH.vocab_size), gen_cfg, eos_token_id=0,
                                  pad_token_id=0, max_total_length=SEQ, device="cuda",
                                  dtype=torch.bfloat16)
        sync()
        start = time.perf_counter()
        gen.update_weights(weights.items())
        load = time.perf_counter() - start
        row("refit", "get_hf_weights (device -> host)", export, "s", f"{gb:.2f} GB, {gb / export:.2f} GB/s")
        row("refit", "hf update_weights (host -> device)", load, "s", f"{gb / load:.2f} GB/s")
        row("refit", "refit total", export + load, "s", f"{gb / (export + load):.2f} GB/s")
        del weights
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, ARCH.vocab_size, (128,), generator=g).tolist()
                   for _ in range(self.args.gen_rows)]
        gen.generate(prompts[:8], seed=0)  # warm-up
        sync()
        start = time.perf_counter()
        out = gen.generate(prompts, seed=1)
        seconds = time.perf_counter() - start
        new = int(out["response_lengths"].sum())
        row("generation", f"hf backend, {len(prompts)} x (128 + {self.args.new_tokens})",
            new / seconds, "tok/s", f"{new} new tokens in {seconds:.1f} s, bf16, sampling")
        free(gen)

    def offload(self, worker) -> None:
        """Two offload cycles (the first allocates the pinned host buffers, the second reuses
        them), memory freed against model + grads + optimizer bytes, the guard."""
        p = param_count(ARCH)["total"]
        expected = p * (2 + 4 + 4 + 8)  # bf16 weights, fp32 grads, fp32 main params, Adam m and v
        for cycle in ("1st", "2nd"):
            worker.train(self.batch, self.loss, self.args.gbs, 4)
            sync()
            before = torch.cuda.memory_allocated()
            seconds = {}
            for step in ("offload_before_refit", "offload_after_refit"):
                start = time.perf_counter()
                getattr(worker, step)()
                seconds[step] = time.perf_counter() - start
            freed = before - torch.cuda.memory_allocated()
            row("offload", f"{cycle} cycle: GPU memory freed", freed / 1e9, "GB",
                f"{100 * freed / expected:.1f}% of model+grads+optimizer ({expected / 1e9:.2f} GB)")
            try:
                worker.get_logprobs(self.batch, 4)
                guard = "no error"
            except RuntimeError as e:
                guard = f"RuntimeError: {str(e)[:60]}..."
            for step in ("prepare_for_lp_inference", "prepare_for_training"):
                start = time.perf_counter()
                getattr(worker, step)()
                seconds[step] = time.perf_counter() - start
            for step, sec in seconds.items():
                row("offload", f"{cycle} cycle: {step}", sec, "s")
        row("offload", "guarded call while offloaded", guard)
        metrics = worker.train(self.batch, self.loss, self.args.gbs, 4)
        row("offload", "train step after prepare", "ok" if metrics["update_successful"] else "skipped")

    def torch_logprobs(self, worker, label: str) -> None:
        """The torch spec's logprobs on the parity rows, with torch's SDPA backend choice and
        with each backend forced (``torch.nn.attention.sdpa_kernel``)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.lp = {label: worker.get_logprobs(self.parity_batch, 4)}
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel([backend]):
                    self.lp[f"{label}, {backend.name}"] = worker.get_logprobs(self.parity_batch, 4)
            except RuntimeError as e:  # EFFICIENT_ATTENTION has no enable_gqa path
                row("parity", f"{label}, {backend.name}", "n/a", "", str(e)[:60])

    def local_spec(self, torch_w) -> None:
        """The local spec's speed, and every spec's bf16 logprobs against an fp32 reference
        (the HF model of the same checkpoint in fp32) on the same rows."""
        from transformers import AutoModelForCausalLM

        batch = self.parity_batch
        torch_w.offload_after_refit()  # room for the local spec's activations
        local_w = build_worker(self.hf_path, "local", self.port, self.args.gbs)
        self.lp["local spec"] = local_w.get_logprobs(batch, 4)
        self.train_row(local_w, "local spec (defaults)", 4)
        free(local_w)
        hf = AutoModelForCausalLM.from_pretrained(self.hf_path, dtype=torch.float32).cuda().eval()
        with torch.no_grad():
            ref = []
            for ids in batch["input_ids"].cuda().split(2):
                logits = hf(ids).logits.float().log_softmax(-1)
                ref.append(logits[:, :-1].gather(-1, ids[:, 1:, None])[..., 0].cpu())
        ref = torch.cat(ref)
        free(hf)
        for name, lp in self.lp.items():
            d = (lp[:, 1:] - ref).abs()
            row("parity", f"{name} (bf16) vs fp32 HF", float(d.max()), "nats",
                f"|logprob diff| max; mean {float(d.mean()):.2e}; 8x{SEQ} tokens")
        d = (self.lp["torch spec"] - self.lp["local spec"])[:, 1:].abs()
        row("parity", "torch vs local spec (bf16)", float(d.max()), "nats",
            f"|logprob diff| max; mean {float(d.mean()):.2e}")
        torch_w.prepare_for_training()


def main() -> None:
    global ARCH, SHAPE
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gbs", type=int, default=16, help="rows per optimizer step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--levers", default="mbs8,fused_adam,logprobs,compile_layer",
                        help="comma list of mbs8, fused_adam, logprobs, compile_norm, compile_layer")
    parser.add_argument("--sections", default="refit,offload,local",
                        help="comma list of refit (and generation), offload, local")
    parser.add_argument("--profile", action="store_true", help="kernel-kind breakdown of a step")
    parser.add_argument("--variants", default="",
                        help="comma list of torch, local, te, fp8-delayed, fp8-tensorwise, "
                             "fp8-blockwise (+mbs8): only their train steps and one table "
                             "(module docstring)")
    parser.add_argument("--shape", default=SHAPE, choices=sorted(SHAPES),
                        help="the model: 0.85b, or Llama-3.1-8B's width at 4 or 8 layers "
                             "(SHAPES)")
    parser.add_argument("--logprob-rows", type=int, default=32)
    parser.add_argument("--gen-rows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    SHAPE, ARCH = args.shape, SHAPES[args.shape]
    for name in filter(None, args.variants.split(",")):
        try:
            parse_variant(name)
        except ValueError as e:
            parser.error(str(e))
    if not torch.cuda.is_available():
        raise SystemExit("bench/train_step.py needs a CUDA GPU")
    bench = Bench(args)
    if args.variants:
        bench.variants()
    else:
        bench.spec_and_levers()
    header = f"{'section':10s} | {'what':46s} | {'value':>14s} | {'unit':8s} | note"
    print("\n" + header + "\n" + "-" * len(header))
    for r in ROWS:
        print(f"{r['section']:10s} | {r['what']:46s} | {r['value']:>14s} | {r['unit']:8s} | {r['note']}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_table.json"), "w") as f:
            json.dump(ROWS, f, indent=1)


if __name__ == "__main__":
    main()

"""Megatron-Bridge against mcore-rl's own conversion on one GPU (issue 34, item 5): a Llama
checkpoint (SmolLM2-135M-Instruct) read four ways, one process, TP = PP = 1, bf16.

    python3 scripts/gpu/bridge_parity.py --model /tmp/models/SmolLM2-135M-Instruct \
        [--layer-spec transformer_engine] [--batch 4 --seq 256] [--no-provider]

Needs megatron-bridge 0.6.2 (its wheel, --no-deps: it imports with the GPU image's packages plus
omegaconf, hydra-core and antlr4 of scripts/gpu/carry.sh's .whl/) and Transformer Engine
(session.sh stage te): the bridge imports TE at import time.

Checks, one line each, then a table; exit status 1 when one fails:

1. load: one model built by mcore-rl (``--layer-spec``), loaded by mcore-rl's name tables and by
   ``AutoBridge.load_hf_weights``: every parameter bitwise equal.
2. logits: on the same random token ids, mcore-rl's model (its own load) and the bridge's own
   model (``AutoBridge.to_megatron_provider()``: the bridge's config and TE layer spec) against
   Hugging Face transformers in fp32 (the reference): max |logit difference| and max |token
   logprob difference|, the bf16 tolerance being what the torch spec shows against fp32.
3. export round trip: mcore-rl's ``export_hf_weights`` and ``AutoBridge.export_hf_weights`` of
   the model loaded in 1, each against the checkpoint's tensors cast to bf16: the same names
   (a tied ``lm_head.weight`` aside) and bitwise equal tensors.

mcore-rl's conversion switches itself to the bridge whenever megatron-bridge imports
(``mcore_rl.megatron.conversion._auto_bridge``); its own tables are forced here by
replacing that lookup for the "own" side of each check.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch

TOLERANCE = {"logits": 0.5, "logprobs": 0.1}  # bf16 against fp32 on a 135M model (max |diff|)


@contextlib.contextmanager
def own_tables():
    """mcore-rl's name tables, even where megatron-bridge imports."""
    from mcore_rl.megatron import conversion

    saved = conversion._auto_bridge
    conversion._auto_bridge = lambda: None
    try:
        yield
    finally:
        conversion._auto_bridge = saved


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """``log p(ids[:, t+1] | ids[:, :t+1])`` in fp32, ``[b, s-1]``, padded vocabulary left out."""
    lp = torch.log_softmax(logits[..., :vocab].float(), dim=-1)
    return lp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)


def megatron_logits(model, ids: torch.Tensor, spec: str) -> torch.Tensor:
    from mcore_rl.megatron.model import attention_mask, position_ids

    b, s = ids.shape
    with torch.no_grad():
        return model(ids, position_ids(b, s, ids.device),
                     attention_mask(spec, b, s, ids.device)).float()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory (Llama)")
    parser.add_argument("--layer-spec", default="transformer_engine",
                        choices=("local", "torch", "transformer_engine"))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--no-provider", action="store_true",
                        help="skip the bridge's own model (check 2's second row)")
    args = parser.parse_args(argv)

    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron.bridge import AutoBridge
    from mcore_rl.config.schema import MegatronConfig
    from mcore_rl.distributed.worker_group import free_port
    from mcore_rl.megatron import parallel
    from mcore_rl.megatron.conversion import (export_hf_weights, hf_config_to_arch,
                                              load_hf_checkpoint, load_hf_weights)
    from mcore_rl.megatron.model import build_model, wrap_float16

    device = parallel.initialize(0, 1, "127.0.0.1", free_port(), args.device)
    hf_config = AutoConfig.from_pretrained(args.model)
    arch = hf_config_to_arch(hf_config)
    vocab = arch.vocab_size
    _, checkpoint = load_hf_checkpoint(args.model)
    megatron = MegatronConfig(layer_spec=args.layer_spec, precision="bf16")
    bridge = AutoBridge.from_hf_pretrained(args.model)
    failures, rows = [], []

    def check(name: str, ok: bool, detail: str) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
        rows.append((name, "ok" if ok else "FAIL", detail))
        if not ok:
            failures.append(name)

    # 1. load: own tables vs AutoBridge.load_hf_weights into the same build
    t0 = time.perf_counter()
    own = wrap_float16(build_model(arch, megatron, vocab, device), "bf16")
    with own_tables():
        load_hf_weights(own, dict(checkpoint), arch)
    bridged = wrap_float16(build_model(arch, megatron, vocab, device), "bf16")
    bridge.load_hf_weights([m.module for m in bridged])
    a, b = own[0].state_dict(), bridged[0].state_dict()
    tensors = [n for n, v in a.items() if torch.is_tensor(v) and not n.endswith("_extra_state")]
    differ = [n for n in tensors if n not in b or not torch.equal(a[n], b[n])]
    check("load", not differ, f"{len(tensors) - len(differ)}/{len(tensors)} parameters bitwise "
          f"equal ({args.layer_spec} spec){'; differ: ' + ', '.join(differ[:4]) if differ else ''}"
          f" [{time.perf_counter() - t0:.1f} s]")

    # 2. logits against transformers in fp32
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        ref = hf(ids).logits.float()
    ref_lp = token_logprobs(ref, ids, vocab)
    del hf
    models = {f"mcore-rl ({args.layer_spec}, own load)": (own[0], args.layer_spec)}
    if not args.no_provider:
        provider = bridge.to_megatron_provider(load_weights=True)
        provider.apply_overrides_and_finalize(dtype=torch.bfloat16)
        provided = provider.provide_distributed_model(wrap_with_ddp=False, bf16=True)
        models["megatron-bridge provider (its TE spec)"] = (provided[0], "transformer_engine")
    for name, (model, spec) in models.items():
        logits = megatron_logits(model.eval(), ids, spec)
        d_logits = (logits[..., :vocab] - ref).abs().max().item()
        d_lp = (token_logprobs(logits, ids, vocab) - ref_lp).abs().max().item()
        check(f"logits {name}", d_logits <= TOLERANCE["logits"] and d_lp <= TOLERANCE["logprobs"],
              f"vs transformers fp32: max |logit diff| {d_logits:.4f}, max |logprob diff| "
              f"{d_lp:.4f} (tolerance {TOLERANCE['logits']}, {TOLERANCE['logprobs']})")
    if len(models) == 2:
        (m1, s1), (m2, s2) = models.values()
        d = (megatron_logits(m1, ids, s1) - megatron_logits(m2, ids, s2)).abs().max().item()
        print(f"     mcore-rl vs bridge provider: max |logit diff| {d:.4f}")

    # 3. export round trips, each against the checkpoint in bf16
    expected = {n: t.to(torch.bfloat16) for n, t in checkpoint.items()}
    if arch.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    for name, exported in (
            ("export mcore-rl", lambda: _own_export(export_hf_weights, own, arch, vocab)),
            ("export bridge", lambda: dict(bridge.export_hf_weights([m.module for m in own],
                                                                    cpu=True, show_progress=False)))):
        t0 = time.perf_counter()
        out = {n: t.cpu() for n, t in exported().items()}
        if arch.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        names_ok = set(out) == set(expected)
        unequal = [n for n in expected if n in out and not torch.equal(out[n].to(torch.bfloat16),
                                                                        expected[n])]
        check(name, names_ok and not unequal,
              f"{len(out)} tensors; missing {sorted(set(expected) - set(out))[:3]}, extra "
              f"{sorted(set(out) - set(expected))[:3]}; {len(unequal)} differ "
              f"{unequal[:3]} [{time.perf_counter() - t0:.1f} s]")

    print("\n| check | result | detail |\n| --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    parallel.destroy()
    return 1 if failures else 0


def _own_export(export_hf_weights, chunks, arch, vocab) -> dict:
    with own_tables():
        return dict(export_hf_weights(chunks, arch, vocab))


if __name__ == "__main__":
    sys.exit(main())

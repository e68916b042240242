"""Preference pairs for the reward-model demonstration of issue 36, from the starting model's own
answers on the arithmetic chat task (``configs/grpo_smollm2_arith.yaml``), training prompts only.

For ``--prompts`` prompts of the task's training split (a seeded draw; the held-out split that
RL validates on is never read), the starting model samples ``--samples`` answers each with the
run's rollout settings (the config's chat template, ``generation.temperature``,
``generation.max_new_tokens``; mcore-rl's hf backend on one GPU), the math verifier marks them,
and every prompt with right and wrong answers gives up to ``--pairs-per-prompt`` pairs (a right
answer chosen, a wrong one rejected; answers cut at the token budget, or whose text tokenizes
back past ``data.max_total_length``, are left out: a reward model scores finished answers). Prompts are split into the reward model's training and held-out
pairs (``--held-out`` of them), so its pair accuracy is measured on prompts it never saw.

    python3 scripts/gpu/preference_pairs.py --model /tmp/models/SmolLM2-135M-Instruct \\
        --out /tmp/rm_pairs [--prompts 4000] [--samples 8]

Writes ``train.jsonl`` and ``test.jsonl`` (``{"prompt", "chosen", "rejected"}``: the question,
rendered by the reward model's run as the policy's are) and ``stats.json`` (sampled accuracy of
the starting model, pairs, seconds); prints one line.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the starting model (Hugging Face directory)")
    parser.add_argument("--out", required=True, help="directory for train.jsonl, test.jsonl, stats.json")
    parser.add_argument("--config", default="grpo_smollm2_arith")
    parser.add_argument("--prompts", type=int, default=4000, help="training prompts sampled")
    parser.add_argument("--samples", type=int, default=8, help="answers per prompt")
    parser.add_argument("--pairs-per-prompt", type=int, default=2)
    parser.add_argument("--held-out", type=float, default=0.1, help="fraction of prompts held out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=1024, help="rows per generate chunk")
    args = parser.parse_args()

    from transformers import AutoConfig

    from mcore_rl.config.loader import load_config
    from mcore_rl.data.preferences import PreferencePair, write_pairs
    from mcore_rl.data.prompts import load_task
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.generation.hf import HFGenerationBackend
    from mcore_rl.megatron.conversion import load_hf_checkpoint
    from mcore_rl.rewards.math import math_reward

    start = time.perf_counter()
    cfg = load_config(args.config, [f"model.hf_path={args.model}", "generation.backend=hf",
                                    f"generation.batch_size={args.batch_size}"])
    tokenizer = load_tokenizer(cfg.model, cfg.data.use_chat_template)
    train, _ = load_task(cfg.data, tokenizer, cfg.run.seed)  # the training split only
    hf_config = AutoConfig.from_pretrained(args.model)
    hf_config.eos_token_id, hf_config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = HFGenerationBackend(hf_config, cfg.generation, tokenizer.eos_token_id,
                                  tokenizer.pad_token_id, cfg.data.max_total_length, device=device,
                                  dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    backend.update_weights(load_hf_checkpoint(args.model)[1].items())

    rng = random.Random(args.seed)
    prompts = rng.sample(range(len(train)), min(args.prompts, len(train)))
    held = set(prompts[:int(len(prompts) * args.held_out)])
    rows = [i for i in prompts for _ in range(args.samples)]
    rollout = backend.generate([list(train.input_ids[i]) for i in rows], seed=args.seed)
    answers: dict = {i: ([], []) for i in prompts}
    right = 0
    for r, i in enumerate(rows):
        p, n = int(rollout["prompt_lengths"][r]), int(rollout["input_lengths"][r])
        text = tokenizer.decode(rollout["input_ids"][r, p:n].tolist(), skip_special_tokens=True)
        ok = math_reward(text, train.examples[i]) == 1.0
        right += ok
        # a finished answer whose text tokenizes back within the run's budget (prompt + answer
        # + eos <= data.max_total_length: what the reward model's run accepts)
        fits = len(train.input_ids[i]) + len(tokenizer(text, add_special_tokens=False)["input_ids"]) \
            < cfg.data.max_total_length
        if not rollout["truncated"][r] and fits:
            answers[i][0 if ok else 1].append(text)
    pairs = {"train": [], "test": []}
    for i in prompts:
        good, bad = (sorted(set(a)) for a in answers[i])
        rng.shuffle(good), rng.shuffle(bad)
        for chosen, rejected in list(zip(good, bad))[:args.pairs_per_prompt]:
            pairs["test" if i in held else "train"].append(PreferencePair(
                train.examples[i].prompt, chosen, rejected, 0.0, train.examples[i].source))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, items in pairs.items():
        rng.shuffle(items)
        write_pairs(items, out / f"{split}.jsonl")
    stats = {"model": args.model, "prompts": len(prompts), "samples": len(rows),
             "sampled_accuracy": right / len(rows),
             "truncated_fraction": float(rollout["truncated"].mean()),
             "train_pairs": len(pairs["train"]), "test_pairs": len(pairs["test"]),
             "seconds": time.perf_counter() - start}
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    print(f"preference pairs: {stats['train_pairs']} train, {stats['test_pairs']} held out, from "
          f"{len(rows)} answers to {len(prompts)} training prompts (sampled accuracy "
          f"{stats['sampled_accuracy']:.3f}); {stats['seconds']:.0f} s -> {out}")


if __name__ == "__main__":
    main()

"""Peer: Hugging Face TRL's ``GRPOTrainer`` on mcore-rl's SmolLM2 GSM8K RL step.

The same work as ``bench/peers/mcore_rl_step.sh``: GRPO on GSM8K, 32 prompts x 8
generations per optimizer step (one generation round of 256 rollouts feeding one optimizer
step, as mcore-rl's ``grpo.optimizer_steps_per_rollout=1``), <= 256 new tokens, prompts
rendered exactly as mcore-rl's gsm8k task (``data.prompt_template="{question}"`` as one user
message through the tokenizer's chat template; the script checks the token ids against
mcore-rl's :class:`~mcore_rl.data.prompts.PromptDataset`), AdamW at a constant lr 1e-6
(betas 0.9/0.999, eps 1e-8, no weight decay, grad-norm clip 1.0), bf16, no KL (``beta=0``),
PPO-clip 0.2, group-normalized advantages (``scale_rewards="group"``), DAPO's token-mean loss
(``loss_type="dapo"``: mcore-rl's ``loss.aggregation=token-mean``), temperature 1, and the same
reward (mcore-rl's ``math`` verifier: math-verify on the text after ``####``).

Modes (``--mode``): ``hf`` (TRL's transformers generation) and ``vllm`` (``use_vllm=True``,
``vllm_mode="colocate"``; needs a vLLM TRL supports, 0.22 to 0.31 for TRL 1.16).

Measures wall seconds per optimizer step (= per RL step here; consecutive ``on_step_end``
callbacks with a CUDA sync, the first from ``on_train_begin``), reports the median over the
steps after the first ``--warmup`` (default 2), and tokens per second: prompt + completion
tokens of the step (TRL's ``num_tokens`` log, as mcore-rl's ``train/num_tokens``) and
completion tokens alone, per step second. Prints a table last and writes
``$OUT/trl_grpo_<mode>.json`` (or ``--json``).

Usage (GPU machine; TRL's wheels on PYTHONPATH):
    python bench/peers/trl_grpo.py --model /path/SmolLM2-135M-Instruct \\
        --data /path/gsm8k/train.jsonl --mode hf --steps 7
Check the arguments without a GPU or training: ``--dry-run``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo: mcore_rl

PINNED_TRL = "1.16.0"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--data", required=True, help="GSM8K-schema train JSONL")
    p.add_argument("--mode", choices=("hf", "vllm"), default="hf")
    p.add_argument("--steps", type=int, default=7, help="optimizer (RL) steps to run")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-length", type=int, default=256,
                   help="as data.max_prompt_length: a longer prompt is an error")
    p.add_argument("--micro-batch", type=int, default=16,
                   help="per_device_train_batch_size; accumulation = rollouts / micro-batch")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--json", default=None, help="output JSON (default $OUT/trl_grpo_<mode>.json)")
    p.add_argument("--output-dir", default="/tmp/trl_grpo_run")
    p.add_argument("--dry-run", action="store_true",
                   help="build the config and the dataset, check the prompts, build no trainer")
    a = p.parse_args(argv)
    rollouts = a.prompts_per_step * a.generations
    if a.steps <= a.warmup:
        p.error(f"--steps ({a.steps}) must exceed --warmup ({a.warmup})")
    if rollouts % a.micro_batch:
        p.error(f"--micro-batch ({a.micro_batch}) must divide prompts x generations ({rollouts})")
    return a


def build_dataset(args, tokenizer):
    """The train prompts as TRL's conversational dataset (one user message), with the gold
    answer and source for the reward; checks the token ids TRL will generate from against
    mcore-rl's rendering and raises ``ValueError`` on a mismatch or an over-long prompt."""
    from datasets import Dataset

    from mcore_rl.data.gsm8k import load_gsm8k
    from mcore_rl.data.prompts import PromptDataset

    examples = load_gsm8k(args.data, key="--data")
    # The same rendering and length check as mcore-rl (raises on a prompt over the limit).
    ref = PromptDataset(examples, tokenizer, "{question}", True, args.max_prompt_length)
    rows = {"prompt": [[{"role": "user", "content": ex.prompt}] for ex in examples],
            "answer": [ex.answer for ex in examples],
            "source": [ex.source for ex in examples]}
    n_check = min(64, len(examples))
    trl_ids = tokenizer.apply_chat_template(rows["prompt"][:n_check], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
    for i in range(n_check):
        if list(trl_ids[i]) != ref.input_ids[i]:
            raise ValueError(f"{examples[i].source}: TRL's prompt tokens differ from mcore-rl's")
    return Dataset.from_dict(rows), max(len(ids) for ids in ref.input_ids)


def math_reward_func(completions, answer, source, **_):
    """TRL reward function: mcore-rl's ``math`` verifier on each completion's text."""
    from mcore_rl.data.example import Example
    from mcore_rl.rewards.math import math_reward

    out = []
    for completion, gold, src in zip(completions, answer, source):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        try:
            out.append(math_reward(text, Example(prompt="", answer=gold, solution="", source=src)))
        except Exception:  # as mcore-rl: a verifier error scores 0
            out.append(0.0)
    return out


def grpo_config(args):
    import torch
    from trl import GRPOConfig

    rollouts = args.prompts_per_step * args.generations
    kwargs = dict(
        output_dir=args.output_dir, seed=args.seed, max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=rollouts // args.micro_batch,
        generation_batch_size=rollouts, num_generations=args.generations, num_iterations=1,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        optim="adamw_torch",
        bf16=True, beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        mask_truncated_completions=False, disable_dropout=True,
        logging_steps=1, report_to="none", save_strategy="no", log_completions=False,
        gradient_checkpointing=False, dataloader_num_workers=0, disable_tqdm=True,
        model_init_kwargs={"dtype": "bfloat16"},
        use_cpu=not torch.cuda.is_available(),  # a CPU check of the script
    )
    if args.mode == "vllm":
        kwargs.update(use_vllm=True, vllm_mode="colocate",
                      vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                      vllm_max_model_length=args.max_prompt_length + args.max_new_tokens,
                      vllm_enable_sleep_mode=False)
    return GRPOConfig(**kwargs)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer, TrainerCallback

    if trl.__version__ != PINNED_TRL:
        print(f"warning: TRL {trl.__version__}, pinned {PINNED_TRL}", file=sys.stderr)
    if args.mode == "vllm":  # colocate runs vLLM in this process as rank 0 of a world of 1
        for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}.items():
            os.environ.setdefault(k, v)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dataset, longest_prompt = build_dataset(args, tokenizer)
    config = grpo_config(args)
    print(f"TRL {trl.__version__}, transformers {transformers.__version__}, torch "
          f"{torch.__version__}; {len(dataset)} prompts, longest {longest_prompt} tokens; mode "
          f"{args.mode}; micro-batch {config.per_device_train_batch_size} x "
          f"{config.gradient_accumulation_steps} accumulation", flush=True)
    if args.dry_run:
        print("dry run: config and dataset OK")
        return 0

    class StepClock(TrainerCallback):
        def __init__(self):
            self.marks, self.logs = [], []

        def _mark(self):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.marks.append(time.perf_counter())

        def on_train_begin(self, *a, **k):
            self._mark()

        def on_step_end(self, *a, **k):
            self._mark()

        def on_log(self, _args, state, control, logs=None, **k):
            if logs and "num_tokens" in logs:
                self.logs.append(dict(logs, step=state.global_step))

    from trl import GRPOTrainer

    clock = StepClock()
    trainer = GRPOTrainer(model=args.model, reward_funcs=math_reward_func, args=config,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[clock])
    trainer.train()

    step_s = [b - a for a, b in zip(clock.marks, clock.marks[1:])]
    tokens = [l["num_tokens"] for l in clock.logs]  # cumulative prompt + completion tokens
    step_tokens = [b - a for a, b in zip([0.0] + tokens, tokens)]
    completion = [l.get("completions/mean_length", 0.0) * args.prompts_per_step * args.generations
                  for l in clock.logs]
    measured = list(range(args.warmup, min(len(step_s), len(step_tokens))))
    med = statistics.median(step_s[i] for i in measured)
    tok_s = statistics.median(step_tokens[i] / step_s[i] for i in measured)
    comp_s = statistics.median(completion[i] / step_s[i] for i in measured)
    rewards = [l.get("reward", float("nan")) for l in clock.logs]
    result = {
        "peer": "trl", "trl_version": trl.__version__, "mode": args.mode,
        "transformers_version": transformers.__version__, "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "model": args.model, "data": args.data, "steps": len(step_s), "warmup": args.warmup,
        "prompts_per_step": args.prompts_per_step, "generations": args.generations,
        "max_new_tokens": args.max_new_tokens, "micro_batch": config.per_device_train_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "seconds_per_step_median": med, "seconds_per_step": step_s,
        "tokens_per_s_median": tok_s, "completion_tokens_per_s_median": comp_s,
        "tokens_per_step": step_tokens, "reward_mean": rewards,
        "command": " ".join([sys.executable] + sys.argv),
    }
    path = args.json or os.path.join(os.environ.get("OUT", "."), f"trl_grpo_{args.mode}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {path}")
    print(f"{'peer':<12}{'mode':<6}{'s/step (median)':>17}{'tokens/s':>11}{'completion tok/s':>18}"
          f"{'steps':>7}")
    print(f"{'TRL ' + trl.__version__:<12}{args.mode:<6}{med:>17.2f}{tok_s:>11.0f}{comp_s:>18.0f}"
          f"{len(measured):>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

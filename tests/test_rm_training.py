"""Reward-model training and learned rewards end to end on CPU, through the ``mcore-rl``
command, on the small default model (``grpo_synthetic``'s 4-layer Qwen2 shape, the character
tokenizer, seeded init).

- ``algorithm=rm`` on a synthetic preference set (single-digit sums ``a+b=``: the chosen
  response is the sum, the rejected one the sum moved by a non-zero offset in -9..9, so the
  model must learn the sums; held-out pairs of a seed of their own) reaches held-out pair
  accuracy >= 0.9 from about 0.5.
- ``mcore-rl eval`` of its last checkpoint reports the same pair accuracy; ``mcore-rl export``
  writes a ``Qwen2ForSequenceClassification`` whose transformers scores give it too.
- GRPO and PPO with only that reward model's reward (``reward.name=model``, the exact-answer
  verifier tracked beside it), and GRPO with a generative judge decoded by the hf and by the
  megatron backend, run through and log both curves.
"""

from __future__ import annotations

import json

import pytest
import torch

from mcore_rl.cli import main
from mcore_rl.data.preferences import synthetic_pairs, write_pairs
from mcore_rl.utils.logging import read_metrics

CPU = ["cluster.use_ray=false", "cluster.device=cpu", "logging.progress=false",
       "logging.tensorboard=false"]
# Measured (held-out pair accuracy, cosine schedule over the run): 300 steps 0.495 -> 0.765
# (100) -> 0.935 (200) -> 0.970; 200 steps 0.495 -> 0.720 (50) -> 0.900 (100) -> 0.925 (150)
# -> 0.945.
STEPS = 200
# A short RL run of the default config with a learned reward: no warm start, few prompts.
RL = CPU + ["sft.steps=0", "data.synthetic.max_value=9", "data.synthetic.num_train=80",
            "data.synthetic.num_test=20", "generation.logprob_canary_prompts=0"]


@pytest.fixture(scope="module")
def rm_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    write_pairs(synthetic_pairs(4000, seed=1, max_value=9), root / "train.jsonl")
    write_pairs(synthetic_pairs(200, seed=2, max_value=9), root / "test.jsonl")
    args = ["--config-name", "grpo_synthetic", *CPU, "algorithm=rm",
            f"rm.train_path={root / 'train.jsonl'}", f"rm.test_path={root / 'test.jsonl'}",
            f"rm.max_steps={STEPS}", f"rm.val_every={STEPS // 3}", "rm.val_num_pairs=200",
            "reward_model.optimizer.lr_decay_style=cosine",
            f"run.output_dir={root / 'run'}"]
    assert main(["train", *args]) == 0
    assert main(["eval", *args, "checkpoint.resume=latest"]) == 0
    assert main(["export", "--checkpoint", str(root / "run" / "checkpoints" / f"step_{STEPS}"),
                 "--output", str(root / "exported")]) == 0
    return root


def test_rm_training_reaches_held_out_pair_accuracy(rm_run):
    summary = json.loads((rm_run / "run" / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert summary["val_pair_accuracy_start"] < 0.7
    assert summary["val_pair_accuracy_end"] >= 0.9, summary["val_curve"]
    train = [r for r in read_metrics(rm_run / "run") if "train/loss" in r]
    assert train[-1]["train/loss"] < train[0]["train/loss"]


def test_eval_reports_the_checkpoints_pair_accuracy(rm_run):
    summary = json.loads((rm_run / "run" / "summary.json").read_text())
    evaluated = json.loads((rm_run / "run" / "eval.json").read_text())
    assert evaluated["step"] == STEPS and evaluated["num_pairs"] == 200
    assert evaluated["val/pair_accuracy"] == summary["val_pair_accuracy_end"]


def test_exported_reward_model_scores_in_transformers(rm_run):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from mcore_rl.data.preferences import load_preference_pairs

    out = rm_run / "exported"
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "Qwen2ForSequenceClassification"
    pairs = load_preference_pairs(rm_run / "test.jsonl")

    def score(text: str) -> float:
        ids = tok(text)["input_ids"] + [tok.eos_token_id]
        with torch.no_grad():
            return float(model(torch.tensor([ids])).logits[0, 0])

    right = [score(p.prompt + p.chosen) > score(p.prompt + p.rejected) for p in pairs]
    evaluated = json.loads((rm_run / "run" / "eval.json").read_text())
    assert sum(right) / len(right) == pytest.approx(evaluated["val/pair_accuracy"], abs=0.011)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_rl_with_the_reward_model_logs_both_curves(rm_run, tmp_path, algorithm):
    loop = [f"{algorithm}.max_steps=2", f"{algorithm}.val_every=2", f"{algorithm}.val_num_prompts=8",
            f"{algorithm}.num_prompts_per_step=4"]
    loop += ["grpo.num_generations=2"] if algorithm == "grpo" else ["ppo.num_generations=1"]
    assert main(["train", "--config-name", "grpo_synthetic", *RL, f"algorithm={algorithm}", *loop,
                 "reward.name=model", f"reward_model.hf_path={rm_run / 'exported'}",
                 # the run's own tokenizer files: transformers reads the exported directory's as
                 # its config's family's (Qwen2Tokenizer), which tokenizes whitespace otherwise
                 f"reward_model.tokenizer={rm_run / 'run' / 'tokenizer'}", "reward.verifier=exact", f"run.output_dir={tmp_path / 'run'}"]) == 0
    rows = read_metrics(tmp_path / "run")
    steps = [r for r in rows if "train/reward_mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert {"train/verifier_reward", "train/reward_model_score", "timing/learned_reward_s"} <= r.keys()
        assert r["train/reward_model_score"] == pytest.approx(r["train/reward_mean"])
    vals = [r for r in rows if "val/reward" in r]
    assert [r["step"] for r in vals] == [0, 2]
    assert all(0 <= r["val/accuracy"] <= 1 for r in vals)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["hf", "hf_process", "megatron"])
def test_grpo_with_a_generative_judge_goes_on_through_unparsable_answers(tmp_path, backend):
    """The judge is the policy's seeded init: it answers noise, so most answers do not parse
    (reward 0, counted as errors); the run goes on. hf_process: the hf engine in a process of
    its own, placed as judge_generation beside the policy's groups."""
    engine = ["judge.generation.backend=hf", "judge.generation.num_workers=1"] \
        if backend == "hf_process" else [f"judge.generation.backend={backend}"]
    assert main(["train", "--config-name", "grpo_synthetic", *RL, "grpo.max_steps=1",
                 "grpo.val_every=0", "grpo.val_at_start=false", "grpo.num_prompts_per_step=2",
                 "grpo.num_generations=2", "reward.name=judge", "judge.max_prompt_length=120",
                 *engine, "judge.generation.max_new_tokens=4",
                 "judge.score_pattern='[0-9]'", "judge.max_score=9",
                 f"run.output_dir={tmp_path / 'run'}"]) == 0
    (step,) = [r for r in read_metrics(tmp_path / "run") if "train/reward_mean" in r]
    assert step["train/judge_errors"] == step["train/reward_errors"]
    assert 0 <= step["train/reward_errors"] <= 4 and 0 <= step["train/reward_mean"] <= 1

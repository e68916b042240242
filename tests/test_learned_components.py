"""A learned reward as one weighted component of ``reward.names`` (``docs/design.md``, "Learned
rewards"): ``reward.names=[exact,model,<a user's reward>]`` with ``reward.weights``.

- :class:`LearnedRewards` with a stand-in learned reward and the real reward pool of the others:
  the rewards are the hand-weighted sum per sample, each component logged by its
  ``reward/<name>``, errors summed; the others scored while decoding
  (:class:`~mcore_rl.rewards.pool.StreamingRewards`) give the same numbers.
- A real trainer on CPU (the small default policy, a one-layer reward model with the policy's
  tokenizer): a rollout's rewards equal ``exact + 0.5 x (transformers'
  *ForSequenceClassification score of the row) + 0.25 x length`` computed apart; the metrics
  carry ``reward/<name>`` of each component (validation's too) and the tracked verifier.
- ``grpo.streaming`` through the ``mcore-rl`` command with the learned component.
"""

from __future__ import annotations

import sys

import pytest
import torch

from mcore_rl.cli import main
from mcore_rl.config.schema import RewardConfig
from mcore_rl.controller.learned_rewards import LearnedRewards, Scored
from mcore_rl.data.example import Example
from mcore_rl.utils.logging import read_metrics

CPU = ["cluster.use_ray=false", "cluster.device=cpu", "logging.progress=false",
       "logging.tensorboard=false"]
LENGTH = "rmwpkg.rewards:length"
NAMES = f"reward.names=[exact,model,{LENGTH}]"
WEIGHTS = "reward.weights=[1.0,0.5,0.25]"
# A short run of the default config: no warm start, few prompts, the others scored in-process.
RUN = CPU + ["sft.steps=0", "generation.logprob_canary_prompts=0", "data.synthetic.max_value=9",
             "data.synthetic.num_train=40", "data.synthetic.num_test=8", "reward.num_workers=0",
             NAMES, WEIGHTS]


@pytest.fixture(scope="module")
def rmwpkg(tmp_path_factory):
    """A user's reward module on ``sys.path``: ``length(response, example) = len(response)``."""
    root = tmp_path_factory.mktemp("rmwpkg")
    (root / "rmwpkg").mkdir()
    (root / "rmwpkg" / "__init__.py").write_text("")
    (root / "rmwpkg" / "rewards.py").write_text(
        "def length(response, example):\n    return float(len(response))\n")
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for name in [m for m in sys.modules if m.split(".")[0] == "rmwpkg"]:
        del sys.modules[name]


class _Learned:
    """A learned reward that scores each response 0.1 x its count of "7"s; "!" fails (0)."""

    def score(self, rollout, texts, examples):
        rewards = torch.tensor([0.0 if "!" in t else 0.1 * t.count("7") for t in texts])
        errors = sum("!" in t for t in texts)
        return Scored(rewards, errors, {"learned_mean": float(rewards.mean())})

    def close(self):
        pass


def test_the_learned_component_joins_the_weighted_sum(rmwpkg):
    from mcore_rl.rewards import reward_components, weighted_names
    from mcore_rl.rewards.exact import exact_reward
    from mcore_rl.rewards.pool import RewardScorer

    reward = RewardConfig(names=["exact", "model", LENGTH], weights=[1.0, 0.5, 0.25])
    assert weighted_names(reward) == [("exact", 1.0, "reward/exact"),
                                      ("model", 0.5, "reward/model"),
                                      (LENGTH, 0.25, "reward/length")]
    others = RewardScorer(reward_components(reward, exclude=("model",)))
    learned = LearnedRewards(_Learned(), None, others, [1.0, 0.5, 0.25], 1, "reward/model")
    examples = [Example(f"{a}+5=", str(a + 5), str(a + 5), f"s:{a}") for a in range(5)]
    texts = ["5", "77", "9!", "", "17 7"]
    by_hand = [[exact_reward(t, e), 0.0 if "!" in t else 0.1 * t.count("7"), float(len(t))]
               for t, e in zip(texts, examples)]
    expected = [row[0] + 0.5 * row[1] + 0.25 * row[2] for row in by_hand]
    try:
        pending = learned.submit({}, texts, examples)
        rewards, errors, _ = pending.result()
        assert rewards.dtype == torch.float32 and errors == 1
        assert rewards.tolist() == pytest.approx(expected, abs=1e-6)
        parts = pending.components()
        assert list(parts) == ["reward/exact", "reward/model", "reward/length"]
        for k, metric in enumerate(parts):
            assert parts[metric].tolist() == pytest.approx([row[k] for row in by_hand])
        assert learned.pop_metrics("train/")["train/learned_mean"] == pytest.approx(0.08)
        # the others scored while decoding (rows as they come): the same numbers
        streaming = others.open(examples)
        streaming.add([3, 4], texts[3:])
        streaming.add([0, 1, 2], texts[:3])
        streaming.close()
        again = learned.submit({}, texts, examples, others=streaming)
        assert torch.equal(again.result()[0], rewards) and again.early_fraction == 1.0
        # alone, of weight 1: the learned reward's own scores exactly
        alone = LearnedRewards(_Learned(), metric="reward/model")
        assert torch.equal(alone.submit({}, texts, examples).result()[0],
                           _Learned().score({}, texts, examples).rewards)
        alone.close()
    finally:
        learned.close()
        others.close()
    with pytest.raises(ValueError, match="2 weights and index 0 for 3 rewards"):
        LearnedRewards(_Learned(), None, others, [1.0, 0.5])


# ---------------------------------------------------------------------------- a real trainer
@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """A one-layer Qwen2ForSequenceClassification (one label, a score head of weight ~1) with
    the character tokenizer in a directory of its own (read as the policy's)."""
    from transformers import AutoModelForSequenceClassification

    from mcore_rl.config.schema import ModelArchConfig
    from mcore_rl.data.tokenizer import build_char_tokenizer
    from mcore_rl.megatron.conversion import arch_to_hf_config

    root = tmp_path_factory.mktemp("learned_component")
    arch = ModelArchConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_query_groups=1,
                           ffn_hidden_size=32, max_position_embeddings=64, vocab_size=99)
    config = arch_to_hf_config(arch, 99)
    config.pad_token_id, config.num_labels = 0, 1
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(root / "rm")
    build_char_tokenizer().save_pretrained(root / "tokenizer")
    return root


def _rm_overrides(root):
    return [f"reward_model.hf_path={root / 'rm'}", f"reward_model.tokenizer={root / 'tokenizer'}"]


@pytest.fixture(scope="module")
def trained(rmwpkg, reward_model, tmp_path_factory):
    """One rollout and validation of a GRPO trainer with ``reward.names=[exact,model,length]``
    (the exact verifier tracked beside them too): the rollout, the texts, the step's and the
    validation's metrics."""
    from mcore_rl.config.loader import load_config
    from mcore_rl.controller.loops import built

    cfg = load_config("grpo_synthetic", RUN + _rm_overrides(reward_model) + [
        "reward.verifier=exact", "grpo.num_prompts_per_step=4", "grpo.num_generations=2",
        "grpo.val_num_prompts=4", f"run.output_dir={tmp_path_factory.mktemp('run') / 'run'}"])
    with built(cfg) as loop:
        trainer = loop.trainer
        trainer.refit()
        rollout, errors = trainer.generate_and_score(2)
        metrics = trainer.reward_timing()
        texts = trainer.producer.texts(rollout)
        data = trainer.train_data
        prompts = [rollout["input_ids"][b, :int(p)].tolist()
                   for b, p in enumerate(rollout["prompt_lengths"])]
        examples = [next(data.examples[i] for i in range(len(data))
                         if list(data.input_ids[i]) == p) for p in prompts]
        val = trainer.validate()
    return rollout, texts, examples, errors, metrics, val


def test_a_rollouts_rewards_are_the_hand_weighted_sum(trained, reward_model):
    from transformers import AutoModelForSequenceClassification

    from mcore_rl.rewards.exact import exact_reward

    rollout, texts, examples, errors, metrics, _ = trained
    model = AutoModelForSequenceClassification.from_pretrained(reward_model / "rm").eval()
    with torch.no_grad():  # each row alone, unpadded: the score of its last token
        scores = torch.stack([model(rollout["input_ids"][b:b + 1, :int(n)]).logits[0, 0]
                              for b, n in enumerate(rollout["input_lengths"])])
    assert errors == 0
    exact = torch.tensor([exact_reward(t, ex) for t, ex in zip(texts, examples)])
    expected = exact + 0.5 * scores + 0.25 * torch.tensor([float(len(t)) for t in texts])
    torch.testing.assert_close(rollout["rewards"], expected, rtol=0, atol=1e-4)
    assert metrics["reward/model"] == pytest.approx(float(scores.mean()), abs=1e-4)
    assert metrics["train/reward_model_score"] == pytest.approx(metrics["reward/model"])
    assert metrics["reward/length"] == pytest.approx(sum(map(len, texts)) / len(texts))
    assert metrics["reward/exact"] == metrics["train/verifier_reward"] == float(exact.mean())
    assert metrics["train/reward_early_fraction"] == 1.0  # the others scored while decoding
    assert "timing/learned_reward_s" in metrics


def test_validation_logs_each_component_and_the_tracked_verifier(trained):
    val = trained[-1]
    assert {"val/reward/exact", "val/reward/model", "val/reward/length"} <= val.keys()
    assert val["val/reward"] == pytest.approx(
        val["val/reward/exact"] + 0.5 * val["val/reward/model"] + 0.25 * val["val/reward/length"],
        abs=1e-5)
    assert val["val/accuracy"] == val["val/reward/exact"]  # the tracked verifier, exact too


@pytest.mark.slow
def test_a_streamed_run_logs_each_component(rmwpkg, reward_model, tmp_path):
    """grpo.streaming=true scores each prompt group as it comes, the learned reward with it
    (PPO's loop scores as GRPO's synchronous one: the trainer test above)."""
    run = tmp_path / "run"
    assert main(["train", "--config-name", "grpo_synthetic", *RUN, *_rm_overrides(reward_model),
                 "grpo.streaming=true", "generation.num_workers=1", "grpo.max_steps=1",
                 "grpo.val_every=0", "grpo.val_at_start=false", "grpo.num_prompts_per_step=2",
                 "grpo.num_generations=2", f"run.output_dir={run}"]) == 0
    (step,) = [r for r in read_metrics(run) if "train/reward_mean" in r]
    parts = [step["reward/exact"], step["reward/model"], step["reward/length"]]
    assert step["train/reward_mean"] == pytest.approx(
        parts[0] + 0.5 * parts[1] + 0.25 * parts[2], abs=1e-5)
    assert step["reward/model"] == pytest.approx(step["train/reward_model_score"])

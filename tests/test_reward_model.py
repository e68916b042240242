"""Reward-model worker on real Megatron-Core over gloo, against transformers.

- Scores equal a transformers ``Qwen2ForSequenceClassification`` forward (its pooling of the
  last non-pad token) of the checkpoint the worker loaded, in one process, at TP=2 (also with
  sequence parallelism), at PP=2 and with DP=2; fixed micro-batches and a token budget give the same scores.
- Import/export: the worker's ``get_hf_weights`` is the loaded checkpoint exactly; a dist
  checkpoint after a training step goes through ``mcore-rl export`` to a directory that
  ``AutoModelForSequenceClassification`` loads and that scores as the worker does.
- A Bradley-Terry step at TP=2 (with and without sequence parallelism), PP=2 and DP=2 equals one process (metrics and weights), and
  its metrics equal a hand computation from the scores.
- A causal LM checkpoint has no score head: refused where one is required, a fresh head on its
  backbone otherwise.
"""

from __future__ import annotations

import json

import pytest
import torch

from dist_utils import _WORLD, run_distributed, use_layout
from rollouts import random_rows
from mcore_rl.algorithms.preference import BradleyTerryLoss, bradley_terry_loss
from mcore_rl.config.schema import MegatronConfig, ModelArchConfig, OptimizerConfig
from mcore_rl.data import batch as B
from mcore_rl.megatron.conversion import arch_to_hf_config

VOCAB = 48
PAD = 0  # random_rows pads with 0 and draws ids from 1..VOCAB-1: HF's pooling finds each end
ARCH = ModelArchConfig(family="qwen2", num_layers=2, hidden_size=32, num_attention_heads=4,
                       num_query_groups=2, ffn_hidden_size=64, max_position_embeddings=64,
                       qkv_bias=True, tie_word_embeddings=True, vocab_size=VOCAB)
# name: (TP, PP, other megatron fields); tp2_sp: sequence parallelism (the head's output
# gathered over the sequence: workers/scalar_head.py)
LAYOUTS = {"tp2": (2, 1, {}), "pp2": (1, 2, {}), "dp2": (1, 1, {}),
           "tp2_sp": (2, 1, dict(sequence_parallel=True))}
LOSS = BradleyTerryLoss()


def _hf_config(num_labels=1):
    config = arch_to_hf_config(ARCH, VOCAB)
    config.num_labels, config.pad_token_id = num_labels, PAD
    return config


def _worker(hf_path, tp=1, pp=1, megatron=None, **overrides):
    from mcore_rl.workers.reward_model import RewardModelWorker

    kwargs = dict(
        hf_path=hf_path, hf_config=_hf_config().to_dict(), vocab_size=VOCAB, arch=ARCH,
        megatron=MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                **(megatron or {})),
        optimizer=OptimizerConfig(name="sgd", lr=0.1, clip_grad=1.0), rank=_WORLD["rank"],
        world_size=_WORLD["world_size"], master_addr="127.0.0.1", master_port=_WORLD["port"],
        device="cpu", seed=7, total_optimizer_steps=10, global_batch_size=8,
        require_score_head=True)
    return RewardModelWorker(**{**kwargs, **overrides})


def _pairs(n_pairs=4, seed=0):
    """Rows of random pairs (chosen first), margins 0 and 0.5 alternating."""
    g = torch.Generator().manual_seed(seed)
    rows = random_rows(2 * n_pairs, VOCAB, (3, 5), (2, 6), g)
    margin = torch.tensor([0.0, 0.5]).repeat(n_pairs // 2 + 1)[:n_pairs]
    return {**rows, "chosen": torch.tensor([1.0, 0.0]).repeat(n_pairs),
            "margin": margin.repeat_interleave(2)}


def _one_process(hf_dir, lm_dir, ckpt_dir):
    from mcore_rl.workers.reward_model import MissingScoreHeadError

    out = {}
    batch = _pairs()
    w = _worker(hf_dir)
    out["scores"] = w.get_scores(batch, 3)
    out["scores_budget"] = _worker(hf_dir, score_tokens_per_microbatch=20).get_scores(batch, 3)
    out["exported"] = w.get_hf_weights()
    out["metrics"] = w.train(batch, LOSS, 8, 4)
    out["after"] = w.get_hf_weights()
    out["scores_after"] = w.get_scores(batch, 8)
    w.save_checkpoint(ckpt_dir)
    try:
        _worker(lm_dir)
    except MissingScoreHeadError as e:
        out["no_head_error"] = str(e)
    fresh = _worker(lm_dir, require_score_head=False)
    out["fresh"] = fresh.get_hf_weights()
    return out


def _layouts(hf_dir):
    out = {}
    batch = _pairs()
    for name, (tp, pp, megatron) in LAYOUTS.items():
        use_layout(tp, pp)
        w = _worker(hf_dir, tp, pp, megatron)
        layout = w.layout()
        dp, dp_rank = layout["dp_size"], layout["dp_rank"]
        out[name] = {"scores": w.get_scores(B.shard(batch, dp)[dp_rank], 3),
                     "metrics": w.train(B.shard(batch, dp)[dp_rank], LOSS, 8, 2),
                     "after": w.get_hf_weights()}
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A Qwen2ForSequenceClassification (one label) and a Qwen2ForCausalLM of ARCH, seeded."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("reward_models")
    torch.manual_seed(3)
    rm = AutoModelForSequenceClassification.from_config(_hf_config())
    with torch.no_grad():  # a score head of the size the backbone's outputs give
        rm.score.weight.normal_(0, 0.5)
    rm.save_pretrained(root / "rm")
    AutoModelForCausalLM.from_config(arch_to_hf_config(ARCH, VOCAB)).save_pretrained(root / "lm")
    return root


@pytest.fixture(scope="module")
def single(checkpoints):
    return run_distributed(_one_process, 1, str(checkpoints / "rm"), str(checkpoints / "lm"),
                           str(checkpoints / "run" / "checkpoints" / "step_1" / "reward_model"))[0]


@pytest.fixture(scope="module")
def layouts(checkpoints):
    return run_distributed(_layouts, 2, str(checkpoints / "rm"))


def _hf_scores(directory, batch):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(batch["input_ids"]).logits[:, 0]


def test_scores_equal_the_sequence_classification_forward(single, checkpoints):
    expected = _hf_scores(checkpoints / "rm", _pairs())
    torch.testing.assert_close(single["scores"], expected, rtol=1e-5, atol=1e-5)
    assert expected.std() > 0.1  # the head reads different states: a wrong token would show
    torch.testing.assert_close(single["scores_budget"], single["scores"], rtol=1e-6, atol=1e-6)


def test_export_is_the_loaded_checkpoint(single, checkpoints):
    from mcore_rl.megatron.conversion import load_hf_checkpoint

    state = load_hf_checkpoint(checkpoints / "rm")[1]
    assert single["exported"].keys() == state.keys()
    for k, v in state.items():
        torch.testing.assert_close(single["exported"][k], v, rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_scores_and_training_equal_one_process(single, layouts, name):
    ranks = [r[name] for r in layouts]
    scores = torch.cat([r["scores"] for r in ranks]) if name == "dp2" else ranks[0]["scores"]
    if name != "dp2":
        assert torch.equal(ranks[0]["scores"], ranks[1]["scores"])
    torch.testing.assert_close(scores, single["scores"], rtol=1e-5, atol=1e-5)
    for k in ("loss", "pair_accuracy", "reward_margin", "grad_norm", "num_valid_sequences"):
        assert ranks[0]["metrics"][k] == pytest.approx(single["metrics"][k], rel=1e-5, abs=1e-6), k
    for k, v in single["after"].items():
        torch.testing.assert_close(ranks[0]["after"][k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_training_metrics_are_the_bradley_terry_loss_of_the_scores(single):
    s, batch = single["scores"], _pairs()
    chosen, rejected, margin = s[0::2], s[1::2], batch["margin"][0::2]
    by_hand = torch.log1p(torch.exp(-(chosen - rejected - margin)))  # -log sigmoid(x)
    m = single["metrics"]
    assert m["loss"] == pytest.approx(float(by_hand.mean()), rel=1e-5)
    assert m["pair_accuracy"] == pytest.approx(float((chosen > rejected).float().mean()))
    assert m["reward_margin"] == pytest.approx(float((chosen - rejected).mean()), rel=1e-5)
    assert m["num_valid_sequences"] == 4
    # the step moved the scores the way the loss wants: the margin grew
    after = single["scores_after"]
    assert float((after[0::2] - after[1::2]).mean()) > float((chosen - rejected).mean())


def test_bradley_terry_loss_against_a_hand_computation():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0, 30.0]), torch.tensor([1.0, 0.0, 1.0, -30.0])
    margin = torch.tensor([0.0, 1.0, 0.5, 0.0])
    # -log sigmoid(d): d = 1 -> log(1 + e^-1); d = -1 -> log(1 + e); d = -2.5; d = 60 -> ~e^-60
    expected = torch.tensor([0.3132616875, 1.3132616875, 2.5788897, 8.7565e-27])
    torch.testing.assert_close(bradley_terry_loss(chosen, rejected, margin), expected,
                               rtol=1e-6, atol=1e-30)
    assert torch.isfinite(bradley_terry_loss(torch.tensor([-100.0]), torch.tensor([100.0]))).all()


def test_bradley_terry_loss_refuses_split_or_swapped_pairs():
    batch = {"chosen": torch.tensor([0.0, 1.0]), "margin": torch.zeros(2),
             "sample_mask": torch.ones(2), "input_lengths": torch.ones(2, dtype=torch.long)}
    with pytest.raises(ValueError, match="chosen first"):
        LOSS(torch.zeros(2), batch)
    with pytest.raises(ValueError, match=r"\[2P\]"):
        LOSS(torch.zeros(3), {**batch, "chosen": torch.ones(3)})


def test_checkpoint_without_score_head_is_refused_or_gets_a_fresh_head(single, checkpoints):
    assert "no score head (score.weight" in single["no_head_error"]
    from mcore_rl.megatron.conversion import load_hf_checkpoint

    lm = load_hf_checkpoint(checkpoints / "lm")[1]
    fresh = single["fresh"]
    assert set(fresh) == set(lm) - {"lm_head.weight"} | {"score.weight"}
    for k in lm:
        if k != "lm_head.weight":
            torch.testing.assert_close(fresh[k], lm[k], rtol=0, atol=0, msg=k)


def test_trained_checkpoint_exports_to_a_sequence_classification_model(single, checkpoints, tmp_path):
    """``mcore-rl export`` of the dist checkpoint saved after the training step."""
    from mcore_rl.cli import main
    from mcore_rl.data.tokenizer import build_char_tokenizer

    run = checkpoints / "run"
    config = arch_to_hf_config(ARCH, VOCAB)
    config.pad_token_id = PAD
    config.to_json_file(run / "hf_config.json")
    build_char_tokenizer().save_pretrained(run / "tokenizer")
    out = tmp_path / "exported"
    assert main(["export", "--checkpoint", str(run / "checkpoints" / "step_1"),
                 "--output", str(out)]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["architectures"] == ["Qwen2ForSequenceClassification"]
    assert saved["num_labels"] == 1 if "num_labels" in saved else len(saved["id2label"]) == 1
    torch.testing.assert_close(_hf_scores(out, _pairs()), single["scores_after"], rtol=1e-5, atol=1e-5)

"""End to end on CPU: resume equals a straight run (and ``mcore-rl plot`` draws the two); the
GSM8K pipeline runs from a Hugging Face Qwen2 checkpoint through the CLI (on Ray) with the real
data file and its verifier."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from mcore_rl.cli import main
from mcore_rl.config.loader import load_config
from mcore_rl.controller.loops import run
from mcore_rl.utils.logging import read_metrics
from mcore_rl.utils.plotting import COLUMNS, DPI, PANEL_INCHES

SHARED_GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"

TINY = [
    "cluster.use_ray=false",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations=4",
    "grpo.val_every=2",
    "grpo.val_num_prompts=5",
    "sft.steps=10",
    "sft.batch_size=16",
    "sft.lr=1e-2",
    "loss.kl_coef=0.05",
    "checkpoint.every=2",
    "logging.progress=false",
    "data.synthetic.max_value=4",
    "data.synthetic.num_train=20",
    "data.synthetic.num_test=5",
    "policy.micro_batch_size=8",
]


def _deterministic(records):
    """Per-step metrics without wall-clock figures."""
    return [{k: v for k, v in r.items()
             if not (k.startswith(("timing/", "perf/")) or k.endswith("_s") and k.startswith("refit/")
                     or k in ("refit/seconds", "generation/tokens_per_s"))}
            for r in records]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A 2-step run without periodic checkpoints: the final one (checkpoint.save_final) is its
    only checkpoint. The first half of the resumed run and the run that eval loads; each test
    works on a copy of its directory."""
    out = tmp_path_factory.mktemp("two_steps") / "run"
    run(load_config("grpo_synthetic", TINY + ["grpo.max_steps=2", "checkpoint.every=0",
                                              f"run.output_dir={out}"]))
    return out


@pytest.mark.slow
def test_resume_equals_straight_run(two_steps, tmp_path):
    straight = tmp_path / "straight"
    run(load_config("grpo_synthetic", TINY + ["grpo.max_steps=4", f"run.output_dir={straight}"]))
    resumed = tmp_path / "resumed"
    shutil.copytree(two_steps, resumed)  # its first 2 steps, saved at the end (save_final)
    assert (resumed / "checkpoints" / "step_2" / "controller.json").is_file()
    run(load_config("grpo_synthetic", TINY + ["grpo.max_steps=4", f"run.output_dir={resumed}",
                                              "checkpoint.resume=latest"]))
    a = _deterministic(read_metrics(straight))
    b = _deterministic(read_metrics(resumed))
    assert [r["step"] for r in a] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-6, abs=1e-9), (ra["step"], k)
    # the steps did learn something, so a wrong restore (weights, optimizer, reference) shows
    assert all(r["train/grad_norm"] > 0 for r in a[1:])
    assert a[-1]["train/kl"] > 0
    # mcore-rl plot of the two runs: five panels, each metric the run logs for them
    png = tmp_path / "curves.png"
    assert main(["plot", str(straight), str(resumed), "--output", str(png), "--format", "png"]) == 0
    with Image.open(png) as image:
        assert image.size == (round(PANEL_INCHES[0] * COLUMNS * DPI),
                              round(PANEL_INCHES[1] * 2 * DPI))
        assert image.text["Runs"] == "straight, resumed"
        drawn = image.text["Metrics"].split(", ")
    phases = sorted({k for r in read_metrics(straight) + read_metrics(resumed) for k in r
                     if k.startswith("timing/") and k.endswith("_s")})
    assert drawn == ["train/reward_mean", "val/accuracy", *phases, "train/logprob_mismatch_max",
                     "train/logprob_mismatch_mean", "train/response_length",
                     "val/response_length"]


@pytest.mark.slow
def test_eval_of_a_checkpoint_equals_the_runs_validation(two_steps, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(two_steps, out)
    # no periodic checkpoints: the final one (checkpoint.save_final) is what eval loads
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2"]
    trained = {r["step"]: r["val/accuracy"] for r in read_metrics(out) if "val/accuracy" in r}
    trained_length = {r["step"]: r["val/response_length"] for r in read_metrics(out)
                      if "val/accuracy" in r}
    args = ["eval", *TINY, f"run.output_dir={out}", "checkpoint.resume=latest"]
    assert main(args) == 0
    result = json.loads((out / "eval.json").read_text())
    assert result["checkpoint"] == str(out / "checkpoints" / "step_2")
    assert (result["step"], result["num_prompts"]) == (2, 5)
    assert result["val/accuracy"] == trained[2]  # greedy, same weights: exactly the same
    assert result["val/response_length"] == trained_length[2]
    assert "held-out accuracy" in capsys.readouterr().out
    # without a checkpoint: the seeded initial weights (no warm start), which answer otherwise
    assert main(["eval", *TINY, f"run.output_dir={tmp_path / 'initial'}"]) == 0
    initial = json.loads((tmp_path / "initial" / "eval.json").read_text())
    assert (initial["checkpoint"], initial["step"]) == (None, 0)
    assert initial["val/response_length"] != result["val/response_length"]
    with pytest.raises(SystemExit) as exit_info:  # no held-out prompts: a clear error
        main(["eval", *TINY, f"run.output_dir={tmp_path / 'empty'}", "data.synthetic.num_test=0"])
    assert exit_info.value.code == 2
    assert "mcore-rl eval needs held-out prompts" in capsys.readouterr().err


@pytest.fixture()
def qwen2_checkpoint(tmp_path):
    """A small random-weight Qwen2 checkpoint with the character tokenizer, written by
    transformers (config.json + safetensors + tokenizer files)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mcore_rl.data.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1100,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    path = tmp_path / "qwen2-tiny"
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.mark.slow
def test_gsm8k_two_steps_from_hf_checkpoint_on_ray(qwen2_checkpoint, tmp_path, capsys):
    train_path = SHARED_GSM8K if SHARED_GSM8K.is_file() else None
    out = tmp_path / "run"
    overrides = [
        f"model.hf_path={qwen2_checkpoint}",
        f"run.output_dir={out}",
        "grpo.max_steps=2",
        "grpo.val_every=2",
        "grpo.val_num_prompts=4",
        "generation.max_new_tokens=8",
        "data.max_prompt_length=1024",
        "data.max_total_length=1032",
        "logging.progress=false",
        "cluster.device=cpu",
        "data.use_chat_template=false",  # the character tokenizer has no chat template
    ]
    if train_path is not None:
        overrides.append(f"data.train_path={train_path}")
    assert main(["train", "--config-name", "grpo_gsm8k", *overrides]) in (0, None)
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert r["train/reward_errors"] == 0
        assert r["train/num_tokens"] > 0
        assert r["train/logprob_mismatch_max"] < 1e-4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2
    # the per-phase breakdown: the step's phases nest in it; validation ran once in 2 steps
    phases = summary["seconds_per_step"]
    assert sum(phases[k] for k in ("generation", "reward", "logprobs", "train", "refit")) <= phases["step"]
    assert phases["validation"] == pytest.approx(
        sum(r.get("timing/validation_s", 0.0) for r in records) / 2)
    assert "per-phase time" in capsys.readouterr().out
    assert os.path.isfile(out / "tokenizer" / "tokenizer.json")

"""``mcore-rl train generation.backend=vllm`` end to end on CPU with real vLLM engines: the
default synthetic config learns, the GSM8K config runs (engine as a Ray actor), and an engine
that fails to start gives one clear error while the run directory keeps what was written."""

from __future__ import annotations

import json

import pytest

from mcore_rl.cli import main
from mcore_rl.utils.logging import read_metrics

VLLM = ["generation.backend=vllm", "logging.progress=false"]


@pytest.mark.slow
def test_default_config_learns(tmp_path):
    out = tmp_path / "run"
    # The default config (configs/grpo_synthetic.yaml), fewer steps and held-out prompts.
    # Measured (val every 5 steps): 0.485, 0.655, 0.705 at step 10, then 0.685-0.690 to step 30.
    assert main(["train", *VLLM, "cluster.use_ray=false", f"run.output_dir={out}",
                 "grpo.max_steps=10", "grpo.val_every=10", "grpo.val_num_prompts=200"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_accuracy_gain"] >= 0.15, summary["val_curve"]
    records = [r for r in read_metrics(out) if "train/loss" in r]
    assert len(records) == 10
    for r in records:
        # the engine's sampled-token logprobs are the trainer's, every step, after every refit
        assert r["train/logprob_mismatch_max"] < 1e-4
        assert 1 <= r["train/token_mult_prob_error"] < 1 + 1e-4
        assert r["generation/tokens_per_s"] > 0 and r["refit/gbytes"] > 0
    assert (out / "vllm_engine_0.log").stat().st_size > 0


@pytest.mark.slow
def test_gsm8k_two_steps_with_the_engine_as_a_ray_actor(tmp_path):
    out = tmp_path / "run"
    # The tiny model.arch with vLLM's smallest CPU head size (32), and room for the character
    # tokenizer's long prompts.
    assert main(["train", "--config-name", "grpo_gsm8k", *VLLM, "cluster.device=cpu",
                 f"run.output_dir={out}", "grpo.max_steps=2", "grpo.val_every=2",
                 "grpo.val_num_prompts=2", "model.arch.num_attention_heads=2",
                 "model.arch.num_query_groups=2", "model.arch.max_position_embeddings=1040",
                 "generation.max_new_tokens=16", "data.max_prompt_length=1024",
                 "data.max_total_length=1040"]) == 0
    records = [r for r in read_metrics(out) if "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["train/logprob_mismatch_max"] < 1e-4 for r in records)


def test_engine_that_fails_to_start(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match=r"generation.backend=vllm: vLLM engine failed to start: .*"
                                           r"memory for the cache blocks.*generation.vllm.kv_cache_gb=1e-06"):
        main(["train", *VLLM, "cluster.use_ray=false", f"run.output_dir={out}",
              "generation.vllm.kv_cache_gb=1e-6", "sft.steps=0"])
    # what the run wrote before the engine started is kept, with the engine's own log
    assert (out / "hf_config.json").is_file() and (out / "tokenizer").is_dir()
    assert "KV cache" in (out / "vllm_engine_0.log").read_text()

"""Config composition (Hydra over the TrainConfig schema), its errors, validation and the CLI."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import mcore_rl
from mcore_rl.cli import main
from mcore_rl.config import ConfigError, TrainConfig, load_config, validate

HEADER = "defaults:\n  - base_train\n  - _self_\n"


def _error(overrides=(), name="grpo_synthetic", config_dir=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(name, list(overrides), config_dir)
    return str(info.value)


def test_default_composes_to_typed_schema_defaults():
    cfg = load_config("grpo_synthetic")
    assert isinstance(cfg, TrainConfig)
    assert cfg.cluster.device == "cpu"  # set by the YAML
    assert cfg.grpo.num_generations == TrainConfig().grpo.num_generations  # schema default
    assert cfg.run.output_dir == "runs/grpo_synthetic"  # ${run.name} resolved


@pytest.mark.parametrize("name", sorted(p.stem for p in (Path(__file__).parents[1] / "configs").glob("*.yaml")))
def test_every_shipped_config_composes_and_validates(name):
    cfg = load_config(name)
    assert cfg.run.name == name


def test_gsm8k_config_points_at_the_packaged_sample_from_any_cwd(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cfg = load_config("grpo_gsm8k", ["model.hf_path=/models/m"])
    pkg = Path(mcore_rl.__file__).resolve().parent
    assert cfg.data.train_path == str(pkg / "data/samples/gsm8k/train.jsonl")
    assert cfg.data.test_path == str(pkg / "data/samples/gsm8k/test.jsonl")
    assert (cfg.data.task, cfg.reward.name, cfg.grpo.num_prompts_per_step) == ("gsm8k", "math", 2)
    assert cfg.data.max_prompt_length + cfg.generation.max_new_tokens == cfg.data.max_total_length


def test_override_grammar():
    cfg = load_config("grpo_synthetic", [
        "grpo.num_generations=4", "run.name=abc",  # key=value; the interpolation follows
        "+model.hf_path=/models/m",                # + on a null key sets it
        "++loss.kl_coef=0.1",
        "grpo={max_steps: 7}",                     # a dict merged into a section
    ])
    assert (cfg.grpo.num_generations, cfg.grpo.max_steps, cfg.run.output_dir) == (4, 7, "runs/abc")
    assert (cfg.model.hf_path, cfg.loss.kl_coef) == ("/models/m", 0.1)
    assert cfg.grpo.num_prompts_per_step == TrainConfig().grpo.num_prompts_per_step  # merged


def test_tilde_unsets_an_optional_key_and_refuses_a_required_one(tmp_path):
    (tmp_path / "run.yaml").write_text(HEADER + "checkpoint:\n  resume: latest\n")
    assert load_config("run", [], tmp_path).checkpoint.resume == "latest"
    assert load_config("run", ["~checkpoint.resume"], tmp_path).checkpoint.resume is None
    msg = _error(["~grpo.num_generations"])
    assert "cannot remove config key 'grpo.num_generations'" in msg and "required int" in msg


def test_plus_on_a_new_key_is_unknown():
    # The schema has no free-form (dict-typed) section, so '+' cannot add a key anywhere.
    assert "unknown config key 'grpo.foo' (from override '+grpo.foo=1')" in _error(["+grpo.foo=1"])


@pytest.mark.parametrize("override, expected", [
    ("grpo.num_generation=4", "unknown config key 'grpo.num_generation' (from override "
     "'grpo.num_generation=4'); did you mean 'grpo.num_generations'?"),
    ("num_generations=4", "did you mean 'grpo.num_generations'"),  # misplaced: found in the tree
    ("loss.kl_coeff=0.1", "did you mean 'loss.kl_coef'?"),
    ("model={arch: {hiden_size: 8}}", "'model.arch.hiden_size'"),  # inside a dict value
])
def test_unknown_override_key_names_the_closest_key(override, expected):
    assert expected in _error([override])


def test_unknown_key_in_yaml_names_file_and_line(tmp_path):
    (tmp_path / "typo.yaml").write_text(HEADER + "grpo:\n  num_generations: 4\n  max_step: 3\n")
    msg = _error(name="typo", config_dir=tmp_path)
    assert f"unknown config key 'grpo.max_step' (in {tmp_path / 'typo.yaml'}, line 6)" in msg
    assert "did you mean 'grpo.max_steps'?" in msg


@pytest.mark.parametrize("override, expected", [
    ("grpo.num_generations=abc", "config key 'grpo.num_generations' (from override "
     "'grpo.num_generations=abc'): expected int, got 'abc'"),
    ("generation.temperature=hot", "'generation.temperature'"),
    ("model.arch.qkv_bias=maybe", "expected bool, got 'maybe'"),
    ("data.max_total_length=null", "expected int, got None"),
    ("policy.megatron.virtual_pipeline_model_parallel_size=x", "expected int or null, got 'x'"),
])
def test_wrong_type_names_key_and_type(override, expected):
    msg = _error([override])
    assert "wrong type" in msg and expected in msg


def test_wrong_type_in_yaml_names_file(tmp_path):
    (tmp_path / "bad.yaml").write_text(HEADER + "model:\n  arch:\n    hidden_size: big\n")
    msg = _error(name="bad", config_dir=tmp_path)
    assert (f"wrong type for config key 'model.arch.hidden_size' (in {tmp_path / 'bad.yaml'}, "
            "line 6): expected int, got 'big'") in msg


def test_config_dir_from_env_and_missing_config(tmp_path, monkeypatch):
    (tmp_path / "mine.yaml").write_text(HEADER + "grpo:\n  max_steps: 3\n")
    monkeypatch.setenv("MCORE_RL_CONFIG_DIR", str(tmp_path))
    assert load_config("mine").grpo.max_steps == 3
    assert "config 'grpo_synthetic' not found" in _error()
    assert "does not exist" in _error(config_dir=tmp_path / "nope")
    (tmp_path / "plain.yaml").write_text("grpo:\n  max_steps: 3\n")
    assert "must start with 'defaults: [base_train, _self_]'" in _error(name="plain")


PAR = "policy.megatron."


@pytest.mark.parametrize("overrides, expected", [
    (["cluster.num_workers=3", PAR + "tensor_model_parallel_size=2"],
     "cluster.num_workers (3) must be divisible by policy.megatron.tensor_model_parallel_size x "
     "pipeline_model_parallel_size (2 x 1)"),
    (["model.arch.num_query_groups=3"],
     "model.arch.num_attention_heads (4) must be divisible by model.arch.num_query_groups (3)"),
    (["model.arch.hidden_size=66"],
     "model.arch.hidden_size (66) must be divisible by model.arch.num_attention_heads (4)"),
    (["cluster.num_workers=8", PAR + "tensor_model_parallel_size=8"],
     "model.arch.num_attention_heads (4) must be divisible by "
     "policy.megatron.tensor_model_parallel_size (8)"),
    (["cluster.num_workers=4", PAR + "tensor_model_parallel_size=4"],
     "model.arch.num_query_groups (2) must be divisible by "
     "policy.megatron.tensor_model_parallel_size (4)"),
    ([PAR + "virtual_pipeline_model_parallel_size=2"],
     "virtual_pipeline_model_parallel_size (2) needs policy.megatron.pipeline_model_parallel_size > 1"),
    (["model.arch.num_layers=2", "cluster.num_workers=2", PAR + "pipeline_model_parallel_size=2",
      PAR + "virtual_pipeline_model_parallel_size=2"],
     "model.arch.num_layers (2) must be divisible by policy.megatron.pipeline_model_parallel_size"
     " x virtual_pipeline_model_parallel_size (2 x 2)"),
    (["model.arch.num_layers=2", "cluster.num_workers=4", PAR + "pipeline_model_parallel_size=4"],
     "model.arch.num_layers (2) must be divisible by policy.megatron.pipeline_model_parallel_size"
     " x virtual_pipeline_model_parallel_size (4 x 1)"),
    ([PAR + "virtual_pipeline_model_parallel_size=0"],
     "virtual_pipeline_model_parallel_size must be null or >= 1"),
    ([PAR + "sequence_parallel=true"],
     "sequence_parallel needs policy.megatron.tensor_model_parallel_size > 1"),
    ([PAR + "ddp.use_distributed_optimizer=true"],
     "policy.megatron.ddp.use_distributed_optimizer needs a GPU: cluster.device is 'cpu'"),
    ([PAR + "ddp.use_distributed_optimizer=true", PAR + "ddp.overlap_param_gather=true"],
     "policy.megatron.ddp.overlap_param_gather needs a GPU: cluster.device is 'cpu'"),
    (["cluster.device=cuda", PAR + "ddp.overlap_param_gather=true"],
     "overlap_param_gather needs policy.megatron.ddp.use_distributed_optimizer"),
    (["cluster.device=tpu"], "cluster.device must be one of cpu, cuda, auto (got 'tpu')"),
    ([PAR + "precision=fp16"], "policy.megatron.precision must be one of fp32, bf16"),
    ([PAR + "layer_spec=te"], "policy.megatron.layer_spec must be one of local"),
    (["generation.backend=vllm"], "generation.backend must be one of hf"),
    (["generation.temperature=0"], "generation.temperature must be > 0"),
    (["generation.top_p=0"], "generation.top_p must be in (0, 1]"),
    (["generation.top_p=1.5"], "generation.top_p must be in (0, 1]"),
    (["generation.max_new_tokens=0"], "generation.max_new_tokens must be >= 1"),
    (["data.max_prompt_length=60"], "data.max_prompt_length + generation.max_new_tokens (60 + 5)"
     " must be <= data.max_total_length (13)"),
    (["data.task=math"], "data.task must be one of synthetic, gsm8k"),
    (["data.task=gsm8k"], "data.task 'gsm8k' needs data.train_path"),
    (["data.test_path=/no/such.jsonl"], "data.test_path: no such file /no/such.jsonl"),
    (["reward.name=f1"], "reward.name must be one of exact, math"),
    (["loss.kl_estimator=k4"], "loss.kl_estimator must be one of k1, k2, k3"),
    (["loss.normalization=batch"], "loss.normalization must be one of token, sequence"),
    (["loss.ratio_clip_low=-0.1"], "loss.ratio_clip_low must be >= 0"),
    (["loss.ratio_clip_high=-0.1"], "loss.ratio_clip_high must be >= 0"),
    (["loss.dual_clip=1.0"], "loss.dual_clip must be null or > 1"),
    (["loss.importance_ratio_cap=0.5"], "loss.importance_ratio_cap must be null or >= 1"),
    (["grpo.num_generations=1"], "grpo.num_generations must be >= 2"),
    (["grpo.num_prompts_per_step=0"], "grpo.num_prompts_per_step must be >= 1"),
    (["grpo.optimizer_steps_per_rollout=3"], "grpo.num_prompts_per_step x grpo.num_generations "
     "(32 x 8 = 256) must be divisible by grpo.optimizer_steps_per_rollout (3)"),
    (["policy.micro_batch_size=0"], "policy.micro_batch_size must be >= 1"),
    (["policy.logprob_micro_batch_size=0"], "policy.logprob_micro_batch_size must be >= 1"),
    (["model.arch.family=gpt"], "model.arch.family must be one of llama, mistral, qwen2, qwen3"),
    (["policy.optimizer.lr_decay_style=step"], "lr_decay_style must be one of constant, linear"),
    (["policy.optimizer.name=adamw"], "policy.optimizer.name must be one of adam, sgd"),
    (["checkpoint.every=-1"], "checkpoint.every must be >= 0"),
])
def test_impossible_combination(overrides, expected):
    assert expected in _error(overrides)


def test_gpu_only_features_on_auto_without_cuda(monkeypatch):
    import torch

    ov = ["cluster.device=auto", PAR + "ddp.use_distributed_optimizer=true"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "cluster.device is 'auto' and torch sees no GPU" in _error(ov)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert load_config("grpo_synthetic", ov).policy.megatron.ddp.use_distributed_optimizer


def test_valid_parallel_layout_passes():
    cfg = load_config("grpo_synthetic", [
        "cluster.num_workers=8", "cluster.device=cuda", PAR + "tensor_model_parallel_size=2",
        PAR + "pipeline_model_parallel_size=2", PAR + "virtual_pipeline_model_parallel_size=1",
        PAR + "sequence_parallel=true", PAR + "ddp.use_distributed_optimizer=true",
        PAR + "ddp.overlap_param_gather=true", "loss.dual_clip=3", "loss.importance_ratio_cap=2",
        "grpo.optimizer_steps_per_rollout=4"])
    validate(cfg)  # no error


def test_all_violations_reported_together():
    msg = _error(["generation.temperature=0", "loss.kl_estimator=k9", "grpo.num_generations=1"])
    lines = msg.splitlines()
    assert lines[0] == "invalid config:" and len(lines) == 4
    for key in ("generation.temperature", "loss.kl_estimator", "grpo.num_generations"):
        assert sum(key in line for line in lines) == 1
    # Key errors of several overrides come together too.
    msg = _error(["grpo.num_generation=4", "grpo.max_steps=abc"])
    assert "grpo.num_generation'" in msg and "'grpo.max_steps'" in msg


def test_cli_config_error_exits_2_without_traceback(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "grpo.num_generation=4"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "did you mean 'grpo.num_generations'?" in err and "Traceback" not in err


def test_cli_cfg_prints_the_composed_yaml(capsys):
    assert main(["train", "--cfg", "grpo.max_steps=3", "--config-name", "grpo_synthetic"]) == 0
    printed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig),
                                                  OmegaConf.create(capsys.readouterr().out)))
    assert printed == load_config("grpo_synthetic", ["grpo.max_steps=3"])


def test_cli_config_path_and_train_dispatch(tmp_path, monkeypatch):
    (tmp_path / "mine.yaml").write_text(HEADER + "grpo:\n  max_steps: 5\n")
    calls = []
    fake = types.ModuleType("mcore_rl.controller.grpo")
    fake.run = lambda cfg: calls.append(cfg) or {"steps": 0}
    monkeypatch.setitem(sys.modules, "mcore_rl.controller.grpo", fake)  # no training starts
    assert main(["train", "--config-path", str(tmp_path), "--config-name", "mine",
                 "run.seed=7"]) == 0
    assert [(c.grpo.max_steps, c.run.seed) for c in calls] == [(5, 7)]


def test_cli_unknown_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["sft"])
    assert info.value.code == 2 and "invalid choice: 'sft'" in capsys.readouterr().err

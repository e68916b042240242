"""Config composition (Hydra over the TrainConfig schema), its errors, validation and the CLI."""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import typing
from pathlib import Path

import pytest
import yaml
import torch
from omegaconf import OmegaConf

import mcore_rl
from mcore_rl.cli import main
from mcore_rl.config import ConfigError, TrainConfig, checks, load_config, schema, validate

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
def test_every_shipped_config_composes_and_validates(name, tmp_path):
    overrides = []
    if "smollm2" in name:  # model.hf_path is what `make model` writes: a stand-in directory here
        for file in ("config.json", "model.safetensors", "tokenizer.json"):
            (tmp_path / file).touch()
        overrides = [f"model.hf_path={tmp_path}"]
    cfg = load_config(name, overrides)
    assert cfg.run.name == name


def test_smollm2_configs_point_at_what_make_model_writes():
    from mcore_rl.gguf import SMOLLM2_OUTPUT

    configs = Path(__file__).parents[1] / "configs"
    arith = yaml.safe_load((configs / "grpo_smollm2_arith.yaml").read_text())
    assert arith["model"]["hf_path"] == SMOLLM2_OUTPUT
    for name in ("grpo_smollm2_gsm8k", "ppo_smollm2_arith", "grpo_smollm2_arith_tools"):  # from arith
        text = yaml.safe_load((configs / f"{name}.yaml").read_text())
        assert text["defaults"][0] == "grpo_smollm2_arith" and "hf_path" not in text.get("model", {})


def test_gsm8k_config_points_at_the_packaged_sample_from_any_cwd(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cfg = load_config("grpo_gsm8k")
    pkg = Path(mcore_rl.__file__).resolve().parent
    assert cfg.data.train_path == str(pkg / "data/samples/gsm8k/train.jsonl")
    assert cfg.data.test_path == str(pkg / "data/samples/gsm8k/test.jsonl")
    assert (cfg.data.task, cfg.reward.name, cfg.grpo.num_prompts_per_step) == ("gsm8k", "math", 2)
    assert cfg.data.max_prompt_length + cfg.generation.max_new_tokens == cfg.data.max_total_length


def test_override_grammar(tmp_path):
    for name in ("config.json", "model.safetensors", "tokenizer.json"):  # an HF directory
        (tmp_path / name).touch()
    cfg = load_config("grpo_synthetic", [
        "grpo.num_generations=4", "run.name=abc",  # key=value; the interpolation follows
        f"+model.hf_path={tmp_path}",              # + on a null key sets it
        "++loss.kl_coef=0.1",
        "grpo={max_steps: 7}",                     # a dict merged into a section
    ])
    assert (cfg.grpo.num_generations, cfg.grpo.max_steps, cfg.run.output_dir) == (4, 7, "runs/abc")
    assert (cfg.model.hf_path, cfg.loss.kl_coef) == (str(tmp_path), 0.1)
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
    ([PAR + "recompute_granularity=full", PAR + "recompute_num_layers=5"],
     "policy.megatron.recompute_num_layers (5) must be at most the layers of one pipeline stage (4"),
    (["env.name=tool_use", "generation.ignore_eos=true"],
     "generation.ignore_eos=true cannot run env.name=tool_use (a multi-turn environment)"),
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
    (["data.max_prompt_length=60"], "data.max_prompt_length + generation.max_new_tokens (60 + 5)"
     " must be <= data.max_total_length (13)"),
    (["data.task=math"], "data.task must be one of synthetic, gsm8k"),
    (["data.task=gsm8k"], "data.task=gsm8k needs data.train_path"),
    (["data.task=gsm8k", "data.train_path=/no/such.jsonl"],
     "data.train_path: /no/such.jsonl: no such file"),
    (["data.train_path=/x.jsonl"], "data.train_path and data.test_path must be null for "
     "data.task=synthetic"),
    (["data.synthetic.operations=+/"], "data.synthetic.operations='+/'"),
    (["data.synthetic.num_train=9600"], "data.synthetic.num_train + data.synthetic.num_test = "
     "9600 + 500 = 10100 exceeds the 10000 distinct prompts"),
    (["reward.name=f1"], "reward.name must be one of exact, math, model, judge, or a "
     "\"module:attribute\" import path (got 'f1')"),
    (["reward.num_workers=-1"], "reward.num_workers must be null or in [0, 256] (got -1)"),
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


def test_fp32_value_head_in_a_bf16_critic_needs_the_distributed_optimizer():
    """megatron-core's Float16 optimizer cannot checkpoint an fp32 parameter in a bf16 model
    (seen on an H100): refused at load time unless the distributed optimizer holds it; the
    default, a bf16 head, loads."""
    ppo = ["algorithm=ppo", "cluster.device=cuda", "value.megatron.precision=bf16"]
    message = ("value.head_fp32=true with value.megatron.precision=bf16 needs "
               "value.megatron.ddp.use_distributed_optimizer=true")
    assert message in _error(ppo + ["value.head_fp32=true"], name="ppo_synthetic")
    for ok in ([], ["value.head_fp32=true", "value.megatron.ddp.use_distributed_optimizer=true"],
               ["value.head_fp32=true", "value.megatron.precision=fp32"]):
        load_config("ppo_synthetic", ppo + ok)
    load_config("grpo_synthetic", ["cluster.device=cuda", "value.head_fp32=true",
                                   "value.megatron.precision=bf16"])  # no critic: no check


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
    fake = types.ModuleType("mcore_rl.controller.loops")
    fake.run = lambda cfg: calls.append(cfg) or {"steps": 0}
    monkeypatch.setitem(sys.modules, "mcore_rl.controller.loops", fake)  # no training starts
    assert main(["train", "--config-path", str(tmp_path), "--config-name", "mine",
                 "run.seed=7"]) == 0
    assert [(c.grpo.max_steps, c.run.seed) for c in calls] == [(5, 7)]


def test_cli_unknown_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["sft"])
    assert info.value.code == 2 and "invalid choice: 'sft'" in capsys.readouterr().err


# ---------------------------------------------------------------------------- declared bounds

# The sections whose every numeric key declares a range (their nested sections included).
CHECKED_SECTIONS = ("loss", "generation", "ppo", "grpo", "model.arch", "policy.megatron",
                    "reward", "env")


def _section(cfg, dotted):
    """The config section at the dotted key ``dotted`` of ``cfg`` (``"model.arch"``)."""
    return functools.reduce(getattr, dotted.split("."), cfg)


def _parent(cfg, key):
    """The section of ``cfg`` (a ``TrainConfig``) that holds the dotted ``key``'s field."""
    return _section(cfg, key.rsplit(".", 1)[0])


def _declared(sections=CHECKED_SECTIONS):
    """(dotted key, its dataclass, field) of every field of ``sections`` (their nested sections
    included: ``generation.vllm``) that declares choices or a range, read from the schema."""
    out = []

    def walk(section, key):
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{key}.{f.name}")
            elif checks.CHOICES in f.metadata or checks.RANGE in f.metadata:
                out.append((f"{key}.{f.name}", type(section), f))

    for section in sections:
        walk(_section(TrainConfig(), section), section)
    return out


def _bad_values(cls, f):
    """Values just outside what field ``f`` of ``cls`` declares: a non-choice, or each side of
    its range (the open end itself, or one step past the closed end), typed as the field."""
    if checks.CHOICES in f.metadata:
        choices = f.metadata[checks.CHOICES]
        if typing.get_type_hints(cls)[f.name] == typing.Optional[typing.List[str]]:
            return [["bogus"]]  # reward.names: a list, each of its values checked
        return [max(choices) + 1] if all(isinstance(c, int) for c in choices) else ["bogus"]
    r = f.metadata[checks.RANGE]
    kind = int if typing.get_type_hints(cls)[f.name] in (int, typing.Optional[int]) else float
    step = 1 if kind is int else 0.5
    out = []
    if r.low is not None:
        out.append(kind(r.low if r.low_open else r.low - step))
    if r.high is not None:
        out.append(kind(r.high if r.high_open else r.high + step))
    return out


BAD_VALUES = [(key, cls, f.name, bad) for key, cls, f in _declared() for bad in _bad_values(cls, f)]


def test_every_numeric_key_of_the_checked_sections_declares_its_range():
    declared = {key for key, _, _ in _declared()}
    numeric = {int, float, typing.Optional[int], typing.Optional[float]}
    sections = [(name, _section(TrainConfig(), name)) for name in CHECKED_SECTIONS]
    for key, section in sections:
        hints = typing.get_type_hints(type(section))
        for f in dataclasses.fields(section):
            if dataclasses.is_dataclass(getattr(section, f.name)):
                sections.append((f"{key}.{f.name}", getattr(section, f.name)))
            elif hints[f.name] in numeric:
                assert f"{key}.{f.name}" in declared, f"{key}.{f.name} declares no range"
    assert len(BAD_VALUES) >= 30


@pytest.fixture(scope="module")
def load_errors():
    """The load errors of grpo_synthetic with every bad value of BAD_VALUES as overrides, in
    two loads (the first bad value of each key, then the second): composing once per key
    would take a minute on a loaded machine."""
    firsts, seconds = {}, {}
    for key, _, _, bad in BAD_VALUES:
        (seconds if key in firsts else firsts)[key] = bad
    return [_error([f"{k}={v}" for k, v in group.items()]).splitlines()
            for group in (firsts, seconds)]


@pytest.mark.parametrize("key, cls, name, bad", BAD_VALUES,
                         ids=[f"{key}={bad}" for key, _, _, bad in BAD_VALUES])
def test_bad_value_of_every_bounded_key_fails_at_load_time_naming_it(load_errors, key, cls, name,
                                                                     bad):
    message = f"{key} must be {checks.describe(cls, name)} (got {bad!r})"
    assert any(f"  {message}" in lines for lines in load_errors)
    # Alone, the same message is the whole error, on one line.
    cfg = TrainConfig()
    setattr(_parent(cfg, key), name, bad)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert str(info.value) == f"invalid config: {message}"


def test_closed_ends_of_every_range_load():
    ends = {"low": {}, "high": {}}
    for key, _, f in _declared():
        r = f.metadata.get(checks.RANGE)
        for side, end, is_open in (("low", r and r.low, r and r.low_open),
                                   ("high", r and r.high, r and r.high_open)):
            if r is not None and end is not None and not is_open:
                ends[side][key] = end
    assert len(ends["low"]) >= 20
    # Ends that load only with other values: virtual pipeline stages need PP > 1 (whose own end
    # is 1), one expert and a shared expert an MoE family.
    vpp = "policy.megatron.virtual_pipeline_model_parallel_size"
    groups = [
        ({vpp: ends["low"].pop(vpp)},
         ["cluster.num_workers=2", "policy.megatron.pipeline_model_parallel_size=2"]),
        (ends["low"], ["model.arch.family=qwen2_moe"]),
        (ends["high"], []),
    ]
    for group, others in groups:
        cfg = load_config("grpo_synthetic", [f"{k}={v}" for k, v in group.items()] + others)
        for key, end in group.items():
            assert getattr(_parent(cfg, key), key.split(".")[-1]) == end, key


def _component_error(key, bad):
    """What the component that takes ``key``'s value raises for ``bad``."""
    from mcore_rl.algorithms.advantages import gae, grpo_advantages
    from mcore_rl.algorithms.losses import ClippedPGLoss
    from mcore_rl.algorithms.ppo import token_level_rewards
    from mcore_rl.generation.base import check_lengths
    from mcore_rl.generation.sampling import Sampler

    root = TrainConfig()
    setattr(_parent(root, key), key.split(".")[-1], bad)
    section = key.split(".")[0]
    cfg = getattr(root, section)
    z = torch.zeros(2, 3)
    build = {
        "loss": lambda: ClippedPGLoss(cfg),
        "generation": lambda: (Sampler(cfg), check_lengths(cfg, 64)),
        "grpo": lambda: grpo_advantages(torch.zeros(4), cfg.num_generations),
        "ppo": lambda: (gae(z, z, z, cfg.gamma, cfg.lam),
                        token_level_rewards(torch.zeros(2), z, z, cfg.reward_kl_coef)),
    }[section]
    with pytest.raises(ConfigError) as info:
        build()
    return str(info.value)


COMPONENT_KEYS = [row for row in BAD_VALUES if row[0].split(".")[0] in ("loss", "generation")
                  or row[0] in ("grpo.num_generations", "ppo.gamma", "ppo.lam",
                                "ppo.reward_kl_coef")]


@pytest.mark.parametrize("key, cls, name, bad", COMPONENT_KEYS,
                         ids=[f"{key}={bad}" for key, _, _, bad in COMPONENT_KEYS])
def test_components_refuse_a_bad_value_with_the_load_time_message(key, cls, name, bad):
    assert _component_error(key, bad) == f"{key} must be {checks.describe(cls, name)} (got {bad!r})"


def test_importance_ratio_cap_is_at_least_one_for_loader_and_loss():
    assert "loss.importance_ratio_cap must be null or >= 1 (got 0.5)" in _error(
        ["loss.importance_ratio_cap=0.5"])
    assert _component_error("loss.importance_ratio_cap", 0.5) == (
        "loss.importance_ratio_cap must be null or >= 1 (got 0.5)")
    cfg = load_config("grpo_synthetic", ["loss.importance_ratio_cap=1"])
    assert cfg.loss.importance_ratio_cap == 1


def test_choice_lists_are_the_components_lists():
    from mcore_rl.algorithms.kl import KL_ESTIMATORS
    from mcore_rl.config.families import FAMILIES
    from mcore_rl.generation.registry import BACKENDS
    from mcore_rl.config.registry import LEARNED_REWARDS, VERIFIERS

    choices = {key: f.metadata[checks.CHOICES] for key, _, f in _declared(
        ("loss", "generation", "reward", "ppo")) if checks.CHOICES in f.metadata}
    assert choices["loss.kl_estimator"] == choices["ppo.reward_kl_estimator"] == KL_ESTIMATORS
    assert choices["generation.backend"] == tuple(BACKENDS)
    assert choices["reward.name"] == tuple(VERIFIERS) + tuple(LEARNED_REWARDS)
    assert choices["reward.verifier"] == tuple(VERIFIERS)
    assert schema.MODEL_FAMILIES == tuple(FAMILIES)


def test_range_text():
    assert [str(checks.Range(**kw)) for kw in (
        dict(low=1), dict(low=0, low_open=True), dict(high=1), dict(low=0, high=1, high_open=True),
        dict(low=0, high=1, low_open=True))] == [">= 1", "> 0", "<= 1", "in [0, 1)", "in (0, 1]"]
    with pytest.raises(TypeError):
        checks.bounded(0, ge=0, gt=0)


def test_gsm8k_config_fits_its_samples_with_the_character_tokenizer():
    """The shipped config runs as shipped (hf_path null: one token per character): every sample
    prompt fits data.max_prompt_length, else loading the task names the file and line."""
    from mcore_rl.data.prompts import load_task
    from mcore_rl.data.tokenizer import load_tokenizer

    cfg = load_config("grpo_gsm8k")
    assert cfg.model.hf_path is None
    train, test = load_task(cfg.data, load_tokenizer(cfg.model), cfg.run.seed)
    assert max(len(p) for p in train.input_ids + test.input_ids) <= cfg.data.max_prompt_length

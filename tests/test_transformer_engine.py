"""Transformer Engine's features on the CPU machine (issue 34): the config keys (``layer_spec=
transformer_engine``, ``fp8``, ``fp8_recipe``, ``context_parallel_size``, ``cp_comm_type``)
refused at load with one line each where no run can use them, the run-time checks of what only
the GPU's process knows (TE imports, the GPU runs the FP8 recipe), and the plumbing that can run
without TE (Megatron's CP groups, ``TransformerConfig``'s fields, micro-batch widths).

TE is not installed here: a test that needs it "installed" replaces the loader's probe
(:func:`mcore_rl.config.rules.transformer_engine_missing`) or TE's import check."""

from __future__ import annotations

import importlib

import pytest

from mcore_rl.cli import main
from mcore_rl.config import ConfigError, TrainConfig, rules, validate
from mcore_rl.config.families import microbatch_width_multiple, transformer_engine_shape_errors
from mcore_rl.config.schema import (FP8_BLOCK_SCALES_ENV as SCALES, FP8_RECIPES, MegatronConfig,
                                    ModelArchConfig)
from mcore_rl.megatron import te

TE_INSTALLED = importlib.util.find_spec("transformer_engine") is not None
CPU = ["--config-name", "grpo_synthetic", "cluster.use_ray=false", "cluster.device=cpu"]


def _one_line_exit_2(argv, capsys) -> str:
    """``mcore-rl`` with ``argv``: exit status 2, one line on stderr, no traceback; the line."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    assert info.value.code == 2, err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in out + err
    return err


@pytest.mark.skipif(TE_INSTALLED, reason="Transformer Engine is installed here")
@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_te_layer_spec_without_te_is_one_line_at_load(tmp_path, capsys, device):
    """The issue's report: a traceback from the worker and exit status 1; now the loader says it
    in one line before any worker (and before the run directory) exists."""
    run = tmp_path / "run"
    err = _one_line_exit_2(["train", *CPU, f"cluster.device={device}", f"run.output_dir={run}",
                            "policy.megatron.layer_spec=transformer_engine"], capsys)
    assert err == ("mcore-rl train: error: invalid config: policy.megatron.layer_spec="
                   "transformer_engine needs Transformer Engine, which is not installed here (no "
                   "module named 'transformer_engine'): pip install --no-build-isolation "
                   "'transformer-engine[pytorch]'; or use policy.megatron.layer_spec=torch\n")
    assert not run.exists()


def test_probe_finds_the_package_and_its_pytorch_extension(tmp_path, monkeypatch):
    """Torch-free: the package alone is not enough; the extension where TE's loader looks (its
    wheel_lib, as the PyPI wheels and scripts/gpu/te_build.sh's install put it) is."""
    package = tmp_path / "transformer_engine"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('the probe must not import TE')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert "without its PyTorch extension transformer_engine_torch" in rules.transformer_engine_missing()
    (package / "wheel_lib").mkdir()
    (package / "wheel_lib" / "transformer_engine_torch.cpython-312-x86_64-linux-gnu.so").write_bytes(b"")
    assert rules.transformer_engine_missing() is None


def _cfg(device="cuda", workers=1, **megatron) -> TrainConfig:
    cfg = TrainConfig()
    cfg.cluster.device, cfg.cluster.num_workers = device, workers
    for key, value in megatron.items():
        setattr(cfg.policy.megatron, key, value)
    return cfg


def _errors(cfg: TrainConfig) -> str:
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    return str(info.value)


@pytest.fixture
def te_installed(monkeypatch):
    """The loader's probe says TE is installed."""
    monkeypatch.setattr(rules, "transformer_engine_missing", lambda: None)


def test_te_features_that_pass_the_loader(te_installed):
    validate(_cfg(layer_spec="transformer_engine"))
    validate(_cfg(layer_spec="transformer_engine", fp8="hybrid", precision="bf16",
                  fp8_recipe="tensorwise", compile_layers=True))
    validate(_cfg(workers=4, layer_spec="transformer_engine", context_parallel_size=2,
                  tensor_model_parallel_size=2))
    validate(_cfg())  # no TE feature: the probe is not asked
    for recipe in FP8_RECIPES:  # which GPU runs which recipe is the run's check
        validate(_cfg(layer_spec="transformer_engine", fp8="e4m3", precision="bf16",
                      fp8_recipe=recipe))
    for recipe in ("blockwise", "tensorwise"):  # the 2-layer model: one bf16 layer at each end
        validate(_cfg(layer_spec="transformer_engine", fp8="e4m3", precision="bf16",
                      fp8_recipe=recipe, fp8_bf16_layers_at_start=1, fp8_bf16_layers_at_end=1))
    validate(_cfg(workers=2, layer_spec="transformer_engine", fp8="e4m3", precision="bf16",
                  pipeline_model_parallel_size=2, fp8_bf16_layers_at_start=1,
                  fp8_bf16_layers_at_end=1))


@pytest.mark.parametrize("megatron, expected", [
    (dict(fp8="e4m3", precision="bf16"),
     "policy.megatron.fp8=e4m3 needs policy.megatron.layer_spec=transformer_engine (got local)"),
    (dict(context_parallel_size=2),
     "policy.megatron.context_parallel_size=2 needs policy.megatron.layer_spec torch or "
     "transformer_engine (got local"),
    (dict(layer_spec="torch", context_parallel_size=2),
     "policy.megatron.context_parallel_size=2 with policy.megatron.layer_spec=torch needs "
     "policy.megatron.cp_comm_type=all_gather (got p2p)"),
    (dict(layer_spec="transformer_engine", fp8="e4m3"),
     "policy.megatron.fp8=e4m3 needs policy.megatron.precision=bf16 (got fp32)"),
    (dict(layer_spec="transformer_engine", fp8="e4m3", precision="bf16", fp8_recipe="delayed",
          compile_layers=True),
     "policy.megatron.fp8_recipe=delayed cannot run with policy.megatron.compile_layers=true"),
    (dict(layer_spec="transformer_engine", context_parallel_size=2, tensor_model_parallel_size=2),
     "cluster.num_workers (2) must be divisible by policy.megatron.tensor_model_parallel_size x "
     "context_parallel_size x pipeline_model_parallel_size (2 x 2 x 1)"),
    (dict(layer_spec="transformer_engine", fp8_bf16_layers_at_start=1),
     "policy.megatron.fp8_bf16_layers_at_start=1 needs policy.megatron.fp8 (got null)"),
    (dict(fp8_bf16_layers_at_start=1, fp8_bf16_layers_at_end=2),  # local spec, no TE asked
     "policy.megatron.fp8_bf16_layers_at_start=1 and policy.megatron.fp8_bf16_layers_at_end=2 "
     "need policy.megatron.fp8 (got null)"),
    (dict(layer_spec="transformer_engine", fp8="e4m3", precision="bf16", fp8_recipe="delayed",
          fp8_bf16_layers_at_end=1),
     "policy.megatron.fp8_bf16_layers_at_end=1 cannot run with policy.megatron.fp8_recipe="
     "delayed"),
    # the default model.arch has 2 layers: one a stage at PP=2
    (dict(layer_spec="transformer_engine", fp8="e4m3", precision="bf16",
          fp8_bf16_layers_at_start=3),
     "policy.megatron.fp8_bf16_layers_at_start (3) must be at most the layers of one pipeline "
     "stage, model.arch.num_layers / policy.megatron.pipeline_model_parallel_size (2 / 1 = 2)"),
    (dict(layer_spec="transformer_engine", fp8="e4m3", precision="bf16",
          pipeline_model_parallel_size=2, fp8_bf16_layers_at_end=2),
     "policy.megatron.fp8_bf16_layers_at_end (2) must be at most the layers of one pipeline "
     "stage, model.arch.num_layers / policy.megatron.pipeline_model_parallel_size (2 / 2 = 1)"),
    # the default model.arch has 4 heads and 2 query groups
    (dict(layer_spec="transformer_engine", context_parallel_size=4, cp_comm_type="a2a"),
     "model.arch.num_query_groups (2) must be divisible by policy.megatron.tensor_model_parallel_size "
     "x context_parallel_size (1 x 4) with policy.megatron.cp_comm_type=a2a"),
])
def test_te_feature_refused_at_load(te_installed, megatron, expected):
    workers = (megatron.get("context_parallel_size", 1) * megatron.get("tensor_model_parallel_size", 1)
               * megatron.get("pipeline_model_parallel_size", 1))
    if "num_workers (2)" in expected:
        workers = 2
    assert expected in _errors(_cfg(workers=workers, **megatron))


def test_te_environment_sets_the_block_scales_of_fp8_blockwise_only():
    """fp8_block_scales becomes TE's NVTE_FP8_BLOCK_SCALING_FP32_SCALES ("1": fp32 scales, the
    default; "0": TE's powers of 2) for FP8 blockwise; nothing with FP8 off or another recipe."""
    fp8 = dict(layer_spec="transformer_engine", precision="bf16", fp8="hybrid")
    assert MegatronConfig().fp8_block_scales == "fp32"
    assert te.te_environment(MegatronConfig(**fp8)) == {SCALES: "1"}
    assert te.te_environment(MegatronConfig(**fp8, fp8_block_scales="power_of_2")) == {SCALES: "0"}
    assert te.te_environment(MegatronConfig(**fp8, fp8_recipe="blockwise",
                                            fp8_block_scales="fp32")) == {SCALES: "1"}
    assert te.te_environment(MegatronConfig()) == {}
    assert te.te_environment(MegatronConfig(layer_spec="transformer_engine",
                                            fp8_block_scales="power_of_2")) == {}
    for recipe in set(FP8_RECIPES) - {"blockwise"}:
        assert te.te_environment(MegatronConfig(**fp8, fp8_recipe=recipe)) == {}


def _ppo_fp8(policy_scales: str, value_scales: str, value_recipe: str = "blockwise"):
    cfg = _cfg(layer_spec="transformer_engine", fp8="hybrid", precision="bf16",
               fp8_block_scales=policy_scales)
    cfg.algorithm = "ppo"
    for key, value in dict(layer_spec="transformer_engine", fp8="hybrid", precision="bf16",
                           fp8_recipe=value_recipe, fp8_block_scales=value_scales).items():
        setattr(cfg.value.megatron, key, value)
    return cfg


def test_fp8_block_scales_of_two_sections_must_agree(te_installed, monkeypatch):
    """The policy and the critic with FP8 blockwise and different block scales: one line naming
    both keys; the same scales pass, and a section of another recipe is no constraint."""
    monkeypatch.delenv(SCALES, raising=False)
    assert _errors(_ppo_fp8("fp32", "power_of_2")) == (
        "invalid config: policy.megatron.fp8_block_scales=fp32 and "
        "value.megatron.fp8_block_scales=power_of_2 must agree: each sets Transformer Engine's "
        f"process-wide {SCALES}, one value per run (set them to one of fp32, power_of_2)")
    validate(_ppo_fp8("power_of_2", "power_of_2"))
    validate(_ppo_fp8("fp32", "power_of_2", value_recipe="tensorwise"))


@pytest.mark.parametrize("scales, env, refused", [
    ("fp32", None, False), ("fp32", "1", False), ("fp32", "0", True), ("fp32", "true", True),
    ("power_of_2", None, False), ("power_of_2", "0", False), ("power_of_2", "1", True)])
def test_fp8_block_scales_against_the_controllers_environment(te_installed, monkeypatch, scales,
                                                              env, refused):
    """A NVTE_FP8_BLOCK_SCALING_FP32_SCALES in the controller's environment that TE reads
    otherwise than the key (only "1" is fp32 scales) is refused in one line naming both; unset
    or agreeing, it passes. Not FP8 blockwise: the variable is no concern of the config."""
    if env is None:
        monkeypatch.delenv(SCALES, raising=False)
    else:
        monkeypatch.setenv(SCALES, env)
    cfg = _cfg(layer_spec="transformer_engine", fp8="hybrid", precision="bf16",
               fp8_block_scales=scales)
    if refused:
        assert _errors(cfg) == (
            f"invalid config: policy.megatron.fp8_block_scales={scales} contradicts "
            f"{SCALES}={env!r} in this environment (Transformer Engine reads '1' as fp32 block "
            f"scales, anything else as powers of 2): unset the variable or make it and the key "
            f"agree")
    else:
        validate(cfg)
    cfg.policy.megatron.fp8_recipe = "tensorwise"
    validate(cfg)


def test_cp_with_heads_it_divides_and_p2p_needs_no_head_split(te_installed):
    validate(_cfg(workers=4, layer_spec="transformer_engine", context_parallel_size=2,
                  cp_comm_type="a2a"))  # 4 heads, 2 groups over CP=2
    validate(_cfg(workers=4, layer_spec="transformer_engine", context_parallel_size=4))  # p2p


def test_cp_with_packed_sequences_runs_on_torch_and_te_p2p(te_installed):
    """Packed sequences with CP pass the loader on the torch spec (each sequence padded to 2 CP,
    split per sequence: tests/test_packing.py), for the policy and the critic, and on the TE spec
    with cp_comm_type=p2p (packed CP=2 against CP=1 passed on two H200s); TE's a2a and
    all_gather on packed sequences are refused in one line naming the keys."""
    torch_cp = dict(layer_spec="torch", context_parallel_size=2, cp_comm_type="all_gather")
    cfg = _cfg(device="cpu", workers=2, **torch_cp)
    cfg.policy.sequence_packing = True
    validate(cfg)
    cfg = _cfg(device="cpu", workers=4, tensor_model_parallel_size=2, sequence_parallel=True,
               **torch_cp)
    cfg.policy.sequence_packing = True
    validate(cfg)
    cfg = _cfg(device="cpu", workers=2, **torch_cp)
    cfg.algorithm = "ppo"
    for key, value in torch_cp.items():
        setattr(cfg.value.megatron, key, value)
    cfg.value.sequence_packing = True
    validate(cfg)
    cfg = _cfg(workers=2, layer_spec="transformer_engine", context_parallel_size=2)
    cfg.policy.sequence_packing = True
    validate(cfg)  # p2p, the default
    for comm in ("a2a", "all_gather"):
        cfg.policy.megatron.cp_comm_type = comm
        expected = ("policy.sequence_packing with policy.megatron.context_parallel_size=2 on "
                    "policy.megatron.layer_spec=transformer_engine needs "
                    f"policy.megatron.cp_comm_type=p2p (got {comm}: Transformer Engine's {comm} "
                    "attention on packed sequences has not run on a GPU here; p2p has: "
                    "scripts/gpu/session.sh cp2)")
        assert _errors(cfg) == f"invalid config: {expected}"  # the only error, one line
        cfg.policy.sequence_packing = False
        validate(cfg)  # unpacked: TE's a2a and all_gather run
        cfg.policy.sequence_packing = True


def test_cp_on_the_torch_spec_needs_no_transformer_engine(monkeypatch):
    """The torch spec's CP (keys and values all-gathered) passes the loader and the run's
    start on the CPU without TE; MoE models and the megatron rollout backend are refused."""
    monkeypatch.setattr(rules, "transformer_engine_missing", lambda: "not installed")
    torch_cp = dict(layer_spec="torch", context_parallel_size=2, cp_comm_type="all_gather")
    validate(_cfg(device="cpu", workers=4, **torch_cp))
    assert te.runtime_errors(MegatronConfig(**torch_cp), "policy.megatron", "cpu") == []
    cfg = _cfg(device="cpu", workers=2, **torch_cp)
    cfg.model.arch.num_experts = 4
    assert "does not support mixture-of-experts models yet" in _errors(cfg)
    from mcore_rl.generation.checks import megatron_layout_errors

    assert megatron_layout_errors(MegatronConfig(**torch_cp)) == [
        "generation.backend=megatron needs policy.megatron.context_parallel_size=1 (got 2: the "
        "decoder does not split sequences); use generation.backend=hf"]


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_te_features_need_a_gpu(te_installed, monkeypatch, device):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    seen = " and torch sees no GPU" if device == "auto" else ""
    assert (f"policy.megatron.layer_spec=transformer_engine and policy.megatron.fp8=hybrid need a "
            f"GPU: cluster.device is '{device}'{seen}") in _errors(
        _cfg(device, layer_spec="transformer_engine", fp8="hybrid", precision="bf16"))


def test_without_te_the_loader_says_so_once_and_not_also_gpu(monkeypatch):
    monkeypatch.setattr(rules, "transformer_engine_missing", lambda: "no module named 'x'")
    errors = _errors(_cfg("cpu", layer_spec="transformer_engine"))
    assert errors.startswith("invalid config: policy.megatron.layer_spec=transformer_engine needs "
                             "Transformer Engine, which is not installed here (no module named "
                             "'x')") and "\n" not in errors and "GPU" not in errors


def test_ppo_critic_section_is_checked_too(te_installed):
    cfg = _cfg()
    cfg.algorithm = "ppo"
    cfg.value.megatron.fp8 = "e4m3"
    cfg.value.megatron.precision = "bf16"
    assert "value.megatron.fp8=e4m3 needs value.megatron.layer_spec=transformer_engine" in _errors(cfg)


def test_fp8_shape_errors_per_tp_rank():
    mg = MegatronConfig(layer_spec="transformer_engine", fp8="e4m3", precision="bf16",
                        tensor_model_parallel_size=2)
    # SmolLM2-135M: 576 hidden, 9 heads x 64, 1536 FFN: every FP8 input multiple of 16 at TP=1
    smol = ModelArchConfig(hidden_size=576, num_attention_heads=9, num_query_groups=3,
                           ffn_hidden_size=1536)
    assert transformer_engine_shape_errors(smol, MegatronConfig(fp8="e4m3"), "m") == []
    arch = ModelArchConfig(hidden_size=200, num_attention_heads=4, num_query_groups=2,
                           head_dim=40, ffn_hidden_size=100)
    errors = transformer_engine_shape_errors(arch, mg, "policy.megatron")
    assert errors == [  # 4 x 40 / 2 = 80 passes
        "policy.megatron.fp8=e4m3 needs model.arch.hidden_size to be a multiple of 16 (got 200): "
        "Transformer Engine's FP8 matrix multiplies",
        "policy.megatron.fp8=e4m3 needs model.arch.ffn_hidden_size / "
        "policy.megatron.tensor_model_parallel_size to be a multiple of 16 (got 100 / 2 = 50): "
        "Transformer Engine's FP8 matrix multiplies"], errors
    arch.head_dim = 36
    assert "(got 4 x 36 / 2 = 72)" in transformer_engine_shape_errors(arch, mg, "policy.megatron")[1]
    # a checkpoint's shape is named by its path (the trainer's check of model.hf_path)
    assert "needs hidden_size of model.hf_path=/m to be" in transformer_engine_shape_errors(
        arch, mg, "policy.megatron", "model.hf_path=/m")[0]


def test_microbatch_widths_and_the_token_budget(te_installed):
    assert microbatch_width_multiple(MegatronConfig()) == 1
    assert microbatch_width_multiple(MegatronConfig(tensor_model_parallel_size=2,
                                                    sequence_parallel=True)) == 2
    assert microbatch_width_multiple(MegatronConfig(context_parallel_size=3)) == 6
    assert microbatch_width_multiple(MegatronConfig(fp8="e4m3")) == 8
    assert microbatch_width_multiple(MegatronConfig(
        tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2,
        fp8="e4m3")) == 64
    cfg = _cfg(layer_spec="transformer_engine", fp8="e4m3", precision="bf16")
    cfg.data.max_total_length, cfg.policy.max_tokens_per_microbatch = 100, 100
    assert ("policy.max_tokens_per_microbatch (100) must be null or >= data.max_total_length "
            "(100, rounded up to a multiple of 8 (8 for FP8))") in _errors(cfg)
    cfg.policy.max_tokens_per_microbatch = 104
    validate(cfg)


@pytest.mark.parametrize("recipe, capability, refused", [
    ("delayed", (8, 0), "compute capability >= 8.9; this GPU's is 8.0"),
    ("delayed", (8, 9), None),
    ("tensorwise", (9, 0), None),
    ("blockwise", (8, 9), "compute capability >= 9.0; this GPU's is 8.9; fp8_recipe=delayed or "
                          "tensorwise run from 8.9"),
    ("blockwise", (10, 0), None),  # with fp8_block_scales=power_of_2 (below: fp32, the default)
    ("mxfp8", (9, 0), "compute capability >= 10.0 and < 12.0; this GPU's is 9.0"),
    ("mxfp8", (10, 0), None),
    ("mxfp8", (12, 0), "this GPU's is 12.0"),
])
def test_fp8_recipe_against_the_gpu(recipe, capability, refused):
    mg = MegatronConfig(layer_spec="transformer_engine", fp8="e4m3", fp8_recipe=recipe,
                        fp8_block_scales="power_of_2")
    error = te.fp8_capability_error(mg, "policy.megatron", capability)
    if refused is None:
        assert error is None
    else:
        assert error.startswith(f"policy.megatron.fp8=e4m3 with policy.megatron.fp8_recipe={recipe} "
                                f"needs a GPU of ") and refused in error, error
    assert te.fp8_capability_error(MegatronConfig(), "m", (7, 0)) is None  # FP8 off


def test_fp32_block_scales_run_on_hopper_only():
    """fp8_block_scales=fp32 (the default) relaxes TE's power-of-2 block scales on Hopper; on
    Blackwell TE has powers of 2 only, so the run's start refuses it in one line naming the
    remedy; power_of_2 runs there, and fp32 runs on 9.0."""
    mg = MegatronConfig(layer_spec="transformer_engine", fp8="e4m3", fp8_recipe="blockwise")
    assert mg.fp8_block_scales == "fp32"
    assert te.fp8_capability_error(mg, "policy.megatron", (9, 0)) is None
    for capability in ((10, 0), (12, 0)):
        assert te.fp8_capability_error(mg, "policy.megatron", capability) == (
            "policy.megatron.fp8_block_scales=fp32 (its default) needs a Hopper GPU (compute "
            f"capability 9.x); this GPU's is {capability[0]}.{capability[1]}, where Transformer "
            "Engine's block scales are powers of 2 only: set "
            "policy.megatron.fp8_block_scales=power_of_2")
    mg.fp8_block_scales = "power_of_2"
    assert te.fp8_capability_error(mg, "policy.megatron", (10, 0)) is None


def test_runtime_errors_where_the_gpu_is(monkeypatch):
    key = "policy.megatron"
    assert te.runtime_errors(MegatronConfig(), key, "cuda") == []  # no TE feature: no import
    spec = MegatronConfig(layer_spec="transformer_engine")
    assert te.runtime_errors(spec, key, "cpu") == [
        "policy.megatron.layer_spec=transformer_engine with Transformer Engine features needs a GPU "
        "(device is cpu)"]
    monkeypatch.setattr(te, "te_import_error", lambda: "OSError: libcuda.so.1: cannot open")
    assert te.runtime_errors(spec, key, "cuda") == [
        "Transformer Engine does not import here (OSError: libcuda.so.1: cannot open), and "
        "policy.megatron asks for it (layer_spec=transformer_engine, fp8=None, "
        "context_parallel_size=1)"]
    monkeypatch.setattr(te, "te_import_error", lambda: None)
    fp8 = MegatronConfig(layer_spec="transformer_engine", fp8="e4m3", fp8_recipe="mxfp8")
    assert te.runtime_errors(fp8, key, "cuda", capability=(9, 0)) == [
        te.fp8_capability_error(fp8, key, (9, 0))]
    assert te.runtime_errors(fp8, key, "cuda", capability=(10, 0)) == []
    # TE's context-parallel attention ran against CP=1 on GPUs (issue 34): no longer refused
    cp = MegatronConfig(layer_spec="transformer_engine", context_parallel_size=2)
    assert te.runtime_errors(cp, key, "cuda") == []


def test_te_import_error_is_one_line():
    problem = te.te_import_error()
    if TE_INSTALLED and problem is None:
        pytest.skip("Transformer Engine imports here")
    assert problem and "\n" not in problem and problem.split(":")[0].endswith("Error")


def test_the_trainer_refuses_before_any_worker(te_installed, monkeypatch, tmp_path, capsys):
    """Where the loader cannot know (it saw a GPU, the run's process has none): one line, exit 2,
    nothing written."""
    monkeypatch.setattr(rules, "_cuda_available", lambda: True)
    run = tmp_path / "run"
    err = _one_line_exit_2(["train", *CPU, "cluster.device=auto", f"run.output_dir={run}",
                            "policy.megatron.layer_spec=transformer_engine"], capsys)
    assert err == ("mcore-rl train: error: policy.megatron.layer_spec=transformer_engine with "
                   "Transformer Engine features needs a GPU (device is cpu)\n")
    assert not run.exists()


def test_transformer_config_takes_fp8_and_cp():
    from mcore_rl.megatron.model import transformer_config

    arch = ModelArchConfig()
    mg = MegatronConfig(layer_spec="transformer_engine", precision="bf16", fp8="hybrid",
                        fp8_recipe="tensorwise", context_parallel_size=2, cp_comm_type="a2a")
    config = transformer_config(arch, mg, 64, "cpu")
    assert (config.fp8, config.fp8_recipe, config.context_parallel_size, config.cp_comm_type) == (
        "hybrid", "tensorwise", 2, "a2a")
    plain = transformer_config(arch, MegatronConfig(), 64, "cpu")
    assert (plain.fp8, plain.context_parallel_size, plain.cp_comm_type) == (None, 1, None)
    with pytest.raises(ValueError, match="needs megatron.layer_spec=transformer_engine"):
        transformer_config(arch, MegatronConfig(fp8="e4m3", precision="bf16"), 64, "cpu")
    with pytest.raises(ValueError, match="needs megatron.layer_spec torch or transformer_engine"):
        transformer_config(arch, MegatronConfig(context_parallel_size=2), 64, "cpu")
    torch_cp = transformer_config(arch, MegatronConfig(layer_spec="torch", context_parallel_size=2,
                                                       cp_comm_type="all_gather"), 64, "cpu")
    assert (torch_cp.context_parallel_size, torch_cp.cp_comm_type) == (2, "all_gather")
    with pytest.raises(ValueError, match="multiple of 16"):
        transformer_config(ModelArchConfig(hidden_size=72, num_attention_heads=4,
                                           num_query_groups=2, ffn_hidden_size=64),
                           MegatronConfig(layer_spec="transformer_engine", fp8="e4m3"), 64, "cpu")


def test_transformer_config_takes_the_bf16_layers_of_fp8():
    """``fp8_bf16_layers_at_start`` and ``_at_end`` become Megatron's ``first_last_layers_bf16``
    with its two counts (its own ``__post_init__`` checks pass: no TE needed); 0 and 0 leave it
    off; the builder refuses what the loader refuses, naming the keys; a checkpoint's shape
    (``model.hf_path``, checked at the trainer's start) gets the per-stage bound too."""
    from mcore_rl.megatron.model import transformer_config

    arch = ModelArchConfig(num_layers=4)
    fp8 = dict(layer_spec="transformer_engine", precision="bf16", fp8="e4m3",
               fp8_recipe="blockwise")
    config = transformer_config(arch, MegatronConfig(**fp8, fp8_bf16_layers_at_start=1,
                                                     fp8_bf16_layers_at_end=2), 64, "cpu")
    assert (config.fp8_recipe, config.first_last_layers_bf16, config.num_layers_at_start_in_bf16,
            config.num_layers_at_end_in_bf16) == ("blockwise", True, 1, 2)
    end_only = transformer_config(arch, MegatronConfig(**fp8, fp8_bf16_layers_at_end=1), 64, "cpu")
    assert (end_only.first_last_layers_bf16, end_only.num_layers_at_start_in_bf16,
            end_only.num_layers_at_end_in_bf16) == (True, 0, 1)
    assert transformer_config(arch, MegatronConfig(**fp8), 64, "cpu").first_last_layers_bf16 is False
    for bad in (dict(fp8, fp8_recipe="delayed"), dict(layer_spec="transformer_engine")):
        with pytest.raises(ValueError, match="megatron.fp8_bf16_layers_at_start and _at_end"):
            transformer_config(arch, MegatronConfig(**bad, fp8_bf16_layers_at_start=1), 64, "cpu")
    with pytest.raises(ValueError, match=r"fp8_bf16_layers_at_end \(3\) must be at most"):
        transformer_config(arch, MegatronConfig(**fp8, pipeline_model_parallel_size=2,
                                                fp8_bf16_layers_at_end=3), 64, "cpu")
    assert transformer_engine_shape_errors(
        arch, MegatronConfig(**fp8, fp8_bf16_layers_at_start=5), "policy.megatron",
        "model.hf_path=/m") == [
        "policy.megatron.fp8_bf16_layers_at_start (5) must be at most the layers of one pipeline "
        "stage, num_layers of model.hf_path=/m / policy.megatron.pipeline_model_parallel_size "
        "(4 / 1 = 4): Megatron-Core's bound"]


def test_world_size_must_hold_tp_cp_pp():
    from mcore_rl.megatron import parallel

    with pytest.raises(ValueError, match=r"world size 6 is not divisible by "
                                         r"tensor_model_parallel_size \(1\) x context_parallel_size "
                                         r"\(4\) x pipeline_model_parallel_size \(1\)"):
        parallel.initialize(0, 6, "127.0.0.1", 1, "cpu", context_parallel_size=4)


def _cp_groups():
    """In 2 gloo processes: Megatron's groups with CP=2."""
    from megatron.core import parallel_state as ps

    from dist_utils import _WORLD
    from mcore_rl.megatron import parallel

    ps.destroy_model_parallel()
    parallel.initialize(_WORLD["rank"], _WORLD["world_size"], "127.0.0.1", _WORLD["port"], "cpu",
                        context_parallel_size=2)
    return dict(cp=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
                dp=ps.get_data_parallel_world_size(),
                dp_cp=ps.get_data_parallel_world_size(with_context_parallel=True),
                cp_ranks=ps.get_context_parallel_global_ranks())


def test_cp_groups_on_gloo():
    """The batch is sharded over DP (1 here: both ranks get the same rows), gradients are
    reduced over DP x CP (Megatron's DDP)."""
    from dist_utils import run_distributed

    out = run_distributed(_cp_groups, 2)
    assert [(o["cp"], o["dp"], o["dp_cp"]) for o in out] == [(2, 1, 2)] * 2
    assert [o["cp_rank"] for o in out] == [0, 1] and [o["cp_ranks"] for o in out] == [[0, 1]] * 2


def _script(name: str, relative: str):
    """The repository's script ``relative`` loaded as module ``name`` (not on sys.path)."""
    path = importlib.util.spec_from_file_location(
        name, __file__.rsplit("/tests/", 1)[0] + "/" + relative)
    module = importlib.util.module_from_spec(path)
    path.loader.exec_module(module)
    return module


def _bench_train_step():
    return _script("bench_train_step", "bench/train_step.py")


def test_train_step_benchmark_variants():
    """bench/train_step.py --variants (session.sh te_mfu): each name's policy.megatron section,
    and the 0.85B shape passes the FP8 shape rules (every FP8 GEMM input a multiple of 16)."""
    bench = _bench_train_step()
    assert bench.parse_variant("torch") == {"spec": "torch", "fp8": None, "fp8_recipe": "delayed",
                                            "mbs": 4}
    assert bench.parse_variant("te+mbs8")["spec"] == "transformer_engine"
    assert bench.parse_variant("te+mbs8")["mbs"] == 8
    for recipe in ("delayed", "tensorwise", "blockwise"):
        mg = bench.variant_megatron(f"fp8-{recipe}")
        assert (mg.layer_spec, mg.fp8, mg.fp8_recipe, mg.precision) == (
            "transformer_engine", "hybrid", recipe, "bf16")
        for arch in bench.SHAPES.values():  # --shape: 0.85b, llama8b-4l, llama8b-8l
            assert transformer_engine_shape_errors(arch, mg, "policy.megatron") == []
        assert te.fp8_capability_error(mg, "policy.megatron", (9, 0)) is None  # an H100
    assert bench.ARCH is bench.SHAPES["0.85b"]
    # Llama-3.1-8B's width at 4 layers: 1.92B parameters, 18 bytes each with Adam fit 80 GB
    wide = bench.SHAPES["llama8b-4l"]
    assert (wide.hidden_size, wide.ffn_hidden_size, wide.num_attention_heads,
            wide.num_query_groups, wide.vocab_size) == (4096, 14336, 32, 8, 128256)
    assert 1.9e9 < bench.param_count(wide)["total"] < 1.95e9
    # the share FP8 leaves in bf16 (output layer, attention products) shrinks with depth
    shares = [bench.bf16_share(bench.SHAPES[s], bench.SEQ)
              for s in ("llama8b-4l", "llama8b-8l", "0.85b")]
    assert 0.38 < shares[0] < 0.40 and 0.24 < shares[1] < 0.26 and 0.15 < shares[2] < 0.17
    for bad in ("fp8-mxfp8", "te+mbs16", "tensorrt"):
        with pytest.raises(ValueError, match="variant"):
            bench.parse_variant(bad)


def _bridge_parity():
    """scripts/gpu/bridge_parity.py as a module (megatron.bridge is imported in main() only)."""
    return _script("bridge_parity", "scripts/gpu/bridge_parity.py")


def test_bridge_provider_is_built_without_apex_fusions():
    """scripts/gpu/bridge_parity.py: megatron-bridge 0.6.2 turns gradient_accumulation_fusion on
    whenever TE imports, and Megatron-Core's output layer then asks for APEX (the first GPU run
    stopped there); the provider's overrides turn it and APEX's other fusions off, only
    attributes the provider has (apply_overrides_and_finalize refuses others)."""
    import types

    module = _bridge_parity()
    provider = types.SimpleNamespace(gradient_accumulation_fusion=True, masked_softmax_fusion=True,
                                     persist_layer_norm=True, apply_rope_fusion=True)
    assert module.apex_free_overrides(provider, "cuda") == {
        "gradient_accumulation_fusion": False, "masked_softmax_fusion": False,
        "persist_layer_norm": False}
    assert module.apex_free_overrides(provider, "cpu")["apply_rope_fusion"] is False
    del provider.persist_layer_norm
    assert "persist_layer_norm" not in module.apex_free_overrides(provider, "cuda")


def test_bridge_parity_names_where_the_largest_logit_difference_is():
    """scripts/gpu/bridge_parity.py: the line under a logits check gives the row, position and
    token of the max |logit diff| and the two logits there (the padded vocabulary left out)."""
    import torch

    module = _bridge_parity()
    ref = torch.zeros(2, 3, 4)
    ref[1, 2] = torch.tensor([1.0, -7.0, 3.0, 0.5])
    out = ref.clone()
    out[1, 2, 1] = -4.0  # |diff| 3 at row 1, position 2, token 1
    out[0, 0, 0] = 2.0
    out = torch.cat((out, torch.full((2, 3, 1), 99.0)), dim=-1)  # the padded column: ignored
    line = module.worst_logit(out, ref, 4)
    assert line.startswith("max |logit diff| at row 1, position 2, token 1: reference -7, "
                           "model -4;")
    assert line.endswith("that position's max |reference logit| 7")


def test_bridge_parity_holds_bf16_to_the_measured_noise_floor():
    """scripts/gpu/bridge_parity.py, check 2: in bf16 a megatron model is held to FLOOR_FACTOR
    times transformers bf16's differences against fp32 (max logit, max and mean logprob), the old
    fixed tolerance only without a usable floor (and the line says so); fp32 has a fixed one."""
    import math

    import torch

    module = _bridge_parity()
    ids = torch.tensor([[0, 2, 1]])
    ref = torch.zeros(1, 3, 4)
    ref_lp = module.token_logprobs(ref, ids, 4)
    out = torch.zeros(1, 3, 5)  # a padded vocabulary: its last column is left out
    out[0, 1, 1], out[..., 4] = 2.0, 100.0
    diff = module.differences(out, ref, ref_lp, ids, 4)
    assert diff["logit_max"] == 2.0 and diff["logit_mean"] == pytest.approx(2.0 / 12)
    # the token after position 1 (1) is the one raised: 2 - log(e^2 + 3) against log(1/4);
    # position 0's token is untouched
    assert diff["lp_max"] == pytest.approx(abs(2 - math.log(math.exp(2) + 3) + math.log(4)))
    assert diff["lp_mean"] == pytest.approx(diff["lp_max"] / 2)

    floor = {"logit_max": 2.0, "logit_mean": 0.1, "lp_max": 0.4, "lp_mean": 0.06}
    limits, basis = module.tolerance("bf16", floor)
    factor = module.FLOOR_FACTOR
    assert limits == {"logit_max": 2.0 * factor, "lp_max": 0.4 * factor, "lp_mean": 0.06 * factor}
    assert "noise floor" in basis
    noisy = {k: 0.95 * v for k, v in limits.items()} | {"logit_mean": 50.0}
    assert module.within(noisy, limits)  # the mean logit difference is reported, not held
    assert not module.within(dict(noisy, lp_mean=1.05 * limits["lp_mean"]), limits)
    assert not module.within(dict(noisy, logit_max=float("nan")), limits)
    for unusable in (None, {}, dict(floor, lp_mean=0.0), dict(floor, lp_max=float("nan"))):
        limits, basis = module.tolerance("bf16", unusable)
        assert limits == module.FALLBACK_TOLERANCE and "no noise floor" in basis
    limits, basis = module.tolerance("fp32", floor)
    assert limits == module.FP32_TOLERANCE and basis.startswith("fp32")

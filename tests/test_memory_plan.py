"""The pre-launch memory planner (``mcore-rl plan``, :mod:`mcore_rl.megatron.memory`): its
parameter counts per rank against the numel of real Megatron models built on CPU ranks (TP=2,
PP=2, four families), its byte figures against their definitions, the CLI table, and ``train``
refusing a layout predicted not to fit (exit 2, before any worker or run directory)."""

from __future__ import annotations

import dataclasses

import pytest

from mcore_rl.cli import main
from mcore_rl.config.loader import load_config
from mcore_rl.config.schema import MegatronConfig, ModelArchConfig
from mcore_rl.megatron import memory

from dist_utils import run_distributed, use_layout

VOCAB = 101  # odd: TP=2 pads it
ARCHS = {
    "qwen2_tied": ModelArchConfig(family="qwen2", num_layers=4, hidden_size=32, ffn_hidden_size=48,
                                  num_attention_heads=4, num_query_groups=2),
    "llama_untied": ModelArchConfig(family="llama", num_layers=4, hidden_size=32, ffn_hidden_size=40,
                                    num_attention_heads=4, num_query_groups=4, qkv_bias=False,
                                    tie_word_embeddings=False),
    "qwen3_head_dim": ModelArchConfig(family="qwen3", num_layers=2, hidden_size=32,
                                      ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
                                      head_dim=16, qkv_bias=False),
    "qwen2_moe": ModelArchConfig(family="qwen2_moe", num_layers=2, hidden_size=32,
                                 ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
                                 num_experts=4, moe_ffn_hidden_size=16,
                                 moe_shared_expert_ffn_hidden_size=24),
}


def _megatron(tp: int, pp: int, spec: str, arch: ModelArchConfig) -> MegatronConfig:
    """The layout (experts with TP need sequence parallelism)."""
    return MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          layer_spec=spec, sequence_parallel=arch.num_experts is not None and tp > 1)


def _numels(layouts):
    """On each rank: for each (TP, PP, spec) of ``layouts`` and each arch, the numel of the
    rank's model chunk."""
    import torch

    from mcore_rl.megatron.model import build_model

    out = {}
    for tp, pp, spec in layouts:
        use_layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        for name, arch in ARCHS.items():
            m = _megatron(tp, pp, spec, arch)
            torch.manual_seed(0)
            chunks = build_model(arch, m, VOCAB, "cpu")
            out[(tp, pp, spec, name)] = sum(p.numel() for c in chunks for p in c.parameters())
    return out


LAYOUTS = [(1, 1, "local"), (1, 1, "torch"), (2, 1, "local"), (1, 2, "torch")]


@pytest.fixture(scope="module")
def numels():
    """Per-rank numel of real models: the single-rank layouts in a world of 2 keep one rank's
    figure (both ranks build the whole model)."""
    return run_distributed(_numels, 2, LAYOUTS)


@pytest.mark.parametrize("tp,pp,spec", LAYOUTS)
@pytest.mark.parametrize("name", list(ARCHS))
def test_rank_parameters_equal_the_built_models_numel(numels, tp, pp, spec, name):
    arch = ARCHS[name]
    m = _megatron(tp, pp, spec, arch)
    measured = [rank[(tp, pp, spec, name)] for rank in numels]
    assert memory.rank_parameters(arch, VOCAB, m) == max(measured)
    if tp == pp == 1:
        assert memory.model_parameters(arch, VOCAB) == measured[0]
    else:  # the ranks together hold the model (TP: norms replicated; PP: tied copy on the last)
        assert sum(measured) >= memory.model_parameters(arch, VOCAB)


def test_bytes_follow_precision_grad_dtype_and_the_distributed_optimizer():
    cfg = load_config("grpo_synthetic_gpu", ["cluster.num_workers=4"])
    arch = cfg.model.arch
    arch.vocab_size = VOCAB
    p = memory.rank_parameters(arch, VOCAB, cfg.policy.megatron)
    plan = memory.plan_memory(cfg, arch)
    policy = plan.roles[0]
    assert plan.layout == (1, 1, 4)
    # bf16: 2-byte weights, fp32 grads (ddp.grad_reduce_in_fp32), fp32 main params + 2 moments
    assert (policy.weights, policy.grads, policy.optimizer) == (2 * p, 4 * p, 12 * p)
    assert policy.optimizer_distributed == 3 * p and policy.optimizer_step_transient == 0
    assert policy.reference == 0  # loss.kl_coef = 0
    dist = memory.plan_memory(load_config("grpo_synthetic_gpu", [
        "cluster.num_workers=4", "policy.megatron.ddp.use_distributed_optimizer=true",
        "policy.megatron.ddp.grad_reduce_in_fp32=false", "loss.kl_coef=0.1"]), arch).roles[0]
    assert (dist.grads, dist.optimizer, dist.optimizer_step_transient, dist.reference) == (
        2 * p, 3 * p, 4 * p, 2 * p)
    fp32 = memory.plan_memory(load_config("grpo_synthetic_gpu", [
        "policy.megatron.precision=fp32"]), arch).roles[0]
    assert (fp32.weights, fp32.grads, fp32.optimizer) == (4 * p, 4 * p, 8 * p)
    # activations: linear in the micro-batch, the local spec adds the s^2 term
    a1 = memory.activation_bytes_per_layer(arch, cfg.policy.megatron, 1, 64)
    assert memory.activation_bytes_per_layer(arch, cfg.policy.megatron, 4, 64) == 4 * a1
    local = dataclasses.replace(cfg.policy.megatron, layer_spec="local")
    repeated_kv = 2 * (14 - 2) * 64 * 2 * 64  # 2 (a - g) d elements a token, bf16, 64 tokens
    assert memory.activation_bytes_per_layer(arch, local, 1, 64) - a1 == (
        5 * 14 * 64 * 64 + repeated_kv)


def test_plan_cli_prints_the_roles_and_the_layouts_that_fit(capsys):
    assert main(["plan", "--config-name", "grpo_synthetic_gpu", "cluster.num_workers=4",
                 "cluster.gpu_memory_gb=5"]) == 0
    out = capsys.readouterr().out
    assert "358.0M parameters" in out
    assert "DOES NOT FIT" in out  # TP=1: 6.8 GiB on a 5 GiB GPU
    rows = {tuple(line.split()[:3]): line.split()[3:] for line in out.splitlines()
            if line.strip() and line.split()[0].isdigit()}
    assert rows[("1", "1", "4")][0] == "0" and rows[("1", "1", "4")][-1] == "no"
    assert rows[("2", "1", "2")][-1] == "yes" and int(rows[("2", "1", "2")][0]) >= 64


def test_train_refuses_a_layout_that_does_not_fit_before_any_worker(tmp_path, monkeypatch, capsys):
    from mcore_rl.megatron import parallel

    monkeypatch.setattr(parallel, "resolve_device", lambda device: "cuda")  # a CPU-only host
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:
        main(["train", "--config-name", "grpo_synthetic_gpu", "cluster.use_ray=false",
              "cluster.num_workers=4", "cluster.gpu_memory_gb=5", f"run.output_dir={out}"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mcore-rl train: error: cluster.gpu_memory_gb=5: layout TP=1 PP=1 DP=4")
    assert "layouts that fit: TP=2 PP=1 DP=2 mbs<=" in err and "skip_memory_check" in err
    assert len(err.splitlines()) == 1
    assert not out.exists()

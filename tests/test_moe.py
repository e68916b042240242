"""Mixture of experts in training, on Megatron-Core's MoE layers over gloo (fp32).

Tiny Qwen3-MoE (query/key norm, renormalized top-k) and Qwen2-MoE (shared expert with its
sigmoid gate, QKV bias) policies, loaded from random-weight checkpoints that transformers
writes, train one step with the load-balancing loss and the z-loss on:

- EP=2 (DP=2 for the dense part) and EP=2 x TP=2 (sequence parallel, experts whole on each
  rank) give what one process gives: logprobs, loss, router loss, grad norm and every weight
  after an SGD step (SGD: a weight moves by ``lr x`` its gradient, so the comparison is of the
  gradients, not of Adam's sign of a round-off gradient);
- the router losses' share of the gradient is exactly that of
  ``coeff * sum_mb n_mb L_mb / N`` (``mcore_rl.megatron.moe``), against autograd through the
  transformers model on the same micro-batches;
- a micro-batch without loss tokens (the last one: its rows are masked) leaves no trace;
- a checkpoint saved at EP=2 exports (``mcore-rl export``'s loader, one process) to the HF
  tensors the EP=2 workers export.

The conversion itself (logits against transformers, bit-exact export at every layout) is in
``test_conversion.py``; the Transformer Engine spec's names and the config checks are tested
here without processes, with the GPU script's model and batch. Three worker groups (1, 2 and 2
processes), spawned once each.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

from mcore_rl.algorithms.losses import ClippedPGLoss
from mcore_rl.config.families import arch_errors, layout_errors
from mcore_rl.config.loader import ConfigError, load_config
from mcore_rl.config.schema import LossConfig, MegatronConfig, ModelArchConfig, OptimizerConfig
from mcore_rl.controller import parity
from mcore_rl.controller.trainer import DataParallelGroup
from mcore_rl.data.microbatching import make_microbatches
from mcore_rl.distributed.worker_group import ProcessWorkerGroup
from mcore_rl.megatron.conversion import hf_config_to_arch, megatron_to_hf_names
from mcore_rl.megatron.moe import router_padding_mask
from mcore_rl.workers.policy import PolicyWorker
from rollouts import random_rows

VOCAB, ROWS, MBS = 64, 8, 2  # 4 training micro-batches in one process, 2 per rank at DP=2
AUX, Z, LR = 0.1, 0.01, 1.0  # large router-loss coefficients and lr: a gradient well resolved
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
              num_experts_per_tok=2, max_position_embeddings=64)
CONFIGS = {
    "qwen3_moe": Qwen3MoeConfig(**COMMON, head_dim=32, norm_topk_prob=True,
                                tie_word_embeddings=False),
    "qwen2_moe": Qwen2MoeConfig(**COMMON, shared_expert_intermediate_size=48, norm_topk_prob=False,
                                tie_word_embeddings=True),
}
EP2 = dict(expert_model_parallel_size=2)
EP2_TP2 = dict(expert_model_parallel_size=2, tensor_model_parallel_size=2,
               expert_tensor_parallel_size=1, sequence_parallel=True)
LOSS = ClippedPGLoss(LossConfig())


class Policies:
    """Several policy workers in one process, one per model name (the first builds the process
    group, the others join it); ``select(name)`` routes every other call to one of them, so a
    :class:`DataParallelGroup` and :func:`parity.record_step` drive each in turn."""

    def __init__(self, models, **common):
        self.workers = {name: PolicyWorker(**common, **kwargs) for name, kwargs in models.items()}
        self.active = next(iter(self.workers.values()))

    def select(self, name):
        self.active = self.workers[name]

    def __getattr__(self, name):
        return getattr(self.active, name)


def _write_checkpoint(family, path):
    """A transformers model of ``family`` with every tensor random (norms around 1), saved."""
    torch.manual_seed(sum(map(ord, family)))
    model = AutoModelForCausalLM.from_config(CONFIGS[family])
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name
                    else 0.5 * torch.randn_like(p) if "embed" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(path)


def _policy(path, family, aux=AUX, z=Z, **megatron):
    arch = hf_config_to_arch(CONFIGS[family])
    return dict(hf_path=str(path), hf_config=CONFIGS[family].to_dict(), arch=arch,
                megatron=MegatronConfig(moe_aux_loss_coeff=aux, moe_z_loss_coeff=z, **megatron))


def _batch():
    """8 rows of prompts 3-6 and responses 2-8 tokens; rows 6 and 7 are masked (sample_mask 0),
    so the last micro-batch has no loss token."""
    g = torch.Generator().manual_seed(0)
    rows = random_rows(ROWS, VOCAB, (3, 6), (2, 8), g, extra_width=2)
    rows["sample_mask"][6:] = 0
    mask = rows["token_mask"]
    old = -math.log(VOCAB) + 0.3 * torch.randn(*mask.shape, generator=g)
    return {**rows, "advantages": torch.randn(ROWS, 1, generator=g) * mask,
            "prev_logprobs": old * mask}


def _run(world, models, save_to=None):
    """One group of ``world`` processes holding ``models``; per model the step record, and
    with ``save_to`` a checkpoint after the step (``save_to / model``)."""
    group = ProcessWorkerGroup(Policies, world, dict(
        models=models, vocab_size=VOCAB, temperature=1.0, use_reference=False,
        optimizer=OptimizerConfig(name="sgd", lr=LR, clip_grad=0.0), device="cpu", seed=7,
        total_optimizer_steps=1, global_batch_size=ROWS))
    try:
        dp = DataParallelGroup(group)
        out = {}
        for name in models:
            group.call("select", name)
            out[name] = parity.record_step(dp, _batch(), LOSS, MBS, MBS)
            if save_to is not None:
                group.call("save_checkpoint", str(save_to / name))
        return out
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    for family in CONFIGS:
        _write_checkpoint(family, root / family)
    return {family: root / family for family in CONFIGS}


@pytest.fixture(scope="module")
def records(checkpoints):
    """``{layout: {model: StepRecord}}``; the reference also runs each family with the router
    losses off; the EP=2 group saves its policies under ``checkpoints["ep2"]``."""
    models = {f: _policy(p, f) for f, p in checkpoints.items()}
    reference = {**models, **{f"{f}_off": _policy(p, f, aux=0.0, z=0.0)
                              for f, p in checkpoints.items()}}
    saved = checkpoints["qwen3_moe"].parent / "ep2"
    return {
        "reference": _run(1, reference),
        "ep2": _run(2, {f: _policy(p, f, **EP2) for f, p in checkpoints.items()}, saved),
        "ep2_saved": saved,
        "ep2_tp2": _run(2, {f: _policy(p, f, **EP2_TP2) for f, p in checkpoints.items()}),
    }


@pytest.mark.parametrize("layout", ["ep2", "ep2_tp2"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_expert_parallel_step_matches_one_process(records, layout, family):
    ref, got = records["reference"][family], records[layout][family]
    diffs = parity.compare(got, ref)
    print(f"\n{parity.parity_table({f'{family} {layout}': diffs})}")
    assert diffs["logprobs_rel"] < 1e-5 and diffs["loss_rel"] < 1e-5
    assert diffs["grad_norm_rel"] < 1e-5
    assert diffs["params_max_abs"] < 1e-6 * LR * 10  # gradients within 1e-5 absolute
    assert got.metrics["moe_aux_loss"] == pytest.approx(ref.metrics["moe_aux_loss"], rel=1e-6)
    if layout == "ep2":  # under sequence parallelism the z-loss metric averages rank means
        assert got.metrics["moe_z_loss"] == pytest.approx(ref.metrics["moe_z_loss"], rel=1e-6)
    moved = max((ref.weights[k] - records["reference"][f"{family}_off"].weights[k]).abs().max()
                for k in ref.weights)
    assert moved > 1e-3  # the router losses are part of the compared gradient


def _router_loss_gradients(family, path):
    """``d/dw [AUX * sum_mb n_mb sum_layers L_mb + Z * sum_mb n_mb sum_layers Z_mb] / N`` by
    autograd through transformers, on the worker's micro-batches: ``L`` the Switch load-balancing
    loss ``E * sum_i f_i P_i`` and ``Z`` the mean squared router logsumexp, both over the
    micro-batch's loss positions (:func:`router_padding_mask`), ``N`` the loss tokens."""
    from transformers.core_model_loading import revert_weight_conversion

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    experts, k = CONFIGS[family].num_experts, CONFIGS[family].num_experts_per_tok
    total, count = 0.0, 0
    for mb in make_microbatches(_batch(), MBS, None):
        loss_positions = ~router_padding_mask(mb).reshape(-1)
        n = int(loss_positions.sum())
        count += n
        if n == 0:
            continue
        for logits in model(mb["input_ids"], output_router_logits=True).router_logits:
            logits = logits[loss_positions]
            scores = logits.softmax(-1)
            routed = torch.zeros_like(scores).scatter(1, scores.topk(k, dim=-1).indices, 1.0)
            balance = experts * (scores.mean(0) * routed.sum(0) / (n * k)).sum()
            z = logits.logsumexp(-1).square().mean()
            total = total + n * (AUX * balance + Z * z)
    (total / count).backward()
    grads = {name: torch.zeros_like(p) if p.grad is None else p.grad
             for name, p in model.named_parameters()}  # lm_head and the final norm: none
    return revert_weight_conversion(model, grads)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_router_loss_gradient_is_per_loss_token(records, checkpoints, family):
    on, off = records["reference"][family], records["reference"][f"{family}_off"]
    expected = _router_loss_gradients(family, checkpoints[family])
    scale = max(g.abs().max().item() for g in expected.values())
    assert scale > 1e-3
    worst = 0.0
    for name, grad in expected.items():
        got = (off.weights[name] - on.weights[name]) / LR  # SGD: the router losses' gradient
        worst = max(worst, (got - grad).abs().max().item())
    assert worst < 1e-4 * scale


@pytest.mark.parametrize("family", list(CONFIGS))
def test_expert_parallel_checkpoint_exports_in_one_process(records, checkpoints, family, tmp_path):
    """``mcore-rl export``'s loader (a world of one process: EP=1) reshards the experts of a
    checkpoint saved at EP=2 into the weights the EP=2 workers exported."""
    out = tmp_path / "state.pt"
    code = ("import sys, torch; from transformers import AutoConfig; "
            "from mcore_rl.export import load_hf_state_dict; "
            "torch.save(load_hf_state_dict(sys.argv[1], AutoConfig.from_pretrained(sys.argv[2])), "
            "sys.argv[3])")
    subprocess.run([sys.executable, "-c", code, str(records["ep2_saved"] / family),
                    str(checkpoints[family]), str(out)], check=True, capture_output=True)
    exported, expected = torch.load(out), records["ep2"][family].weights
    assert list(exported) == list(expected)
    assert [k for k in expected if not torch.equal(exported[k], expected[k])] == []


# ------------------------------------------------------------------------- no processes

def test_router_padding_mask_marks_positions_of_loss_tokens():
    mb = {"input_ids": torch.zeros(2, 5, dtype=torch.long),
          "token_mask": torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1.0]]),
          "sample_mask": torch.tensor([1.0, 0.0])}
    # position t produces the logits of token t + 1; row 1 is masked
    assert (~router_padding_mask(mb)).int().tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 0, 0]]
    assert not router_padding_mask({"input_ids": mb["input_ids"]}).any()


def _te_names(local_names, moe: bool):
    """The Transformer Engine spec's names of the local spec's parameters: Megatron's own
    ``sharded_state_dict_keys_map`` of the local spec for the norms TE fuses into the next
    linear (not the pre-MLP norm of an MoE layer, which TE keeps), ``TEGroupedMLP``'s
    ``weight{k}`` for the experts of a rank. Returns ``{TE name: local name}``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    renames = dict(get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map)
    if moe:
        renames.pop("pre_mlp_layernorm.")
    out = {}
    for name in local_names:
        te = name
        for old, new in renames.items():
            te = te.replace(f".{old}", f".{new}")
        layer, sep, expert = te.partition(".mlp.experts.local_experts.")
        if sep:
            k, linear, param = expert.split(".")
            te = f"{layer}.mlp.experts.{linear}.{param}{k}"
        out[te] = name
    return out


LAYER_NAMES = {
    "qwen3": ["input_layernorm.weight", "self_attention.linear_qkv.weight",
              "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
              "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight",
              "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"],
    "qwen2_moe": ["input_layernorm.weight", "self_attention.linear_qkv.weight",
                  "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight",
                  "pre_mlp_layernorm.weight", "mlp.router.weight",
                  *[f"mlp.experts.local_experts.{k}.linear_fc{i}.weight"
                    for k in range(2) for i in (1, 2)],
                  "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight",
                  "mlp.shared_experts.gate_weight"],
}
ARCHS = {"qwen3": ModelArchConfig(family="qwen3", qkv_bias=False, tie_word_embeddings=False),
         "qwen2_moe": ModelArchConfig(family="qwen2_moe", num_experts=4, tie_word_embeddings=False,
                                      moe_shared_expert_ffn_hidden_size=48)}


@pytest.mark.parametrize("family", list(LAYER_NAMES))
def test_transformer_engine_names_map_like_local_ones(family):
    """The TE spec cannot be built here (no TE): its parameter names must bind to the same HF
    tensors as the local spec's, on EP rank 1 of 2 (experts 2 and 3)."""
    arch = ARCHS[family]
    local = ["embedding.word_embeddings.weight",
             *[f"decoder.layers.0.{n}" for n in LAYER_NAMES[family]],
             "decoder.final_layernorm.weight", "output_layer.weight"]
    kwargs = dict(layer_numbers=[1], pre_process=True, post_process=True, ep_rank=1, ep_size=2)
    by_local = megatron_to_hf_names(local, arch, **kwargs)
    te = _te_names(local, moe=arch.num_experts is not None)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert ("decoder.layers.0.mlp.experts.linear_fc2.weight1" in te if arch.num_experts
            else "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te)
    by_te = megatron_to_hf_names(te, arch, **kwargs)
    assert {te[n]: bound for n, bound in by_te.items()} == by_local
    hf = {name for names, *_ in by_local.values() for name in names}
    assert "model.layers.0.post_attention_layernorm.weight" in hf
    if arch.num_experts:
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in hf
        assert "model.layers.0.mlp.experts.1.down_proj.weight" not in hf  # EP rank 0's
        assert "model.layers.0.mlp.shared_expert_gate.weight" in hf
    with pytest.raises(ValueError, match="decoder.layers.0.mlp.extra.weight"):
        megatron_to_hf_names([*te, "decoder.layers.0.mlp.extra.weight"], arch, **kwargs)


@pytest.mark.parametrize("overrides, needle", [
    (["model.arch.family=qwen3_moe", "model.arch.qkv_bias=false", "model.arch.num_experts=6",
      "policy.megatron.expert_model_parallel_size=4", "cluster.num_workers=4"],
     "model.arch.num_experts (6) must be divisible by policy.megatron.expert_model_parallel_size (4)"),
    (["model.arch.family=qwen3_moe", "model.arch.qkv_bias=false", "model.arch.num_experts=4",
      "policy.megatron.expert_model_parallel_size=4", "cluster.num_workers=2"],
     "cluster.num_workers (2) must be divisible by policy.megatron.expert_tensor_parallel_size x "
     "expert_model_parallel_size x pipeline_model_parallel_size (1 x 4 x 1)"),
    (["model.arch.family=qwen3_moe", "model.arch.qkv_bias=false", "model.arch.num_experts=4",
      "policy.megatron.tensor_model_parallel_size=2", "cluster.num_workers=2"],
     "policy.megatron.sequence_parallel must be true with experts"),
    (["policy.megatron.expert_model_parallel_size=2", "cluster.num_workers=2"],
     "need a model with experts"),
    (["model.arch.family=qwen3_moe", "model.arch.qkv_bias=false", "model.arch.num_experts=4",
      "policy.megatron.expert_model_parallel_size=2", "cluster.num_workers=2",
      "generation.backend=megatron"],
     "generation.backend=megatron needs policy.megatron.expert_model_parallel_size=1 (got 2)"),
    (["model.arch.family=qwen3_moe", "model.arch.qkv_bias=false"],
     "model.arch.num_experts must be set for family qwen3_moe"),
    (["model.arch.family=qwen3"], "model.arch.qkv_bias must be false for family qwen3"),
])
def test_config_refuses_impossible_moe_layouts(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config("grpo_synthetic", overrides)
    assert needle in str(e.value)


def test_config_accepts_an_expert_parallel_layout():
    cfg = load_config("grpo_synthetic", [
        "model.arch.family=qwen3_moe", "model.arch.qkv_bias=false", "model.arch.num_experts=4",
        "cluster.num_workers=4", "policy.megatron.expert_model_parallel_size=2",
        "policy.megatron.tensor_model_parallel_size=2", "policy.megatron.sequence_parallel=true"])
    assert cfg.policy.megatron.expert_model_parallel_size == 2


def test_gpu_script_builds_a_valid_model_and_batch():
    """scripts/gpu/moe_parity.py (run on GPUs only) imports, and its presets are models the
    builder accepts at EP=2 with a batch whose loss tokens lie inside each row."""
    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "moe_parity.py"
    spec = importlib.util.spec_from_file_location("moe_parity", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for preset in module.PRESETS:
        args = module.parse_args(["--preset", preset])
        arch = module._arch(args)
        assert arch_errors(arch) == []
        assert layout_errors(arch, MegatronConfig(expert_model_parallel_size=2), "megatron", 2) == []
    batch = module.make_batch(module.parse_args(["--preset", "tiny"]))
    cols = torch.arange(batch["input_ids"].shape[1])
    assert torch.equal(batch["token_mask"].bool(),
                       (cols >= batch["prompt_lengths"][:, None])
                       & (cols < batch["input_lengths"][:, None]))


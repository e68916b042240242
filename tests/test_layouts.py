"""Policy parallel layouts on real Megatron-Core over gloo (fp32): every TP x PP x DP layout
gives what one process gives on the same model and global batch.

One model serves every layout: 4 layers (PP=2 with 2 virtual stages), tied embeddings (the
last stage holds a copy of the embedding under PP) and a vocabulary of 47 rows (padded to 48
under TP=2). The layouts of one world size share one spawned worker group
(:class:`LayoutHost`: each layout's workers are built in the same processes, one layout after
the other, on fresh Megatron parallel groups; a spawn costs seconds, the checks a fraction of
one); :func:`_check_layout` builds a layout's workers and runs all its checks, and the
single-process reference runs the same checks. Per
layout: the HF export round trip (bit-exact), fixed vs token-budget micro-batches (same
gradients and logprobs), per-token logprobs, loss, grad norm and every weight after one
optimizer step against the reference (:mod:`mcore_rl.controller.parity`), tied embedding
copies after several steps, TP-replicated weights after several steps, and Megatron's RNG.

Tolerances: the acceptance bounds (relative 1e-5, weights 1e-6 absolute). Adam's first step
is ``lr * g / (|g| + eps)``: a gradient that is round-off only (the key bias: softmax ignores
a shift shared by all keys, so its true gradient is 0) moves its weight by ``lr * g / eps``,
and a layout's other summation order changes ``g`` by ~1e-11, the weight by ~``lr * 1e-3``.
lr = 5e-4 keeps that under the bound (1e-6 measured at lr = 1e-3) while the step still
moves the other weights by ~5e-4.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from mcore_rl.algorithms.losses import ClippedPGLoss
from mcore_rl.config.loader import ConfigError, load_config
from mcore_rl.config.schema import DDPConfig, LossConfig, MegatronConfig, ModelArchConfig, OptimizerConfig
from mcore_rl.controller import parity
from mcore_rl.data.microbatching import (
    ROW_INDEX,
    gather_rows,
    make_microbatches,
    shapes_vary,
    token_budget_groups,
)
from mcore_rl.distributed.worker_group import DataParallelGroup, ProcessWorkerGroup
from mcore_rl.megatron.conversion import arch_to_hf_config
from mcore_rl.workers.policy import PolicyWorker, initial_hf_state_dict
from rollouts import random_rows

VOCAB = 47  # odd: not divisible by TP=2
ARCH = ModelArchConfig(family="qwen2", num_layers=4, hidden_size=32, num_attention_heads=4,
                       num_query_groups=2, ffn_hidden_size=64, max_position_embeddings=64,
                       qkv_bias=True, tie_word_embeddings=True, vocab_size=VOCAB)
SEED = 7
ROWS, MBS, LP_MBS = 12, 4, 8  # 3 training micro-batches: VPP pads them to 4
BUDGET = 24  # tokens per micro-batch: rows of 5..16 tokens give 1-4 rows of differing widths
TIED_STEPS = 3  # extra optimizer steps before the tied-embedding and replicated-weight checks

TORCH_CP = dict(layer_spec="torch", cp_comm_type="all_gather")
# name: (world size, policy.megatron fields)
LAYOUTS = {
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    # DDP options on: overlapped, bucketed (several buckets) DP reduction with the NaN check
    "dp2": (2, dict(ddp=DDPConfig(overlap_grad_reduce=True, bucket_size=4000,
                                  check_for_nan_in_grad=True))),
    "tp2_pp2": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    "pp2_dp2": (4, dict(pipeline_model_parallel_size=2)),
    "pp2_vpp2": (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    # activation recomputation changes no number: every layer's forward again in the backward
    # (groups of 2 layers), and on a pipeline the first layer of each stage plus the core
    # attention of the others
    "tp2_recompute_full": (2, dict(tensor_model_parallel_size=2, recompute_granularity="full",
                                   recompute_method="uniform", recompute_num_layers=2)),
    "pp2_recompute_block": (2, dict(pipeline_model_parallel_size=2, recompute_granularity="full",
                                    recompute_method="block", recompute_num_layers=1)),
    "dp2_recompute_selective": (2, dict(recompute_granularity="selective")),
    # context parallelism with the torch spec (keys and values all-gathered); compared with one
    # process of the torch spec too (test_context_parallel_matches_one_torch_spec_process)
    "cp2": (2, dict(context_parallel_size=2, **TORCH_CP)),
    "cp2_dp2": (4, dict(context_parallel_size=2, **TORCH_CP)),
}
PP_LAYOUTS = [n for n, (_, m) in LAYOUTS.items() if m.get("pipeline_model_parallel_size", 1) > 1]
CP_LAYOUTS = [n for n, (_, m) in LAYOUTS.items() if m.get("context_parallel_size", 1) > 1]
TP_LAYOUTS = [n for n, (_, m) in LAYOUTS.items() if m.get("tensor_model_parallel_size", 1) > 1]
LOSS = ClippedPGLoss(LossConfig(kl_coef=0.05))


class LayoutProbe(PolicyWorker):
    """A policy worker that also reports this rank's state to the test (test-only read-outs)."""

    def probe_gradients(self, batch, loss_fn, micro_batch_size):
        """``train``'s forward/backward and gradient finalization (DP reduction, 1/N scaling,
        tied-embedding and sequence-parallel reductions) without the optimizer step: this
        rank's main grads by chunk and parameter name."""
        self._zero_grads()
        self._run_schedule(batch, micro_batch_size, forward_only=False,
                           output_fn=lambda out, mb: self._loss_output(out, mb, loss_fn))
        grads = {f"{i}.{n}": p.main_grad.detach().clone()
                 for i, m in enumerate(self.model) for n, p in m.module.named_parameters()}
        self._zero_grads()
        return grads

    def set_token_budget(self, max_tokens):
        self.max_tokens_per_microbatch = max_tokens

    def megatron_options(self):
        ddp = self.model[0].ddp_config
        return {"ddp": {f.name: getattr(ddp, f.name) for f in dataclasses.fields(DDPConfig)},
                "sequence_parallel": self.model_config.sequence_parallel,
                "recompute": (self.model_config.recompute_granularity,
                              self.model_config.recompute_method,
                              self.model_config.recompute_num_layers),
                "calculate_per_token_loss": self.model_config.calculate_per_token_loss}

    def rng_draws(self):
        """Draws from the default generator and from Megatron's model-parallel RNG tracker."""
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        default = torch.rand(8)
        with get_cuda_rng_tracker().fork():
            tracker = torch.rand(8)
        return {**self.layout(), "default": default, "tracker": tracker}

    def replicated_params(self):
        """Parameters not split over TP (norm weights), by chunk and name."""
        return {**self.layout(), "params": {
            f"{i}.{n}": p.detach().clone() for i, m in enumerate(self.model)
            for n, p in m.module.named_parameters() if not getattr(p, "tensor_model_parallel", False)}}

    def tied_copies(self):
        """The first stage's word embedding and the last stage's output-layer copy of it."""
        out = {**self.layout(), "embedding": None, "output": None}
        for m in self.model:
            if m.module.pre_process:
                out["embedding"] = m.module.embedding.word_embeddings.weight.detach().clone()
            if m.module.post_process and m.module.output_layer.weight is not None:
                out["output"] = m.module.output_layer.weight.detach().clone()
        return out


class LayoutHost:
    """One rank of a worker group that hosts the layouts' workers in turn: :meth:`build` makes
    a :class:`LayoutProbe` of a layout in this process (the gloo world of the first build
    stays; Megatron's parallel groups are made anew, as :func:`dist_utils.use_layout` does),
    and every other call goes to the probe built last."""

    probe = None

    def __init__(self, **spawn):  # rank, world_size, master_addr, master_port
        self._spawn = spawn

    def build(self, kwargs):
        from megatron.core import parallel_state

        self.probe = None
        parallel_state.destroy_model_parallel()  # the previous layout's groups
        self.probe = LayoutProbe(**kwargs, **self._spawn)

    def __getattr__(self, name):
        if self.probe is None:
            raise AttributeError(name)
        return getattr(self.probe, name)


def _kwargs(**megatron):
    return dict(
        hf_path=None, hf_config=arch_to_hf_config(ARCH, VOCAB).to_dict(), vocab_size=VOCAB,
        temperature=1.0, use_reference=False, arch=ARCH, megatron=MegatronConfig(**megatron),
        optimizer=OptimizerConfig(lr=5e-4, clip_grad=1.0), device="cpu", seed=SEED,
        total_optimizer_steps=10, global_batch_size=ROWS,
    )


def _batch(n=ROWS, seed=0):
    """A right-padded rollout: prompts of 3-6 tokens, responses of 2-10, old and reference
    logprobs near log(1/V) so that clipped and unclipped ratios both occur."""
    g = torch.Generator().manual_seed(seed)
    rows = random_rows(n, VOCAB, (3, 6), (2, 10), g, extra_width=2)  # trailing padding columns too
    mask = rows["token_mask"]
    near = -math.log(VOCAB) + 0.3 * torch.randn(2, *mask.shape, generator=g)
    return {**rows, "advantages": torch.randn(n, 1, generator=g) * mask,
            "prev_logprobs": near[0] * mask, "reference_logprobs": near[1] * mask}


def _check_layout(group, megatron):
    """Every check of one layout on a :class:`LayoutHost` group; returns what the tests assert
    on."""
    group.call("build", _kwargs(**megatron))
    dp = DataParallelGroup(group)
    batch = _batch()
    out = {"options": group.call("megatron_options"), "rng": group.call("rng_draws"),
           "export": group.call("get_hf_weights")[0],
           "grads_fixed": dp.call_sharded("probe_gradients", batch, LOSS, MBS)}
    group.call("set_token_budget", BUDGET)
    out["grads_budget"] = dp.call_sharded("probe_gradients", batch, LOSS, MBS)
    out["logprobs_budget"] = dp.gather_rows("get_logprobs", batch, LP_MBS)
    group.call("set_token_budget", None)
    out["tied_before"] = group.call("tied_copies")
    out["record"] = parity.record_step(dp, batch, LOSS, MBS, LP_MBS)
    for _ in range(TIED_STEPS):
        dp.train(batch, LOSS, MBS)
    out["tied_after"] = group.call("tied_copies")
    out["replicated"] = group.call("replicated_params")
    return out


@pytest.fixture(scope="module")
def results():
    """``results(name)``: the checks of layout ``name`` ("reference": one process), run on
    first use and kept for the module (a failed layout re-raises in each of its tests). One
    :class:`LayoutHost` group per world size serves its layouts; a layout that fails ends its
    group (a rank may be left waiting in a collective), and the next layout starts a new one."""
    cache, hosts = {}, {}

    def get(name):
        if name not in cache:
            world, megatron = ((1, {}) if name == "reference" else
                               (1, {"layer_spec": "torch"}) if name == "reference_torch" else
                               LAYOUTS[name])
            try:
                if world not in hosts:
                    hosts[world] = ProcessWorkerGroup(LayoutHost, world, {})
                cache[name] = _check_layout(hosts[world], megatron)
            except Exception as e:  # noqa: BLE001 -- re-raised by every test of this layout
                cache[name] = e
                group = hosts.pop(world, None)
                if group is not None:
                    group.shutdown()
        if isinstance(cache[name], Exception):
            raise cache[name]
        return cache[name]

    yield get
    for group in hosts.values():
        group.shutdown()


def _by(records, *keys):
    """Group per-rank dicts by the values of ``keys`` (e.g. ranks of one TP group)."""
    groups = {}
    for r in records:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    return groups


# ------------------------------------------------------------------------- per layout

@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_one_step_matches_one_process(results, name):
    ref, got = results("reference")["record"], results(name)["record"]
    diffs = parity.compare(got, ref)
    print(f"\n{parity.parity_table({name: diffs})}")
    assert diffs["logprobs_rel"] < 1e-5
    assert diffs["loss_rel"] < 1e-5
    assert diffs["grad_norm_rel"] < 1e-5
    worst = max(ref.weights, key=lambda k: (got.weights[k] - ref.weights[k]).abs().max().item())
    assert diffs["params_max_abs"] < 1e-6, worst
    # the numbers compared are not trivial: a real loss, gradient and update
    start = initial_hf_state_dict(arch_to_hf_config(ARCH, VOCAB), SEED)
    moved = max((ref.weights[k] - start[k]).abs().max().item() for k in ref.weights)
    assert moved > 2.5e-4 and ref.metrics["grad_norm"] > 1e-3 and abs(ref.metrics["loss"]) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name", CP_LAYOUTS)
def test_context_parallel_matches_one_torch_spec_process(results, name):
    """CP = 2 (and CP = 2 x DP = 2) against CP = 1 of the same (torch) layer spec: the sequence
    split, the all-gathered keys and values, the gathered logprobs and the count taken once
    change no number beyond fp32 round-off (issue 34, item 4)."""
    ref, got = results("reference_torch")["record"], results(name)["record"]
    diffs = parity.compare(got, ref)
    print(f"\n{parity.parity_table({name + ' vs torch CP=1': diffs})}")
    assert diffs["logprobs_rel"] < 1e-5 and diffs["loss_rel"] < 1e-5
    assert diffs["grad_norm_rel"] < 1e-5 and diffs["params_max_abs"] < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("name", ["reference", *LAYOUTS])
def test_export_round_trip_is_bit_exact(results, name):
    """Import of the HF state dict into the layout, then export, gives it back exactly."""
    expected = initial_hf_state_dict(arch_to_hf_config(ARCH, VOCAB), SEED)
    expected.pop("lm_head.weight")  # tied
    got = results(name)["export"]
    assert list(got) == list(expected)
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["reference", *LAYOUTS])
def test_token_budget_gives_same_gradients_and_logprobs(results, name):
    r = results(name)
    for fixed, budget in zip(r["grads_fixed"], r["grads_budget"]):
        assert fixed.keys() == budget.keys()
        for k in fixed:
            assert parity.relative_diff(budget[k], fixed[k]) < 1e-5, k
    assert max(g.abs().max().item() for g in r["grads_fixed"][0].values()) > 1e-4
    assert parity.relative_diff(r["logprobs_budget"], r["record"].logprobs) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("name", PP_LAYOUTS)
def test_tied_embedding_copies_stay_equal(results, name):
    r = results(name)
    before = _by(r["tied_before"], "tp_rank", "dp_rank")
    for key, ranks in _by(r["tied_after"], "tp_rank", "dp_rank").items():
        first = next(x["embedding"] for x in ranks if x["embedding"] is not None)
        last = next(x["output"] for x in ranks if x["output"] is not None)
        start = next(x["embedding"] for x in before[key] if x["embedding"] is not None)
        assert not torch.equal(first, start)  # the steps moved the embedding
        assert torch.equal(first, last), key


@pytest.mark.slow
@pytest.mark.parametrize("name", TP_LAYOUTS)
def test_replicated_params_stay_equal_across_tp(results, name):
    """After several steps (with sequence parallelism the norm gradients are partial per TP
    rank: without their TP all-reduce these would drift apart)."""
    for key, ranks in _by(results(name)["replicated"], "pp_rank", "dp_rank").items():
        assert len(ranks) == 2
        a, b = ranks[0]["params"], ranks[1]["params"]
        assert a.keys() == b.keys() and any("layernorm" in k for k in a)
        assert [k for k in a if not torch.equal(a[k], b[k])] == [], key


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2_pp2", "pp2_dp2"])
def test_rng_is_layout_aware(results, name):
    """Megatron's seeding: the default generator agrees on the TP ranks of a stage (dropout of
    replicated activations), the model-parallel tracker differs per TP rank (dropout in
    TP-split regions), and pipeline stages get different seeds."""
    draws = results(name)["rng"]
    for ranks in _by(draws, "pp_rank", "dp_rank").values():
        assert all(torch.equal(r["default"], ranks[0]["default"]) for r in ranks)
        tracker = {tuple(r["tracker"].tolist()) for r in ranks}
        assert len(tracker) == len(ranks)
    stages = {tuple(r["default"].tolist()) for r in draws if r["tp_rank"] == 0 and r["dp_rank"] == 0}
    assert len(stages) == 2


@pytest.mark.slow
def test_ddp_options_and_sequence_parallel_reach_megatron(results):
    for options in results("dp2")["options"]:
        assert options["ddp"] == dataclasses.asdict(LAYOUTS["dp2"][1]["ddp"])
        assert options["calculate_per_token_loss"] and not options["sequence_parallel"]
    assert all(o["sequence_parallel"] for o in results("tp2_sp")["options"])
    assert all(o["recompute"] == (None, None, None) for o in results("tp2_sp")["options"])
    assert {o["recompute"] for o in results("tp2_recompute_full")["options"]} == {("full", "uniform", 2)}
    assert {o["recompute"] for o in results("pp2_recompute_block")["options"]} == {("full", "block", 1)}
    assert {o["recompute"] for o in results("dp2_recompute_selective")["options"]} == {
        ("selective", None, None)}


CLI_BUDGET = 13  # data.max_total_length of the default config: one whole sequence fits


@pytest.mark.slow
def test_cli_train_with_tensor_parallelism_and_a_token_budget(tmp_path):
    from mcore_rl.cli import main
    from mcore_rl.utils.logging import read_metrics

    out = tmp_path / "run"
    overrides = [
        "policy.megatron.tensor_model_parallel_size=2", "cluster.num_workers=2",
        "cluster.use_ray=false", f"run.output_dir={out}", "grpo.max_steps=2",
        "grpo.num_prompts_per_step=2", "grpo.num_generations=4", "grpo.val_at_start=false",
        "grpo.val_every=0", "grpo.val_num_prompts=2", "logging.progress=false",
        # a short warm start on a 16-prompt task, so rollouts get mixed rewards (a random
        # policy answers none right: zero advantages, zero gradient)
        "sft.steps=40", "sft.lr=1e-2", "sft.batch_size=8", "data.synthetic.max_value=3",
        "data.synthetic.num_train=12", "data.synthetic.num_test=2",
        "model.arch.num_layers=2", "model.arch.hidden_size=32", "model.arch.ffn_hidden_size=64",
        "policy.micro_batch_size=4", "policy.logprob_micro_batch_size=8",
        # 4 rows of >= 6 tokens without it: the workers must cut micro-batches under the budget
        f"policy.max_tokens_per_microbatch={CLI_BUDGET}",
    ]
    assert main(["train", *overrides]) == 0
    records = read_metrics(out)
    assert [r["step"] for r in records][-2:] == [1, 2]
    for r in records[-2:]:
        assert r["train/grad_norm"] > 0
        assert r["train/logprob_mismatch_max"] < 1e-4  # trainer (TP=2) vs rollout logprobs
        assert 0 < r["train/microbatch_tokens_max"] <= CLI_BUDGET


# ------------------------------------------------------------------------- no processes

def test_token_budget_groups_respect_budget_and_cover_rows():
    lengths = torch.tensor([5, 3, 9, 2, 7, 7, 1, 16])
    for budget, multiple in ((16, 1), (16, 2), (20, 4), (100, 1)):
        groups = token_budget_groups(lengths, budget, multiple)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        order = [i for g in groups for i in g]
        assert [int(lengths[i]) for i in order] == sorted(lengths.tolist(), reverse=True)
        for g in groups:
            width = -(-int(lengths[g].max()) // multiple) * multiple
            assert len(g) * width <= budget
    assert token_budget_groups(lengths, 128) == [[7, 2, 4, 5, 0, 1, 3, 6]]  # 8 rows x 16
    assert token_budget_groups(lengths, 127) == [[7, 2, 4, 5, 0, 1, 3], [6]]
    with pytest.raises(ValueError, match="row 7 has 16 tokens.*max_tokens_per_microbatch"):
        token_budget_groups(lengths, 15)


def test_make_microbatches_shapes_and_row_order():
    batch = _batch(7)
    width = int(batch["input_lengths"].max())
    fixed = make_microbatches(batch, 3, width_multiple=4, count_multiple=2, uniform_shapes=True)
    assert len(fixed) == 4 and not shapes_vary(fixed)
    assert fixed[0]["input_ids"].shape == (3, -(-width // 4) * 4)
    assert [mb[ROW_INDEX].tolist() for mb in fixed] == [[0, 1, 2], [3, 4, 5], [6, -1, -1], [-1] * 3]
    assert all(float(mb["token_mask"][mb[ROW_INDEX] < 0].sum()) == 0 for mb in fixed)
    # without uniform shapes the last micro-batch holds only the rows left: no padding rows
    short = make_microbatches(batch, 3, width_multiple=4)
    assert [mb[ROW_INDEX].tolist() for mb in short] == [[0, 1, 2], [3, 4, 5], [6]]
    assert shapes_vary(short) and short[2]["input_ids"].shape == (1, -(-width // 4) * 4)
    budget = make_microbatches(batch, 3, max_tokens_per_microbatch=BUDGET, width_multiple=2)
    assert shapes_vary(budget)
    for mb in budget:
        assert mb["input_ids"].numel() <= BUDGET and mb["input_ids"].shape[1] % 2 == 0
    uniform = make_microbatches(batch, 3, max_tokens_per_microbatch=BUDGET, width_multiple=2,
                                uniform_shapes=True, count_multiple=2)
    assert not shapes_vary(uniform) and len(uniform) % 2 == 0
    assert uniform[0]["input_ids"].shape == (BUDGET // (-(-width // 2) * 2), -(-width // 2) * 2)
    for mbs in (fixed, short, budget, uniform):
        ids = gather_rows([mb["input_ids"] for mb in mbs], [mb[ROW_INDEX] for mb in mbs], 7,
                          batch["input_ids"].shape[1])
        assert torch.equal(ids, batch["input_ids"])
    with pytest.raises(ValueError, match="not a permutation"):
        gather_rows([fixed[0]["input_ids"]], [fixed[0][ROW_INDEX]], 7, width)


def test_compare_and_table():
    w = {"a": torch.zeros(2, 3)}
    ref = parity.StepRecord(torch.full((2, 3), -2.0), {"loss": 0.5, "grad_norm": 2.0}, w)
    got = parity.StepRecord(torch.full((2, 3), -2.002), {"loss": 0.5005, "grad_norm": 2.0},
                            {"a": torch.full((2, 3), 3e-6)})
    diffs = parity.compare(got, ref)
    assert diffs == pytest.approx({"logprobs_rel": 1e-3, "loss_rel": 1e-3, "grad_norm_rel": 0.0,
                                   "params_max_abs": 3e-6, "logprobs_max_abs": 2e-3,
                                   "logprobs_mean_abs": 2e-3, "params_mean_abs": 3e-6},
                                  rel=1e-4, abs=1e-12)
    table = parity.parity_table({"tp2": diffs})
    assert table.splitlines()[1].split() == ["tp2", "1.00e-03", "1.00e-03", "0.00e+00", "3.00e-06"]
    # the mean over a mask's positions only; a row without a column's key leaves it blank
    uneven = parity.StepRecord(torch.tensor([[-2.0, -2.1, -5.0]]), got.metrics, got.weights)
    masked = parity.compare(uneven, parity.StepRecord(torch.full((1, 3), -2.0), ref.metrics, w),
                            mask=torch.tensor([[False, True, False]]))
    assert masked["logprobs_max_abs"] == pytest.approx(0.1)
    assert masked["logprobs_mean_abs"] == pytest.approx(0.1)
    columns = parity.DIFF_KEYS + parity.DETAIL_KEYS
    lines = parity.parity_table({"a": masked, "tolerance": {"loss_rel": 0.5}}, columns).splitlines()
    assert lines[0].split() == ["layout", *columns]
    assert lines[2].split() == ["tolerance", "5.00e-01"]
    with pytest.raises(ValueError, match="weight names differ"):
        parity.compare(parity.StepRecord(got.logprobs, got.metrics, {"b": w["a"]}), ref)


@pytest.mark.parametrize("override, needle", [
    ("policy.megatron.ddp.average_in_collective=true", "average_in_collective must be false"),
    ("policy.megatron.ddp.bucket_size=0", "bucket_size must be null or >= 1"),
    ("policy.max_tokens_per_microbatch=12", "max_tokens_per_microbatch (12) must be null or >= "
                                             "data.max_total_length (13)"),
])
def test_config_refuses_what_cannot_work(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config("grpo_synthetic", [override])
    assert needle in str(e.value)


def test_token_budget_config_accepts_one_sequence():
    cfg = load_config("grpo_synthetic", ["policy.max_tokens_per_microbatch=13"])
    assert cfg.policy.max_tokens_per_microbatch == 13
    with pytest.raises(ConfigError, match="rounded up to a multiple of TP=2"):
        load_config("grpo_synthetic", ["policy.max_tokens_per_microbatch=13", "cluster.num_workers=2",
                                       "policy.megatron.tensor_model_parallel_size=2",
                                       "policy.megatron.sequence_parallel=true"])


def _load_gpu_script():
    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "layout_parity.py"
    spec = importlib.util.spec_from_file_location("layout_parity", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("layout_parity", module)  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_script_imports_and_parses_layouts():
    module = _load_gpu_script()
    L = module.Layout
    args = module.parse_args(["--layouts", "2,1,1", "1,2,1", "--steps", "2"])
    assert args.layouts == [L(2, 1, 1), L(1, 2, 1)] and args.steps == 2
    assert module.parse_args([]).layouts == [L(2, 1, 1), L(1, 2, 1), L(1, 1, 2), L(2, 2, 1)]
    args = module.parse_args(["--reference", "1,1,1:torch", "--layouts",
                              "1,1,1,2:transformer_engine", "1,1,1:fp8-tensorwise"])
    assert args.reference == [L(1, 1, 1, spec="torch")]
    assert args.layouts == [L(1, 1, 1, 2, "transformer_engine"),
                            L(1, 1, 1, spec="transformer_engine", fp8_recipe="tensorwise")]
    assert [x.name("local") for x in args.layouts] == ["TP1 PP1 DP1 CP2 transformer_engine",
                                                       "TP1 PP1 DP1 fp8-tensorwise"]
    fp8 = module.worker_kwargs(args, args.layouts[1])["megatron"]
    assert (fp8.layer_spec, fp8.fp8, fp8.fp8_recipe) == ("transformer_engine", "hybrid",
                                                         "tensorwise")
    assert (fp8.fp8_bf16_layers_at_start, fp8.fp8_bf16_layers_at_end) == (0, 0)
    ends = module.parse_layout("1,1,1:fp8-blockwise-bf16ends")
    assert ends == L(1, 1, 1, spec="transformer_engine", fp8_recipe="blockwise", bf16_ends=True)
    assert ends.name("local") == "TP1 PP1 DP1 fp8-blockwise-bf16ends"
    fp8 = module.worker_kwargs(args, ends)["megatron"]
    assert (fp8.fp8_recipe, fp8.fp8_bf16_layers_at_start, fp8.fp8_bf16_layers_at_end) == (
        "blockwise", 1, 1)
    with pytest.raises(argparse.ArgumentTypeError, match="SPEC is one of"):
        module.parse_layout("1,1,1:fp8-delayed-bf16ends")  # Megatron refuses it
    torch_args = module.parse_args(["--layer-spec", "torch"])
    cp = module.worker_kwargs(torch_args, L(1, 1, 1, 2))["megatron"]
    assert (cp.context_parallel_size, cp.cp_comm_type, cp.layer_spec) == (2, "all_gather", "torch")
    args = module.parse_args(["--reference", "1,1,1:transformer_engine",
                              "1,1,1:transformer_engine:packed", "--layouts", "1,1,1,2:packed",
                              "--max-tokens-per-microbatch", "4096"])
    assert args.reference == [L(1, 1, 1, spec="transformer_engine"),
                              L(1, 1, 1, spec="transformer_engine", packed=True)]
    assert args.layouts == [L(1, 1, 1, 2, packed=True)]
    assert args.layouts[0].name("torch") == "TP1 PP1 DP1 CP2 torch packed"
    packed = module.worker_kwargs(args, args.reference[1])
    assert packed["sequence_packing"] and packed["max_tokens_per_microbatch"] == 4096
    padded = module.worker_kwargs(args, args.reference[0])
    assert not padded["sequence_packing"] and padded["max_tokens_per_microbatch"] is None
    for bad in (["--layouts", "2,1"], ["--layouts", "1,1,1:tensorrt"], ["--set", "a=1"],
                ["--layouts", "1,1,1:torch:local"], ["--layouts", "1,1,1:packing"]):
        with pytest.raises(SystemExit):
            module.parse_args(bad)


def test_gpu_script_compares_specs_and_cp_on_cpu(capsys):
    """scripts/gpu/layout_parity.py's code path on CPU (gloo, fp32): the local spec and the
    torch spec's packed micro-batches at CP=2 against the torch spec in one process, padded
    and packed (two references, each layout against each), on a tiny shape (the GPU runs
    compare transformer_engine with torch and local the same way, session.sh te_parity, and
    packed CP=2 with CP=1 on both specs, session.sh cp2). Rows of 4 to 16 tokens, most not
    multiples of 2 CP = 4, two to a packed micro-batch (budget 24 tokens)."""
    module = _load_gpu_script()
    rc = module.main(["--device", "cpu", "--precision", "fp32", "--num-layers", "2",
                      "--hidden-size", "32", "--ffn-hidden-size", "64", "--heads", "4",
                      "--query-groups", "2", "--vocab-size", "47", "--rows", "4",
                      "--max-length", "16", "--micro-batch-size", "2", "--lr", "1e-3",
                      "--max-tokens-per-microbatch", "24", "--prev-logprobs", "reference",
                      "--reference", "1,1,1:torch", "1,1,1:torch:packed",
                      "--layouts", "1,1,1:local", "1,1,1,2:torch:packed"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = {line.split(" vs ")[0] + " vs " + line.split(" vs ")[1].split("  ")[0]: line.split()
            for line in out.splitlines() if line.startswith("TP1 PP1 DP1 ") and " vs " in line}
    assert set(rows) == {f"{a} vs {b}" for a in ("TP1 PP1 DP1 local", "TP1 PP1 DP1 CP2 torch packed")
                         for b in ("TP1 PP1 DP1 torch", "TP1 PP1 DP1 torch packed")}, out
    for cells in rows.values():  # fp32: specs, packing and CP agree far inside bf16 tolerances
        numbers = [float(c) for c in cells if "e" in c and c[0].isdigit()]
        assert len(numbers) == 7 and max(numbers) < 1e-4, out
    for ref in ("TP1 PP1 DP1 torch", "TP1 PP1 DP1 torch packed"):
        assert any(line.startswith(f"reference {ref} ") and " loss " in line
                   for line in out.splitlines()), out
    assert "FAIL" not in out

"""Value worker on real Megatron-Core over gloo.

- Right shift pinned: ``get_values`` equals Hugging Face's token-classification model (its own
  Qwen2 forward) on the exported weights, shifted right by one; changing token k leaves
  ``values[:, :k+1]`` alone and changes ``values[:, k+1]``.
- Layout parity: values, metrics and weights after one clipped-value-loss step at TP=2, PP=2,
  DP=2, CP=2 (torch spec: the head's output gathered over CP ranks) and TP=2 with sequence
  parallelism (torch spec, padded and packed micro-batches: the head's output gathered over
  the sequence) equal one process (fp32); the replicated head stays identical over TP ranks.
- Split step (begin / train_microbatch / finish) equals sync ``train``.
- A base LM checkpoint initialises the backbone and not the head; ``load_backbone``;
  checkpoints restore weights and Adam state.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import _WORLD, run_distributed, use_layout
from rollouts import random_rows
from mcore_rl.algorithms.losses import ClippedValueLoss
from mcore_rl.config.schema import MegatronConfig, ModelArchConfig, OptimizerConfig, ValueLossConfig
from mcore_rl.data import batch as B
from mcore_rl.megatron.conversion import arch_to_hf_config

VOCAB = 48
# Tied embeddings: with PP=2 the critic must not all-reduce an embedding copy it does not have.
ARCH = ModelArchConfig(family="qwen2", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=64, max_position_embeddings=64, qkv_bias=True, tie_word_embeddings=True,
                       vocab_size=VOCAB)
LOSS = ClippedValueLoss(ValueLossConfig(cliprange=0.05, coef=1.0))
# name: (TP, PP, other policy.megatron fields, other worker arguments); cp2: context parallelism
# on the torch spec; tp2_sp*: sequence parallelism on the torch spec (the head sees s / TP
# positions per rank), padded and packed micro-batches
TORCH_SP = dict(sequence_parallel=True, layer_spec="torch")
LAYOUTS = {"tp2": (2, 1, {}, {}), "pp2": (1, 2, {}, {}), "dp2": (1, 1, {}, {}),
           "cp2": (1, 1, dict(context_parallel_size=2, layer_spec="torch",
                              cp_comm_type="all_gather"), {}),
           "tp2_sp": (2, 1, TORCH_SP, {}),
           "tp2_sp_packed": (2, 1, TORCH_SP, dict(sequence_packing=True,
                                                  max_tokens_per_microbatch=24))}


def _worker_kwargs(tp=1, pp=1, **megatron):
    return dict(
        hf_path=None, hf_config=arch_to_hf_config(ARCH, VOCAB).to_dict(), vocab_size=VOCAB, head_fp32=True,
        arch=ARCH, megatron=MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                           **megatron),
        # SGD: the step is linear in the gradient (Adam's first step is lr * sign(g), which
        # turns the rounding noise of a zero gradient, e.g. the k_proj bias's, into lr).
        optimizer=OptimizerConfig(name="sgd", lr=0.1, clip_grad=1.0), rank=_WORLD["rank"], world_size=_WORLD["world_size"],
        master_addr="127.0.0.1", master_port=_WORLD["port"], device="cpu", seed=7, total_optimizer_steps=10,
        global_batch_size=8)


def _worker(tp=1, pp=1, megatron=None, **overrides):
    from mcore_rl.workers.value import ValueWorker

    return ValueWorker(**{**_worker_kwargs(tp, pp, **(megatron or {})), **overrides})


def _batch(n=8, seed=0):
    """Right-padded rows (prompts of 3-5 tokens, responses of 2-6) with returns and old values."""
    g = torch.Generator().manual_seed(seed)
    rows = random_rows(n, VOCAB, (3, 5), (2, 6), g)
    mask = rows["token_mask"]
    return {**rows, "returns": torch.randn(mask.shape, generator=g) * mask}


def _with_old_values(worker, batch):
    """``prev_values``: the worker's values moved by seeded noise, so the value clip bites."""
    noise = 0.1 * torch.randn(batch["input_ids"].shape, generator=torch.Generator().manual_seed(5))
    return dict(batch, prev_values=worker.get_values(batch, 4) + noise * batch["token_mask"])


def _train_step(worker, batch, shard):
    """One step on this rank's shard of the global batch."""
    return worker.train(shard(_with_old_values(worker, batch)), LOSS, B.batch_size(batch), 2)


def _one_process(ckpt_dir, hf_dir):
    """Everything a single process checks, and the references of the layout run."""
    from transformers import AutoModelForTokenClassification

    from mcore_rl.megatron.conversion import load_hf_checkpoint
    from mcore_rl.workers.policy import initial_hf_state_dict

    out = {}
    batch = _batch()
    w = _worker()
    values = w.get_values(batch, 4)
    # HF's own forward of the exported critic: logits at t = head at t, so values = shift.
    hf_cfg = arch_to_hf_config(ARCH, VOCAB)
    hf_cfg.num_labels = 1
    hf = AutoModelForTokenClassification.from_config(hf_cfg).eval()
    exported = w.get_hf_weights()
    hf.load_state_dict(exported)
    with torch.no_grad():
        logits = hf(batch["input_ids"]).logits[..., 0]
    out["values"], out["hf_logits"] = values, logits
    out["exported"] = exported
    out["initial"] = initial_hf_state_dict(hf_cfg, 7)
    perturbed = batch["input_ids"].clone()
    perturbed[:, 4] = (perturbed[:, 4] % (VOCAB - 1)) + 1 + (perturbed[:, 4] == VOCAB - 1)
    out["perturbed_values"] = w.get_values(dict(batch, input_ids=perturbed), 4)

    out["metrics"] = _train_step(w, batch, lambda b: b)
    out["after"] = w.get_hf_weights()

    # split step == sync train, on a fresh worker with the same start
    s = _worker()
    full = _with_old_values(s, batch)
    s.begin_train_step(LOSS, 8, 2)
    for part in B.shard(full, 2):
        s.train_microbatch(part)
    out["split_metrics"] = s.finish_train_step()
    out["split_after"] = s.get_hf_weights()

    # checkpoint (Adam): save after one step, load into a fresh worker, a second step on both
    adam = OptimizerConfig(lr=1e-2, clip_grad=1.0)
    a = _worker(optimizer=adam)
    _train_step(a, batch, lambda b: b)
    a.save_checkpoint(ckpt_dir)
    r = _worker(optimizer=adam)
    r.load_checkpoint(ckpt_dir)
    out["saved_values"], out["restored_values"] = a.get_values(batch, 4), r.get_values(batch, 4)
    second = _batch(seed=1)
    _train_step(a, second, lambda b: b)
    _train_step(r, second, lambda b: b)
    out["second_straight"], out["second_restored"] = a.get_hf_weights(), r.get_hf_weights()
    f = _worker(optimizer=adam)  # the same weights with a fresh optimizer: another second step
    f.load_checkpoint(ckpt_dir)
    f.rebuild_optimizer()
    _train_step(f, second, lambda b: b)
    out["second_fresh_optimizer"] = f.get_hf_weights()

    # base LM checkpoint -> backbone; load_backbone keeps the head
    base = _worker(hf_path=hf_dir)
    out["from_checkpoint"] = base.get_hf_weights()
    out["checkpoint_state"] = load_hf_checkpoint(hf_dir)[1]
    head_before = base.get_hf_weights()["score.weight"]
    base.load_backbone(out["initial"])
    out["reloaded"] = base.get_hf_weights()
    out["head_before_reload"] = head_before
    return out


def _layouts():
    """One step in each layout of 2 processes; per layout: values, metrics, weights, head."""
    out = {}
    batch = _batch()
    for name, (tp, pp, megatron, extra) in LAYOUTS.items():
        use_layout(tp, pp, context_parallel_size=megatron.get("context_parallel_size", 1))
        w = _worker(tp, pp, megatron, **extra)
        layout = w.layout()
        dp, dp_rank = layout["dp_size"], layout["dp_rank"]
        values = w.get_values(B.shard(batch, dp)[dp_rank], 4)
        metrics = _train_step(w, batch, lambda b: B.shard(b, dp)[dp_rank])
        head = w.model[-1].module.output_layer if w._is_last_stage() else None
        out[name] = {"values": values, "metrics": metrics, "after": w.get_hf_weights(),
                     "head": None if head is None else head.weight.detach().clone()}
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    hf_dir = tmp_path_factory.mktemp("base_lm")
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(arch_to_hf_config(ARCH, VOCAB)).save_pretrained(hf_dir)
    return run_distributed(_one_process, 1, str(tmp_path_factory.mktemp("ckpt")), str(hf_dir))[0]


@pytest.fixture(scope="module")
def layouts():
    return run_distributed(_layouts, 2)


def _assert_weights_close(a, b, tol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)


def test_values_are_the_head_at_the_previous_position(single):
    values, logits = single["values"], single["hf_logits"]
    batch = _batch()
    valid = torch.arange(values.shape[1])[None, :] < batch["input_lengths"][:, None]
    expected = torch.cat([torch.zeros_like(logits[:, :1]), logits[:, :-1]], dim=1) * valid
    torch.testing.assert_close(values, expected, rtol=1e-5, atol=1e-6)
    assert (values[:, 0] == 0).all()
    # the head's outputs differ at every position, so an unshifted read would not match
    assert (logits[:, 1:] - logits[:, :-1]).abs().min() > 0


def test_token_k_changes_only_values_after_it(single):
    values, perturbed = single["values"], single["perturbed_values"]
    assert torch.equal(values[:, :5], perturbed[:, :5])  # V(x_<t) for t <= 4 never sees x_4
    assert ((values[:, 5] - perturbed[:, 5]).abs() > 0).all()


def test_backbone_starts_from_the_seeded_policy_init_and_head_is_fresh(single):
    exported, initial = single["exported"], single["initial"]
    for k, v in exported.items():
        if not k.startswith("score."):
            torch.testing.assert_close(v, initial[k], rtol=0, atol=0, msg=k)
    assert exported["score.weight"].abs().sum() > 0 and exported["score.bias"].abs().sum() == 0


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_one_process(single, layouts, name):
    ranks = [r[name] for r in layouts]
    if name == "dp2":  # each rank has its shard's values (padded to its own longest row)
        width = single["values"].shape[1]
        values = torch.cat([torch.nn.functional.pad(r["values"], (0, width - r["values"].shape[1]))
                            for r in ranks])
    else:
        values = ranks[0]["values"]
        assert torch.equal(ranks[0]["values"], ranks[1]["values"])
    torch.testing.assert_close(values, single["values"], rtol=1e-5, atol=1e-6)
    for k in ("loss", "vf_clipfrac", "value_mean", "grad_norm", "num_valid_tokens"):
        assert ranks[0]["metrics"][k] == pytest.approx(single["metrics"][k], rel=1e-5, abs=1e-7), k
        assert ranks[1]["metrics"][k] == ranks[0]["metrics"][k]
    assert 0 < single["metrics"]["vf_clipfrac"] < 1  # the clip is exercised
    _assert_weights_close(ranks[0]["after"], single["after"])
    if name.startswith("tp2"):  # the replicated head got the same update on both TP ranks
        assert torch.equal(ranks[0]["head"], ranks[1]["head"])


def test_split_step_equals_sync_train(single):
    for k in ("loss", "vf_clipfrac", "value_mean", "grad_norm", "num_valid_tokens"):
        assert single["split_metrics"][k] == pytest.approx(single["metrics"][k], rel=1e-6, abs=1e-8), k
    _assert_weights_close(single["split_after"], single["after"])


def test_checkpoint_restores_weights_and_optimizer(single):
    torch.testing.assert_close(single["restored_values"], single["saved_values"], rtol=0, atol=0)
    # the second Adam step equals the straight run's only if the moments were restored
    _assert_weights_close(single["second_restored"], single["second_straight"], tol=0)
    fresh, straight = single["second_fresh_optimizer"], single["second_straight"]
    assert any(not torch.equal(fresh[k], straight[k]) for k in straight)


def test_base_lm_checkpoint_sets_backbone_not_head(single):
    ckpt, got = single["checkpoint_state"], single["from_checkpoint"]
    assert set(got) == (set(ckpt) - {"lm_head.weight"}) | {"score.weight", "score.bias"}
    for k in ckpt:
        if k != "lm_head.weight":
            torch.testing.assert_close(got[k], ckpt[k], rtol=0, atol=0, msg=k)
    torch.testing.assert_close(got["score.weight"], single["exported"]["score.weight"], rtol=0, atol=0)
    reloaded = single["reloaded"]
    for k, v in single["initial"].items():
        if k != "lm_head.weight":
            torch.testing.assert_close(reloaded[k], v, rtol=0, atol=0, msg=k)
    torch.testing.assert_close(reloaded["score.weight"], single["head_before_reload"], rtol=0, atol=0)

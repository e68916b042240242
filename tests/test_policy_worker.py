"""Policy worker on real Megatron-Core over gloo: DP=2 equals one process; trainer and rollout
logprobs agree after a train step and refit; the first step's KL to the reference is 0; with
``manual_gc_interval`` garbage is collected only after every N-th optimizer step, on all ranks."""

from __future__ import annotations

import gc

import pytest
import torch

from mcore_rl.algorithms.losses import ClippedPGLoss
from mcore_rl.config.schema import GenerationConfig, LossConfig, MegatronConfig, ModelArchConfig, OptimizerConfig
from mcore_rl.data import batch as B
from mcore_rl.distributed.worker_group import ProcessWorkerGroup
from mcore_rl.generation.hf import HFGenerationBackend
from mcore_rl.megatron.conversion import arch_to_hf_config
from mcore_rl.workers.policy import PolicyWorker
from dist_utils import run_distributed
from rollouts import random_rows

VOCAB = 48
ARCH = ModelArchConfig(family="qwen2", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=64, max_position_embeddings=64, qkv_bias=True, tie_word_embeddings=False,
                       vocab_size=VOCAB)


def _kwargs(lr=1e-2, **megatron):
    return dict(
        hf_path=None,
        hf_config=arch_to_hf_config(ARCH, VOCAB).to_dict(),
        vocab_size=VOCAB,
        temperature=1.0,
        use_reference=True,
        arch=ARCH,
        megatron=MegatronConfig(**megatron),
        optimizer=OptimizerConfig(lr=lr, clip_grad=1.0),
        device="cpu",
        seed=7,
        total_optimizer_steps=10,
        global_batch_size=8,
    )


def _rollout(n=8, seed=0):
    """A synthetic right-padded rollout batch with prompts of 3-5 tokens and responses of 2-6."""
    g = torch.Generator().manual_seed(seed)
    rows = random_rows(n, VOCAB, (3, 5), (2, 6), g)
    return {**rows, "advantages": torch.randn(n, generator=g)[:, None] * rows["token_mask"]}


@pytest.fixture(scope="module")
def groups():
    one = ProcessWorkerGroup(PolicyWorker, 1, _kwargs())
    two = ProcessWorkerGroup(PolicyWorker, 2, _kwargs())
    yield one, two
    one.shutdown()
    two.shutdown()


def _train(group, batch, loss):
    shards = B.shard(batch, group.world_size)
    return group.call_each("train", [[s, loss, B.batch_size(batch), 2] for s in shards])


def test_dp2_matches_one_process(groups):
    one, two = groups
    batch = _rollout()
    lp1 = one.call("get_logprobs", batch, 4)[0]
    shards = B.shard(batch, 2)
    lp2 = torch.cat(two.call_each("get_logprobs", [[s, 4] for s in shards]))
    torch.testing.assert_close(lp2, lp1, rtol=1e-5, atol=1e-6)
    batch["prev_logprobs"] = lp1
    # A rollout engine off by up to 0.3 nats: the importance weights' statistics are reported
    # (no correction is configured); their maximum is reduced with MAX over micro-batches and DP.
    noise = 0.3 * torch.rand(lp1.shape, generator=torch.Generator().manual_seed(1))
    batch["generation_logprobs"] = lp1 - noise
    valid = (batch["token_mask"] * batch["sample_mask"][:, None])[:, 1:] > 0
    loss = ClippedPGLoss(LossConfig(kl_coef=0.0))
    m1 = _train(one, batch, loss)[0]
    m2 = _train(two, batch, loss)
    assert m2[0] == m2[1]
    for k in ("loss", "grad_norm", "clip_fraction", "num_valid_tokens", "is_weight_mean",
              "is_weight_max"):
        assert m2[0][k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), k
    assert m1["is_weight_max"] == pytest.approx(float(noise[:, 1:][valid].exp().max()), rel=1e-6)
    assert m1["is_weight_mean"] == pytest.approx(float(noise[:, 1:][valid].exp().mean()), rel=1e-6)
    w1 = one.call("get_hf_weights")[0]
    w2 = two.call("get_hf_weights")[0]
    assert w1.keys() == w2.keys()
    for k in w1:
        assert (w1[k] - w2[k]).abs().max() < 1e-6, k


def test_rollout_logprobs_match_trainer_after_refit_and_first_kl_is_zero():
    group = ProcessWorkerGroup(PolicyWorker, 1, _kwargs())
    try:
        hf_config = arch_to_hf_config(ARCH, VOCAB)
        gen = HFGenerationBackend(hf_config, GenerationConfig(max_new_tokens=6), eos_token_id=0, pad_token_id=0,
                                  max_total_length=16)
        gen.update_weights(group.call("get_hf_weights")[0].items())
        prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]] * 2
        rollout = gen.generate(prompts, seed=3)
        n = B.batch_size(rollout)
        rollout["sample_mask"] = torch.ones(n)
        rollout["advantages"] = torch.linspace(-1, 1, n)[:, None] * rollout["token_mask"]
        lp = group.call("get_logprobs", rollout, 4)[0]
        ref = group.call("get_reference_logprobs", rollout, 4)[0]
        assert torch.equal(lp, ref)
        rollout["prev_logprobs"] = lp
        rollout["reference_logprobs"] = ref
        m = group.call("train", rollout, ClippedPGLoss(LossConfig(kl_coef=0.1)), n, 2)[0]
        assert m["kl"] == 0.0
        # refit, sample again: the rollout engine's logprobs equal the trainer's
        gen.update_weights(group.call("get_hf_weights")[0].items())
        rollout2 = gen.generate(prompts, seed=4)
        lp2 = group.call("get_logprobs", rollout2, 4)[0]
        diff = ((lp2 - rollout2["generation_logprobs"]).abs() * rollout2["token_mask"]).max()
        assert diff < 1e-4
        ref2 = group.call("get_reference_logprobs", rollout2, 4)[0]
        assert not torch.equal(lp2, ref2)  # the policy moved, the reference did not
    finally:
        group.shutdown()


class GCRecordingWorker(PolicyWorker):
    """A policy worker that records every garbage collection of its process as
    ``(generation, trainer_version)``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.collections = []
        gc.callbacks.append(self._record)

    def _record(self, phase, info):
        if phase == "start":
            self.collections.append((info["generation"], self.trainer_version))

    def make_cyclic_garbage(self, n: int) -> None:
        """``n`` unreachable self-referencing lists: enough allocations to trigger automatic
        collections of every generation if they were on."""
        for _ in range(n):
            cycle = []
            cycle.append(cycle)

    def gc_report(self):
        return gc.isenabled(), list(self.collections)


def test_manual_gc_collects_after_every_nth_optimizer_step_on_all_ranks():
    group = ProcessWorkerGroup(GCRecordingWorker, 2, dict(_kwargs(), manual_gc_interval=2))
    try:
        batch = _rollout()
        batch["prev_logprobs"] = torch.cat(group.call_each(
            "get_logprobs", [[s, 4] for s in B.shard(batch, 2)]))
        loss = ClippedPGLoss(LossConfig(kl_coef=0.0))
        for step in range(1, 5):
            group.call("make_cyclic_garbage", 200_000)
            if step == 3:  # the split step collects as train() does
                shards = B.shard(batch, 2)
                group.call("begin_train_step", loss, B.batch_size(batch), 2)
                group.call_each("train_microbatch", [[s] for s in shards])
                group.call("finish_train_step")
            else:
                _train(group, batch, loss)
        for enabled, collections in group.call("gc_report"):
            assert not enabled
            assert collections == [(2, 2), (2, 4)]  # full collections, after steps 2 and 4 only
    finally:
        group.shutdown()


def test_manual_gc_interval_must_not_be_negative():
    with pytest.raises(ValueError, match="manual_gc_interval must be >= 0"):
        PolicyWorker(**_kwargs(), manual_gc_interval=-1, rank=0, world_size=1,
                     master_addr="127.0.0.1", master_port=0)


def _warmup_longer_than_the_run():
    from dist_utils import _WORLD

    from mcore_rl.workers.policy import PolicyWorker

    kw = dict(_kwargs(), optimizer=OptimizerConfig(lr=1e-2, lr_warmup_steps=5, clip_grad=1.0),
              total_optimizer_steps=2)
    worker = PolicyWorker(**kw, rank=0, world_size=1, master_addr="127.0.0.1",
                          master_port=_WORLD["port"])
    batch = _rollout()
    lrs = []
    for _ in range(2):
        rows = dict(batch, prev_logprobs=worker.get_logprobs(batch, 4))
        lrs.append(worker.train(rows, ClippedPGLoss(LossConfig()), B.batch_size(rows), 4)["lr"])
    return lrs


def test_a_run_shorter_than_its_lr_warmup_trains_while_warming_up():
    """2 optimizer steps with lr_warmup_steps=5 (a smoke run of a config with a warmup):
    Megatron's scheduler asserts warmup < decay; the run trains at the warmup's lr, 0 then
    lr/5 (the lr read before each step's scheduler increment)."""
    lrs = run_distributed(_warmup_longer_than_the_run, 1)[0]
    assert lrs == pytest.approx([0.0, 2e-3])

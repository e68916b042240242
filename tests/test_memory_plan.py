"""The pre-launch memory planner (``mcore-rl plan``, :mod:`mcore_rl.megatron.memory`): its
parameter counts per rank against the numel of real Megatron models built on CPU ranks (TP=2,
PP=2, four families), its byte figures against their definitions, the CLI table, and ``train``
refusing a layout predicted not to fit (exit 2, before any worker or run directory), and its
terms against what the code allocates: the megatron decoder's KV cache and row states after a
run's generate calls, the workers' micro-batch tokens; the phases a run enters; and
scripts/gpu/llama8b.py's memory rows, refit line and summary, and its streaming recorder."""

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


def test_activation_recompute_keeps_what_megatron_keeps():
    """policy.megatron.recompute_*: full uniform keeps each group's input ([s, b, h]) per
    micro-batch in flight plus one group recomputed; block keeps the first k layers' inputs and
    the others whole; selective drops the core attention's output copy (and, for the local
    spec, the s^2 scores and the repeated KV heads)."""
    cfg = load_config("grpo_llama8b", [])
    arch, m = cfg.model.arch, cfg.policy.megatron  # 32 layers, bf16, torch spec, TP=2
    rows, seq = 4, 1000
    per_layer = memory.activation_bytes_per_layer(arch, m, rows, seq)
    layer_input = 4096 * 2 * rows * seq  # h elements a token, bf16
    assert memory.stage_activation_bytes(arch, m, rows, seq, 1) == 32 * per_layer
    full = dataclasses.replace(m, recompute_granularity="full", recompute_num_layers=4)
    assert memory.stage_activation_bytes(arch, full, rows, seq, 2) == (
        2 * 8 * layer_input + 4 * per_layer)
    block = dataclasses.replace(full, recompute_method="block", recompute_num_layers=30)
    assert memory.stage_activation_bytes(arch, block, rows, seq, 1) == (
        30 * layer_input + 2 * per_layer + per_layer)
    selective = dataclasses.replace(m, recompute_granularity="selective")
    attention_copy = 32 * 128 * 2 // 2 * rows * seq  # a d / t elements a token, bf16
    assert memory.activation_bytes_per_layer(arch, selective, rows, seq) == per_layer - attention_copy
    local = dataclasses.replace(m, layer_spec="local")
    local_selective = dataclasses.replace(local, recompute_granularity="selective")
    scores = 5 * 32 * seq * seq * rows // 2
    repeated_kv = 2 * (32 - 8) * 128 // 2 * 2 * rows * seq
    assert memory.activation_bytes_per_layer(arch, local_selective, rows, seq) == (
        memory.activation_bytes_per_layer(arch, local, rows, seq) - scores - repeated_kv
        - attention_copy)
    # packed micro-batches need PP = 1: no layout with PP > 1 is offered
    assert {pp for _, pp, _ in memory.candidate_layouts(cfg, arch)} == {1}
    assert {pp for _, pp, _ in memory.candidate_layouts(
        load_config("grpo_llama8b", ["policy.sequence_packing=false"]), arch)} == {1, 2, 4}
    # the plan of the 8B config shrinks by the recomputed activations
    plan = memory.plan_memory(cfg, arch)
    recomputed = memory.plan_memory(load_config("grpo_llama8b", [
        "policy.megatron.recompute_granularity=full"]), arch)
    assert recomputed.phases["train"] < plan.phases["train"] - 8 * 2**30


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



def test_auto_keeps_the_train_state_where_the_plan_fits_with_it():
    """cluster.offload_train_state=auto at the 8B config (TP=2 x DP=2, two colocated vLLM
    engines at 0.45 of the GPU) picks the least that fits: the training state (44.9 GiB) and
    the engines' awake share fit a 141 GiB GPU together (false); on an 80 GiB one they do not,
    but without the gradient buffers (15.0 GiB) they do (grads); with the engines at 0.7 of
    it only offloading all of it fits (true). The generation phase holds what stays, and the
    plan says which and why in one line."""
    plans = {}
    cases = {"141": ["cluster.gpu_memory_gb=141"], "80": ["cluster.gpu_memory_gb=80"],
             "80, engine 0.7": ["cluster.gpu_memory_gb=80",
                                "generation.vllm.gpu_memory_utilization=0.7"]}
    for case, extra in cases.items():
        for setting in ("auto", "true", "grads", "false"):
            cfg = load_config("grpo_llama8b", [*extra, f"cluster.offload_train_state={setting}"])
            plans[case, setting] = memory.plan_memory(cfg, cfg.model.arch)
    for case, picked in (("141", "false"), ("80", "grads"), ("80, engine 0.7", "true")):
        auto, off = plans[case, "auto"], plans[case, "true"]
        grads, stays = plans[case, "grads"], plans[case, "false"]
        resident = sum(r.static for r in stays.roles)
        engine = sum(stays.engine.values())
        assert off.phases["generation"] == engine  # vLLM: the policy holds nothing
        assert stays.phases["generation"] == resident + engine
        assert grads.phases["generation"] == resident - stays.roles[0].grads + engine
        assert stays.phases["train"] == off.phases["train"] == grads.phases["train"]
        assert auto.offload_mode == picked
        assert auto.phases == plans[case, picked].phases
        assert [plans[case, m].offload_mode for m in ("true", "grads", "false")] == [
            "true", "grads", "false"]
        assert auto.train_state_offloaded is (picked == "true")
        line = memory.format_plan(auto).splitlines()[-1]
        assert line == auto.offload_decision
        assert line.startswith(f"cluster.offload_train_state=auto -> {picked}: ")
        # the rule, on the plan's own terms: the first of false, grads, true that fits
        fitting = [m for m in ("false", "grads", "true") if plans[case, m].fits]
        assert fitting[0] == picked
    assert plans["80", "auto"].offload_decision == (
        "cluster.offload_train_state=auto -> grads: with the policy's training state resident "
        "generation would need 80.87 GiB > cluster.gpu_memory_gb=80 (generation 80.87 GiB = "
        "training state 44.87 + engine awake 36.00); its gradient buffers (14.96 GiB) are "
        "dropped while the engine decodes; the weights and optimizer state (29.92 GiB) stay "
        "(peak 65.92 GiB in generation)")
    assert plans["80, engine 0.7", "auto"].offload_decision.startswith(
        "cluster.offload_train_state=auto -> true: with the policy's training state resident "
        "generation would need 100.87 GiB > cluster.gpu_memory_gb=80")
    # without colocation, or streaming, nothing moves and nothing is said
    for extra in (["cluster.colocate_generation=false"], [
            "grpo.streaming=true", "generation.backend=hf", "generation.num_workers=1",
            "loss.prev_logprobs=recompute"]):
        cfg = load_config("grpo_llama8b", extra)
        plan = memory.plan_memory(cfg, cfg.model.arch)
        assert plan.offload_mode == "false" and plan.offload_decision == ""


def test_a_false_that_does_not_fit_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """cluster.offload_train_state=false where only offloading fits: refused at load (one line:
    the phase, the predicted GiB, the keys to change) unless cluster.skip_memory_check."""
    cfg = load_config("grpo_llama8b", ["cluster.offload_train_state=false"])
    assert memory.memory_error(cfg, cfg.model.arch) == (
        "cluster.offload_train_state=false: with the policy's training state on the GPU while "
        "the engine decodes, generation is predicted to need 80.87 GiB per GPU "
        "(cluster.gpu_memory_gb=80; offloaded: peak 56.85); set "
        "cluster.offload_train_state=auto (or true), or cluster.skip_memory_check=true to "
        "train anyway")
    # grads where even the engines' awake share beside the weights and optimizer does not fit
    cfg = load_config("grpo_llama8b", ["cluster.offload_train_state=grads",
                                       "generation.vllm.gpu_memory_utilization=0.7"])
    assert memory.memory_error(cfg, cfg.model.arch) == (
        "cluster.offload_train_state=grads: with the policy's weights and optimizer state on "
        "the GPU while the engine decodes, generation is predicted to need 85.92 GiB per GPU "
        "(cluster.gpu_memory_gb=80; offloaded: peak 56.85); set "
        "cluster.offload_train_state=auto (or true), or cluster.skip_memory_check=true to "
        "train anyway")
    for fits in (["cluster.gpu_memory_gb=141"], ["cluster.offload_train_state=auto"]):
        cfg = load_config("grpo_llama8b", ["cluster.offload_train_state=false", *fits])
        assert memory.memory_error(cfg, cfg.model.arch) is None
    # a layout that does not fit either way: the layout's own refusal
    cfg = load_config("grpo_llama8b", ["cluster.offload_train_state=false",
                                       "cluster.gpu_memory_gb=50"])
    assert memory.memory_error(cfg, cfg.model.arch).startswith("cluster.gpu_memory_gb=50: layout")
    from mcore_rl.megatron import parallel

    monkeypatch.setattr(parallel, "resolve_device", lambda device: "cuda")  # a CPU-only host
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:  # 6 GiB resident + vLLM's 5 of a 10 GiB GPU
        main(["train", "--config-name", "grpo_synthetic_gpu", "cluster.use_ray=false",
              "cluster.num_workers=4", "generation.backend=vllm",
              "cluster.colocate_generation=true", "cluster.offload_train_state=false",
              "cluster.gpu_memory_gb=10", f"run.output_dir={out}"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mcore-rl train: error: cluster.offload_train_state=false: with the "
                          "policy's training state on the GPU while the engine decodes, "
                          "generation is predicted to need 11.00 GiB per GPU "
                          "(cluster.gpu_memory_gb=10; offloaded: peak 6.79); ")
    assert len(err.splitlines()) == 1 and not out.exists()

# ---------------------------------------------------------------- terms against the real code
def test_decoder_constants_are_the_megatron_decoders():
    from mcore_rl.generation import megatron as decoder

    assert (memory.DECODER_MIN_ROWS, memory.DECODER_MIN_SPAN, memory.DECODER_PREFILL_TOKENS) == (
        decoder._MIN_ROWS, decoder._MIN_SPAN, decoder._PREFILL_TOKENS)


def _stub_decoder(arch: ModelArchConfig, dtype):
    """A :class:`~mcore_rl.generation.megatron.MegatronDecoder` whose model is a stub: the
    buffers it reserves (``_reserve``: KV cache, row states) are the real ones; no forward."""
    import types

    import torch

    from mcore_rl.config.families import head_dim
    from mcore_rl.generation.megatron import MegatronDecoder

    d = head_dim(arch)
    dec = MegatronDecoder.__new__(MegatronDecoder)
    config = types.SimpleNamespace(bias_dropout_fusion=False, bias_activation_fusion=False,
                                   params_dtype=dtype, num_moe_experts=None)
    param = torch.nn.Parameter(torch.zeros(1))
    dec.model = torch.nn.Module()
    dec.gpt = types.SimpleNamespace(config=config, parameters=lambda: iter([param]),
                                    rotary_pos_emb=lambda n: torch.zeros(n, 1, 1, d))
    dec.megatron, dec.vocab_size, dec.device = MegatronConfig(), VOCAB, torch.device("cpu")
    dec.attentions = [types.SimpleNamespace(layer_number=i + 1,
                                            num_query_groups_per_partition=arch.num_query_groups,
                                            key_hidden_size=d, val_hidden_size=d)
                      for i in range(arch.num_layers)]
    dec._slots = dec._cache = dec._rope = dec._pool = dec._stream = None
    dec._graphs, dec._weights = {}, ()
    dec._decode_chunk = lambda chunk, *args: [None] * len(chunk)
    return dec


@pytest.mark.parametrize("overrides,prompt", [
    ([], 100),  # validation's 32 held-out prompts (val_num_prompts 200, the samples' test file)
    (["generation.batch_size=16"], 100),  # chunks of 16 rows
    (["grpo.num_prompts_per_step=20", "grpo.num_generations=3", "grpo.val_every=0",
      "generation.logprob_budget=null"], 37),  # the rollout's 60 rows alone
    (["generation.max_new_tokens=300", "data.max_prompt_length=400",
      "data.max_total_length=700"], 400),  # 700 slots: 128-rounding capped by the total
])
def test_planned_kv_cache_is_what_the_megatron_decoder_reserves(monkeypatch, overrides, prompt):
    """The plan's ``kv_cache`` and ``decode_row_states`` bytes against the buffers the decoder
    allocates (sum of tensor nbytes) after the run's generate calls (rollout, validation on
    the task's held-out prompts, the logprob canary), on CPU with a stub model."""
    import contextlib

    import torch

    from mcore_rl.generation.base import response_budgets
    from mcore_rl.megatron import attention

    monkeypatch.setattr(attention, "kv_cache_attention", lambda *a: contextlib.nullcontext())
    cfg = load_config("grpo_gsm8k", ["cluster.use_ray=false", "policy.megatron.precision=bf16",
                                     "generation.backend=megatron", *overrides])
    arch = dataclasses.replace(ARCHS["qwen2_tied"], num_layers=3, num_query_groups=2)
    dec = _stub_decoder(arch, torch.bfloat16)
    g, data = cfg.generation, cfg.data
    calls = memory.generation_calls(cfg)
    assert calls.get("validation") in (None, 32)  # min(val_num_prompts, the 32 test prompts)
    for n in calls.values():  # every prompt of the longest length: the buffers' bound
        prompts = [[1] * prompt] * n
        dec.generate(prompts, 0, 0, True, g, 2, 0, data.max_total_length)
    real_kv = sum(t.nbytes for t in (*dec._cache.keys.values(), *dec._cache.values.values()))
    s = dec._slots
    real_states = sum(t.nbytes for t in (s.uniforms, s.out_tokens, s.out_logprobs))
    plan = memory.plan_memory(cfg, arch, VOCAB, prompt=prompt)
    assert plan.engine["kv_cache"] == real_kv
    assert plan.engine["decode_row_states"] == real_states
    assert (s.rows, s.slots) == memory.decoder_buffers(cfg, 1, prompt)
    assert max(response_budgets([[1] * prompt], g.max_new_tokens, data.max_total_length)) > 0


@pytest.mark.parametrize("packing,budget", [(True, 4096), (False, 4096), (True, None),
                                            (False, None)])
def test_planned_micro_batch_tokens_are_the_workers(packing, budget):
    """:func:`memory.micro_batch_tokens` against the largest micro-batch the workers cut
    (packed: the packed row's tokens; padded: rows x width) from full-length rows: the same,
    or with a packing budget its bound (rows shorter than ``seq`` can fill it)."""
    import torch

    from mcore_rl.data.microbatching import make_microbatches
    from mcore_rl.data.packing import make_packed_microbatches

    seq, rows, mbs = 300, 40, 8
    cfg = load_config("grpo_synthetic_gpu", [
        f"policy.sequence_packing={str(packing).lower()}",
        f"policy.max_tokens_per_microbatch={budget or 'null'}"])
    batch = {"input_ids": torch.ones(rows, seq, dtype=torch.long),
             "input_lengths": torch.full((rows,), seq)}
    if packing:
        parts = make_packed_microbatches(batch, budget or mbs * seq)
        real = max(p["packed_input_ids"].numel() for p in parts)
    else:
        real = max(p["input_ids"].numel() for p in make_microbatches(batch, mbs, budget))
    planned = memory.micro_batch_tokens(cfg, mbs, rows, seq)
    if packing and budget:  # the budget bounds rows of any lengths; whole rows of seq fill
        assert real <= planned < real + seq  # it to within one row
    else:
        assert planned == real



def test_planned_packed_tokens_count_the_padding_to_2cp():
    """Packed with CP = 2, every row is padded to a multiple of 4: rows of 301 tokens run as
    304 (:func:`memory.micro_batch_tokens` against the workers' packed micro-batches: the same
    without a budget, its bound with one)."""
    import torch

    from mcore_rl.data.packing import make_packed_microbatches

    seq, rows, mbs = 301, 12, 4
    cp = dataclasses.replace(load_config("grpo_synthetic").policy.megatron, layer_spec="torch",
                             context_parallel_size=2, cp_comm_type="all_gather")
    batch = {"input_ids": torch.ones(rows, seq, dtype=torch.long),
             "input_lengths": torch.full((rows,), seq)}
    for budget in (None, 1000):
        cfg = load_config("grpo_synthetic", [
            "policy.sequence_packing=true", "policy.megatron.layer_spec=torch",
            f"policy.max_tokens_per_microbatch={budget or 'null'}"])
        parts = make_packed_microbatches(batch, budget or mbs * 304, width_multiple=4,
                                         sequence_multiple=4)
        real = max(p["packed_input_ids"].numel() for p in parts)
        planned = memory.micro_batch_tokens(cfg, mbs, rows, seq, cp)
        if budget:  # 3 padded rows fill the budget to within one row
            assert real == 3 * 304 <= planned == budget < real + 304
        else:
            assert planned == real == mbs * 304
        assert memory.micro_batch_tokens(cfg, mbs, rows, seq) == (budget or mbs * seq)


def test_context_parallel_divides_a_ranks_activations_and_logits():
    """CP = 2: a rank's activations are those of half the positions plus the other half's
    all-gathered keys and values; its logits half; DP counts workers / (TP x CP x PP)."""
    from mcore_rl.config.families import head_dim

    cfg = load_config("grpo_synthetic", ["cluster.num_workers=4"])
    arch, mg = cfg.model.arch, dataclasses.replace(cfg.policy.megatron, layer_spec="torch")
    cp = dataclasses.replace(mg, context_parallel_size=2)
    kv = 2 * arch.num_query_groups * head_dim(arch) * 4 * 2 * 32  # fp32, 2 rows x 32 tokens
    assert memory.activation_bytes_per_layer(arch, cp, 2, 64) == \
        memory.activation_bytes_per_layer(arch, mg, 2, 64) // 2 + kv
    assert memory._dp(cfg, cp) == 2 and memory._dp(cfg, mg) == 4
    one = memory.role_memory("policy", cfg, arch, 64, mg, "adam", 4, 8, False, False,
                             train_rows=4)
    two = memory.role_memory("policy", cfg, arch, 64, cp, "adam", 4, 8, False, False,
                             train_rows=4)
    assert two.logits * 2 == one.logits and two.tokens == one.tokens


# ---------------------------------------------------------------- phases a run enters
@pytest.mark.parametrize("overrides,runs", [
    (["loss.prev_logprobs=recompute"], True),
    (["loss.prev_logprobs=train_forward"], False),  # the training forward's logprobs
    (["loss.prev_logprobs=train_forward", "loss.kl_coef=0.1"], True),  # the reference's forward
])
def test_logprobs_phase_only_where_a_logprob_forward_runs(overrides, runs):
    """``logprobs`` has a figure only where the synchronous loop runs a logprob forward (the old
    policy's with ``loss.prev_logprobs=recompute``, or the KL reference's); otherwise the plan
    names the phase as not run, with its reason, and its peak is that of the other phases."""
    cfg = load_config("grpo_synthetic_gpu", ["cluster.num_workers=2", *overrides])
    arch = cfg.model.arch
    plan = memory.plan_memory(cfg, arch, VOCAB)
    policy = plan.roles[0]
    assert set(plan.phases) == ({"generation", "logprobs", "train"} if runs
                                else {"generation", "train"})
    line = [x for x in memory.format_plan(plan).splitlines() if x.split()[:2] == ["peak", "logprobs"]]
    assert len(line) == 1
    if runs:
        assert not plan.not_run
        assert not plan.engine_offloaded  # everything resident: the engine's bytes too
        assert plan.phases["logprobs"] == (policy.static + sum(plan.engine.values())
                                           + policy.logprob_logits + policy.logprob_forward)
        assert "not run" not in line[0]
    else:
        assert "train_forward" in plan.not_run["logprobs"]
        assert line[0].split()[2] == "-" and "not run: loss.prev_logprobs=train_forward" in line[0]
        assert plan.peak == max(plan.phases["generation"], plan.phases["train"])


@pytest.mark.parametrize("colocate", [True, False])
def test_megatron_decoder_buffers_are_counted_where_they_are_resident(colocate):
    """The megatron backend's KV cache and row states, by phase: always in ``generation``;
    colocated, in neither ``logprobs`` nor ``train`` (the controller frees them once the
    rollout is generated: tests/test_megatron_generation.py::
    test_colocated_decoder_buffers_leave_before_the_logprobs_phase), else in both (kept
    between calls)."""
    cfg = load_config("grpo_synthetic_gpu", [
        "cluster.num_workers=2", "generation.backend=megatron", "loss.prev_logprobs=recompute",
        f"cluster.colocate_generation={str(colocate).lower()}"])
    plan = memory.plan_memory(cfg, cfg.model.arch, VOCAB)
    policy = plan.roles[0]
    kv = plan.engine["kv_cache"] + plan.engine["decode_row_states"]
    assert plan.engine["kv_cache"] > 0 and plan.engine_offloaded == colocate
    resident = 0 if colocate else kv
    assert plan.phases["generation"] == ((policy.weights if colocate else policy.static) + kv
                                         + sum(plan.engine_transient.values()))
    assert plan.phases["logprobs"] == ((policy.weights if colocate else policy.static) + resident
                                       + policy.logprob_logits + policy.logprob_forward)
    assert plan.phases["train"] == policy.static + resident + policy.train_transient
    state = "off the GPU outside generation" if colocate else "resident"
    assert f"kv_cache ({state})" in memory.format_plan(plan)


# ---------------------------------------------------------------- scripts/gpu/llama8b.py's tables
def _llama8b_script():
    """scripts/gpu/llama8b.py (run on GPUs only), imported."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "llama8b.py"
    spec = importlib.util.spec_from_file_location("llama8b", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Sampler:
    """GPUSampler's answers: each GPU's used GiB, whatever the window."""

    def __init__(self, used_gib):
        self.used = used_gib

    def peak(self, windows, gpus=None):
        return int(max(u for i, u in enumerate(self.used) if gpus is None or i in gpus) * 2**30)

    def process_peaks(self, windows):
        return [("1039: python3 scripts/gpu/llama8b.py", 61.0)]


L8OFF = ["cluster.colocate_generation=false", "cluster.num_workers=2",
         "generation.vllm.num_engines=2", "generation.vllm.tensor_parallel_size=1",
         "generation.vllm.kv_cache_gb=40", "generation.vllm.gpu_memory_utilization=0.9",
         "grpo.streaming=true", "grpo.max_staleness=1", "loss.prev_logprobs=recompute",
         "policy.megatron.recompute_granularity=null", "policy.max_tokens_per_microbatch=8192",
         "cluster.gpu_memory_gb=141"]  # scripts/gpu/session.sh's l8off, as it ran


@pytest.mark.parametrize("layout", ["colocated", "megatron", "offpolicy"])
def test_llama8b_memory_rows_compare_each_phase_that_runs_with_its_plan(layout):
    """The 8B script's memory rows (the windows and peaks its Recorder keeps): a phase the
    plan says never runs (the empty logprobs phase under train_forward) gets the plan's
    reason instead of a figure; the others the policy's peak against the plan less the vLLM
    engines' share where the phase counts it; the streaming loop's train row is its streamed
    step's; the GPU figure is the policy's GPUs' only."""
    l8 = _llama8b_script()
    overrides = {"colocated": [], "megatron": ["generation.backend=megatron"],
                 "offpolicy": L8OFF}[layout]
    cfg = load_config("grpo_llama8b", overrides)
    plan = memory.plan_memory(cfg, cfg.model.arch)
    # the streaming loop's step has no generation or logprobs phase of its own
    phases = ("refit", "train") if layout == "offpolicy" else l8.PHASES
    windows = {p: [(0.0, 1.0)] for p in phases}
    peaks = {p: (i + 1) * 2**30 for i, p in enumerate(phases)}
    sampler = _Sampler([60.0, 61.0, 120.0, 121.0])
    rows = {r["phase"]: r for r in l8.memory_rows(plan, cfg.generation.backend, peaks, windows,
                                                  sampler, [0, 1], layout == "offpolicy")}
    gib = 2**30
    if layout == "offpolicy":  # recompute: logprobs runs, but streamed inside the step
        assert set(rows) == {"refit", "train"} and "logprobs" in plan.phases
        assert rows["train"]["policy_plan_gib"] == plan.phases["train"] / gib  # engines elsewhere
        assert "streamed step" in rows["train"]["note"]
    else:
        assert rows["logprobs"] == {"phase": "logprobs", "not_run": plan.not_run["logprobs"]}
        assert "note" not in rows["train"]
        engine = sum(plan.engine.values())
        if layout == "colocated":  # the vLLM share is the engines' processes', asleep in training
            assert rows["generation"]["policy_plan_gib"] == (plan.phases["generation"] - engine) / gib
        else:  # the megatron decoder's KV cache is the policy's own
            assert rows["generation"]["policy_plan_gib"] == plan.phases["generation"] / gib
        assert rows["train"]["policy_plan_gib"] == plan.phases["train"] / gib
    assert rows["refit"]["policy_plan_gib"] is None and rows["refit"]["gpu_plan_gib"] is None
    assert rows["train"]["policy_alloc_gib"] == phases.index("train") + 1
    assert rows["train"]["gpu_used_gib"] == 61.0  # GPUs 0-1, not the engines' 2-3


def test_llama8b_summary_names_what_the_refit_gigabytes_are():
    """The summary's refit: GB each engine worker receives and GB sent in all (the colocated
    8B run's CUDA IPC refit: 16.1 and 64.2; over NCCL both 16.1; the megatron backend's shared
    weights: nothing sent), and a phase not run by name and reason."""
    l8 = _llama8b_script()
    median = {"refit/seconds": 2.12, "refit/gbytes": 16.06, "refit/gbytes_sent": 64.24}
    assert l8.refit_line(median, 4) == (
        "refit 2.12 s: 16.1 GB to each of 4 engine workers, 64.2 GB sent by the policy's ranks "
        "in all")
    assert l8.refit_line({**median, "refit/gbytes_sent": 16.06}, 2).endswith(
        "16.1 GB to each of 2 engine workers, 16.1 GB sent by the policy's ranks in all")
    assert l8.refit_line({"refit/seconds": 0.97, "refit/gbytes": 0.0}, None) == (
        "refit 0.97 s: weights shared in place, nothing sent")
    cfg = load_config("grpo_llama8b", [])
    plan = memory.plan_memory(cfg, cfg.model.arch)
    step = {"step": 2, "timing/step_s": 46.08, "timing/generation_s": 7.61, "timing/refit_s": 2.10,
            "timing/logprobs_s": 0.0, "timing/train_s": 36.34, "perf/tokens_per_s_per_gpu": 2504.0,
            "train/response_length": 795.0, "train/token_mult_prob_error": 1.0704,
            "refit/offload_train_s": 0.95}
    result = {"name": "l8_colocated", "steps": [step], "warmup": 1, "engine_workers": 4,
              "plan": memory.format_plan(plan),
              "median": {**{k: v for k, v in step.items() if k != "step"}, **median},
              "memory": [{"phase": "logprobs", "not_run": plan.not_run["logprobs"]},
                         {"phase": "train", "policy_alloc_gib": 56.5, "policy_plan_gib": 56.9,
                          "gpu_used_gib": 64.6, "gpu_plan_gib": 56.9, "gpu0_processes": []}]}
    out = l8.format_summary(result).splitlines()
    assert any(line.endswith("64.2 GB sent by the policy's ranks in all") and "med" in line
               for line in out)
    assert "  refit hand-overs (medians, s): offload_train 0.95" in out
    assert "  logprobs not run: loss.prev_logprobs=train_forward and no KL reference: no logprob " \
           "forward runs" in out
    assert any(line.split()[:4] == ["train", "policy", "56.5", "plan"] for line in out)


def test_llama8b_recorder_takes_the_streamed_steps_train_peak():
    """The Recorder on the streaming loop: the policy's peaks reset when an RL step starts and
    read when its ``finish`` phase (the optimizer step) ends give ``train`` (the micro-batches
    and logprob forwards between, in no phase of their own); the refit after it is measured
    from its own reset, as in the synchronous loop."""
    from types import SimpleNamespace

    from mcore_rl.distributed.worker_group import typed
    from mcore_rl.utils.timers import PhaseTimer

    l8 = _llama8b_script()
    log, allocated = [], {"now": 0}

    def memory_stats(method, reset):
        assert method == "memory_stats"
        log.append("reset" if reset else "read")
        peak = allocated["now"]
        if reset:
            allocated["now"] = 5  # what stays allocated
        return [{"max_allocated": peak}, {"max_allocated": peak - 1}]

    trainer = SimpleNamespace(timer=PhaseTimer(), policy=SimpleNamespace(call=typed(memory_stats)),
                              producer=SimpleNamespace(generate=None, generate_scored=None))
    rec = l8.Recorder(trainer)

    class Loop:
        def rl_step(self):
            with trainer.timer.phase("reward"):
                allocated["now"] = 70  # micro-batches train: the step's peak
            with trainer.timer.phase("finish"):
                allocated["now"] = 72  # the optimizer step
            with trainer.timer.phase("refit"):
                allocated["now"] = 66
            return {}

    loop = Loop()
    rec.stream(loop)
    for _ in range(2):
        loop.rl_step()
    assert log == ["reset", "read", "reset", "read"] * 2
    assert rec.peaks == {"train": 72, "refit": 66}
    assert len(rec.windows["train"]) == len(rec.windows["refit"]) == 2
    assert "finish" not in rec.windows and len(rec.windows["reward"]) == 2  # inside train's window
    (start, end), (refit_start, _) = rec.windows["train"][1], rec.windows["refit"][1]
    assert start <= rec.windows["reward"][1][0] and end <= refit_start


def test_memory_check_long_cp_jobs_plan_out_of_memory_at_cp1_and_a_fit_at_cp2():
    """scripts/gpu/memory_check.py's long_cp1 / long_cp2 (session.sh cp2, issue 34 item 4): the
    configs load (the torch spec's all-gather CP, hf engine, two GPUs), and at 32k tokens a row
    the planner puts CP=1's train phase over 80 GiB and CP=2's under it: the GPU run then shows
    an out-of-memory and a fit, or that the planner is wrong."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "memory_check.py"
    spec = importlib.util.spec_from_file_location("memory_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    peaks = {}
    for cp in (1, 2):
        cfg = load_config("grpo_synthetic_gpu", module.COMMON + module.LONG + [
            f"policy.megatron.context_parallel_size={cp}"])
        assert (cfg.data.max_total_length, cfg.cluster.num_workers) == (module.LONG_SEQ, 2)
        plan = memory.plan_memory(cfg, cfg.model.arch, cfg.model.arch.vocab_size,
                                  seq=module.LONG_SEQ, train_rows=module.LONG_ROWS)
        peaks[cp] = plan.phases["train"] / 2**30
        assert plan.gpu_bytes == 80 * 2**30  # LONG_GPU_GB unset
    assert peaks[1] > 85 and peaks[2] < 72, peaks  # a margin each way for the planner's error
    assert module.is_out_of_memory(RuntimeError("worker 0: torch.OutOfMemoryError: CUDA out of "
                                                "memory. Tried to allocate 2.00 GiB"))
    assert not module.is_out_of_memory(RuntimeError("NCCL error"))
    # the start line's plan, the deadline that stops a job whose ranks do not answer, its row
    for cp, verdict in ((1, "DOES NOT FIT 80 GiB"), (2, "fits 80 GiB")):
        cfg = load_config("grpo_synthetic_gpu", module.COMMON + module.LONG + [
            f"policy.megatron.context_parallel_size={cp}"])
        plan = memory.plan_memory(cfg, cfg.model.arch, cfg.model.arch.vocab_size,
                                  seq=module.LONG_SEQ, train_rows=module.LONG_ROWS)
        assert module.plan_line(plan).endswith(verdict)
    import threading

    release = threading.Event()
    assert module.run_with_deadline(release.wait, 0.05) == (False, None)
    release.set()
    assert module.run_with_deadline(lambda: None, 5) == (True, None)
    done, error = module.run_with_deadline(lambda: 1 / 0, 5)
    assert done and isinstance(error, ZeroDivisionError)
    row = {"config": "long_cp1", "phase": "train", "measured_alloc_gib": float("nan"),
           "measured_reserved_gib": float("nan"), "plan_max_len_gib": 94.6,
           "plan_seen_len_gib": 94.6, "error_pct": float("nan"), "longest": 32768, "oom": False,
           "hung": True, "plan_fits": False}
    assert "NO ANSWER" in module.format_row(row) and "does not fit" in module.format_row(row)

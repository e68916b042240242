"""The cross-field rules of a config: combinations of keys that no run can satisfy, one small
function per schema section (or per plugin, through its entry in
:mod:`mcore_rl.config.registry`), run in order by :func:`mcore_rl.config.loader.validate`
(:data:`RULES`).

A rule maps ``(cfg, field_errors)`` to its messages, each naming the keys it is about:
``cfg`` is the :class:`~mcore_rl.config.schema.TrainConfig`, ``field_errors`` what the field
checks (:func:`mcore_rl.config.checks.errors`: each key's declared choices and bounds) already
report, so a rule does not repeat them. The single-key checks stay on the schema's fields
(:mod:`mcore_rl.config.fields`); a plugin's load-time check stays in the plugin's torch-free
module (a generation backend's :attr:`~mcore_rl.config.registry.BackendEntry.config_check`, a
task's :attr:`~mcore_rl.config.registry.Task.config_check`); the model family's shape and MoE
layout checks in :mod:`mcore_rl.config.families`; the file checks in
:mod:`mcore_rl.config.paths`.

Adding a rule: a function here (or, for a plugin, in its check), one entry in :data:`RULES`.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

from mcore_rl.config.families import (arch_errors, layout_errors, microbatch_width_multiple,
                                      parallel_shape_errors)
from mcore_rl.config.learned import learned_reward_name, learned_reward_rules
from mcore_rl.config.paths import hf_checkpoint_errors, tokenizer_dir_error
from mcore_rl.config.plugins import plugin_errors
from mcore_rl.config.registry import (ADVANTAGE_ESTIMATORS, ENVIRONMENTS, backend_errors,
                                      estimator_entry, is_import_path, task_errors)
from mcore_rl.config.registry import sandbox_errors
from mcore_rl.config.schema import (CHAR_TOKENIZER, FP8_BLOCK_SCALES_ENV,
                                    FP8_BLOCK_SCALES_ENV_VALUES, TrainConfig)

Rule = Callable[[TrainConfig, Sequence[str]], List[str]]

# The algorithm whose critic (the ``value`` section) has a Megatron layout of its own.
CRITIC_ALGORITHM = "ppo"


def _megatron_sections(cfg: TrainConfig) -> Tuple[Tuple[str, bool], ...]:
    """The sections with a Megatron layout, each with whether its model is ``model.*``:
    ``policy``, ``value`` with a critic, ``reward_model`` (of ``model.*`` for ``algorithm: rm``;
    of ``reward_model.hf_path`` for a reward model in ``reward.name`` or ``reward.names``),
    ``judge`` (of ``model.*`` unless ``judge.hf_path``) for a judge there."""
    if cfg.algorithm == "rm":
        return (("reward_model", True),)
    sections = (("policy", True), ("value", True)) if cfg.algorithm == CRITIC_ALGORITHM \
        else (("policy", True),)
    learned = learned_reward_name(cfg.reward)
    if learned == "model":
        sections += (("reward_model", False),)
    if learned == "judge":
        sections += (("judge", cfg.judge.hf_path is None),)
    return sections


def model_rules(cfg: TrainConfig, field_errors: Sequence[str]) -> List[str]:
    """``model.arch``: the family's shape checks (:func:`~mcore_rl.config.families.arch_errors`;
    only without ``model.hf_path``, whose checkpoint fixes the shape) and the head counts'
    divisibility."""
    arch, errors = cfg.model.arch, []
    if cfg.model.hf_path is None:  # arch_errors repeats the field checks of model.arch
        errors += [e for e in arch_errors(arch) if e not in field_errors]
    if arch.num_query_groups >= 1 and arch.num_attention_heads >= 1:
        if arch.num_attention_heads % arch.num_query_groups != 0:
            errors.append(f"model.arch.num_attention_heads ({arch.num_attention_heads}) must be "
                          f"divisible by model.arch.num_query_groups ({arch.num_query_groups})")
        if arch.head_dim is None and arch.hidden_size % arch.num_attention_heads != 0:
            errors.append(f"model.arch.hidden_size ({arch.hidden_size}) must be divisible by "
                          f"model.arch.num_attention_heads ({arch.num_attention_heads})")
    return errors


def megatron_section_rules(cfg: TrainConfig, section: str, field_errors: Sequence[str],
                           same_model: bool = True) -> List[str]:
    """``<section>.megatron`` (``policy``, ``value``, ``reward_model``, ``judge``) against the
    worker count, the model shape, ``<section>.sequence_packing`` and the device: the TP x PP
    split of ``cluster.num_workers``, virtual stages, the shape over TP/PP/VPP and the MoE
    layout (only for ``model.arch``'s model, ``same_model`` without ``model.hf_path``: the
    trainer checks a checkpoint's shape when it reads its config.json), sequence parallelism,
    compiled layers and the DDP options."""
    same_model = same_model and cfg.model.hf_path is None
    arch, device = cfg.model.arch, cfg.cluster.device
    mg = getattr(cfg, section).megatron
    ddp, key = mg.ddp, f"{section}.megatron"
    tp, pp, vpp = mg.tensor_model_parallel_size, mg.pipeline_model_parallel_size, \
        mg.virtual_pipeline_model_parallel_size
    errors = []

    def check(ok: bool, message: str) -> None:
        if not ok:
            errors.append(message)

    cp = mg.context_parallel_size
    if tp >= 1 and pp >= 1 and cp == 1:
        check(cfg.cluster.num_workers % (tp * pp) == 0,
              f"cluster.num_workers ({cfg.cluster.num_workers}) must be divisible by "
              f"{key}.tensor_model_parallel_size x pipeline_model_parallel_size "
              f"({tp} x {pp})")
    elif tp >= 1 and pp >= 1 and cp > 1:
        check(cfg.cluster.num_workers % (tp * cp * pp) == 0,
              f"cluster.num_workers ({cfg.cluster.num_workers}) must be divisible by "
              f"{key}.tensor_model_parallel_size x context_parallel_size x "
              f"pipeline_model_parallel_size ({tp} x {cp} x {pp})")
    if vpp is not None and vpp >= 1:  # < 1: the field check reports it
        check(pp > 1, f"{key}.virtual_pipeline_model_parallel_size ({vpp}) needs "
                      f"{key}.pipeline_model_parallel_size > 1 (got {pp})")
    if same_model and (vpp is None or vpp >= 1):
        errors += parallel_shape_errors(arch, mg, key)
    if getattr(getattr(cfg, section), "sequence_packing", False):
        # Packed micro-batches differ in length, and the pipeline schedules need one shape
        # per micro-batch: packing is refused with PP > 1 rather than padded to the budget.
        check(pp == 1 and vpp is None,
              f"{section}.sequence_packing needs {key}.pipeline_model_parallel_size=1 and no "
              f"virtual stages (got PP={pp}, VPP={vpp}): packed micro-batches vary in length")
        check(mg.layer_spec != "local",
              f"{section}.sequence_packing needs {key}.layer_spec torch or transformer_engine "
              f"(the local spec's attention has no packed-sequence (THD) path)")
        check(arch.num_experts is None,
              f"{section}.sequence_packing does not support mixture-of-experts models yet "
              f"(model.arch.num_experts is {arch.num_experts})")
    check(not mg.sequence_parallel or tp > 1, f"{key}.sequence_parallel needs "
          f"{key}.tensor_model_parallel_size > 1 (got {tp})")
    check(not mg.compile_layers or device != "cpu",
          f"{key}.compile_layers needs a GPU: cluster.device is 'cpu'")
    if mg.recompute_granularity == "full" and pp >= 1 and (vpp or 1) >= 1:
        per_stage = arch.num_layers // (pp * (vpp or 1)) if cfg.model.hf_path is None else None
        check(per_stage is None or mg.recompute_num_layers <= per_stage,
              f"{key}.recompute_num_layers ({mg.recompute_num_layers}) must be at most the layers "
              f"of one pipeline stage ({per_stage}: model.arch.num_layers / PP / VPP)")
    check(not ddp.overlap_param_gather or ddp.use_distributed_optimizer,
          f"{key}.ddp.overlap_param_gather needs {key}.ddp.use_distributed_optimizer")
    check(not ddp.average_in_collective,
          f"{key}.ddp.average_in_collective must be false: the losses are normalized by the "
          f"global token/sequence count (Megatron's calculate_per_token_loss), which "
          f"Megatron's DDP refuses to combine with averaging over DP")
    if same_model:  # else the model's shape is read from the checkpoint
        errors += [e for e in layout_errors(arch, mg, key, cfg.cluster.num_workers)
                   if e not in field_errors]
    gpu_only = [n for n in ("use_distributed_optimizer", "overlap_param_gather") if getattr(ddp, n)]
    if gpu_only and (device == "cpu" or device == "auto" and not _cuda_available()):
        seen = " and torch sees no GPU" if device == "auto" else ""
        errors += [f"{key}.ddp.{n} needs a GPU: cluster.device is '{device}'{seen}"
                   for n in gpu_only]
    return errors


def transformer_engine_missing() -> Optional[str]:
    """Why Transformer Engine's PyTorch layers cannot load here, found without importing torch
    or TE (the loader runs before any worker): None when the ``transformer_engine`` package and
    its PyTorch extension (``transformer_engine_torch*.so``, where TE's own loader looks: next to
    the package, in it, or in its ``wheel_lib``) are installed. An installation that is present
    but broken is found at the run's start instead (:func:`mcore_rl.megatron.te.runtime_errors`)."""
    spec = importlib.util.find_spec("transformer_engine")
    if spec is None or spec.origin is None:
        return "no module named 'transformer_engine'"
    package = Path(spec.origin).parent
    if not any(next(d.glob("transformer_engine_torch*.so"), None)
               for d in (package.parent, package, package / "wheel_lib")):
        return (f"transformer_engine is installed ({package}) without its PyTorch extension "
                f"transformer_engine_torch")
    return None


def transformer_engine_errors(cfg: TrainConfig, section: str) -> List[str]:
    """Why the Transformer Engine features of ``<section>.megatron`` (``layer_spec=
    transformer_engine``, ``fp8``, ``context_parallel_size`` > 1) cannot run, one message each;
    empty when none is asked for or they can. In order: FP8 and CP need the TE layer spec; TE must
    be installed (:func:`transformer_engine_missing`), else nothing more is said about the device
    (one line for the usual mistake); TE runs on a GPU only; FP8 runs in bf16 and, with the
    ``delayed`` recipe, uncompiled (TE refuses it under torch.compile); packed sequences with CP
    need the ``torch`` spec or TE's ``p2p`` (:func:`context_parallel_errors`);
    ``fp8_bf16_layers_at_start`` and ``_at_end`` need ``fp8`` and a
    recipe other than ``delayed`` (their bound per pipeline stage is a shape check:
    :func:`mcore_rl.config.families.transformer_engine_shape_errors`). Which GPU runs which FP8
    recipe is known only where the GPU is: at the run's start
    (:func:`mcore_rl.megatron.te.runtime_errors`)."""
    mg, key, device = getattr(cfg, section).megatron, f"{section}.megatron", cfg.cluster.device
    cp = mg.context_parallel_size
    errors = context_parallel_errors(cfg, section)
    bf16_layers = [f"{key}.fp8_bf16_layers_at_{end}={n}" for end in ("start", "end")
                   if (n := getattr(mg, f"fp8_bf16_layers_at_{end}")) > 0]
    if bf16_layers and mg.fp8 is None:
        errors.append(f"{' and '.join(bf16_layers)} need{'s' if len(bf16_layers) == 1 else ''} "
                      f"{key}.fp8 (got null): they keep layers of an FP8 model in bf16")
    elif bf16_layers and mg.fp8_recipe == "delayed":
        errors.append(f"{' and '.join(bf16_layers)} cannot run with {key}.fp8_recipe=delayed "
                      f"(Megatron-Core refuses bf16 layers with delayed scaling): use "
                      f"fp8_recipe=blockwise or tensorwise, or 0 bf16 layers")
    asked = [f"{key}.{name}={value}" for name, value, on in (
        ("layer_spec", mg.layer_spec, mg.layer_spec == "transformer_engine"),
        ("fp8", mg.fp8, mg.fp8 is not None)) if on]
    if not asked:
        return errors
    what = f"{' and '.join(asked)} need{'s' if len(asked) == 1 else ''}"
    if mg.layer_spec != "transformer_engine":  # fp8
        errors.append(f"{what} {key}.layer_spec=transformer_engine (got "
                      f"{mg.layer_spec}): FP8 matrix multiplies are Transformer Engine's")
    missing = transformer_engine_missing()
    if missing:
        only_spec = asked == [f"{key}.layer_spec=transformer_engine"]
        errors.append(f"{what} Transformer Engine, which is not installed here ({missing}): pip "
                      f"install --no-build-isolation 'transformer-engine[pytorch]'"
                      f"{f'; or use {key}.layer_spec=torch' if only_spec else ''}")
    elif device == "cpu" or device == "auto" and not _cuda_available():
        seen = " and torch sees no GPU" if device == "auto" else ""
        errors.append(f"{what} a GPU: cluster.device is '{device}'{seen}")
    if mg.fp8 is not None:
        if mg.precision != "bf16":
            errors.append(f"{key}.fp8={mg.fp8} needs {key}.precision=bf16 (got {mg.precision}): "
                          f"FP8 matrix multiplies with bf16 weights and activations elsewhere")
        if mg.fp8_recipe == "delayed" and mg.compile_layers:
            errors.append(f"{key}.fp8_recipe=delayed cannot run with {key}.compile_layers=true "
                          f"(Transformer Engine refuses delayed scaling under torch.compile): use "
                          f"fp8_recipe=tensorwise or compile_layers=false")
    return errors


def context_parallel_errors(cfg: TrainConfig, section: str) -> List[str]:
    """Why ``<section>.megatron.context_parallel_size`` CP > 1 cannot run, one message each;
    empty for CP = 1. CP needs the ``torch`` layer spec (its attention all-gathers keys and
    values: :mod:`mcore_rl.megatron.context_parallel`, so ``cp_comm_type=all_gather``) or the
    ``transformer_engine`` one (TE's attention, ``cp_comm_type`` p2p, a2a or all_gather; CP=2
    against CP=1 on GPUs: bench/RESULTS.md, issue 34); not the ``local`` one. Packed sequences run
    on the ``torch`` spec (each padded to 2 CP: :mod:`mcore_rl.data.packing`) and on the TE one
    with ``cp_comm_type=p2p`` (the split is TE's ``thd_get_partitioned_indices``, tested on CPU;
    packed CP=2 against padded and packed CP=1 on two H200s within bf16 tolerance:
    ``session.sh cp2``, bench/RESULTS.md); TE's a2a and all_gather on packed (THD) sequences have
    not run, so they are refused. Not built yet: mixture-of-experts models (the router's padding
    mask and losses are not split), and the sections other than ``policy`` and ``value`` (a
    reward model's or a judge's CP is not tested)."""
    mg, key = getattr(cfg, section).megatron, f"{section}.megatron"
    cp = mg.context_parallel_size
    if cp <= 1:
        return []
    errors = []
    if section not in ("policy", "value"):
        errors.append(f"{key}.context_parallel_size > 1 (got {cp}) runs on the policy and the "
                      f"critic only so far; use {key}.context_parallel_size=1")
    if mg.layer_spec == "local":
        errors.append(f"{key}.context_parallel_size={cp} needs {key}.layer_spec torch or "
                      f"transformer_engine (got local: Megatron's local attention does not split "
                      f"sequences)")
    if mg.layer_spec == "torch" and mg.cp_comm_type != "all_gather":
        errors.append(f"{key}.context_parallel_size={cp} with {key}.layer_spec=torch needs "
                      f"{key}.cp_comm_type=all_gather (got {mg.cp_comm_type}): the torch spec's "
                      f"attention all-gathers keys and values")
    if getattr(getattr(cfg, section), "sequence_packing", False) \
            and mg.layer_spec == "transformer_engine" and mg.cp_comm_type != "p2p":
        errors.append(f"{section}.sequence_packing with {key}.context_parallel_size={cp} on "
                      f"{key}.layer_spec=transformer_engine needs {key}.cp_comm_type=p2p (got "
                      f"{mg.cp_comm_type}: Transformer Engine's {mg.cp_comm_type} attention on "
                      f"packed sequences has not run on a GPU here; p2p has: "
                      f"scripts/gpu/session.sh cp2)")
    if getattr(cfg.model.arch, "num_experts", None) is not None and mg.layer_spec == "torch":
        errors.append(f"{key}.context_parallel_size > 1 (got {cp}) does not support "
                      f"mixture-of-experts models yet (model.arch.num_experts is "
                      f"{cfg.model.arch.num_experts})")
    return errors


def transformer_engine_rules(cfg: TrainConfig, field_errors: Sequence[str]) -> List[str]:
    """:func:`transformer_engine_errors` of the policy and, with a critic, of the ``value``
    section (skipped for a section whose keys the field checks already refuse)."""
    return [e for section, _ in _megatron_sections(cfg)
            if not any(f.startswith(f"{section}.megatron.") for f in field_errors)
            for e in transformer_engine_errors(cfg, section)]


def fp8_block_scales_rules(cfg: TrainConfig, field_errors: Sequence[str]) -> List[str]:
    """``<section>.megatron.fp8_block_scales`` of the sections that run FP8 with
    ``fp8_recipe=blockwise`` (:func:`_megatron_sections`; a section whose keys the field checks
    refuse is skipped): it sets Transformer Engine's process-wide
    ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` in the section's workers
    (:func:`mcore_rl.megatron.te.te_environment`), so the sections must agree (one line naming
    every such key), and a value of that variable already in this (the controller's)
    environment must agree with them (TE reads "1" as fp32 scales, anything else as powers of
    2; one line naming the keys and the variable). Unset, the variable is no constraint."""
    keys = {}
    for section, _ in _megatron_sections(cfg):
        mg = getattr(cfg, section).megatron
        if mg.fp8 is not None and mg.fp8_recipe == "blockwise" \
                and not any(f.startswith(f"{section}.megatron.") for f in field_errors):
            keys[f"{section}.megatron.fp8_block_scales"] = mg.fp8_block_scales
    named = " and ".join(f"{k}={v}" for k, v in keys.items())
    if len(set(keys.values())) > 1:
        return [f"{named} must agree: each sets Transformer Engine's process-wide "
                f"{FP8_BLOCK_SCALES_ENV}, one value per run (set them to one of fp32, "
                f"power_of_2)"]
    env = os.environ.get(FP8_BLOCK_SCALES_ENV)
    if not keys or env is None:
        return []
    scales = next(iter(keys.values()))
    if (env == "1") == (FP8_BLOCK_SCALES_ENV_VALUES[scales] == "1"):
        return []
    return [f"{named} contradicts {FP8_BLOCK_SCALES_ENV}={env!r} in this environment (Transformer "
            f"Engine reads '1' as fp32 block scales, anything else as powers of 2): unset the "
            f"variable or make it and the key agree"]


def megatron_rules(cfg: TrainConfig, field_errors: Sequence[str]) -> List[str]:
    """:func:`megatron_section_rules` of the policy and, with a critic (``algorithm: ppo``), of
    the ``value`` section (the critic has a Megatron layout of its own over
    ``cluster.num_workers`` processes); likewise the reward model's and the judge's
    (:func:`_megatron_sections`)."""
    return [e for section, same_model in _megatron_sections(cfg)
            for e in megatron_section_rules(cfg, section, field_errors, same_model)]


def generation_backend_rules(cfg: TrainConfig, field_errors: Sequence[str]) -> List[str]:
    """``generation.backend``: the chosen backend's own check, through its plugin entry
    (:func:`~mcore_rl.config.registry.backend_errors`)."""
    return backend_errors(cfg)


def algorithm_errors(cfg: TrainConfig) -> List[str]:
    """Combinations of ``loss.*`` and ``grpo.*`` keys no run can use, one message each naming
    its keys: a reward KL without an estimator that reads it
    (:attr:`~mcore_rl.config.registry.Estimator.reads_reward_kl`), an overlong buffer longer
    than the response budget."""
    g, out = cfg.grpo, []
    estimator = estimator_entry(g.advantage_estimator)
    if (cfg.algorithm == "grpo" and g.reward_kl_coef > 0 and estimator is not None
            and not estimator.reads_reward_kl):
        readers = " or ".join(f"grpo.advantage_estimator={n}"
                              for n, e in ADVANTAGE_ESTIMATORS.items() if e.reads_reward_kl)
        readers += " (or your estimator with reads_reward_kl = True)"
        out.append(f"grpo.reward_kl_coef ({g.reward_kl_coef}) is read by {readers} only (got "
                   f"{g.advantage_estimator!r}); use loss.kl_coef for a KL term in the loss")
    if g.overlong_buffer_length > cfg.generation.max_new_tokens:
        out.append(f"grpo.overlong_buffer_length ({g.overlong_buffer_length}) must be <= "
                   f"generation.max_new_tokens ({cfg.generation.max_new_tokens})")
    return out


def algorithm_rules(cfg: TrainConfig, field_errors: Sequence[str]) -> List[str]:
    """:func:`algorithm_errors`."""
    return algorithm_errors(cfg)


def length_rules(cfg: TrainConfig, field_errors: Sequence[str]) -> List[str]:
    """``data.max_prompt_length + generation.max_new_tokens <= data.max_total_length``."""
    data, gen = cfg.data, cfg.generation
    if data.max_prompt_length + gen.max_new_tokens <= data.max_total_length:
        return []
    return [f"data.max_prompt_length + generation.max_new_tokens ({data.max_prompt_length} + "
            f"{gen.max_new_tokens}) must be <= data.max_total_length ({data.max_total_length})"]


def policy_rules(cfg: TrainConfig, field_errors: Sequence[str]) -> List[str]:
    """``policy.max_tokens_per_microbatch`` holds the longest row (``data.max_total_length``,
    rounded up to the workers' micro-batch width multiple: :func:`~mcore_rl.config.families.
    microbatch_width_multiple`)."""
    budget, mg = cfg.policy.max_tokens_per_microbatch, cfg.policy.megatron
    multiple = microbatch_width_multiple(mg)  # widths are padded to it (SP: TP, CP: 2 CP, FP8)
    longest = -(-cfg.data.max_total_length // multiple) * multiple
    if budget is None or budget >= longest:
        return []
    factors = [f for f, on in ((f"TP={mg.tensor_model_parallel_size}", mg.sequence_parallel),
                               (f"2 x CP={mg.context_parallel_size}", mg.context_parallel_size > 1),
                               ("8 for FP8", mg.fp8 is not None)) if on]
    of = factors[0] if len(factors) == 1 and not mg.fp8 else f"{multiple} ({' x '.join(factors)})"
    return [f"policy.max_tokens_per_microbatch ({budget}) must be null or >= "
            f"data.max_total_length ({cfg.data.max_total_length}"
            f"{f', rounded up to a multiple of {of}' if multiple > 1 else ''})"
            f": a micro-batch holds at least one whole sequence"]


def logging_rules(cfg: TrainConfig, field_errors: Sequence[str]) -> List[str]:
    """``logging.wandb`` needs the wandb package."""
    if not cfg.logging.wandb or importlib.util.find_spec("wandb") is not None:
        return []
    return ["logging.wandb=true needs the wandb package: pip install wandb"]


def plugin_rules(cfg: TrainConfig, field_errors: Sequence[str]) -> List[str]:
    """The user's own plugins named by import path (``reward.name=my_pkg.rewards:score``, ...):
    each imports and honours its key's contract
    (:func:`~mcore_rl.config.plugins.plugin_errors`)."""
    return plugin_errors(cfg)


def reward_rules(cfg: TrainConfig, field_errors: Sequence[str]) -> List[str]:
    """``reward.names`` not empty and without repeats; ``reward.weights`` one per reward (of
    ``reward.names``, else of ``reward.name``)."""
    r, errors = cfg.reward, []
    names = r.names if r.names is not None else [r.name]
    if r.names is not None and not r.names:
        errors.append("reward.names is empty: give at least one reward, or null for reward.name")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        errors.append(f"reward.names names {', '.join(repeated)} more than once")
    if r.weights is not None and len(r.weights) != len(names):
        errors.append(f"reward.weights has {len(r.weights)} weights for {len(names)} reward(s) "
                      f"({'reward.names' if r.names is not None else 'reward.name'}: "
                      f"{', '.join(names)}): give one weight each")
    return errors


def task_rules(cfg: TrainConfig, field_errors: Sequence[str]) -> List[str]:
    """``data.task``: the chosen task's own check of the ``data`` section, through its plugin
    entry (:func:`~mcore_rl.config.registry.task_errors`)."""
    return task_errors(cfg.data)


def checkpoint_path_rules(cfg: TrainConfig, field_errors: Sequence[str]) -> List[str]:
    """The model directories the config names (:mod:`mcore_rl.config.paths`):
    ``model.hf_path`` (with its tokenizer unless ``model.tokenizer`` is set), the critic's
    ``value.hf_path``, and a ``model.tokenizer`` directory."""
    model, errors = cfg.model, []
    if model.hf_path is not None:
        errors += hf_checkpoint_errors("model.hf_path", model.hf_path,
                                       tokenizer=model.tokenizer is None)
    if cfg.algorithm == CRITIC_ALGORITHM and cfg.value.hf_path is not None:
        errors += hf_checkpoint_errors("value.hf_path", cfg.value.hf_path)
    if model.tokenizer not in (None, CHAR_TOKENIZER):
        errors += filter(None, [tokenizer_dir_error("model.tokenizer", model.tokenizer)])
    return errors


def streaming_errors(cfg: TrainConfig) -> List[str]:
    """Why the streaming loop (``<algorithm>.streaming=true``,
    :mod:`mcore_rl.controller.streaming`) cannot run ``cfg``, one message per reason naming
    its keys; empty when it can or when the run does not stream. The loop trains each prompt
    group as soon as it is scored, in one optimizer step per RL step, while the rollout engine
    generates the rest in processes of its own, so it refuses what needs the whole batch before
    any of it trains: GRPO's batch-wide estimator (REINFORCE++), dynamic sampling and several
    optimizer steps a rollout; PPO's advantage whitening (the batch's mean and std),
    several epochs and several mini-batches."""
    if not cfg.streaming:
        return []
    loop, name = cfg.loop, cfg.algorithm
    on = f"{name}.streaming=true"
    errors = []
    one_step = "a streamed RL step is one optimizer step on rows that train as they arrive"
    if name == "grpo":
        if loop.optimizer_steps_per_rollout != 1:
            errors.append(f"{on} needs grpo.optimizer_steps_per_rollout=1 (got "
                          f"{loop.optimizer_steps_per_rollout}): {one_step}")
        estimator = estimator_entry(loop.advantage_estimator)
        if estimator is not None and not estimator.per_group:
            per_group = " or ".join(n for n, e in ADVANTAGE_ESTIMATORS.items() if e.per_group)
            per_group += ", or your estimator with per_group = True"
            errors.append(f"{on} needs a per-group grpo.advantage_estimator ({per_group}; got "
                          f"{loop.advantage_estimator}): a group trains as soon as it is scored")
        if loop.dynamic_sampling:
            errors.append(f"{on} cannot use grpo.dynamic_sampling (it draws prompt groups in "
                          f"rounds until the batch is full); the streaming loop trains each "
                          f"group as it comes")
    else:
        for key in ("ppo_epochs", "num_mini_batches"):
            if getattr(loop, key) != 1:
                errors.append(f"{on} needs ppo.{key}=1 (got {getattr(loop, key)}): {one_step}")
        if loop.whiten_advantages:
            errors.append(f"{on} needs ppo.whiten_advantages=false: whitening takes the mean and "
                          f"std of the whole batch's advantages, which are not known before its "
                          f"first rows train")
    return errors


def streaming_rules(cfg: TrainConfig, field_errors: Sequence[str]) -> List[str]:
    """:func:`streaming_errors`."""
    return streaming_errors(cfg)


def env_errors(cfg: TrainConfig) -> List[str]:
    """Why the multi-turn rollout loop (``env.name`` other than ``single_turn``,
    :mod:`mcore_rl.rollout.multi_turn`) cannot run ``cfg``, one message each naming its keys;
    empty for ``single_turn`` (today's one-turn path). A multi-turn environment needs the
    synchronous loop (the streaming loop decodes one turn per prompt group), and with a
    tokenizer of a pretrained model (``model.hf_path`` or ``model.tokenizer``) the chat
    template (``data.use_chat_template=true``: tool results are chat messages); the built-in
    character tokenizer renders turns as plain text."""
    env = cfg.env
    errors = []
    m = cfg.model
    pretrained = m.tokenizer not in (None, CHAR_TOKENIZER) or (m.tokenizer is None
                                                               and m.hf_path is not None)
    if cfg.data.task == "synthetic" and cfg.data.synthetic.tool_solutions > 0 and (
            env.name != "tool_use" or pretrained):
        errors.append(f"data.synthetic.tool_solutions={cfg.data.synthetic.tool_solutions} "
                      f"writes plain-text calculator episodes: it needs env.name=tool_use (got "
                      f"{env.name}) and the character tokenizer (model.tokenizer=char, or no "
                      f"model.hf_path)")
    if env.name == "single_turn" or not (env.name in ENVIRONMENTS or is_import_path(env.name)):
        return errors  # an unknown name is the field check's
    if cfg.streaming:
        errors.append(f"env.name={env.name} (a multi-turn environment) cannot run with "
                      f"{cfg.algorithm}.streaming=true: the streaming loop decodes one turn per "
                      f"prompt group; set {cfg.algorithm}.streaming=false or env.name=single_turn")
    if cfg.generation.ignore_eos:
        errors.append(f"generation.ignore_eos=true cannot run env.name={env.name} (a multi-turn "
                      f"environment): a turn ends at its stop tokens, which ignore_eos ignores")
    if pretrained and not cfg.data.use_chat_template:
        errors.append(f"env.name={env.name} with a pretrained tokenizer (model.hf_path / "
                      f"model.tokenizer) needs data.use_chat_template=true: the episode's tool "
                      f"results and turns are rendered by the chat template")
    return errors


def env_rules(cfg: TrainConfig, field_errors: Sequence[str]) -> List[str]:
    """:func:`env_errors`, ``env.sandbox``'s own check (through its plugin entry:
    :func:`~mcore_rl.config.registry.sandbox_errors`), then ``env.step_timeout_seconds >
    env.tool_timeout_seconds`` (unless a field check of the ``env`` section already failed)."""
    env = cfg.env
    errors = env_errors(cfg) + sandbox_errors(cfg)
    if (any(e.startswith("env.") for e in field_errors)  # then the field checks report it
            or env.step_timeout_seconds > env.tool_timeout_seconds):
        return errors
    return errors + [f"env.step_timeout_seconds ({env.step_timeout_seconds}) must be > "
            f"env.tool_timeout_seconds ({env.tool_timeout_seconds}): a step waits for its tools"]


def grpo_rules(cfg: TrainConfig, field_errors: Sequence[str]) -> List[str]:
    """The GRPO batch arithmetic: a rollout's rows split evenly over
    ``grpo.optimizer_steps_per_rollout``."""
    grpo = cfg.grpo
    rollouts = grpo.num_prompts_per_step * grpo.num_generations
    steps = grpo.optimizer_steps_per_rollout
    if steps < 1 or rollouts % steps == 0:
        return []
    return [f"grpo.num_prompts_per_step x grpo.num_generations ({grpo.num_prompts_per_step} x "
            f"{grpo.num_generations} = {rollouts}) must be divisible by "
            f"grpo.optimizer_steps_per_rollout ({steps})"]


def loss_rules(cfg: TrainConfig, field_errors: Sequence[str]) -> List[str]:
    """``loss.prev_logprobs=train_forward`` only where the policy's weights do not change
    between the logprob forward it saves and the training forward (the schema's comment says
    why), and nothing reads the old logprobs before training: GRPO with one optimizer step per
    rollout and no reward KL (whose estimator reads them in the advantages). The streaming loop
    (``grpo.streaming``, which needs one optimizer step a rollout itself) qualifies: its one
    optimizer step ends the RL step, after every chunk's forwards."""
    if cfg.loss.prev_logprobs != "train_forward":
        return []
    grpo = cfg.grpo
    wrong = [f"{k}={v}" for k, v, ok in (
        ("algorithm", cfg.algorithm, cfg.algorithm == "grpo"),
        ("grpo.optimizer_steps_per_rollout", grpo.optimizer_steps_per_rollout,
         grpo.optimizer_steps_per_rollout == 1),
        ("grpo.reward_kl_coef", grpo.reward_kl_coef, grpo.reward_kl_coef == 0))
        if not ok]
    if not wrong:
        return []
    return [f"loss.prev_logprobs=train_forward needs algorithm=grpo, "
            f"grpo.optimizer_steps_per_rollout=1 and grpo.reward_kl_coef=0 (the old policy must "
            f"be the weights being trained, and no estimator may read its logprobs before the "
            f"training forward); got "
            f"{', '.join(wrong)}: set loss.prev_logprobs=recompute"]


def ppo_rules(cfg: TrainConfig, field_errors: Sequence[str]) -> List[str]:
    """The PPO batch arithmetic: a rollout's samples split evenly into ``ppo.num_mini_batches``."""
    ppo = cfg.ppo
    samples = ppo.num_prompts_per_step * ppo.num_generations
    if ppo.num_mini_batches < 1 or samples % ppo.num_mini_batches == 0:
        return []
    return [f"ppo.num_prompts_per_step x ppo.num_generations ({ppo.num_prompts_per_step} x "
            f"{ppo.num_generations} = {samples}) must be divisible by ppo.num_mini_batches "
            f"({ppo.num_mini_batches})"]


def value_rules(cfg: TrainConfig, field_errors: Sequence[str]) -> List[str]:
    """A float32 value head in a bf16 critic checkpoints only with Megatron's distributed
    optimizer: megatron-core's ``Float16OptimizerWithFloat16Params.sharded_state_dict`` maps
    checkpoint entries to the ids of the bf16 parameters alone, while the optimizer's state
    numbers the fp32 ones among them, so the first save fails with a ``KeyError`` (seen on an
    H100 with megatron-core 0.19.2: PPO on SmolLM2, the critic's id 182 = its 182 bf16
    parameters + the head)."""
    v = cfg.value
    if cfg.algorithm != CRITIC_ALGORITHM or not v.head_fp32 or v.megatron.precision != "bf16" \
            or v.megatron.ddp.use_distributed_optimizer:
        return []
    return ["value.head_fp32=true with value.megatron.precision=bf16 needs "
            "value.megatron.ddp.use_distributed_optimizer=true: megatron-core's other optimizer "
            "cannot checkpoint an fp32 parameter in a bf16 model (its first save fails); set "
            "value.head_fp32=false (the head in bf16 with fp32 main weights in the optimizer) or "
            "use the distributed optimizer"]


# What validate runs after the field checks, in this order (the order of the messages).
RULES: Tuple[Rule, ...] = (
    model_rules,
    megatron_rules,
    transformer_engine_rules,
    fp8_block_scales_rules,
    generation_backend_rules,
    algorithm_rules,
    length_rules,
    policy_rules,
    logging_rules,
    plugin_rules,
    reward_rules,
    task_rules,
    checkpoint_path_rules,
    streaming_rules,
    env_rules,
    grpo_rules,
    loss_rules,
    ppo_rules,
    value_rules,
    learned_reward_rules,
)


def rule_errors(cfg: TrainConfig, field_errors: Sequence[str]) -> List[str]:
    """Every message of :data:`RULES` for ``cfg``, in order."""
    return [e for rule in RULES for e in rule(cfg, field_errors)]


def _cuda_available() -> bool:
    import torch  # deferred: only configs that ask for GPU-only features pay for the import

    return torch.cuda.is_available()

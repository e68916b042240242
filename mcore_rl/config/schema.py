"""Structured configs: the one place every config key, its type and default is declared.

YAML files in ``configs/`` are composed over these dataclasses by Hydra (see
:mod:`mcore_rl.config.loader`), so an unknown key or a wrong type is refused before any work.
Units: learning rates per optimizer step, lengths in tokens, intervals in RL steps.
Each field's meaning is the comment directly above it (or at the end of its line); its valid
values are declared with :func:`~mcore_rl.config.fields.one_of` (choices) or
:func:`~mcore_rl.config.fields.bounded` (a range), which config loading and the components
check (:mod:`mcore_rl.config.checks`); :mod:`mcore_rl.config.docs` writes both into
``docs/config-reference.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Union

from mcore_rl.config.fields import bounded, one_of, plugin
from mcore_rl.config.registry import ALGORITHMS as _ALGORITHM_TABLE
from mcore_rl.config.registry import (ADVANTAGE_ESTIMATORS, BACKENDS, ENVIRONMENTS,
                                      LEARNED_REWARDS, POLICY_LOSSES, TASKS, VERIFIERS, names)
from mcore_rl.config.registry import SANDBOXES

# Choice lists that components take from here rather than repeat.
# cluster.placement: how mcore_rl.distributed.placement puts worker groups on GPUs.
PLACEMENTS = ("colocated", "separate")
# cluster.offload_train_state: what of the colocated policy leaves the GPU for generation.
OFFLOAD_TRAIN_STATE = ("auto", "true", "grads", "false")
# loss.kl_estimator and ppo.reward_kl_estimator: mcore_rl.algorithms.kl.kl_estimate.
KL_ESTIMATORS = ("k1", "k2", "k3")
# loss.aggregation: how mcore_rl.algorithms.losses.ClippedPGLoss turns per-token losses into the
# batch's loss (the field's loss_agg_mode names).
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                     "seq-mean-token-sum-norm")
# model.arch.family: the Hugging Face model_types of mcore_rl.config.families.FAMILIES.
MODEL_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
# *.megatron.moe_token_dispatcher_type: Megatron-Core token dispatchers that run on gloo and
# NCCL ("flex" needs DeepEP).
MOE_TOKEN_DISPATCHERS = ("alltoall", "allgather")
# *.megatron.layer_spec: the layer specs of mcore_rl.megatron.model.
LAYER_SPECS = ("local", "torch", "transformer_engine")
# generation.compile_decode_mode: torch.compile modes of the compiled decode layers (the decoder
# captures its own CUDA graphs, so none of the modes that capture them).
COMPILE_DECODE_MODES = ("default", "max-autotune-no-cudagraphs")
# generation.decode_attention: the compiled decode layers' attention over the KV cache
# (mcore_rl.megatron.attention: decode_attention, flex_decode_attention;
# mcore_rl.megatron.flash_decode: flash_decode).
DECODE_ATTENTIONS = ("bmm", "flex", "triton", "triton_rope")
# *.megatron.fp8 and fp8_recipe: Megatron-Core TransformerConfig's fp8 formats and recipes (its
# "custom" recipe, which takes a quantizer factory, is not offered).
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
# *.megatron.fp8_block_scales: the environment variable Transformer Engine reads for its
# blockwise recipe's scales when transformer_engine.common.recipe is imported (Float8BlockScaling.
# use_f32_scales: "1" keeps fp32 scales, any other value or none rounds them to powers of 2), and
# the value each choice puts in a worker's environment (mcore_rl.megatron.te.te_environment).
FP8_BLOCK_SCALES_ENV = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"
FP8_BLOCK_SCALES_ENV_VALUES = {"fp32": "1", "power_of_2": "0"}
# The GPUs (CUDA compute capability, lowest and first refused; None: no upper end) on which
# Transformer Engine 2.20 runs each recipe (transformer_engine.pytorch.quantization's checks):
# FP8 from Ada (8.9), 128-block scaling from Hopper (9.0), MXFP8 on Blackwell datacenter GPUs
# (10.x and 11.x).
FP8_RECIPE_CAPABILITY = {"delayed": ((8, 9), None), "tensorwise": ((8, 9), None),
                         "blockwise": ((9, 0), None), "mxfp8": ((10, 0), (12, 0))}
# generation.vllm.quantization: vLLM's online weight quantizations offered (vLLM's own names).
VLLM_QUANTIZATIONS = ("fp8",)
# The lowest CUDA compute capability on which vLLM's fp8 runs FP8 matrix multiplies (W8A8); below
# it vLLM falls back to weight-only FP8 (Marlin kernels, bf16 activations).
VLLM_FP8_CAPABILITY = (8, 9)
# *.megatron.cp_comm_type: how Megatron-Core's context-parallel attention (Transformer Engine's)
# exchanges keys and values.
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")
# model.tokenizer: the built-in character tokenizer of mcore_rl.data.tokenizer.
CHAR_TOKENIZER = "char"


@dataclass
class RunConfig:
    # Run name; the default run.output_dir is `runs/<name>`.
    name: str = "grpo_synthetic"
    # Run directory: metrics.jsonl, TensorBoard events, checkpoints, summary.json.
    output_dir: str = "runs/${run.name}"
    # Seeds the synthetic split, prompt order, random init (no hf_path) and each step's rollouts.
    seed: int = bounded(42, ge=0)


@dataclass
class ClusterConfig:
    """Processes and devices of the run."""

    # Processes for the policy's Megatron world (= TP x PP x DP).
    num_workers: int = bounded(1, ge=1)
    # "cpu" (gloo + the CPU redirects), "cuda" (NCCL), or "auto" (cuda when a GPU is visible).
    device: str = one_of("auto", ("cpu", "cuda", "auto"))
    # Ray: null starts a local cluster; "auto" or "host:port" joins an existing one.
    ray_address: Optional[str] = None
    # False runs workers as plain processes (torch.multiprocessing), without Ray.
    use_ray: bool = True
    # Torch CPU threads per worker on the cpu device (set_num_threads); 0: CPU cores / workers.
    threads_per_worker: int = bounded(0, ge=0)
    # How worker groups share GPUs (Ray placement groups; one GPU per rank of a group):
    # "colocated": PPO's policy and value on the same cluster.num_workers GPUs (a fraction of
    # each GPU per rank); "separate": each group on GPUs of its own (PPO: 2 x num_workers).
    placement: str = one_of("colocated", PLACEMENTS)
    # Rollout engine on the policy's GPUs: the policy's weights, grads and optimizer state leave
    # the GPU after each refit and come back for logprobs and training (offload lifecycle;
    # cluster.offload_train_state keeps them where memory allows); the engine sleeps while the
    # policy trains. The streaming loop (grpo/ppo.streaming) generates while it trains, so
    # there both stay resident and share each GPU (one GPU runs it; memory must hold both).
    colocate_generation: bool = False
    # With cluster.colocate_generation: what of the policy's training state leaves the GPU while
    # the engine decodes (verl's param_offload / grad_offload / optimizer_offload). "true": the
    # gradient buffers (dropped), the optimizer state and the weights (to host memory), every RL
    # step (the offload lifecycle); "grads": only the gradient buffers, dropped (every step
    # zeroes them first: no copy), while the weights and the optimizer state stay, so the refit
    # moves nothing over PCIe; "false": nothing leaves and the refit only wakes the engine and
    # transfers the weights. The engine still sleeps while the policy trains. "auto": the least
    # that fits cluster.gpu_memory_gb in every phase by the planner (false, else grads, else
    # true; the rule: mcore_rl.megatron.memory.offload_train_state_decision); `mcore-rl plan`
    # and the train log say which and why. `train` on cuda refuses a false or grads predicted
    # not to fit (cluster.skip_memory_check=true trains anyway). On the cpu device auto is
    # true. No effect without colocation or with streaming. The default stays "true" until
    # grads and false have run on a GPU (their parity is tested on CPU).
    offload_train_state: str = one_of("true", OFFLOAD_TRAIN_STATE)
    # Garbage collection in the Megatron workers. 0: Python's automatic collection. N > 0: off,
    # with a full collection after every N-th optimizer step on all ranks at once (Megatron-LM's
    # --manual-gc): automatic collections (~0.2 s each, measured on an H200 host) land on each
    # rank at its own time and stall the others at the next collective.
    manual_gc_interval: int = bounded(0, ge=0)
    # Memory of one GPU in GiB (2^30 bytes) for the pre-launch planner (mcore-rl plan;
    # mcore_rl/megatron/memory.py): `train` on cuda refuses a layout predicted to need more.
    gpu_memory_gb: float = bounded(80.0, gt=0)
    # Train even when the planner predicts that the layout does not fit cluster.gpu_memory_gb.
    skip_memory_check: bool = False

    def __post_init__(self) -> None:
        # YAML and override values true/false of offload_train_state arrive as "True"/"False".
        self.offload_train_state = str(self.offload_train_state).lower()


@dataclass
class ModelArchConfig:
    """Decoder shape (Llama/Mistral/Qwen2/Qwen3 families, dense or mixture of experts), used
    when ``model.hf_path`` is null."""

    family: str = one_of("qwen2", MODEL_FAMILIES)  # Hugging Face model_type of the decoder
    # Transformer layers; divisible by PP x VPP.
    num_layers: int = bounded(2, ge=1)
    # Hidden (model) dimension; divisible by num_attention_heads.
    hidden_size: int = bounded(64, ge=1)
    # Query heads; divisible by num_query_groups and by TP.
    num_attention_heads: int = bounded(4, ge=1)
    # Key/value heads (grouped-query attention; = num_attention_heads for MHA); divisible by TP.
    num_query_groups: int = bounded(2, ge=1)
    # Size of one attention head (HF head_dim); null: hidden_size / num_attention_heads.
    head_dim: Optional[int] = bounded(None, ge=1)
    # Inner size of the SwiGLU MLP (HF intermediate_size).
    ffn_hidden_size: int = bounded(128, ge=1)
    # Longest sequence in tokens the model declares (HF max_position_embeddings).
    max_position_embeddings: int = bounded(128, ge=1)
    # RoPE base frequency.
    rope_theta: float = bounded(10000.0, gt=0)
    # Llama 3.x RoPE scaling (HF rope_type "llama3" with low/high frequency factors 1 and 4 and an
    # original context of 8192 tokens): the factor; null: unscaled RoPE.
    rope_scaling_factor: Optional[float] = bounded(None, gt=0)
    # Epsilon of the RMSNorm layers.
    rms_norm_eps: float = bounded(1.0e-6, gt=0)
    # Bias on the q/k/v projections: true for qwen2 and qwen2_moe, false for the other families.
    qkv_bias: bool = True
    # Share the input embedding matrix with the output layer.
    tie_word_embeddings: bool = True
    # null: the tokenizer's vocabulary size.
    vocab_size: Optional[int] = bounded(None, ge=1)
    # Routed experts of every MoE layer (HF num_experts; qwen2_moe and qwen3_moe, all layers
    # MoE); null for the dense families.
    num_experts: Optional[int] = bounded(None, ge=1)
    # Experts each token is routed to (HF num_experts_per_tok); <= num_experts.
    moe_router_topk: int = bounded(2, ge=1)
    # Inner size of each expert's SwiGLU MLP (HF moe_intermediate_size); null: ffn_hidden_size.
    moe_ffn_hidden_size: Optional[int] = bounded(None, ge=1)
    # Renormalize the top-k routing probabilities to sum to 1 (HF norm_topk_prob).
    moe_norm_topk_prob: bool = False
    # Inner size of qwen2_moe's shared expert (HF shared_expert_intermediate_size); null otherwise.
    moe_shared_expert_ffn_hidden_size: Optional[int] = bounded(None, ge=1)


@dataclass
class ModelConfig:
    """The policy's weights and tokenizer."""

    # A Hugging Face checkpoint directory (config.json + safetensors + tokenizer files).
    hf_path: Optional[str] = None
    # Tokenizer directory or "char" (built-in); null: hf_path's, or "char" if hf_path is null.
    tokenizer: Optional[str] = None
    arch: ModelArchConfig = field(default_factory=ModelArchConfig)
    # Random initial weights when hf_path is null: "transformers" (a seeded transformers model
    # of model.arch built on the host, then loaded: the small models' default) or "normal"
    # (each tensor drawn on its worker's device from its own seed, transformers' distribution:
    # N(0, 0.02) weights, unit norms; for shapes too large to build on the host, e.g. 8B).
    # Either is the same in every parallel layout.
    init: str = one_of("transformers", ("transformers", "normal"))


@dataclass
class DDPConfig:
    """Megatron-Core ``DistributedDataParallelConfig`` fields of the same names."""

    # Overlap the gradient reduction over DP with the backward pass, bucket by bucket.
    overlap_grad_reduce: bool = False
    # Parameters per gradient bucket with overlap_grad_reduce; null: max(4e7, 1e6 x DP size).
    bucket_size: Optional[int] = bounded(None, ge=1)
    # Keep gradient buffers and their DP reduction in fp32 (matters with precision bf16).
    grad_reduce_in_fp32: bool = True
    # Average over DP in the collective; must stay false: the trainer's per-token loss
    # (calculate_per_token_loss) divides by the global token count itself, Megatron refuses both.
    average_in_collective: bool = False
    # Shard optimizer state and fp32 main params over DP (Megatron distributed optimizer); GPU only.
    use_distributed_optimizer: bool = False
    # Overlap the parameter all-gather with the forward; needs use_distributed_optimizer; GPU only.
    overlap_param_gather: bool = False
    # Stop with an error when a gradient holds NaN or Inf (checked before the DP reduction).
    check_for_nan_in_grad: bool = False


@dataclass
class MegatronConfig:
    """A Megatron worker's (the policy's, or the PPO critic's) parallel layout, precision and
    layers."""

    # TP size: ranks each layer's weights are split over; divides attention heads and query groups.
    tensor_model_parallel_size: int = bounded(1, ge=1)
    # PP size: pipeline stages (layers split evenly); TP x PP divides cluster.num_workers.
    pipeline_model_parallel_size: int = bounded(1, ge=1)
    # Model chunks per pipeline stage (interleaved schedule); null: off; needs PP > 1.
    virtual_pipeline_model_parallel_size: Optional[int] = bounded(None, ge=1)
    # Megatron sequence parallelism (activations split over TP ranks); needs TP > 1.
    sequence_parallel: bool = False
    # CP size: ranks each sequence is split over (context parallelism: two chunks of 1/(2 CP) of
    # the micro-batch width per rank, attention passing keys and values between them); needs
    # layer_spec=torch with cp_comm_type=all_gather, or layer_spec=transformer_engine (TE's
    # attention; CP=2 matched CP=1 on GPUs, issue 34); TP x CP x PP divides
    # cluster.num_workers; policy and value only, no MoE; with sequence_packing (torch spec, or
    # the TE spec with cp_comm_type=p2p) every packed sequence is padded to a multiple of 2 CP
    # and split the same way.
    context_parallel_size: int = bounded(1, ge=1)
    # With CP > 1, how attention exchanges keys and values (Megatron's cp_comm_type): "p2p" (a ring
    # of sends overlapped with compute), "all_gather", "a2a" (all-to-all over heads: attention
    # heads and query groups per TP rank divisible by CP); layer_spec=torch: all_gather only.
    cp_comm_type: str = one_of("p2p", CP_COMM_TYPES)
    # bf16: bf16 params with fp32 main params and grads in the optimizer.
    precision: str = one_of("fp32", ("fp32", "bf16"))
    # Layer implementation: "local" (Megatron's own modules), "torch" (local with torch SDPA
    # attention: fast without Transformer Engine), "transformer_engine" (needs TE installed).
    layer_spec: str = one_of("local", LAYER_SPECS)
    # FP8 matrix multiplies in the transformer layers: "e4m3" (all of them), "hybrid" (e4m3
    # forward, e5m2 gradients); null: off. Needs layer_spec=transformer_engine, precision=bf16 and
    # a GPU with FP8 (fp8_recipe says which).
    fp8: Optional[str] = one_of(None, FP8_FORMATS)
    # FP8 scaling: "delayed" (scales from an amax history), "tensorwise" (current scaling),
    # "blockwise" (1x128 and 128x128 blocks; Hopper and newer), "mxfp8" (Blackwell only). The
    # default is blockwise, as NeMo RL's and verl's FP8 RL recipes: from a pretrained model
    # SmolLM2-135M learned 0.11 -> 0.94 in 40 steps with it, and delayed scaling (Megatron's
    # default; no amax history at the first step) collapsed after one (bench/RESULTS.md, issue
    # 34). Ada GPUs (8.9) run delayed or tensorwise only.
    fp8_recipe: str = one_of("blockwise", FP8_RECIPES)
    # With fp8 and fp8_recipe=blockwise: each block's scale "fp32" (fp8_max / amax) or
    # "power_of_2" (rounded down to a power of 2: Transformer Engine's own default). Sets TE's
    # NVTE_FP8_BLOCK_SCALING_FP32_SCALES ("1" or "0") in the section's workers before TE loads;
    # sections with FP8 blockwise must agree, and so must that variable if the controller's
    # environment has it. fp32 is the default as the measured better one: grpo_smollm2_arith at
    # step 40 (two H200s) held-out 1.000 against power_of_2's 0.941 (bf16: 1.000), rollouts'
    # token_mult_prob_error median 1.154 against 1.237 (bench/RESULTS.md, issue 34, second
    # session); slime's Hopper FP8 scripts use fp32 scales too. fp32 runs on Hopper only (TE:
    # Blackwell's block scales are powers of 2): refused at the run's start on 10.x and up.
    fp8_block_scales: str = one_of("fp32", ("fp32", "power_of_2"))
    # With fp8: the first this many transformer layers run in bf16 rather than FP8 (Megatron-Core's
    # first_last_layers_bf16 with num_layers_at_start_in_bf16; layers of the whole model, at most
    # those of one pipeline stage); 0 with fp8_bf16_layers_at_end 0: every layer in FP8. Not with
    # fp8_recipe=delayed (Megatron refuses it).
    fp8_bf16_layers_at_start: int = bounded(0, ge=0)
    # With fp8: the last this many transformer layers run in bf16 (num_layers_at_end_in_bf16; the
    # same bounds as fp8_bf16_layers_at_start); 0: the last layers in FP8 too.
    fp8_bf16_layers_at_end: int = bounded(0, ge=0)
    # EP size: ranks each MoE layer's experts are split over (model.arch.num_experts divisible by
    # it); expert_tensor_parallel_size x EP x PP divides cluster.num_workers.
    expert_model_parallel_size: int = bounded(1, ge=1)
    # Ranks each expert's weights are split over (expert TP); null: tensor_model_parallel_size.
    expert_tensor_parallel_size: Optional[int] = bounded(None, ge=1)
    # How MoE layers send tokens to their experts' ranks (both run on gloo and NCCL).
    moe_token_dispatcher_type: str = one_of("alltoall", MOE_TOKEN_DISPATCHERS)
    # Router load-balancing loss coefficient (Switch Transformer, Fedus et al. 2022, eq. 4;
    # summed over MoE layers), added to the loss per loss token; 0: off.
    moe_aux_loss_coeff: float = bounded(0.0, ge=0)
    # Router z-loss coefficient (ST-MoE, Zoph et al. 2022, eq. 5), added per loss token; 0: off.
    moe_z_loss_coeff: float = bounded(0.0, ge=0)
    # torch.compile every transformer layer (GPU only): fuses RoPE, residual adds and the
    # activation; ~8% faster train steps on the 0.85B bench (bench/RESULTS.md), compile time
    # at the first step and at new sequence-length shapes. Training and logprob passes only:
    # generation.backend=megatron decodes with the layers' eager forward (CUDA graphs).
    compile_layers: bool = False
    # Activation recomputation (Korthikanti et al. 2022): null keeps every layer's activations
    # for the backward; "full" keeps only each recomputed layer's input and runs its forward
    # again in the backward (about a third more compute for most of the activation memory);
    # "selective" recomputes the core attention only (Megatron's recompute_modules=core_attn;
    # the torch and TE specs' fused attention keeps no s^2 scores, so it saves little there).
    recompute_granularity: Optional[str] = one_of(None, ("full", "selective"))
    # With "full": "uniform" (layers in groups of recompute_num_layers, each group's input
    # kept) or "block" (the first recompute_num_layers layers of each pipeline stage only).
    recompute_method: str = one_of("uniform", ("uniform", "block"))
    # With "full": layers per group ("uniform") or layers recomputed per stage ("block").
    recompute_num_layers: int = bounded(1, ge=1)
    ddp: DDPConfig = field(default_factory=DDPConfig)


@dataclass
class OptimizerConfig:
    """A Megatron worker's (the policy's, or the PPO critic's) optimizer and learning-rate
    schedule."""

    # "adam" (AdamW: decoupled weight decay) or "sgd" (momentum 0.9).
    name: str = one_of("adam", ("adam", "sgd"))
    # Peak learning rate, reached after warmup.
    lr: float = bounded(1.0e-3, ge=0)
    # Learning rate at the end of linear or cosine decay.
    min_lr: float = bounded(0.0, ge=0)
    # Weight decay coefficient; biases and 1-D (norm) weights get none.
    weight_decay: float = bounded(0.0, ge=0)
    # Adam beta1: decay of the gradient's running mean.
    adam_beta1: float = bounded(0.9, ge=0, lt=1)
    # Adam beta2: decay of the squared gradient's running mean.
    adam_beta2: float = bounded(0.999, ge=0, lt=1)
    # Adam epsilon, added to the denominator.
    adam_eps: float = bounded(1.0e-8, gt=0)
    # Max global grad norm; 0 disables clipping (the norm is still reported).
    clip_grad: float = bounded(1.0, ge=0)
    # Optimizer steps of linear warmup from 0 to lr; 0: start at lr.
    lr_warmup_steps: int = bounded(0, ge=0)
    # Decay from lr to min_lr over the run's optimizer steps (after warmup).
    lr_decay_style: str = one_of("constant", ("constant", "linear", "cosine"))


@dataclass
class PolicyConfig:
    """The trained policy: Megatron layout, optimizer and micro-batch sizes."""

    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    # Sequences per training forward/backward on each DP rank (RL and warm-start steps).
    micro_batch_size: int = bounded(16, ge=1)
    # Sequences per forward-only pass on each DP rank for old and reference logprobs.
    logprob_micro_batch_size: int = bounded(32, ge=1)
    # Token budget per micro-batch (rows x padded width, rows sorted by length; with
    # sequence_packing the tokens of one packed micro-batch), used instead of micro_batch_size and
    # logprob_micro_batch_size; >= data.max_total_length; null: fixed sizes (with packing:
    # micro_batch_size / logprob_micro_batch_size x the call's longest row).
    max_tokens_per_microbatch: Optional[int] = bounded(None, ge=1)
    # Pack sequences (THD: tokens concatenated, attention within each sequence, no padding) in
    # training and logprob passes. Needs PP=1, a dense model, layer_spec torch or
    # transformer_engine (torch with context_parallel_size > 1: each sequence padded to a
    # multiple of 2 CP); micro-batch counts are equalized over DP ranks.
    sequence_packing: bool = False


@dataclass
class VLLMConfig:
    """generation.backend=vllm: vLLM engines, each in a process of its own (a Ray actor with
    cluster.use_ray). Placement follows cluster.colocate_generation: true puts the engines on the
    policy's GPUs (sleep/wake around training, refit through CUDA IPC), false on GPUs of their
    own after the policy's (refit over NCCL from policy rank 0). On CPU, refit goes through host
    memory."""

    # Engines (vLLM instances); each decodes a contiguous share of a step's prompt groups.
    num_engines: int = bounded(1, ge=1)
    # Tensor-parallel size of each engine (its own, independent of the policy's layout).
    tensor_parallel_size: int = bounded(1, ge=1)
    # GPU: fraction of each engine GPU's memory vLLM may take (weights, activations, KV cache).
    gpu_memory_utilization: float = bounded(0.5, gt=0, le=1)
    # KV cache size per engine in GiB; null: on GPU what gpu_memory_utilization leaves, on
    # CPU 0.25.
    kv_cache_gb: Optional[float] = bounded(None, gt=0)
    # Refit bucket size in MiB: weights are streamed to the engines in buckets of about this size.
    refit_bucket_mb: int = bounded(256, ge=1)
    # Colocated GPU runs: vLLM sleep level while the policy trains; 1 moves the engine's weights
    # to host memory (and back at the wake before the refit, which then overwrites them), 2
    # discards them (the next refit rewrites them; a hand-over without one, after a checkpoint
    # save or the start-up canary, refits). Both free the KV cache.
    sleep_level: int = one_of(1, (1, 2))
    # Reuse the KV cache of shared prompt prefixes (reset at every refit).
    enable_prefix_caching: bool = True
    # GPU: decode without CUDA graphs (faster start, slower decoding). Always eager on CPU.
    enforce_eager: bool = False
    # null: the engine computes in the policy's precision. "fp8": vLLM's online FP8 (its
    # quantization="fp8" on bf16 weights: each linear layer's weight in float8_e4m3fn with one
    # scale per tensor, activations quantized per token as they come; embeddings, norms and
    # lm_head stay bf16). Every refit sends bf16 weights, which vLLM quantizes again as it loads
    # them (docs/design.md, "fp8 rollouts"). Needs policy.megatron.precision=bf16 and GPUs of
    # compute capability >= 8.9 (Ada, Hopper and newer); the rollouts' logprobs then differ more
    # from the trainer's (train/token_mult_prob_error against generation.logprob_budget).
    quantization: Optional[str] = one_of(None, VLLM_QUANTIZATIONS)


@dataclass
class GenerationConfig:
    """The rollout engine and its decoding."""

    # Rollout engine (mcore_rl/config/registry.py): "hf" (a transformers model with our own
    # decoding loop, refit by weight copy), "megatron" (the policy workers decode with the
    # policy's own Megatron model and a static KV cache, weights shared in place: refit copies
    # nothing; needs policy.megatron.pipeline_model_parallel_size=1 and sequence_parallel=false)
    # or "vllm" (vLLM engines in processes of their own, refit by streamed weights:
    # generation.vllm).
    backend: str = one_of("hf", names(BACKENDS))
    # Sampling temperature; the policy's logprobs use the same temperature.
    temperature: float = bounded(1.0, gt=0)
    # Nucleus sampling mass; 1 disables (logprobs are taken before the filter).
    top_p: float = bounded(1.0, gt=0, le=1)
    # Max response tokens; also capped at data.max_total_length minus the prompt length.
    max_new_tokens: int = bounded(16, ge=1)
    # Sequences per generate chunk (memory bound); a step's rollouts are decoded in chunks
    # (the streaming loop: a generation call decodes one chunk).
    batch_size: int = bounded(256, ge=1)
    # Validation decoding: greedy when true.
    greedy_validation: bool = True
    # Decode every response to its token budget (max_new_tokens, or what data.max_total_length
    # leaves), never stopping at eos or a stop token (vLLM's ignore_eos): fixed-length rollouts
    # for throughput benchmarks, e.g. random weights at a measured mean response length.
    ignore_eos: bool = False
    # Processes of the rollout engine's own (Ray actors, or plain processes with
    # cluster.use_ray=false), prompt groups spread over them; 0: it runs in the controller's
    # process. generation.backend=hf only; grpo/ppo.streaming with hf need >= 1.
    num_workers: int = bounded(0, ge=0)
    # backend=megatron on CUDA with tensor parallelism 1 (above it with cuda_graphs_tp) and a
    # dense model: decode steps replayed as CUDA graphs (captured per bucket of rows and attended
    # length at first use, kept between generate calls); false, or a model with experts, decodes
    # the same steps eagerly.
    cuda_graphs: bool = True
    # backend=megatron with policy.megatron.tensor_model_parallel_size > 1: replay the decode
    # steps as CUDA graphs there too (with generation.cuda_graphs), the tensor-parallel NCCL
    # all-reduces and all-gathers captured inside them; every TP rank captures and replays the
    # same graphs in the same order. Off: TP > 1 decodes eagerly. Opt-in: not run on a GPU yet.
    # Refused with cuda_graphs=false; ignored at TP=1; a model with experts stays eager.
    cuda_graphs_tp: bool = False
    # backend=megatron: the rows that share a prompt (equal consecutive prompts: GRPO's group)
    # read one copy of its keys and values (prefilled once), a two-level attention (prompt
    # part + each row's response part, one softmax over both); the batch is compacted by whole
    # groups. Not bit for bit against the rows decoded alone (the sums run in another order):
    # each attention output within 4 eps of the probability-weighted |v| (tests); fp32 rollouts
    # equal, logprobs within 1e-5; bf16: scripts/gpu/decode_step_profile.py.
    shared_prompt_kv: bool = False
    # backend=megatron: each decode step's layers run as two functions of tensors compiled by
    # torch.compile (Inductor: norms, RoPE, bias and residual adds, SwiGLU, the attention's mask
    # and softmax fused between the matrix products; one compile for every layer and CUDA-graph
    # bucket, made at the first decode step). Dense local/torch-spec layers at TP=1. On CUDA
    # the decode step's sampler (temperature, log-softmax, top-p, block_sampling's sums and
    # draw) is compiled too, with the same mode, one compile for every bucket (the prefill's
    # first tokens and the CPU sample eagerly: mcore_rl/generation/megatron.py). Not bit for
    # bit (fused kernels round intermediates differently): the same tokens and logprobs
    # within 5e-5 of the eager decoder in fp32 on CPU (tests; 7.9e-6 measured); the compiled
    # sampler alone: logprobs within 1e-5 + float32 eps x the largest |logit| / temperature,
    # tokens apart only where a draw is within float32 rounding of a cdf boundary
    # (tests/test_sampling_compile.py); bf16 on the GPU: scripts/gpu/decode_step_profile.py
    # (rows and logprobs against the eager decoder).
    compile_decode: bool = False
    # backend=megatron: the torch.compile mode of compile_decode's layer functions and sampler:
    # default (Inductor's fusions, the matrix products cuBLAS's), or max-autotune-no-cudagraphs
    # (Inductor also autotunes the matrix products, Triton GEMM templates against cuBLAS, and
    # may fuse epilogues such as the residual add into them; the decoder captures its own CUDA
    # graphs).
    # Needs compile_decode=true (refused at load otherwise). The first decode step compiles
    # longer (each matrix product's candidates are benchmarked). Slower on one H200
    # (scripts/gpu/decode_step_profile.py, SmolLM2-135M's shape, 256 rows): 3.91 ms a decode
    # step against default's 3.44 (the attention's batched products as Triton templates took
    # 650 us a step each against cuBLAS's 391 and 306); default stays the default.
    compile_decode_mode: str = one_of("default", COMPILE_DECODE_MODES)
    # backend=megatron: the attention over the KV cache in compile_decode's layers: bmm (two
    # batched matrix products around a softmax kernel, the scores written to memory), flex
    # (torch's FlexAttention in one kernel) or triton (one Triton flash-decoding kernel a layer,
    # mcore_rl/megatron/flash_decode.py: a program per row and KV group, the scores in
    # registers, the softmax online in fp32; with shared_prompt_kv too). flex and triton need
    # compile_decode=true; flex is not supported with shared_prompt_kv (both refused at load);
    # flex compiles its attention half once per row bucket. Not bit for bit (bmm rounds scores
    # and probabilities to the model's dtype; flex and triton keep fp32 scores): fp32 on CPU
    # within 1e-5 of bmm per output element, rollouts equal (tests). One H200, SmolLM2-135M's
    # shape, 256 rows, with compile_decode and block_sampling (decode_step_profile.py): bmm
    # 3.16 ms a decode step, triton 2.80, triton with shared_prompt_kv 2.37; flex 4.63 (Inductor
    # took its main FlexAttention kernel, 78 us a layer). grpo_smollm2_gsm8k turns triton on.
    # triton_rope: triton's kernel with the query and key RoPE and the KV-cache write inside
    # (mcore_rl/megatron/flash_decode.py, flash_decode_rope: 8 kernels a layer instead of 10),
    # for layers without qk_layernorm and with RoPE over the whole head; its query and key are
    # rounded once after an fp32 RoPE, as the compiled layer's. Not measured on a GPU yet.
    decode_attention: str = one_of("bmm", DECODE_ATTENTIONS)
    # Sampling (backends hf and megatron, mcore_rl/generation/sampling.py): draw each token by
    # the same inverse transform in two levels, the vocabulary in blocks of 256 (block sums,
    # then a scan of the chosen block) with the probabilities taken from the logprobs, instead
    # of a softmax and a scan over the whole vocabulary: fewer passes over [rows, vocab] a
    # decode step. Not bit for bit: a token differs only where its uniform lies within float32
    # rounding (~1e-7) of an interval's boundary (tests; rare for peaked distributions, up to
    # ~vocab x 1e-7 a draw for flat ones); logprobs of the same tokens equal. vllm: ignored.
    # One H200, SmolLM2-135M's shape, 256 rows, with compile_decode: 3.44 -> 3.16 ms a decode
    # step (the SmolLM2 recipes turn it on).
    block_sampling: bool = False
    # Logprob contract (docs/logprob-contract.md): the largest train/token_mult_prob_error (mean
    # over response tokens of exp(|trainer logprob - rollout logprob|), NeMo RL's definition)
    # the run accepts, checked on a start-up canary batch and every RL step; null: unchecked.
    # 1.05 is NeMo RL's test threshold; measured: bf16 megatron decode of SmolLM2-135M on an
    # H100 1.041-1.042 (2026-11-25, 8 steps), fp32 CPU runs 1.0000.
    logprob_budget: Optional[float] = bounded(1.05, ge=1)
    # Consecutive RL steps over logprob_budget that stop the run (exit code 3): the last of
    # them is aborted before its optimizer step and not saved.
    logprob_budget_steps: int = bounded(3, ge=1)
    # Prompts of the start-up canary (the first training prompts, one response each, sampled
    # as the run samples) whose trainer/rollout mismatch must be within logprob_budget before
    # the first RL step; 0: no canary. Streaming with max_staleness >= 1: also the canary
    # decoded after each refit, which counts toward logprob_budget_steps for a step that
    # trains no row decoded by its own weights (logged as canary/*); 0: such steps are not
    # counted.
    logprob_canary_prompts: int = bounded(8, ge=0)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)


@dataclass
class SyntheticTaskConfig:
    """Integer arithmetic ``a op b`` with exact-answer reward (seeded, disjoint held-out split)."""

    # Operators drawn from, distinct characters of "+-*" (e.g. "+-").
    operations: str = "+"
    # Smallest operand (inclusive).
    min_value: int = 0
    # Largest operand (inclusive).
    max_value: int = 99
    # Training prompts; with num_test at most the count of distinct prompts.
    num_train: int = bounded(9500, ge=1)
    # Held-out prompts for validation; 0: no validation.
    num_test: int = bounded(500, ge=0)
    # Fraction of the examples whose reference solution (the sft.* warm start) is a calculator
    # episode of env.name=tool_use in plain text (the built-in character tokenizer): a tool call
    # of the expression, eos, the tool's response, the answer; the rest answer directly. 0: every
    # solution is the answer alone (the default; the splits do not depend on this key).
    tool_solutions: float = bounded(0.0, ge=0, le=1)


@dataclass
class DataConfig:
    """The prompt data set and how prompts are rendered."""

    # Prompt task (mcore_rl/config/registry.py TASKS): "synthetic" (data.synthetic), "gsm8k"
    # (GSM8K JSONL files), "dataset" (your data: a JSONL, JSON or Parquet file or a `datasets`
    # save_to_disk directory, its columns named by data.prompt_key, data.answer_key,
    # data.messages_key), or "module:function" of your own, (DataConfig, seed) -> (train, test)
    # lists of mcore_rl.data.example.Example.
    task: str = plugin("synthetic", names(TASKS))
    # gsm8k and dataset: the training data (gsm8k: JSONL with question, answer ending in
    # "#### N"; dataset: .jsonl, .json, .parquet, or a save_to_disk directory, of a DatasetDict
    # its "train" split); null for synthetic.
    train_path: Optional[str] = None
    # gsm8k and dataset: held-out data for validation, in the train_path formats (a DatasetDict
    # directory: its "test" split); null: none, or data.test_fraction (must be null for
    # synthetic).
    test_path: Optional[str] = None
    synthetic: SyntheticTaskConfig = field(default_factory=SyntheticTaskConfig)
    # dataset: the column of the prompt text (a non-empty string).
    prompt_key: str = "prompt"
    # dataset: the column of the ground-truth answer the reward reads (Example.answer, turned
    # into text; also the reference solution of the sft.* warm start); null: none (empty).
    answer_key: Optional[str] = "answer"
    # dataset: the column of chat-format prompts, a list of {"role", "content"} messages with
    # at least one "user" turn, used in place of data.prompt_key and rendered with the chat
    # template (without one: the contents, one a line); null: plain-text prompts. The other
    # columns reach the reward and the environment as Example.fields.
    messages_key: Optional[str] = None
    # A system message before each prompt (with the chat template; plain text: its own line
    # before the prompt); messages with a system turn keep theirs; null: none.
    system_prompt: Optional[str] = None
    # gsm8k and dataset without data.test_path: the fraction of the train rows held out for
    # validation (shuffled with data.split_seed); 0: no validation set.
    test_fraction: float = bounded(0.0, ge=0, lt=1)
    # Seed of the data.test_fraction split; null: run.seed.
    split_seed: Optional[int] = bounded(None, ge=0)
    # Prompt text around the question; "{question}" is replaced (not applied to messages).
    prompt_template: str = "{question}"
    # Apply the tokenizer's chat template (when it has one) to the prompt.
    use_chat_template: bool = False
    # Max prompt tokens; a longer prompt is an error naming the sample, unless
    # data.filter_long_prompts.
    max_prompt_length: int = bounded(32, ge=1)
    # Drop the prompts longer than data.max_prompt_length (the count of each split is logged
    # and kept in summary.json) instead of stopping with an error.
    filter_long_prompts: bool = False
    # Max prompt + response tokens; >= max_prompt_length + generation.max_new_tokens.
    max_total_length: int = bounded(64, ge=2)


@dataclass
class RewardConfig:
    """The reward: a verifier, a learned reward (a reward model, a judge), or several weighted
    (mcore_rl/rewards/; at most one of them learned). A reward function is ``(response_text,
    example) -> float`` (``example.fields`` holds the data set's extra columns); ``async def``
    ones are awaited concurrently and batched ones (the attribute ``batched = True``:
    ``(responses, examples) -> list of floats``) get a step's samples in one call, both in the
    controller (for remote scorers); the others score in the pool."""

    # Verifier (mcore_rl/config/registry.py VERIFIERS): "exact" (synthetic: first line is the
    # integer answer), "math" (GSM8K, math-verify), or "module:function" of your own; or a
    # learned reward: "model" (a reward model's score of the last token: reward_model.*) or
    # "judge" (a generative judge's parsed rating: judge.*).
    name: str = plugin("exact", names(VERIFIERS) + names(LEARNED_REWARDS))
    # With a learned reward (model or judge, in reward.name or reward.names): a verifier scored
    # beside it on every rollout, for tracking only (train/verifier_reward; validation's
    # val/accuracy, with the run's reward as val/reward); null: none (val/accuracy is then the
    # run's reward).
    verifier: Optional[str] = one_of(None, names(VERIFIERS))
    # Several rewards (each as reward.name), summed with reward.weights; with two or more, each
    # is logged as reward/<name> (unweighted; val/reward/<name> in validation). At most one
    # learned reward (model or judge) among them: it scores the whole rollout after generation,
    # the others as reward.name would. When set, replaces reward.name; null: reward.name alone.
    names: Optional[List[str]] = plugin(None, names(VERIFIERS) + names(LEARNED_REWARDS))
    # The weight of each reward of reward.names (or of reward.name: one weight); null: 1 each.
    weights: Optional[List[float]] = None
    # Processes that score in parallel, overlapped with the logprob forward
    # (mcore_rl/rewards/pool.py); 0 scores in the controller; null: 0 when every plain
    # (not async, not batched) reward is "exact" (a regex), else min(8, CPU count).
    num_workers: Optional[int] = bounded(None, ge=0, le=256)
    # Hard limit in seconds on one sample's scoring in the pool (or one async call): past it
    # the sample scores 0, counts in train/reward_errors, and the pool's processes are replaced.
    timeout_seconds: float = bounded(10.0, gt=0)
    # One-turn rollouts: each prompt group goes to the reward pool as the rollout backend
    # finishes it (the megatron backend: as its decoder marks the rows done), so scoring
    # overlaps the rest of the decoding; the async and batched rewards still score the whole
    # rollout after it. The same rewards as scoring after generation; the fraction scored
    # before generation ended is logged as train/reward_early_fraction.
    score_while_decoding: bool = True


@dataclass
class EnvConfig:
    """The environment an episode runs in (mcore_rl/environments/): reset on a data example,
    stepped one model turn at a time. env.name=single_turn is the one-turn path (the response
    scored by reward.name's verifier in the reward pool); any other runs the multi-turn rollout
    loop (mcore_rl/rollout/multi_turn.py) in the synchronous RL loops (not with streaming)."""

    # Environment (mcore_rl/config/registry.py ENVIRONMENTS): "single_turn" (reward.name's
    # verifier scores the one model turn), "tool_use" (the model may call a calculator and a
    # Python sandbox, as `<tool_call>` JSON blocks of the Hermes/Qwen format, before its
    # answer, which reward.name's verifier scores), or "module:Class" of your own (a picklable
    # class with a classmethod from_config(cfg), reset(example) and step(state,
    # model_turn_text): mcore_rl/environments/base.py), run by the multi-turn loop.
    name: str = plugin("single_turn", names(ENVIRONMENTS))
    # Model turns per episode at most; tool calls in the last one are not run (reward 0).
    max_turns: int = bounded(4, ge=1, le=1024)
    # Wall-clock limit in seconds of one Python sandbox run; past it the process group is
    # killed and the call counts as a tool timeout.
    tool_timeout_seconds: float = bounded(10.0, gt=0)
    # Characters kept of a sandbox run's stdout and of its stderr each (the rest is dropped).
    max_output_chars: int = bounded(4096, ge=1)
    # Address-space limit (RLIMIT_AS) of the Python sandbox in MiB; the interpreter itself
    # takes about 20.
    sandbox_memory_mb: int = bounded(512, ge=64)
    # CPU-time limit (RLIMIT_CPU) of the Python sandbox in seconds.
    sandbox_cpu_seconds: int = bounded(5, ge=1, le=3600)
    # How the Python sandbox isolates model-written code (mcore_rl/config/registry.py
    # SANDBOXES): "bwrap" (bubblewrap namespaces: no network, no host files but the interpreter
    # and its standard library read-only, a private /tmp, own PID namespace, uid 65534, no new
    # processes; refused at load where bwrap cannot run) or "unsafe_subprocess" (a plain
    # subprocess as the trainer's user: host files, network and processes reachable; warns
    # every step).
    sandbox: str = one_of("bwrap", names(SANDBOXES))
    # Processes that run environment steps (mcore_rl/environments/executor.py), so a slow or
    # crashing environment cannot stall or kill the controller; 0: in the controller's process.
    num_workers: int = bounded(4, ge=0, le=256)
    # Hard limit in seconds on one environment step in those processes: past it the episode
    # ends with reward 0 and an error, and the processes are replaced. Must exceed
    # env.tool_timeout_seconds.
    step_timeout_seconds: float = bounded(60.0, gt=0)


@dataclass
class LossConfig:
    """The policy loss (:mod:`mcore_rl.algorithms.losses`, chosen by ``loss.name``)."""

    # Policy loss (mcore_rl/config/registry.py): "ppo_clip" (token-level ratio, PPO-clip;
    # Schulman et al. 2017), "gspo" (sequence-level length-normalized ratio, clipped per
    # sequence; Zheng et al. 2025: use small clip ranges, e.g. 3e-4 / 4e-4), or "module:Class"
    # of your own, built as Class(LossConfig, max_response_length=...) with ClippedPGLoss's
    # interface (loss_type, metric_kinds, __call__(logprobs, batch)).
    name: str = plugin("ppo_clip", names(POLICY_LOSSES))
    # Ratio clipped below at 1 - this (Schulman et al. 2017, eq. 7).
    ratio_clip_low: float = bounded(0.2, ge=0, lt=1)
    # Ratio clipped above at 1 + this; above ratio_clip_low is DAPO's clip-higher (Yu et al. 2025).
    ratio_clip_high: float = bounded(0.2, ge=0)
    # Dual clip constant c for negative advantages (Ye et al. 2020): the loss -A*r is capped at
    # -A*c, which must stay above the on-policy loss -A (ratio 1); null disables.
    dual_clip: Optional[float] = bounded(None, gt=1)
    # KL(pi || pi_ref) penalty in the loss; 0 disables the reference model.
    kl_coef: float = bounded(0.0, ge=0)
    # KL estimator (Schulman 2020, "Approximating KL divergence").
    kl_estimator: str = one_of("k3", KL_ESTIMATORS)
    # How per-token losses make the batch loss: "token-mean" (sum over the valid tokens of the
    # global batch / their count; DAPO's token-level loss), "seq-mean-token-mean" (each
    # sequence's token mean, averaged over sequences; GRPO's), "seq-mean-token-sum" (each
    # sequence's token sum, averaged over sequences), "seq-mean-token-sum-norm" (token sums
    # divided by the constant generation.max_new_tokens, averaged over sequences; Dr. GRPO's).
    aggregation: str = one_of("token-mean", LOSS_AGGREGATIONS)
    # Truncated importance weights min(exp(old - generation), cap) (TIS, Yao et al. 2025);
    # null disables. At least 1, so that a token on which rollout engine and trainer agree keeps
    # its full weight (ClippedPGLoss says why).
    importance_ratio_cap: Optional[float] = bounded(None, ge=1)
    # Masked importance sampling (MIS) against the rollout engine's mismatch: "token" zeroes the
    # loss of each token whose weight exp(old - generation) is outside [importance_mask_low,
    # importance_mask_high]; "sequence" zeroes every token of a sequence whose weight (the
    # product of its tokens' weights) is outside; null disables.
    importance_mask: Optional[str] = one_of(None, ("token", "sequence"))
    # Lower bound of the weights MIS keeps (at most 1: agreement keeps its tokens).
    importance_mask_low: float = bounded(0.5, ge=0, le=1)
    # Upper bound of the weights MIS keeps (at least 1).
    importance_mask_high: float = bounded(2.0, ge=1)
    # The old policy's logprobs of the ratio: "recompute" (a forward of the policy over the
    # rollout before training; NeMo RL's and verl's way), or "train_forward": the training
    # forward's own logprobs, detached (TRL's way with one iteration per generation): the ratio
    # is exactly 1 and the gradient the same, one forward of the policy less per RL step. Only
    # where the weights do not change between the recompute forward and the training forward,
    # and nothing reads the old logprobs before training: algorithm grpo with
    # grpo.optimizer_steps_per_rollout=1 and grpo.reward_kl_coef=0; streaming too (its one
    # optimizer step ends the RL step; stale rows keep their generation_logprobs, so the
    # importance weights are those of recompute). The trainer/rollout mismatch
    # (train/token_mult_prob_error, generation.logprob_budget; streaming: over the rows the
    # trained weights decoded) is then measured in the training forward, after that step's
    # optimizer step; a run the budget stops saves nothing of that step. A streamed step
    # without such rows is measured on the refit's canary (generation.logprob_canary_prompts)
    # before its optimizer step, as with recompute.
    prev_logprobs: str = one_of("recompute", ("recompute", "train_forward"))


@dataclass
class StreamingLoopConfig:
    """The streaming loop's keys, shared by the ``grpo`` and ``ppo`` sections (their first
    keys; :mod:`mcore_rl.controller.streaming`)."""

    # Streaming loop (mcore_rl/controller/streaming.py): finished prompt groups are scored and
    # trained (split train step) while the rest are still generated, by a rollout engine in
    # processes of its own (hf with generation.num_workers >= 1, or the vllm engines). GRPO
    # needs grpo.optimizer_steps_per_rollout=1; PPO needs ppo.ppo_epochs=1,
    # ppo.num_mini_batches=1 and ppo.whiten_advantages=false.
    streaming: bool = False
    # Streaming: how many policy versions (policy updates) a rollout's weights may lag the
    # weights it trains: 0 is on-policy (parameters of the synchronous loop); k lets generation
    # run up to k steps ahead. Older rollouts are dropped and their prompts generated again.
    max_staleness: int = bounded(0, ge=0)
    # Streaming: times an RL step is tried again after it failed (a micro-batch raised, a
    # generation worker died): the step is aborted, its rollouts requeued; 0 stops the run
    # with the error at the first failure.
    max_step_retries: int = bounded(2, ge=0)


@dataclass
class GRPOConfig(StreamingLoopConfig):
    """The GRPO loop (Shao et al. 2024, "DeepSeekMath", sec. 4.1)."""

    # Prompts sampled per RL step.
    num_prompts_per_step: int = bounded(32, ge=1)
    # Responses per prompt (the GRPO group size): a group of one has no baseline.
    num_generations: int = bounded(8, ge=2)
    # RL steps to run: each is one rollout, its optimizer steps and a refit.
    max_steps: int = bounded(100, ge=0)
    # Advantage estimator (mcore_rl/config/registry.py): "grpo" (group mean baseline, over
    # the group std with normalize_std; Shao et al. 2024), "rloo" (leave-one-out mean of the
    # group; Ahmadian et al. 2024), "reinforce_plus_plus" (reward-to-go with the KL penalty
    # grpo.reward_kl_coef in the reward, whitened over the global batch; Hu 2025), or
    # "module:function" of your own, (rollout, cfg) -> [B, S] advantages, whose attributes
    # per_group and reads_reward_kl (false when absent) say what the built-ins' entries say.
    advantage_estimator: str = plugin("grpo", names(ADVANTAGE_ESTIMATORS))
    # "grpo" estimator: divide by the group std (Shao et al. 2024); false gives Dr. GRPO's
    # mean-centering (Liu et al. 2025).
    normalize_std: bool = True
    # "reinforce_plus_plus": KL(pi_old || pi_ref) penalty per response token in the reward,
    # -coef * KL_t; 0: none.
    reward_kl_coef: float = bounded(0.0, ge=0)
    # Estimator of that KL term (Schulman 2020).
    reward_kl_estimator: str = one_of("k1", KL_ESTIMATORS)
    # DAPO dynamic sampling (Yu et al. 2025): drop prompt groups whose rewards are all equal
    # (zero advantage) and generate more until num_prompts_per_step groups are kept.
    dynamic_sampling: bool = False
    # Generation rounds per RL step with dynamic_sampling; when they run out, the batch is
    # filled with dropped groups (zero advantage) and train/dynamic_sampling_filled counts them.
    dynamic_sampling_max_tries: int = bounded(4, ge=1)
    # DAPO overlong reward shaping: a penalty rising linearly from 0 to overlong_penalty_factor
    # over the last this many tokens of generation.max_new_tokens; 0 disables.
    overlong_buffer_length: int = bounded(0, ge=0)
    # The penalty of a response of generation.max_new_tokens tokens or more (DAPO: 1).
    overlong_penalty_factor: float = bounded(1.0, ge=0)
    # DAPO overlong filtering: responses cut at generation.max_new_tokens leave the loss
    # (sample_mask 0 after the advantages are computed).
    overlong_filtering: bool = False
    # Optimizer steps per RL step (the rollout batch split into this many global batches).
    optimizer_steps_per_rollout: int = bounded(1, ge=1)
    # Validate every k RL steps and after the last one; 0: never during training.
    val_every: int = bounded(10, ge=0)
    # Held-out prompts per validation (the first ones of the test split).
    val_num_prompts: int = bounded(200, ge=1)
    # Validate once before the first RL step (not on a resumed run).
    val_at_start: bool = True


@dataclass
class PPOConfig(StreamingLoopConfig):
    """The PPO loop (``algorithm: ppo``): clipped policy updates (Schulman et al. 2017,
    arXiv:1707.06347) with a learned critic and token-level GAE (Schulman et al. 2016,
    arXiv:1506.02438), as in RLHF (Ouyang et al. 2022, arXiv:2203.02155)."""

    # Prompts sampled per RL step.
    num_prompts_per_step: int = bounded(64, ge=1)
    # Responses per prompt (the critic is the baseline: 1 is usual).
    num_generations: int = bounded(1, ge=1)
    # RL steps to run: each is one rollout, its critic and policy updates and a refit.
    max_steps: int = bounded(100, ge=0)
    # Passes over each rollout (critic then policy update on every mini-batch of a pass).
    ppo_epochs: int = bounded(1, ge=1)
    # Mini-batches per pass (shuffled rows): optimizer steps per pass for critic and policy.
    num_mini_batches: int = bounded(1, ge=1)
    # GAE discount gamma (per token).
    gamma: float = bounded(1.0, ge=0, le=1)
    # GAE lambda: 1 gives Monte Carlo returns, 0 one-step TD.
    lam: float = bounded(0.95, ge=0, le=1)
    # Whiten the advantages over the rollout's valid tokens (after the returns are taken).
    whiten_advantages: bool = True
    # RL steps at the start that train the critic only (the policy is frozen).
    critic_warmup_steps: int = bounded(0, ge=0)
    # KL(pi_old || pi_ref) penalty per response token in the reward, -coef * KL_t; 0: none.
    reward_kl_coef: float = bounded(0.0, ge=0)
    # Estimator of the reward's KL term (Schulman 2020).
    reward_kl_estimator: str = one_of("k1", KL_ESTIMATORS)
    # Validate every k RL steps and after the last one; 0: never during training.
    val_every: int = bounded(10, ge=0)
    # Held-out prompts per validation (the first ones of the test split).
    val_num_prompts: int = bounded(200, ge=1)
    # Validate once before the first RL step (not on a resumed run).
    val_at_start: bool = True


@dataclass
class ValueLossConfig:
    """The clipped value loss (:class:`mcore_rl.algorithms.losses.ClippedValueLoss`)."""

    # Values clipped to the rollout's values +- this before the squared error; null: unclipped.
    cliprange: Optional[float] = bounded(0.5, gt=0)
    # Multiplies the value loss (the critic has its own optimizer: it matters with clip_grad).
    coef: float = bounded(1.0, gt=0)


@dataclass
class ValueConfig:
    """The PPO critic (``algorithm: ppo``): the policy's backbone with a scalar value head."""

    # A Hugging Face causal-LM checkpoint of the policy's architecture for the backbone; null:
    # the policy's weights (model.hf_path or the same seeded init; after an sft warm start, the
    # warm-started policy's).
    hf_path: Optional[str] = None
    # Keep the value head in float32 whatever value.megatron.precision is. With precision bf16
    # this needs value.megatron.ddp.use_distributed_optimizer=true: megatron-core's other
    # optimizer (Float16OptimizerWithFloat16Params) numbers a bf16 model's fp32 parameters out of
    # step with their checkpoint entries and fails at the first save (KeyError, seen on an H100
    # with megatron-core 0.19.2); the load-time check refuses that combination.
    head_fp32: bool = False
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    # Sequences per training forward/backward on each DP rank.
    micro_batch_size: int = bounded(16, ge=1)
    # Sequences per forward-only pass on each DP rank for the rollout's values.
    values_micro_batch_size: int = bounded(32, ge=1)
    # As policy.sequence_packing, for the critic (token budget: micro_batch_size /
    # values_micro_batch_size x the call's longest row).
    sequence_packing: bool = False
    loss: ValueLossConfig = field(default_factory=ValueLossConfig)


@dataclass
class RewardModelConfig:
    """The reward model (reward.name=model): a Megatron GPT backbone with a scalar score head,
    scoring each rollout by its last token (mcore_rl/workers/reward_model.py), placed with the
    training groups (cluster.placement: on the policy's GPUs, or GPUs of its own); with
    cluster.colocate_generation its weights leave the device between scorings. Its megatron and
    optimizer sections are also the layout and optimizer of reward-model training
    (algorithm=rm, which trains model.*)."""

    # A Hugging Face *ForSequenceClassification checkpoint with one label (score.weight; e.g.
    # `mcore-rl export` of an algorithm=rm run) of the families mcore-rl converts; needed by
    # reward.name=model (or model in reward.names).
    hf_path: Optional[str] = None
    # Its tokenizer directory; null: hf_path's.
    tokenizer: Optional[str] = None
    # A tokenizer other than the policy's: each rollout is decoded and tokenized again with the
    # reward model's (the prompt and response as a user and an assistant turn of its chat
    # template with data.use_chat_template, else plain text and its eos). False refuses a
    # tokenizer that differs from the policy's at load; an equal one scores the rollout's ids.
    retokenize: bool = False
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    # algorithm=rm only (scoring keeps the weights fixed).
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    # Sequences per scoring forward pass on each DP rank.
    score_micro_batch_size: int = bounded(32, ge=1)
    # Token budget per scoring micro-batch (rows sorted by length, padded to each micro-batch's
    # longest), used instead of score_micro_batch_size; >= the longest row; null: fixed sizes.
    max_tokens_per_microbatch: Optional[int] = bounded(None, ge=1)


@dataclass
class JudgeConfig:
    """The generative judge (reward.name=judge): a causal LM of the families mcore-rl converts,
    decoded by any generation backend (judge.generation.backend), asked through a prompt
    template to rate each response; the first number in its answer (judge.score_pattern),
    scaled from [min_score, max_score] to [0, 1], is the reward. An answer without a score, or
    one out of range, gives reward 0 and counts in train/reward_errors; the run goes on."""

    # The judge's Hugging Face checkpoint; null: the policy's starting weights (model.hf_path,
    # or model.arch's seeded init), frozen.
    hf_path: Optional[str] = None
    # The judge's tokenizer directory; null: hf_path's, or the policy's with hf_path null.
    tokenizer: Optional[str] = None
    # The judge's prompt: {response} (required) is the decoded response, {prompt} the task's
    # question, {answer} its reference answer.
    template: str = ("Rate the response to the question from 0 to 10.\nQuestion: {prompt}\n"
                     "Response: {response}\nRating (0-10):")
    # Render the template as a user turn of the judge tokenizer's chat template.
    use_chat_template: bool = False
    # Regular expression of the score; its first match in the judge's answer (group 1 if it has
    # groups) is read as a number.
    score_pattern: str = r"-?\d+(?:\.\d+)?"
    # The lowest score: reward = (score - min_score) / (max_score - min_score); a score below
    # it is an error (reward 0).
    min_score: float = 0.0
    # The highest score (reward 1); a score above it is an error (reward 0).
    max_score: float = 10.0
    # Longest rendered judge prompt in tokens; a longer one scores 0 and counts as an error.
    max_prompt_length: int = bounded(512, ge=1)
    # Greedy decoding of the judge's answer (else sampled at judge.generation.temperature).
    greedy: bool = True
    # The judge's decoding: its backend (hf, megatron, vllm; built as the policy's is, on the
    # judge's own Megatron model), max_new_tokens, batch_size, ...
    generation: GenerationConfig = field(default_factory=lambda: GenerationConfig(
        max_new_tokens=8, logprob_budget=None, logprob_canary_prompts=0))
    # The layout of the judge's Megatron model (its weights; the megatron backend decodes on it).
    megatron: MegatronConfig = field(default_factory=MegatronConfig)


@dataclass
class RMConfig:
    """Reward-model training (algorithm: rm; mcore_rl/controller/rm.py): the Bradley-Terry loss
    -log sigmoid(r_chosen - r_rejected - margin) (Bradley & Terry 1952; Ouyang et al. 2022,
    eq. 1; the margin of Touvron et al. 2023, eq. 2) on preference pairs (JSONL: prompt, chosen,
    rejected, optional margin; mcore_rl/data/preferences.py), each row scored at its last token.
    It trains model.* (a causal LM's backbone with a fresh score head, a *ForSequenceClassification
    checkpoint, or model.arch's seeded init) on reward_model.megatron with
    reward_model.optimizer; prompts are rendered as the policy's (data.prompt_template,
    data.use_chat_template); checkpoints as for the policy, `mcore-rl export` writes a
    *ForSequenceClassification directory, `mcore-rl eval` reports held-out pair accuracy."""

    # Training pairs (JSONL).
    train_path: Optional[str] = None
    # Held-out pairs (JSONL) for pair accuracy; null: no validation.
    test_path: Optional[str] = None
    # Pairs per optimizer step (all DP ranks); divisible by the DP size.
    pairs_per_step: int = bounded(64, ge=1)
    # Pairs per forward/backward on each DP rank (2 rows each; a pair stays in one micro-batch).
    micro_batch_pairs: int = bounded(16, ge=1)
    # Optimizer steps to run.
    max_steps: int = bounded(100, ge=0)
    # Validate every k steps and after the last one; 0: never during training.
    val_every: int = bounded(10, ge=0)
    # Held-out pairs per validation (the first ones of rm.test_path).
    val_num_pairs: int = bounded(500, ge=1)
    # Validate once before the first step (not on a resumed run).
    val_at_start: bool = True


@dataclass
class SFTConfig:
    """Optional supervised warm start on the task's reference answers before RL."""

    # Supervised (NLL) optimizer steps before RL; the KL reference is taken after them; 0: none.
    steps: int = bounded(0, ge=0)
    # Prompts with their reference answers per supervised step (all DP ranks together).
    batch_size: int = bounded(64, ge=1)
    # Constant learning rate of the warm start; RL then starts a fresh policy.optimizer.
    lr: float = bounded(1.0e-3, ge=0)


@dataclass
class LoggingConfig:
    """Where per-step metrics go (all under ``run.output_dir``)."""

    # Console progress of the warm start, the RL steps and eval: on a terminal a bar (step,
    # phase, reward, held-out accuracy, time left); elsewhere (a log file) a line per step.
    progress: bool = True
    # TensorBoard scalars under `<output_dir>/tensorboard`.
    tensorboard: bool = True
    # One JSON line of metrics per RL step in `<output_dir>/metrics.jsonl`.
    jsonl: bool = True
    # Weights & Biases: each RL step's metrics and the whole config to a W&B run named run.name
    # (needs `pip install wandb` and a login, or WANDB_MODE=offline); files under
    # `<output_dir>/wandb`; a resumed run continues the same W&B run.
    wandb: bool = False
    # W&B project.
    wandb_project: str = "mcore-rl"
    # W&B entity (team or user); null: the account's default.
    wandb_entity: Optional[str] = None


@dataclass
class CheckpointConfig:
    """Saving and resuming (policy, optimizer, LR schedule, prompt sampler, step)."""

    # Save every k RL steps (0: never) under `<output_dir>/checkpoints/step_<k>`.
    every: int = bounded(0, ge=0)
    # Also save after the last RL step (for `mcore-rl eval` and `mcore-rl export`), whatever
    # `every` is.
    save_final: bool = True
    # Resume from a checkpoint directory, or "latest" for the run directory's newest complete
    # one (those skipped, interrupted or damaged, are named in a warning; one that fails to load
    # falls back to the one before). The optimizer.* keys of the config apply (a warning names
    # those that changed); the LR schedule's progress, the weights and the Adam moments are the
    # checkpoint's.
    resume: Optional[str] = None
    # Newest complete checkpoints kept, older ones deleted after each completed save (never
    # before a newer one is complete); 0: keep all.
    keep_last: int = bounded(2, ge=0)
    # Write checkpoints in the background (Megatron's asynchronous dist-checkpoint save): a save
    # stages the tensors in host memory and training goes on while a forked process per worker
    # writes them; the checkpoint becomes step_<k> once written and verified. Costs a host copy
    # of the saved state per worker.
    async_save: bool = False


@dataclass
class WatchdogConfig:
    """The hang watchdog (mcore_rl/controller/watchdog.py): a phase of the RL step that
    overruns its deadline dumps every worker's Python stack to `<output_dir>/hang/` and stops
    the run with exit code 4, instead of waiting for an NCCL timeout. A phase's deadline is
    max(floor_seconds, factor x the longest of its last `history` durations); before it has a
    duration, factor x floor_seconds (its first run carries the warm-up)."""

    # Watch the phases (generation, reward, logprobs, values, train, finish, refit,
    # validation, checkpoint; the streaming loop's calls each).
    enabled: bool = True
    # The shortest deadline of any phase, in seconds: generous, so that a slow but live phase
    # never trips it.
    floor_seconds: float = bounded(600.0, gt=0)
    # A phase's deadline is this many times the longest of its recent durations (when that is
    # above floor_seconds).
    factor: float = bounded(3.0, ge=1)
    # Recent durations of each phase that the deadline looks at.
    history: int = bounded(10, ge=1)


# The RL algorithms (mcore_rl/config/registry.py ALGORITHMS), each with a config section of
# its name.
ALGORITHMS = names(_ALGORITHM_TABLE)


@dataclass
class TrainConfig:
    """Root config of ``mcore-rl train`` (GRPO or PPO)."""

    # "grpo" (the grpo section), "ppo" (the ppo and value sections) or "rm" (reward-model
    # training: the rm and reward_model sections).
    algorithm: str = one_of("grpo", ALGORITHMS)
    run: RunConfig = field(default_factory=RunConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    value: ValueConfig = field(default_factory=ValueConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    rm: RMConfig = field(default_factory=RMConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)

    @property
    def loop(self) -> Optional[Union[GRPOConfig, PPOConfig, RMConfig]]:
        """The section of the loop that ``algorithm`` names (``grpo``, ``ppo``, ``rm``); None
        when it names none (the field check of ``algorithm`` reports that)."""
        return getattr(self, self.algorithm) if self.algorithm in ALGORITHMS else None

    @property
    def streaming(self) -> bool:
        """Whether the run uses the streaming loop (``<algorithm>.streaming``)."""
        return getattr(self.loop, "streaming", False)

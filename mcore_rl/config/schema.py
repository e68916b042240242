"""Structured configs: the one place every config key, its type and default is declared.

YAML files in ``configs/`` are composed over these dataclasses by Hydra (see
:mod:`mcore_rl.config.loader`), so an unknown key or a wrong type is refused before any work.
Units: learning rates per optimizer step, lengths in tokens, intervals in RL steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RunConfig:
    name: str = "grpo_synthetic"
    # Run directory: metrics.jsonl, TensorBoard events, checkpoints, summary.json.
    output_dir: str = "runs/${run.name}"
    seed: int = 42


@dataclass
class ClusterConfig:
    # Processes for the policy's Megatron world (= TP x PP x DP).
    num_workers: int = 1
    # "cpu" (gloo + the CPU redirects), "cuda" (NCCL), or "auto" (cuda when a GPU is visible).
    device: str = "auto"
    # Ray: null starts a local cluster; "auto" or "host:port" joins an existing one.
    ray_address: Optional[str] = None
    # False runs workers as plain processes (torch.multiprocessing), without Ray.
    use_ray: bool = True
    # CPU threads per worker process (torch.set_num_threads); 0 leaves torch's default.
    threads_per_worker: int = 0


@dataclass
class ModelArchConfig:
    """Llama/Qwen2-family decoder shape, used when ``model.hf_path`` is null."""

    family: str = "qwen2"  # "llama" or "qwen2"
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 128
    max_position_embeddings: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1.0e-6
    qkv_bias: bool = True
    tie_word_embeddings: bool = True
    # null: the tokenizer's vocabulary size.
    vocab_size: Optional[int] = None


@dataclass
class ModelConfig:
    # A Hugging Face checkpoint directory (config.json + safetensors + tokenizer files).
    hf_path: Optional[str] = None
    # Tokenizer directory or "char" (the built-in character tokenizer); null: hf_path's.
    tokenizer: Optional[str] = None
    arch: ModelArchConfig = field(default_factory=ModelArchConfig)


@dataclass
class DDPConfig:
    overlap_grad_reduce: bool = False
    bucket_size: Optional[int] = None
    grad_reduce_in_fp32: bool = True
    average_in_collective: bool = False
    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    check_for_nan_in_grad: bool = False


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    # "fp32" or "bf16" (bf16 params with fp32 main params and grads in the optimizer).
    precision: str = "fp32"
    # Layer implementation: "local" (Megatron's own modules); more specs come with the GPU path.
    layer_spec: str = "local"
    ddp: DDPConfig = field(default_factory=DDPConfig)


@dataclass
class OptimizerConfig:
    name: str = "adam"
    lr: float = 1.0e-3
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1.0e-8
    # Max global grad norm; 0 disables clipping (the norm is still reported).
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    # "constant", "linear" or "cosine" decay over the run's optimizer steps.
    lr_decay_style: str = "constant"


@dataclass
class PolicyConfig:
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    # Sequences per micro-batch for training and for logprob inference.
    micro_batch_size: int = 16
    logprob_micro_batch_size: int = 32


@dataclass
class GenerationConfig:
    backend: str = "hf"
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    # Sequences per generate call (memory bound); the step's rollouts are split into these.
    batch_size: int = 256
    # Validation decoding: greedy when true.
    greedy_validation: bool = True


@dataclass
class SyntheticTaskConfig:
    """Integer arithmetic ``a op b`` with exact-answer reward (seeded, disjoint held-out split)."""

    operations: str = "+"
    min_value: int = 0
    max_value: int = 99
    num_train: int = 20000
    num_test: int = 500


@dataclass
class DataConfig:
    # "synthetic" or "gsm8k".
    task: str = "synthetic"
    # JSONL files (GSM8K schema: question, answer with "#### N"); null for synthetic.
    train_path: Optional[str] = None
    test_path: Optional[str] = None
    synthetic: SyntheticTaskConfig = field(default_factory=SyntheticTaskConfig)
    # Prompt text around the question; "{question}" is replaced.
    prompt_template: str = "{question}"
    # Apply the tokenizer's chat template (when it has one) to the prompt.
    use_chat_template: bool = False
    # Tokens: prompt (a longer prompt is an error naming the sample) and prompt + response.
    max_prompt_length: int = 32
    max_total_length: int = 64


@dataclass
class RewardConfig:
    # "exact" (synthetic: the integer after the prompt) or "math" (GSM8K verifier).
    name: str = "exact"


@dataclass
class LossConfig:
    # Clipped PG (Schulman et al. 2017, eq. 7) with asymmetric clip (DAPO, Yu et al. 2025).
    ratio_clip_low: float = 0.2
    ratio_clip_high: float = 0.2
    # Dual clip constant c > 1 for negative advantages (Ye et al. 2020); null disables.
    dual_clip: Optional[float] = None
    # KL(pi || pi_ref) penalty in the loss; 0 disables the reference model.
    kl_coef: float = 0.0
    # "k1", "k2" or "k3" (Schulman 2020, "Approximating KL divergence").
    kl_estimator: str = "k3"
    # "token": divide by valid tokens of the global batch; "sequence": per-sequence token
    # mean, divided by valid sequences.
    normalization: str = "token"
    # Truncated importance weights exp(old - generation) capped at this; null disables.
    importance_ratio_cap: Optional[float] = None


@dataclass
class GRPOConfig:
    num_prompts_per_step: int = 32
    num_generations: int = 8
    max_steps: int = 100
    # Divide by the group std (Shao et al. 2024); false gives Dr. GRPO's mean-centering.
    normalize_std: bool = True
    # Leave-one-out baseline (RLOO, Ahmadian et al. 2024) instead of the group mean.
    leave_one_out: bool = False
    # Optimizer steps per RL step (the rollout batch split into this many global batches).
    optimizer_steps_per_rollout: int = 1
    val_every: int = 10
    val_num_prompts: int = 200
    val_at_start: bool = True


@dataclass
class SFTConfig:
    """Optional supervised warm start on the task's reference answers before RL."""

    steps: int = 0
    batch_size: int = 64
    lr: float = 1.0e-3


@dataclass
class LoggingConfig:
    progress: bool = True
    tensorboard: bool = True
    jsonl: bool = True


@dataclass
class CheckpointConfig:
    # Save every k RL steps (0: never) under <output_dir>/checkpoints/step_<k>.
    every: int = 0
    # Resume from a checkpoint directory, or "latest" for the run directory's newest.
    resume: Optional[str] = None
    keep_last: int = 2


@dataclass
class TrainConfig:
    """Root config of ``mcore-rl train`` (GRPO)."""

    run: RunConfig = field(default_factory=RunConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

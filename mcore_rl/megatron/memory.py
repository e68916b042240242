"""Per-GPU memory of a run, predicted from its config before any worker starts (no torch).

The model of one GPU of the policy's workers (and the critic's, colocated) in bytes, by role:

- **weights**: the parameters a rank holds (:func:`rank_parameters`: its pipeline stage's layers,
  each linear weight split over TP, experts over EP, the vocabulary-parallel embedding and
  output layer on the first and last stage), 2 bytes each with ``precision=bf16``, 4 with fp32;
- **grads**: Megatron DDP's gradient buffer, 4 bytes a parameter with fp32 or
  ``ddp.grad_reduce_in_fp32``, else 2 (plus a transient fp32 copy at the optimizer step:
  Megatron's mixed-precision optimizer copies ``main_grad.float()``);
- **optimizer**: Adam's two fp32 moments (8 bytes; SGD: one momentum, 4) plus, with bf16, the
  fp32 main parameters (4 bytes); divided by DP with ``ddp.use_distributed_optimizer``
  (Rajbhandari et al. 2020, "ZeRO", stage 1, sec. 5.1);
- **reference**: a frozen copy of the weights when a KL term needs the reference policy;
- **activations** of one micro-batch of ``b`` rows of ``s`` tokens, per layer (the counting of
  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  sec. 4.1, whose GPT layer with dropout gives ``34 s b h + 5 a s^2 b`` bytes, applied to this
  decoder: RMSNorm, grouped-query attention, SwiGLU, no dropout): in elements per token,
  ``4 h`` (the two norms' inputs and outputs, replicated over TP unless sequence parallel)
  ``+ (3 a d + 2 g d) / t`` (q, k, v after RoPE; the attention output twice: SDPA keeps its
  ``[b, a, s, d]`` output and the output projection its ``[s, b, a d]`` copy) ``+ 3 f / t``
  (SwiGLU's input ``2 f`` and the down projection's input ``f``), times the activation bytes;
  the ``local`` spec (no fused attention) adds the KV heads it repeats for GQA and the score
  and probability matrices, Korthikanti's ``5 a s^2 b / t`` bytes; torch SDPA / TE keep no
  ``s^2`` term. Checked against bench/RESULTS.md (0.85B, seq 2048, H100): peak 23.6 GiB at
  micro-batch 4 and 32.7 at 8 measured, 23.2 and 32.0 predicted; ``local`` 49.2 measured, 43.9
  predicted (Korthikanti's 5 bytes per ``a s^2 b`` count is short there by ~1 byte). A
  pipeline's first stage keeps ``min(PP, micro-batches)`` micro-batches in flight (1F1B).
  Activation recomputation (``policy.megatron.recompute_granularity``) keeps less:
  :func:`stage_activation_bytes`; at 8B (Llama-3.1 shape, TP=2, 8192-token packed micro-batches,
  4 H200s) the train phase allocated 69.6 GiB, 68.8 predicted;
- context parallelism (CP): a rank's activations, logits and forward intermediates are those
  of its ``s / CP`` positions, plus the keys and values its attention all-gathers (DP counts
  ``workers / (TP x CP x PP)``); packed, every sequence is padded to a multiple of ``2 CP``
  (:func:`micro_batch_tokens`);
- **logits** ``[b, s, V/t]`` in the activation dtype and their gradient (the fused logprob
  kernels of :mod:`mcore_rl.megatron.logprobs` keep no fp32 copy);
- a micro-batch's tokens (:func:`micro_batch_tokens`, as the workers cut them): ``b x s`` with
  ``b`` rows of ``micro_batch_size`` (training) or ``logprob_micro_batch_size`` (logprobs), or,
  with ``policy.max_tokens_per_microbatch``, the token budget (packed: at most the budget and
  the call's tokens; padded: whole rows under it);
- **kv_cache** of the ``megatron`` rollout backend (:func:`decoder_buffers`, what
  ``MegatronDecoder._reserve`` allocates): per layer keys and values of ``rows x slots``
  tokens, rows the largest chunk (``generation.batch_size`` prompts at most) of any
  ``generate`` call on one DP rank rounded up to a power of two, at least 8: the rollout's
  rows, validation's ``val_num_prompts`` capped by the task's held-out examples
  (:func:`generation_calls`), the logprob canary's prompts; slots the longest prompt +
  ``generation.max_new_tokens`` rounded up to 128, at most ``data.max_total_length``; plus the
  row states (16 bytes a slot). Kept through training unless ``cluster.colocate_generation``
  releases it. The ``vllm`` backend's share ``gpu_memory_utilization x GPU`` when colocated;
  the ``hf`` backend's fp32 model copy and cache in the controller's process when it runs on
  GPU 0.

Phases (the figure reported is the largest): ``generation`` (resident state + KV cache + one
layer's prefill intermediates for one prefill group of at most 16384 prompt tokens and a decode
step's fp32 logits), ``logprobs`` (resident + forward-only logits of a logprob micro-batch and
one layer's intermediates), ``train`` (resident + activations + logits + their gradient + the
optimizer step's transient). A phase the run never enters has no figure, only its reason
(:func:`phases_not_run`): ``logprobs`` with ``loss.prev_logprobs=train_forward`` and no KL
reference (the training forward's logprobs are the old policy's; no logprob forward runs).
Checked against the measured peaks of bench/RESULTS.md (SmolLM2-135M on GSM8K: -4 to -8%; the
0.85B benchmark: -2%; 8B at TP=2 x DP=2 on four H200s with colocated vLLM engines and with
in-place megatron decoding: generation -3 to 0%, train +1%) and, term by term, against the buffers the
decoder and the micro-batching really allocate (tests/test_memory_plan.py).
"Resident" is what stays on the GPU in that phase:
with ``cluster.colocate_generation`` the policy's gradients and optimizer state leave the GPU
for generation, unless ``cluster.offload_train_state`` keeps them (or all but the gradient
buffers: ``grads``; :func:`offload_train_state_decision`), and the rollout engine's memory leaves it once the
step's rollout is generated (the ``megatron`` decoder's KV cache at once,
``controller/colocation.Colocation.rollout_done``; a vLLM engine's share at the next phase's
hand-over), so neither logprobs nor training count it.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from mcore_rl.config.schema import MegatronConfig, ModelArchConfig, TrainConfig
from mcore_rl.config.families import FAMILIES, head_dim, packed_sequence_multiple
from mcore_rl.config.registry import load, task_entry

GIB = float(2**30)
PHASES = ("generation", "logprobs", "train")  # the plan's phases, in a step's order


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The model's vocabulary rows: the smallest multiple of ``tp`` >= ``vocab_size`` (as
    :func:`mcore_rl.megatron.model.padded_vocab_size`)."""
    return _ceil_div(vocab_size, tp) * tp


def layer_parameters(arch: ModelArchConfig, tp: int = 1, ep: int = 1,
                     etp: Optional[int] = None) -> int:
    """Parameters of one decoder layer held by one rank (TP ``tp``, expert parallel ``ep``,
    expert TP ``etp``, default ``tp``); ``tp = ep = 1``: the whole layer.

    Counted: q/k/v/o projections (``h x a d``, ``2 x h x g d``, ``a d x h``; q/k/v biases for
    families with ``qkv_bias``), q/k RMSNorm weights (``2 d``, qwen3), the two RMSNorm weights
    (``2 h``, replicated over TP), the SwiGLU MLP (``3 h f``) or, with experts, the router
    (``h E``, replicated), ``E / ep`` experts of ``3 h f_moe`` (split over ``etp``) and a shared
    expert (``3 h f_s`` plus its gate ``h``, qwen2_moe).
    """
    h, a, g, d = arch.hidden_size, arch.num_attention_heads, arch.num_query_groups, head_dim(arch)
    family = FAMILIES[arch.family]
    attn = (h * a * d + 2 * h * g * d + a * d * h) // tp
    if family.qkv_bias:
        attn += (a * d + 2 * g * d) // tp
    norms = 2 * h + (2 * d if family.qk_layernorm else 0)
    if arch.num_experts is None:
        mlp = 3 * h * arch.ffn_hidden_size // tp
    else:
        f_moe = arch.moe_ffn_hidden_size or arch.ffn_hidden_size
        mlp = h * arch.num_experts + (arch.num_experts // ep) * 3 * h * f_moe // (etp or tp)
        if arch.moe_shared_expert_ffn_hidden_size:
            mlp += 3 * h * arch.moe_shared_expert_ffn_hidden_size // tp + h
    return attn + norms + mlp


def model_parameters(arch: ModelArchConfig, vocab_size: int) -> int:
    """All parameters of the decoder (one copy, no padding): embedding ``V h``, layers, final
    norm ``h``, and an output layer ``V h`` unless tied."""
    v, h = vocab_size, arch.hidden_size
    out = 0 if arch.tie_word_embeddings else v * h
    return v * h + arch.num_layers * layer_parameters(arch) + h + out


def rank_parameters(arch: ModelArchConfig, vocab_size: int, megatron: MegatronConfig,
                    value_head: bool = False) -> int:
    """Parameters held by the fullest rank of a layout: the largest of the first pipeline stage
    (embedding ``V_pad h / t``) and the last (final norm, and the output layer ``V_pad h / t``
    when untied or when PP > 1 with tied embeddings: Megatron keeps a copy there; a critic's
    ``value_head`` instead: ``h + 1``), each with ``ceil(L / PP)`` layers.
    """
    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    layers = _ceil_div(arch.num_layers, pp) * layer_parameters(
        arch, tp, megatron.expert_model_parallel_size, megatron.expert_tensor_parallel_size)
    h = arch.hidden_size
    table = padded_vocab(vocab_size, tp) * h // tp
    if value_head:
        output = h + 1
    else:
        output = table if (not arch.tie_word_embeddings or pp > 1) else 0
    first = layers + table + (0 if pp > 1 else h + output)
    last = layers + h + output
    return max(first, last)


def activation_bytes_per_layer(arch: ModelArchConfig, megatron: MegatronConfig, rows: int,
                               seq: int) -> int:
    """Saved activations of one decoder layer for a micro-batch of ``rows x seq`` tokens on
    one rank (module docstring: ``(4 h [/t with SP] + (3 a d + 2 g d) / t + 3 f / t)`` elements
    a token; the ``local`` spec adds its repeated KV heads, ``2 (a - g) d / t`` elements a
    token, and ``5 a s^2 b / t`` bytes). With context parallelism (CP > 1) a rank holds ``seq /
    CP`` of each row's tokens, and its attention keeps the keys and values all-gathered from
    the other CP ranks (``2 g d / t`` elements for each of their ``seq (CP - 1) / CP`` tokens:
    :mod:`mcore_rl.megatron.context_parallel`)."""
    tp, cp = megatron.tensor_model_parallel_size, max(1, megatron.context_parallel_size)
    h, a, g, d = arch.hidden_size, arch.num_attention_heads, arch.num_query_groups, head_dim(arch)
    f = arch.ffn_hidden_size if arch.num_experts is None else (
        (arch.moe_ffn_hidden_size or arch.ffn_hidden_size) * arch.moe_router_topk
        + (arch.moe_shared_expert_ffn_hidden_size or 0))
    e = 2 if megatron.precision == "bf16" else 4
    replicated = 4 * h / (tp if megatron.sequence_parallel else 1)
    selective = megatron.recompute_granularity == "selective"  # core attention recomputed
    # q, k, v after RoPE are the recomputed core attention's inputs (kept); its own output
    # copy (a d / t) and, for ``local``, the repeated KV heads and the s^2 matrices go.
    per_token = replicated + ((2 if selective else 3) * a * d + 2 * g * d) / tp + 3 * f / tp
    if megatron.layer_spec == "local" and not selective:  # DotProductAttention repeats KV heads
        per_token += 2 * (a - g) * d / tp
    out = per_token * e * rows * seq / cp
    if cp > 1:
        out += 2 * g * d / tp * e * rows * seq * (cp - 1) / cp
    if megatron.layer_spec == "local" and not selective:
        out += 5 * a * seq * seq * rows / tp
    return int(out)


def stage_activation_bytes(arch: ModelArchConfig, megatron: MegatronConfig, rows: float,
                           seq: int, in_flight: int) -> int:
    """Saved activations of one pipeline stage's ``ceil(L / PP)`` layers for ``in_flight``
    micro-batches of ``rows x seq`` tokens (:func:`activation_bytes_per_layer` each), under
    ``megatron.recompute_granularity``:

    - none or ``"selective"``: every layer's activations, for every micro-batch in flight;
    - ``"full"``, ``recompute_method=uniform`` with ``k = recompute_num_layers``: per micro-batch
      in flight the input ``[s, b, h]`` of each group of ``k`` layers (``h`` elements a token,
      ``/t`` with sequence parallelism), plus one group's activations while the backward
      recomputes it;
    - ``"full"``, ``block``: the first ``k`` layers keep their input only, the others all their
      activations, plus one recomputed layer's in the backward.
    """
    layers = _ceil_div(arch.num_layers, megatron.pipeline_model_parallel_size)
    per_layer = activation_bytes_per_layer(arch, megatron, rows, seq)
    if megatron.recompute_granularity != "full":
        return int(layers * in_flight * per_layer)
    e = 2 if megatron.precision == "bf16" else 4
    sp = megatron.tensor_model_parallel_size if megatron.sequence_parallel else 1
    layer_input = arch.hidden_size / sp * e * rows * seq / max(1, megatron.context_parallel_size)
    k = min(megatron.recompute_num_layers, layers)
    if megatron.recompute_method == "uniform":
        return int(in_flight * _ceil_div(layers, k) * layer_input + k * per_layer)
    return int(in_flight * (k * layer_input + (layers - k) * per_layer) + per_layer)


@dataclasses.dataclass
class RoleMemory:
    """One Megatron worker group's bytes on one GPU (module docstring)."""

    name: str
    parameters: int
    weights: int
    grads: int
    optimizer: int
    optimizer_distributed: int  # the same with the distributed optimizer at this DP size
    optimizer_step_transient: int
    reference: int
    activations: int
    logits: int
    logprob_logits: int
    logprob_forward: int  # one layer's intermediates of the forward-only pass (no autograd)
    micro_batch_size: int
    seq: int
    tokens: int = 0  # of the largest training micro-batch (micro_batch_tokens)
    logprob_tokens: int = 0  # of the largest logprob (or values) micro-batch

    @property
    def static(self) -> int:
        """Weights, grads, optimizer state and reference: what stays allocated."""
        return self.weights + self.grads + self.optimizer + self.reference

    @property
    def train_transient(self) -> int:
        return self.activations + self.logits + self.optimizer_step_transient


@dataclasses.dataclass
class MemoryPlan:
    """The predicted per-GPU memory of a run's configured layout (bytes).

    Attributes:
        roles: the Megatron groups on the policy's GPUs (policy; the critic for PPO when
            ``cluster.placement=colocated``).
        engine: the rollout engine's bytes on a policy GPU (KV cache, engine weights).
        engine_transient: what a generate call adds while it runs (prefill, decode logits).
        engine_offloaded: ``cluster.colocate_generation``: the engine leaves the GPU for
            training and logprobs.
        offload_mode: what of the policy's training state leaves the GPU for generation
            (colocated, ``cluster.offload_train_state`` resolved: ``"true"`` all of it,
            ``"grads"`` the gradient buffers, ``"false"`` nothing).
        offload_decision: one line: ``cluster.offload_train_state``, what it resolved to and
            why (empty without colocation); :func:`offload_train_state_decision`.
        phases: peak bytes by phase (``generation``, ``logprobs``, ``train``), of the phases
            the run enters.
        not_run: the phases the run never enters (no figure in ``phases``), each with the
            reason (:func:`phases_not_run`).
        gpu_bytes: ``cluster.gpu_memory_gb`` in bytes.
        layout: ``(TP, PP, DP)``.
    """

    roles: List[RoleMemory]
    engine: Dict[str, int]
    engine_transient: Dict[str, int]
    engine_offloaded: bool
    phases: Dict[str, int]
    gpu_bytes: int
    layout: Tuple[int, int, int]
    offload_mode: str = "false"
    offload_decision: str = ""
    not_run: Dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def train_state_offloaded(self) -> bool:
        """All of the policy's training state (gradients, optimizer state, weights) leaves the
        GPU for generation (:attr:`offload_mode` ``"true"``)."""
        return self.offload_mode == "true"

    @property
    def peak_phase(self) -> str:
        """The phase of :attr:`peak` (the first of equal ones, in :data:`PHASES` order)."""
        return max(self.phases, key=self.phases.get)

    @property
    def fits(self) -> bool:
        return self.peak <= self.gpu_bytes


def rollout_rows(cfg: TrainConfig) -> int:
    """Rollout rows of one RL step (prompts x generations of the configured algorithm)."""
    loop = getattr(cfg, cfg.algorithm)
    return loop.num_prompts_per_step * loop.num_generations


def _dp(cfg: TrainConfig, megatron: MegatronConfig) -> int:
    return max(1, cfg.cluster.num_workers // (megatron.tensor_model_parallel_size
                                             * max(1, megatron.context_parallel_size)
                                             * megatron.pipeline_model_parallel_size))


def role_memory(name: str, cfg: TrainConfig, arch: ModelArchConfig, vocab_size: int,
                megatron: MegatronConfig, optimizer_name: str, micro_batch_size: int,
                logprob_micro_batch_size: int, reference: bool, value_head: bool,
                seq: Optional[int] = None, train_rows: Optional[int] = None) -> RoleMemory:
    """:class:`RoleMemory` of one worker group. ``seq`` defaults to ``data.max_total_length``
    (rows are padded to the longest in a micro-batch: the bound); the micro-batch is
    ``min(micro_batch_size, train_rows)`` with ``train_rows`` (default: the rollout's rows per
    DP rank per optimizer step) the most one rank trains at once."""
    seq = seq or cfg.data.max_total_length
    dp = _dp(cfg, megatron)
    if train_rows is None:
        steps = getattr(getattr(cfg, cfg.algorithm), "optimizer_steps_per_rollout", 1)
        train_rows = max(1, _ceil_div(rollout_rows(cfg), dp * steps))
    b = max(1, min(micro_batch_size, train_rows))
    lp_rows = _ceil_div(rollout_rows(cfg), dp)
    b_lp = max(1, min(logprob_micro_batch_size, lp_rows))
    # The rows of one micro-batch, in units of rows of ``seq`` tokens (micro_batch_tokens).
    tokens = micro_batch_tokens(cfg, b, train_rows, seq, megatron)
    lp_tokens = micro_batch_tokens(cfg, b_lp, lp_rows, seq, megatron)
    t_rows, t_lp = tokens / seq, lp_tokens / seq
    p = rank_parameters(arch, vocab_size, megatron, value_head)
    bf16 = megatron.precision == "bf16"
    e = 2 if bf16 else 4
    grad_bytes = 4 if (not bf16 or megatron.ddp.grad_reduce_in_fp32) else 2
    moments = 8 if optimizer_name == "adam" else 4
    opt_per_param = moments + (4 if bf16 else 0)
    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    micro_batches = _ceil_div(train_rows, b)
    in_flight = min(pp, micro_batches)
    acts = stage_activation_bytes(arch, megatron, t_rows, seq, in_flight)
    vocab_cols = 1 if value_head else padded_vocab(vocab_size, tp) // tp
    cp = max(1, megatron.context_parallel_size)  # a rank's logits: its 1/CP of the positions
    return RoleMemory(
        name=name, parameters=p, weights=p * e, grads=p * grad_bytes,
        optimizer=p * opt_per_param,
        optimizer_distributed=_ceil_div(p * opt_per_param, dp),
        optimizer_step_transient=p * 4 if grad_bytes == 2 else 0,
        reference=p * e if reference else 0,
        activations=acts,
        logits=int(2 * t_rows * seq * vocab_cols * e / cp),
        logprob_logits=int(t_lp * seq * vocab_cols * e / cp),
        logprob_forward=int(lp_tokens * forward_elements_per_token(arch, megatron) * e / cp),
        micro_batch_size=b, seq=seq, tokens=tokens, logprob_tokens=lp_tokens)


def forward_elements_per_token(arch: ModelArchConfig, megatron: MegatronConfig) -> float:
    """The largest intermediates of one decoder layer's forward without autograd, elements a
    token on one rank: the residual stream and its norm ``2 h``, then SwiGLU's input and output
    ``3 f / t`` or q, k, v and the attention output ``(2 a d + 2 g d) / t`` (a forward-only
    pass frees each layer's tensors before the next: the logprob pass and the rollout's
    prefill)."""
    tp = megatron.tensor_model_parallel_size
    a, g, d = arch.num_attention_heads, arch.num_query_groups, head_dim(arch)
    f = arch.ffn_hidden_size if arch.num_experts is None else (
        (arch.moe_ffn_hidden_size or arch.ffn_hidden_size) * arch.moe_router_topk
        + (arch.moe_shared_expert_ffn_hidden_size or 0))
    return 2 * arch.hidden_size + max(3 * f, 2 * a * d + 2 * g * d) / tp


def micro_batch_tokens(cfg: TrainConfig, rows: int, total_rows: int, seq: int,
                       megatron: Optional[MegatronConfig] = None) -> int:
    """Tokens (padded, the width the model runs at) of the largest micro-batch of a call over
    ``total_rows`` rows of at most ``seq`` tokens with micro-batches of ``rows`` rows, as the
    workers cut them (:func:`mcore_rl.data.microbatching.make_microbatches`,
    :func:`mcore_rl.data.packing.make_packed_microbatches`): with
    ``policy.max_tokens_per_microbatch`` the budget (a micro-batch holds at most that many
    tokens, and never more than the call's rows; without packing whole rows of ``seq`` under
    it), else ``rows x seq`` (a packed micro-batch's budget is then ``rows`` x the longest row).
    Packed rows count with their padding to a multiple of ``2 CP`` under context parallelism
    of ``megatron`` (default ``policy.megatron``: :func:`~mcore_rl.config.families.
    packed_sequence_multiple`).
    """
    budget = cfg.policy.max_tokens_per_microbatch
    if cfg.policy.sequence_packing:  # every packed row to a multiple of 2 CP
        multiple = packed_sequence_multiple(megatron or cfg.policy.megatron)
        seq = _ceil_div(seq, multiple) * multiple
    if budget is None:
        return rows * seq
    if cfg.policy.sequence_packing:
        return min(budget, total_rows * seq)
    return min(max(1, budget // seq), total_rows) * seq


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# The megatron rollout decoder's constants (mcore_rl/generation/megatron.py, a floor above:
# tests/test_memory_plan.py checks they agree): the smallest row bucket and attended span, and
# the padded prompt tokens of one prefill forward.
DECODER_MIN_ROWS, DECODER_MIN_SPAN, DECODER_PREFILL_TOKENS = 8, 128, 16384


def _bucket(n: int, floor: int) -> int:
    """The smallest power of two ``>= max(n, floor)`` (the decoder's ``_bucket``)."""
    return max(floor, _pow2(n))


_HELD_OUT: Dict[Tuple[str, int], Optional[int]] = {}


def _held_out_examples(cfg: TrainConfig) -> Optional[int]:
    """The task's held-out examples (None: unknown task or unreadable data), once per data
    section (the planner calls this for every layout it tries)."""
    key = (repr(cfg.data), cfg.run.seed)
    if key not in _HELD_OUT:
        try:
            _, test = load(task_entry(cfg.data.task).examples)(cfg.data, cfg.run.seed)
            _HELD_OUT[key] = len(test)
        except Exception:  # noqa: BLE001 - the config loader reports bad data; here: unknown
            _HELD_OUT[key] = None
    return _HELD_OUT[key]


def generation_calls(cfg: TrainConfig) -> Dict[str, int]:
    """Prompts of each kind of ``generate`` call a run makes (what sizes the rollout engine's
    buffers): ``rollout`` (prompts x generations of an RL step), ``validation`` (with
    validation on: ``<algorithm>.val_num_prompts``, at most the task's held-out examples, read
    through the task's plugin entry (:func:`mcore_rl.config.registry.task_entry`); as the trainer's
    ``validate``) and ``canary`` (``generation.logprob_canary_prompts`` with
    ``generation.logprob_budget``)."""
    loop, g = getattr(cfg, cfg.algorithm), cfg.generation
    calls = {"rollout": rollout_rows(cfg)}
    if loop.val_every > 0 or loop.val_at_start:
        held_out = _held_out_examples(cfg) if task_entry(cfg.data.task) else None
        n = loop.val_num_prompts if held_out is None else min(loop.val_num_prompts, held_out)
        if n > 0:
            calls["validation"] = n
    if g.logprob_budget is not None and g.logprob_canary_prompts > 0:
        calls["canary"] = g.logprob_canary_prompts
    return calls


def decoder_buffers(cfg: TrainConfig, dp: int, prompt: int) -> Tuple[int, int]:
    """``(rows, slots)`` of the ``megatron`` decoder's KV cache after a run's calls
    (``MegatronDecoder._reserve``): rows, the largest chunk of a call on one DP rank
    (``generation.batch_size`` prompts at most) rounded up to a power of two, at least 8; slots,
    the longest prompt (``prompt`` tokens) plus ``generation.max_new_tokens`` rounded up to 128,
    at most ``data.max_total_length``. The buffers only grow, so the largest call sizes them."""
    g = cfg.generation
    rows = max(_bucket(min(g.batch_size, _ceil_div(c, dp)), DECODER_MIN_ROWS)
               for c in generation_calls(cfg).values())
    width = min(prompt + g.max_new_tokens, cfg.data.max_total_length)
    slots = min(_ceil_div(width, DECODER_MIN_SPAN) * DECODER_MIN_SPAN, cfg.data.max_total_length)
    return rows, slots


def kv_cache_bytes(arch: ModelArchConfig, megatron: MegatronConfig, rows: int, slots: int) -> int:
    """Bytes of the decoder's :class:`~mcore_rl.megatron.attention.KVCache` on one rank: keys
    and values ``[rows, g / TP, slots + 1, d]`` per layer of its stage (a spare slot), in the
    parameters' dtype."""
    e = 2 if megatron.precision == "bf16" else 4
    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    groups = max(1, arch.num_query_groups // tp)
    return _ceil_div(arch.num_layers, pp) * 2 * rows * groups * (slots + 1) * head_dim(arch) * e


def engine_memory(cfg: TrainConfig, arch: ModelArchConfig, vocab_size: int,
                  seq: Optional[int] = None, prompt: Optional[int] = None
                  ) -> Tuple[Dict[str, int], Dict[str, int]]:
    """The rollout engine's bytes on one policy GPU, by item (module docstring): what it keeps
    between calls, and what a call adds while it runs. The ``megatron`` backend keeps its KV
    cache (:func:`decoder_buffers`, :func:`kv_cache_bytes`) and the row states (``[rows,
    slots]`` random streams, tokens and logprobs: 16 bytes a slot); a call adds the largest
    intermediates of one layer's prefill forward, no autograd, for one prefill group of at most
    16384 padded prompt tokens (``tokens x (2 h + max(3 f, 2 a d + 2 g d) / t)`` elements: the
    residual stream and its norm, then SwiGLU's input and output or q, k, v and the attention
    output), and the fp32 logits of a decode step. ``prompt``: the longest prompt (default
    ``data.max_prompt_length``, at most ``seq``)."""
    g, m = cfg.generation, cfg.policy.megatron
    tp = m.tensor_model_parallel_size
    e = 2 if m.precision == "bf16" else 4
    seq = seq or cfg.data.max_total_length
    prompt = prompt or min(cfg.data.max_prompt_length, seq)
    dp = _dp(cfg, m)
    if g.backend == "megatron":
        rows, slots = decoder_buffers(cfg, dp, prompt)
        kv = kv_cache_bytes(arch, m, rows, slots)
        per_token = forward_elements_per_token(arch, m)
        chunk = max(min(g.batch_size, _ceil_div(c, dp)) for c in generation_calls(cfg).values())
        group = min(chunk, max(1, DECODER_PREFILL_TOKENS // prompt))
        prefill = int(group * prompt * per_token * e)
        return ({"kv_cache": kv, "decode_row_states": rows * slots * 16},
                {"prefill": prefill, "decode_logits": rows * padded_vocab(vocab_size, tp) * 4})
    calls = generation_calls(cfg).values()
    rows = _pow2(max(min(g.batch_size, _ceil_div(c, dp)) for c in calls))
    if g.backend == "vllm":
        if not cfg.cluster.colocate_generation:
            return {}, {}
        return {"vllm_share": int(g.vllm.gpu_memory_utilization * cfg.cluster.gpu_memory_gb * GIB)}, {}
    if g.backend == "hf" and g.num_workers == 0:  # the controller's fp32 copy, on GPU 0
        weights = model_parameters(arch, vocab_size) * 4
        kv = arch.num_layers * 2 * arch.num_query_groups * head_dim(arch) * rows * seq * 4
        return {"hf_weights": weights, "kv_cache": kv}, {}
    return {}, {}


def needs_reference(cfg: TrainConfig) -> bool:
    """Whether the policy keeps a frozen reference (a KL term in the loss, ``loss.kl_coef``, or
    in the reward, ``<algorithm>.reward_kl_coef``), as the algorithms' ``needs_reference``."""
    return cfg.loss.kl_coef > 0 or getattr(getattr(cfg, cfg.algorithm), "reward_kl_coef", 0) > 0


def phases_not_run(cfg: TrainConfig) -> Dict[str, str]:
    """The phases of the plan (:data:`PHASES`) that a run of ``cfg``
    never enters, each with the reason (one phrase): ``logprobs`` when
    ``loss.prev_logprobs=train_forward`` and there is no KL reference (:func:`needs_reference`):
    the synchronous loop then runs no logprob forward (``controller/loops.SyncLoop``; the
    training forward's own logprobs are the old policy's)."""
    if cfg.loss.prev_logprobs == "train_forward" and not needs_reference(cfg):
        return {"logprobs": "loss.prev_logprobs=train_forward and no KL reference: no logprob "
                            "forward runs"}
    return {}


def plan_memory(cfg: TrainConfig, arch: ModelArchConfig, vocab_size: Optional[int] = None,
                megatron: Optional[MegatronConfig] = None, micro_batch_size: Optional[int] = None,
                seq: Optional[int] = None, train_rows: Optional[int] = None,
                prompt: Optional[int] = None,
                offload_train_state: Optional[str] = None) -> MemoryPlan:
    """The :class:`MemoryPlan` of ``cfg`` (or of its policy layout replaced by ``megatron``
    and micro-batch ``micro_batch_size``; the critic keeps its own layout). ``seq`` (tokens a
    row) defaults to ``data.max_total_length``, ``prompt`` (the longest prompt, which sizes
    the rollout engine's buffers with ``generation.max_new_tokens``) to
    ``data.max_prompt_length``; ``offload_train_state`` (colocated: what of the policy's
    training state leaves the GPU for generation, ``"true"``, ``"grads"`` or ``"false"``) to
    ``cluster.offload_train_state`` as :func:`offload_train_state_decision` resolves it. A phase the run never enters
    (:func:`phases_not_run`) is in the plan's ``not_run``, not in its ``phases``."""
    vocab_size = vocab_size or arch.vocab_size
    pm = megatron or cfg.policy.megatron
    kl = needs_reference(cfg)
    roles = [role_memory("policy", cfg, arch, vocab_size, pm, cfg.policy.optimizer.name,
                         micro_batch_size or cfg.policy.micro_batch_size,
                         cfg.policy.logprob_micro_batch_size, kl, False, seq, train_rows)]
    if pm.ddp.use_distributed_optimizer:
        roles[0].optimizer = roles[0].optimizer_distributed
    if cfg.algorithm == "ppo" and cfg.cluster.placement == "colocated":
        v = cfg.value
        critic = role_memory("value", cfg, arch, vocab_size, v.megatron, v.optimizer.name,
                             v.micro_batch_size, v.values_micro_batch_size, False, True, seq,
                             train_rows)
        if v.megatron.ddp.use_distributed_optimizer:
            critic.optimizer = critic.optimizer_distributed
        roles.append(critic)
    eng, eng_transient = engine_memory(cfg, arch, vocab_size, seq, prompt)
    engine = sum(eng.values())
    # Streaming generates while it trains: nothing is offloaded there.
    offloaded = cfg.cluster.colocate_generation and not cfg.streaming
    weights = sum(r.weights + r.reference for r in roles)
    static = sum(r.static for r in roles)
    decision = ""
    if offload_train_state is None:
        offload_train_state, decision = offload_train_state_decision(
            cfg, arch, vocab_size, megatron=megatron, micro_batch_size=micro_batch_size,
            seq=seq, train_rows=train_rows, prompt=prompt)
    mode = offload_train_state if offloaded else "false"
    policy = roles[0]
    # Offloaded for generation ("true"): all of the policy leaves the GPU, except the weights
    # the megatron backend decodes with; "grads": its gradient buffers only.
    kept = weights if cfg.generation.backend == "megatron" else 0
    dropped = policy.grads if mode == "grads" else 0
    generation = ((kept if mode == "true" else static - dropped) + engine
                  + sum(eng_transient.values()))
    resident_train = static + (0 if offloaded else engine)
    # Colocated, what left stays off the GPU for logprobs (only the weights return; the
    # gradient buffers come back for training) and the engine's memory has left it (the
    # megatron decoder's right after the rollout).
    logprobs = ((weights if mode == "true" else resident_train - dropped)
                + policy.logprob_logits + policy.logprob_forward)
    train = resident_train + max(r.train_transient for r in roles)
    tp, pp = pm.tensor_model_parallel_size, pm.pipeline_model_parallel_size
    not_run = phases_not_run(cfg)
    phases = {name: value for name, value in zip(PHASES, (generation, logprobs, train))
              if name not in not_run}
    return MemoryPlan(roles=roles, engine=eng, engine_transient=eng_transient,
                      engine_offloaded=offloaded, phases=phases,
                      gpu_bytes=int(cfg.cluster.gpu_memory_gb * GIB),
                      layout=(tp, pp, _dp(cfg, pm)), not_run=not_run,
                      offload_mode=mode, offload_decision=decision)


def candidate_layouts(cfg: TrainConfig, arch: ModelArchConfig) -> List[Tuple[int, int, int]]:
    """``(TP, PP, DP)`` with ``TP x PP x DP = cluster.num_workers`` that can build ``arch``:
    TP divides the attention heads and the query groups, PP the layers (even split); the
    ``megatron`` rollout backend and ``policy.sequence_packing`` also need PP = 1 (the config
    refuses them with PP > 1, so such a layout is never offered)."""
    w, out = cfg.cluster.num_workers, []
    for tp in range(1, w + 1):
        if w % tp or arch.num_attention_heads % tp or arch.num_query_groups % tp:
            continue
        for pp in range(1, w // tp + 1):
            if (w // tp) % pp or arch.num_layers % pp:
                continue
            if pp > 1 and (cfg.generation.backend == "megatron" or cfg.policy.sequence_packing):
                continue
            out.append((tp, pp, w // (tp * pp)))
    return out


def largest_micro_batch(cfg: TrainConfig, arch: ModelArchConfig, megatron: MegatronConfig,
                        vocab_size: Optional[int] = None) -> int:
    """The largest micro-batch (rows, up to the rows a DP rank trains per optimizer step) for
    which :func:`plan_memory` fits ``cluster.gpu_memory_gb`` with layout ``megatron``; 0 when
    none does."""
    base = plan_memory(cfg, arch, vocab_size, megatron, micro_batch_size=1)
    if not base.fits:
        return 0
    high = max(1, _ceil_div(rollout_rows(cfg), base.layout[2]))
    lo, hi = 1, high
    while lo < hi:  # memory grows with the micro-batch: bisect
        mid = (lo + hi + 1) // 2
        if plan_memory(cfg, arch, vocab_size, megatron, micro_batch_size=mid).fits:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _layout(megatron: MegatronConfig, tp: int, pp: int) -> MegatronConfig:
    return dataclasses.replace(megatron, tensor_model_parallel_size=tp,
                               pipeline_model_parallel_size=pp,
                               sequence_parallel=megatron.sequence_parallel and tp > 1)


def fitting_layouts(cfg: TrainConfig, arch: ModelArchConfig, vocab_size: Optional[int] = None
                    ) -> List[Tuple[Tuple[int, int, int], int, MemoryPlan]]:
    """Every :func:`candidate_layouts` entry with its largest fitting micro-batch (0: does
    not fit) and its plan at ``min(policy.micro_batch_size, that)``."""
    out = []
    for tp, pp, dp in candidate_layouts(cfg, arch):
        m = _layout(cfg.policy.megatron, tp, pp)
        mbs = largest_micro_batch(cfg, arch, m, vocab_size)
        plan = plan_memory(cfg, arch, vocab_size, m,
                           micro_batch_size=max(1, min(cfg.policy.micro_batch_size, mbs or 1)))
        out.append(((tp, pp, dp), mbs, plan))
    return out


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a table: GiB per GPU by role and item, then by phase (a phase the run
    never enters: ``-`` and the reason)."""
    tp, pp, dp = plan.layout
    lines = [f"layout TP={tp} PP={pp} DP={dp}; GiB per GPU (cluster.gpu_memory_gb="
             f"{plan.gpu_bytes / GIB:g})", f"{'role':10s} {'item':50s} {'GiB':>8s}"]
    for r in plan.roles:
        items = [("parameters (millions)", r.parameters / 1e6 * GIB),
                 ("weights", r.weights), ("grads", r.grads),
                 ("optimizer state", r.optimizer),
                 (f"  with the distributed optimizer (DP={dp})", r.optimizer_distributed),
                 ("optimizer step transient (fp32 grads)", r.optimizer_step_transient),
                 ("reference weights", r.reference),
                 (f"activations ({r.tokens} tokens a micro-batch, seq {r.seq})", r.activations),
                 ("logits and their grad", r.logits),
                 (f"logprob micro-batch logits ({r.logprob_tokens} tokens)", r.logprob_logits),
                 ("logprob forward (one layer, no autograd)", r.logprob_forward)]
        for what, value in items:
            lines.append(f"{r.name:10s} {what:50s} {_gib(value):>8s}")
    state = "off the GPU outside generation" if plan.engine_offloaded else "resident"
    for what, value in plan.engine.items():
        lines.append(f"{'rollout':10s} {what + ' (' + state + ')':50s} {_gib(value):>8s}")
    for what, value in plan.engine_transient.items():
        lines.append(f"{'rollout':10s} {what + ' (while generating)':50s} {_gib(value):>8s}")
    for phase in PHASES:
        if phase in plan.phases:
            lines.append(f"{'peak':10s} {phase:50s} {_gib(plan.phases[phase]):>8s}")
        elif phase in plan.not_run:
            lines.append(f"{'peak':10s} {phase:50s} {'-':>8s}  not run: {plan.not_run[phase]}")
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines.append(f"{'peak':10s} {'max':50s} {_gib(plan.peak):>8s}  {verdict}")
    if plan.offload_decision:
        lines.append(plan.offload_decision)
    return "\n".join(lines)


def format_layouts(rows: List[Tuple[Tuple[int, int, int], int, MemoryPlan]]) -> str:
    """The table of :func:`fitting_layouts`."""
    lines = [f"{'TP':>3s} {'PP':>3s} {'DP':>3s} {'largest mbs':>12s} {'peak GiB':>9s}  fits"]
    for (tp, pp, dp), mbs, plan in rows:
        lines.append(f"{tp:3d} {pp:3d} {dp:3d} {mbs:12d} {_gib(plan.peak):>9s}  "
                     f"{'yes' if mbs else 'no'}")
    return "\n".join(lines)


def offload_train_state_decision(cfg: TrainConfig, arch: ModelArchConfig,
                                 vocab_size: Optional[int] = None,
                                 **plan_args) -> Tuple[str, str]:
    """``cluster.offload_train_state`` resolved for the plan of ``cfg`` (``plan_args``: those of
    :func:`plan_memory`): what of the colocated policy's training state leaves the GPU while
    the rollout engine decodes (``"true"``: gradient buffers, optimizer state and weights;
    ``"grads"``: the gradient buffers, dropped; ``"false"``: nothing), and one line saying
    which and why (empty without colocation or with streaming, where it has no effect).

    ``true``, ``grads`` and ``false`` are taken as set. ``auto`` is the least that fits
    ``cluster.gpu_memory_gb`` in every phase: ``false`` when the plan with the policy's
    training state resident (``plan_memory(..., offload_train_state="false")``) fits, else
    ``grads`` when the plan without its gradient buffers fits, else ``true``. With ``S`` the
    resident training state (every role's weights, grads, optimizer state and reference
    weights: :attr:`RoleMemory.static`) and ``G`` the policy's gradient buffers:

    - generation: ``S`` (``grads``: ``S - G``) + the engine's awake share
      (``MemoryPlan.engine``: vLLM's ``gpu_memory_utilization x cluster.gpu_memory_gb``, the
      megatron decoder's KV cache and row states) + what a generate call adds
      (``MemoryPlan.engine_transient``);
    - logprobs: ``S`` (``grads``: ``S - G``) + a logprob micro-batch's logits and forward
      intermediates;
    - train (the same either way): ``S`` + the train transients (activations, logits and
      their gradient, the optimizer step's fp32 grads) + the sleeping engine's residue, which
      the plan counts as 0 (the engine's memory leaves the GPU for training);

    ``true`` otherwise (where the train phase alone does not fit, the layout's own refusal,
    :func:`memory_error`, stands either way).
    """
    setting, gpu = cfg.cluster.offload_train_state, cfg.cluster.gpu_memory_gb
    key = f"cluster.offload_train_state={setting}"
    if not cfg.cluster.colocate_generation or cfg.streaming:
        return ("false" if setting == "false" else "true"), ""
    keep = plan_memory(cfg, arch, vocab_size, offload_train_state="false", **plan_args)
    resident = sum(r.static for r in keep.roles)
    grads = keep.roles[0].grads
    if setting == "true":
        return "true", (f"{key}: the policy's training state ({_gib(resident)} GiB) goes to host "
                        f"memory while the engine decodes")
    awake = sum(keep.engine.values()) + sum(keep.engine_transient.values())
    phase = keep.peak_phase
    figures = (f"generation {_gib(keep.phases['generation'])} GiB = training state "
               f"{_gib(resident)} + engine awake {_gib(awake)}")
    peak = f"peak {_gib(keep.peak)} GiB in {phase} of cluster.gpu_memory_gb={gpu:g}"
    if setting == "false":
        return "false", f"{key}: the policy's training state stays on the GPU ({peak}; {figures})"
    dropping = plan_memory(cfg, arch, vocab_size, offload_train_state="grads", **plan_args)
    stays = (f"gradient buffers ({_gib(grads)} GiB) are dropped while the engine decodes; "
             f"the weights and optimizer state ({_gib(resident - grads)} GiB) stay (peak "
             f"{_gib(dropping.peak)} GiB in {dropping.peak_phase})")
    if setting == "grads":
        return "grads", f"{key}: the policy's {stays}"
    if keep.fits:
        return "false", (f"{key} -> false: with the policy's training state resident every "
                         f"phase fits ({peak}; {figures})")
    over = (f"with the policy's training state resident {phase} would need {_gib(keep.peak)} "
            f"GiB > cluster.gpu_memory_gb={gpu:g} ({figures})")
    if dropping.fits:
        return "grads", f"{key} -> grads: {over}; its {stays}"
    return "true", (f"{key} -> true: {over}, and {_gib(dropping.peak)} GiB with its gradient "
                    f"buffers dropped; it goes to host memory while the engine decodes")


def offload_train_state_error(cfg: TrainConfig, arch: ModelArchConfig,
                              vocab_size: Optional[int], plan: MemoryPlan) -> Optional[str]:
    """One line refusing ``cluster.offload_train_state=false`` (or ``grads``) when ``plan``
    (the config's) does not fit ``cluster.gpu_memory_gb`` but would with the training state
    offloaded (the phase, the predicted GiB, the keys to change); else None."""
    setting = cfg.cluster.offload_train_state
    if setting not in ("false", "grads") or not plan.engine_offloaded or plan.fits:
        return None
    offloading = plan_memory(cfg, arch, vocab_size, offload_train_state="true")
    if not offloading.fits:
        return None
    phase = plan.peak_phase
    what = "training state" if setting == "false" else "weights and optimizer state"
    return (f"cluster.offload_train_state={setting}: with the policy's {what} on the GPU "
            f"while the engine decodes, {phase} is predicted to need {_gib(plan.peak)} GiB per "
            f"GPU (cluster.gpu_memory_gb={cfg.cluster.gpu_memory_gb:g}; offloaded: peak "
            f"{_gib(offloading.peak)}); set cluster.offload_train_state=auto (or true), or "
            f"cluster.skip_memory_check=true to train anyway")


def memory_error(cfg: TrainConfig, arch: ModelArchConfig, vocab_size: Optional[int] = None
                 ) -> Optional[str]:
    """One line when the configured layout is predicted not to fit ``cluster.gpu_memory_gb``
    (naming the phase, the figures and the layouts that fit; for a
    ``cluster.offload_train_state=false`` or ``grads`` that would fit offloaded,
    :func:`offload_train_state_error`), else None."""
    plan = plan_memory(cfg, arch, vocab_size)
    if plan.fits:
        return None
    refusal = offload_train_state_error(cfg, arch, vocab_size, plan)
    if refusal:
        return refusal
    phase = plan.peak_phase
    r = plan.roles[0]
    fit = [f"TP={tp} PP={pp} DP={dp} mbs<={mbs}" for (tp, pp, dp), mbs, _ in
           fitting_layouts(cfg, arch, vocab_size) if mbs]
    tp, pp, dp = plan.layout
    return (f"cluster.gpu_memory_gb={cfg.cluster.gpu_memory_gb:g}: layout TP={tp} PP={pp} DP={dp} "
            f"with policy.micro_batch_size={cfg.policy.micro_batch_size} is predicted to need "
            f"{_gib(plan.peak)} GiB per GPU in {phase} (weights {_gib(r.weights)}, grads "
            f"{_gib(r.grads)}, optimizer {_gib(r.optimizer)}, activations {_gib(r.activations)}, "
            f"logits {_gib(r.logits)}, rollout engine {_gib(sum(plan.engine.values()))}); "
            f"layouts that fit: {', '.join(fit) if fit else 'none'}; `mcore-rl plan` prints the "
            f"breakdown; cluster.skip_memory_check=true trains anyway")

"""Rollouts decoded by the policy workers with the policy's own Megatron-Core ``GPTModel``:
the weights are shared in place, so a refit copies nothing.

Two halves:

- :func:`decode` runs inside each policy worker (``PolicyWorker.generate``): Megatron-Core's
  static-batching KV cache (``StaticInferenceContext`` passed as ``inference_context`` to
  ``GPTModel.forward``, the machinery of Megatron's legacy static engine) with our sampling
  (:mod:`mcore_rl.generation.sampling`), so the rollout conventions are those of the ``hf``
  backend.
- :class:`MegatronGenerationBackend` is the controller's :class:`GenerationBackend`: it splits
  the prompts over the data-parallel ranks and assembles the rollout batch.

Why not Megatron's engines: in megatron-core 0.19 ``StaticInferenceEngine`` runs on the dynamic
engine unless ``legacy=True``, and the dynamic-batching attention asserts flash-attn >= 2.7.3
at its first forward (``Attention.forward``), which the GPU image lacks. The legacy path's
``TextGenerationController`` allocates its tensors and sampling RNG on
``torch.cuda.current_device()`` (it cannot run on the CPU) and samples with its own RNG and
logprob conventions. The static context needs only the core attention of our layer specs
(``local``: ``DotProductAttention``; ``torch``:
:class:`~mcore_rl.megatron.attention.TorchSDPAttention`), no flash-attn or Transformer Engine:
it runs on megatron-core 0.16.1 (CPU tests) and 0.19.2 (GPU, bf16). Its layer-internal API used
here (``key_value_memory_dict`` keyed by ``layer_number``, ``increment_sequence_len_offset``,
``InferenceMode`` from 0.18) is the same from 0.16 to 0.19.

Decoding scheme (that of Megatron's static engine): prompts of one chunk are right-padded and
decoded in lockstep. The first forward runs every row's first ``min(prompt lengths)`` tokens;
each later forward runs one position for all rows, where a row still inside its prompt is fed
its next prompt token (its logits are ignored) and a generating row its last sampled token.
So every token sits at its true position (Megatron's rotary embedding takes positions from the
KV-cache offset) and right padding needs only the causal mask.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import as_completed
from typing import Dict, Iterator, List

import torch

from mcore_rl.config.schema import GenerationConfig, MegatronConfig
from mcore_rl.generation.base import (BackendContext, FinishedGroup, GenerationBackend,
                                      GroupAssembler, Response, check_lengths, check_prompts,
                                      response_budgets)
from mcore_rl.generation.checks import megatron_layout_errors
from mcore_rl.generation.sampling import Sampler, check_sampling, row_uniforms


def check_layout(megatron: MegatronConfig) -> None:
    """Raise ``NotImplementedError`` naming the config keys for a policy layout :func:`decode`
    does not run (:func:`mcore_rl.generation.checks.megatron_layout_errors`: pipeline or
    sequence parallelism)."""
    errors = megatron_layout_errors(megatron)
    if errors:
        raise NotImplementedError("; ".join(errors))


# TransformerConfig switches turned off while decoding: the bias+dropout+add and bias+SwiGLU
# fusions, which megatron-core compiles with torch.compile. Decoding is bound by the host (one
# token per forward), and a compiled call costs ~88 us of guard checks and graph dispatch
# against ~10-30 us for the eager ops it replaces (scripts/gpu/decode_profile.py,
# bench/RESULTS.md). Training keeps them.
_DECODE_OFF = ("bias_dropout_fusion", "bias_activation_fusion")


@contextlib.contextmanager
def _inference_mode(model: torch.nn.Module, config):
    """The model in eval mode (megatron-core < 0.18 takes the inference path when
    ``inference_context is not None and not self.training``) with Megatron's process-wide
    ``InferenceMode`` flag set (>= 0.18 reads it instead) and the :data:`_DECODE_OFF` switches
    of its ``TransformerConfig`` ``config`` off (Megatron's layers read them at each forward);
    all restored afterwards, also on an exception."""
    try:
        from megatron.core.inference.utils import InferenceMode
        flag = InferenceMode.active()
    except ImportError:  # megatron-core < 0.18
        flag = contextlib.nullcontext()
    was_training = model.training
    switches = {name: getattr(config, name) for name in _DECODE_OFF}
    model.eval()
    try:
        for name in _DECODE_OFF:
            setattr(config, name, False)
        with flag, torch.no_grad():
            yield
    finally:
        model.train(was_training)
        for name, value in switches.items():
            setattr(config, name, value)


def _static_context(gpt, batch: int, max_length: int, dtype: torch.dtype, device: torch.device):
    """A ``StaticInferenceContext`` for ``batch`` rows of up to ``max_length`` tokens with its KV
    buffers allocated on ``device``: per attention layer (keyed by its ``layer_number``) a key and
    a value tensor ``[max_length, batch, query groups / TP, head dim]`` of ``dtype``, the layout
    Megatron's ``Attention._allocate_memory`` would create (on ``torch.cuda.current_device()``,
    which is why they are made here)."""
    from megatron.core.inference.contexts.static_context import StaticInferenceContext

    context = StaticInferenceContext(batch, max_length)
    for layer in gpt.decoder.layers:
        attn = layer.self_attention
        shape = (max_length, batch, attn.num_query_groups_per_partition)
        context.key_value_memory_dict[attn.layer_number] = (
            torch.empty(*shape, attn.key_hidden_size, dtype=dtype, device=device),
            torch.empty(*shape, attn.val_hidden_size, dtype=dtype, device=device),
        )
    return context


def decode(model: torch.nn.Module, megatron: MegatronConfig, vocab_size: int,
           prompts: List[List[int]], first_row: int, seed: int, greedy: bool,
           cfg: GenerationConfig, eos_token_id: int, pad_token_id: int,
           max_total_length: int) -> List[Response]:
    """Decode ``prompts`` with a policy worker's model; one :class:`Response` per prompt.

    Args:
        model: the worker's model chunk (``DistributedDataParallel`` around, with bf16,
            ``Float16Module`` around a ``GPTModel``); weights used in place, unchanged.
        megatron: the policy's ``policy.megatron`` config (layout checked by
            :func:`check_layout`; ``layer_spec`` and ``precision``).
        vocab_size: the real vocabulary; padded logit columns are never sampled.
        prompts: token-id lists (checked by the caller); may be empty.
        first_row: the index of ``prompts[0]`` in the ``generate`` call, so each row draws from
            its own stream (:func:`~mcore_rl.generation.sampling.row_uniforms`).
        seed, greedy: as in :meth:`GenerationBackend.generate`.
        cfg: ``generation`` config (sampling, ``max_new_tokens``, ``batch_size`` rows per chunk).
        eos_token_id, pad_token_id, max_total_length: as for the ``hf`` backend.

    Returns:
        Per prompt: response tokens [R] int64 and logprobs [R] float32 on the CPU, truncated flag.

    Collective over the tensor-parallel group (every TP rank calls it with the same prompts;
    logits are gathered over TP by Megatron, so every rank samples the same tokens).

    Raises:
        NotImplementedError: a layout :func:`check_layout` refuses.
    """
    from megatron.core.utils import unwrap_model

    check_layout(megatron)
    sampler = Sampler(cfg)
    gpt = unwrap_model(model)
    out = []
    with _inference_mode(model, gpt.config):
        for start in range(0, len(prompts), cfg.batch_size):
            chunk = prompts[start:start + cfg.batch_size]
            budgets = response_budgets(chunk, cfg.max_new_tokens, max_total_length)
            rows = range(first_row + start, first_row + start + len(chunk))
            out.extend(_decode_chunk(model, gpt, megatron, vocab_size, chunk, budgets, rows, seed,
                                     greedy, sampler, eos_token_id, pad_token_id))
    return out


def _decode_chunk(model, gpt, megatron: MegatronConfig, vocab_size: int, prompts: List[List[int]],
                  budgets: List[int], rows: range, seed: int, greedy: bool, sampler: Sampler,
                  eos_token_id: int, pad_token_id: int) -> List[Response]:
    """One chunk, decoded in lockstep over right-padded rows (module docstring)."""
    from mcore_rl.megatron.model import attention_mask

    device = next(gpt.parameters()).device
    n = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    budget = torch.tensor(budgets, device=device)
    width = int((lengths + budget).max())
    tokens = torch.full((n, width), pad_token_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p, dtype=torch.long)
    tokens = tokens.to(device)  # built on the host, one copy (not a blocking copy per row)
    logprobs = torch.zeros((n, width), dtype=torch.float32, device=device)
    steps = int(budget.max())
    uniforms = None if greedy else row_uniforms(seed, rows, steps, device)
    context = _static_context(gpt, n, width, gpt.config.params_dtype, device)
    # bf16 keeps the logits in bf16 (as get_logprobs does); the sampler computes in float32.
    half = {"fp32_output": False} if megatron.precision == "bf16" else {}
    done = torch.zeros(n, dtype=torch.bool, device=device)
    written = torch.zeros(n, dtype=torch.long, device=device)
    prev = 0
    for cur in range(int(lengths.min()), width):
        s = cur - prev
        logits = model(tokens[:, prev:cur], torch.arange(prev, cur, device=device).expand(n, s),
                       attention_mask(megatron.layer_spec, n, s, device) if prev == 0 else None,
                       inference_context=context, runtime_gather_output=True, **half)
        context.increment_sequence_len_offset(s)
        prev = cur
        step = cur - lengths  # response index of position cur (< 0: still in the prompt)
        generating = (step >= 0) & ~done
        noise = None if greedy else uniforms.gather(1, step.clamp(0, steps - 1)[:, None]).squeeze(1)
        token, logprob = sampler(logits[:, -1, :vocab_size], noise)
        tokens[:, cur] = torch.where(generating, token, tokens[:, cur])
        logprobs[:, cur] = torch.where(generating, logprob, logprobs[:, cur])
        written += generating
        done |= generating & ((token == eos_token_id) | (step + 1 >= budget))
        if bool(done.all()):
            break
    tokens, logprobs = tokens.cpu(), logprobs.cpu()
    results = []
    for i, p in enumerate(prompts):
        end = len(p) + int(written[i])
        response = tokens[i, len(p):end]
        results.append(Response(response, logprobs[i, len(p):end],
                                bool(response[-1] != eos_token_id)))
    return results


class MegatronGenerationBackend(GenerationBackend):
    """Rollouts decoded by the policy workers with the policy's weights in place
    (``generation.backend: megatron``); :meth:`refit` copies nothing.

    Each data-parallel group of the policy decodes a contiguous share of the prompt groups
    (:func:`decode`, through ``PolicyWorker.generate``); rows keep their random streams, so the
    rollouts do not depend on the DP layout. Needs a policy layout :func:`check_layout` accepts
    (the workers raise ``NotImplementedError`` otherwise).

    Args:
        policy: the policy's worker group with its DP layout
            (:class:`mcore_rl.controller.worker_group.DataParallelGroup`: ``dp_size``,
            ``call_per_dp_async``).
        cfg: ``generation`` config (temperature, top_p, max_new_tokens, batch_size: rows per
            decoding chunk on each DP rank).
        eos_token_id: ends a response (kept as its last token).
        pad_token_id: fills ``input_ids`` after a row's end.
        max_total_length: cap on prompt + response tokens (``data.max_total_length``).
        vocab_size: the policy's real vocabulary (prompt ids are checked against it).

    Raises:
        ValueError: a ``generation.*`` value or ``max_total_length`` out of range.
    """

    shares_policy_weights = True

    def __init__(self, policy, cfg: GenerationConfig, eos_token_id: int, pad_token_id: int,
                 max_total_length: int, vocab_size: int):
        check_sampling(cfg)
        check_lengths(cfg, max_total_length)
        self.policy = policy
        self.cfg = cfg
        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        self.max_total_length = int(max_total_length)
        self.vocab_size = int(vocab_size)

    @classmethod
    def from_context(cls, ctx: BackendContext) -> "MegatronGenerationBackend":
        """The run's backend, decoding on ``ctx.policy``."""
        return cls(ctx.policy, ctx.cfg.generation, ctx.eos_token_id, ctx.pad_token_id,
                   ctx.cfg.data.max_total_length, ctx.vocab_size)

    def refit(self, policy) -> Dict[str, float]:
        """Shared weights: the workers decode with the policy's current parameters, so nothing
        is exported or copied (``refit/gbytes`` 0)."""
        return {"refit/gbytes": 0.0}

    def generate_async(self, prompts: List[List[int]], seed: int, greedy: bool = False,
                       group_size: int = 1) -> Iterator[FinishedGroup]:
        """See :meth:`GenerationBackend.generate_async`; sampling as the ``hf`` backend's. Each
        DP rank starts on its share of the groups at once; a share's groups come when it is
        decoded.

        Raises (beyond the interface's, when iterated): ``WorkerError`` of the worker group when
        a worker raises, for example ``RuntimeError`` naming ``prepare_for_lp_inference()``
        while the policy's weights are offloaded, or ``NotImplementedError`` for a refused
        layout.
        """
        check_prompts(prompts, self.vocab_size, self.max_total_length)
        groups = GroupAssembler(len(prompts), group_size)
        dp, num_groups = self.policy.dp_size, len(prompts) // group_size
        bounds = [round(d * num_groups / dp) * group_size for d in range(dp + 1)]
        first_row = {}
        for d in range(dp):
            if bounds[d] < bounds[d + 1]:
                future = self.policy.call_per_dp_async(
                    "generate", [[prompts[bounds[d]:bounds[d + 1]], bounds[d], seed, greedy]],
                    dp_ranks=[d], cfg=self.cfg, eos_token_id=self.eos_token_id,
                    pad_token_id=self.pad_token_id, max_total_length=self.max_total_length)
                first_row[future] = bounds[d]
        return self._collect(first_row, groups)

    @staticmethod
    def _collect(first_row: Dict, groups: GroupAssembler) -> Iterator[FinishedGroup]:
        for future in as_completed(first_row):
            yield from groups.add(first_row[future], future.result()[0])

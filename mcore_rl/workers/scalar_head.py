"""What the critic and the reward model share: the policy's GPT backbone on Megatron with a
scalar head (``hidden -> 1``) in place of the LM output layer.

:class:`ScalarHead` replaces ``GPTModel.output_layer``; :class:`ScalarHeadWorker` builds the
chunks with it (the backbone from a Hugging Face checkpoint or the seeded initialisation of the
policy's config), loads a causal LM's backbone into them, and exports the model under the
Hugging Face names of a classification model with one label: the backbone's ``model.*``
tensors and ``score.weight`` ``[1, h]`` (``score.bias`` ``[1]`` for a head with a bias). The
value worker (:mod:`mcore_rl.workers.value`: ``AutoModelForTokenClassification``, per-token
values) and the reward-model worker (:mod:`mcore_rl.workers.reward_model`:
``AutoModelForSequenceClassification``, the last token's score) differ in what they read of
the head's output.

Tensor parallelism: the hidden states after the final norm are replicated over the TP ranks
(the last row-parallel layer all-reduces them), so the head is replicated and every TP rank
computes the same outputs, loss and head gradients: no TP reduction is needed, and Megatron
counts the head in the gradient norm on TP rank 0 only, as any replicated parameter. With
sequence parallelism each TP rank holds ``s / TP`` positions after the norm (``GPTModel``
hands them to the output layer as they are; its vocabulary projection gathers them itself):
the head runs on the rank's positions and its ``[s / TP, b, 1]`` output is all-gathered along
the sequence (Megatron's ``gather_from_sequence_parallel_region`` with
``tensor_parallel_output_grad=False``: the loss after it is computed whole on every TP rank,
so the backward keeps the rank's slice of the gradient instead of summing the TP copies).
The head's gradients are then partial sums over the rank's positions: its parameters carry
Megatron's ``sequence_parallel`` flag, and ``finalize_model_grads`` sums them over TP as it
does the norms'.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from mcore_rl.workers.megatron_worker import MegatronTrainWorker, requires_device_state
from mcore_rl.workers.policy import initial_hf_state_dict

SCORE_WEIGHT, SCORE_BIAS = "score.weight", "score.bias"  # the head's Hugging Face names


class ScalarHead(torch.nn.Module):
    """Scalar head ``v = h @ w^T (+ b)`` in place of ``GPTModel.output_layer``.

    Called by ``GPTModel`` as its output layer: ``forward(hidden_states [s, b, h], weight=None,
    runtime_gather_output=None) -> (values [s, b, 1], None)`` (the two keyword arguments are
    those of the LM output layer and are ignored); with ``sequence_parallel`` the input is this
    TP rank's ``[s / TP, b, h]`` and the output is gathered to ``[s, b, 1]`` (module
    docstring). Parameters are named ``weight`` ``[1, h]`` and, with ``bias``, ``bias`` ``[1]``
    (Megatron's checkpointing of a language model expects ``output_layer.weight``); replicated
    over TP.

    Args:
        hidden_size: ``h``.
        dtype: parameter dtype; hidden states are cast to it (float32 for an fp32 head on a
            bf16 model).
        init_std: the weight is drawn from ``N(0, init_std^2)``; the bias starts at 0.
        seed: seeds the weight's draw (a CPU generator), so every TP rank and every parallel
            layout starts from the same head.
        device: parameter device.
        bias: with a bias (the critic's); without (the reward model's, as Hugging Face's
            ``*ForSequenceClassification`` ``score`` layer).
        sequence_parallel: the model's ``TransformerConfig.sequence_parallel``.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, init_std: float, seed: int,
                 device: torch.device, bias: bool = True, sequence_parallel: bool = False):
        super().__init__()
        g = torch.Generator(device="cpu").manual_seed(seed)
        weight = torch.randn(1, hidden_size, generator=g, dtype=torch.float32) * init_std
        self.weight = torch.nn.Parameter(weight.to(device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, device=device, dtype=dtype)) if bias else None
        self.sequence_parallel = sequence_parallel
        for p in self.parameters():
            p.keep_fp32 = dtype == torch.float32  # stays fp32 in a bf16 model (model.wrap_float16)
            p.sequence_parallel = sequence_parallel  # gradients summed over TP (module docstring)

    def forward(self, hidden_states: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        """``hidden_states [s, b, h]`` (``[s / TP, b, h]`` under sequence parallelism) ->
        ``(values [s, b, 1], None)`` in the head's dtype (``weight`` and
        ``runtime_gather_output``: the LM output layer's arguments, ignored)."""
        values = torch.nn.functional.linear(hidden_states.to(self.weight.dtype), self.weight, self.bias)
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


class ScalarHeadWorker(MegatronTrainWorker):
    """A Megatron GPT backbone with a :class:`ScalarHead` (the base of the critic and the
    reward model; subclasses read the head's output ``[b, s, 1]``).

    Args (beyond :class:`MegatronTrainWorker`'s):
        hf_path: Hugging Face checkpoint whose backbone initialises the model, or None to use
            the seeded initialisation of ``hf_config`` (with the same ``seed`` as the policy's:
            the same starting backbone). Its LM head is not used.
        hf_config: the transformers config (a dict from ``to_dict()``).
        vocab_size: real vocabulary size (the embedding may be padded for TP).
        head_fp32: keep the head in float32 whatever ``megatron.precision`` is.

    Attribute ``head_bias`` (class): whether the head has a bias.
    """

    head_bias: bool = True

    def __init__(self, *, hf_path: Optional[str], hf_config: Dict[str, Any], vocab_size: int,
                 head_fp32: bool = False, **kwargs):
        self.hf_path = hf_path
        self.hf_config_dict = hf_config
        self.vocab_size = vocab_size
        self.head_fp32 = head_fp32
        self._seed = kwargs["seed"]
        super().__init__(**kwargs)

    # ------------------------------------------------------------------ construction
    def _initial_hf_state(self) -> Dict[str, torch.Tensor]:
        """The Hugging Face state the model starts from: ``hf_path``'s tensors, or the seeded
        initialisation of ``hf_config``."""
        from transformers import AutoConfig

        from mcore_rl.megatron import conversion

        if self.hf_path:
            return conversion.load_hf_checkpoint(self.hf_path)[1]
        cfg = dict(self.hf_config_dict)
        return initial_hf_state_dict(AutoConfig.for_model(cfg.pop("model_type"), **cfg), self._seed)

    def _build_output_model(self) -> List[torch.nn.Module]:
        from mcore_rl.megatron.model import build_model

        chunks = build_model(self.arch, self.megatron_cfg, self.vocab_size, self.device)
        attach_scalar_heads(chunks, self._head_dtype(), self._seed, self.device, self.head_bias)
        state = self._initial_hf_state()
        load_backbone(chunks, state, self.arch)
        self._load_head(chunks, state)
        return chunks

    def _load_head(self, chunks: List[torch.nn.Module], hf_state: Dict[str, torch.Tensor]) -> None:
        """After the backbone: the head's weights from ``hf_state`` (none here: the head
        stays fresh)."""

    def _head_dtype(self) -> torch.dtype:
        return torch.float32 if self.head_fp32 or self.megatron_cfg.precision == "fp32" else torch.bfloat16

    @requires_device_state(training=True)
    def load_backbone(self, hf_state_dict: Dict[str, torch.Tensor]) -> None:
        """Copy a causal LM's Hugging Face-named weights (for example the policy's after a
        supervised warm start, from ``PolicyWorker.get_hf_weights``) into the backbone; the
        head is left as it is. Rebuilds the optimizer and schedule (fresh state).
        Collective. Raises ``ValueError`` (from the conversion) when names or shapes do not
        match ``arch``."""
        load_backbone(unwrap(self.model), hf_state_dict, self.arch)
        self.rebuild_optimizer()

    # ------------------------------------------------------------------ export
    @requires_device_state(training=False)
    def get_hf_weights(self) -> Optional[Dict[str, torch.Tensor]]:
        """The model as Hugging Face names of a classification model with one label: the
        backbone's ``model.*`` tensors (gathered across TP and PP, vocabulary padding stripped)
        plus ``score.weight`` ``[1, h]`` (and ``score.bias`` ``[1]`` with a bias). Subclasses
        say which model class reads them.

        Returns CPU tensors on rank 0, None on other ranks. Collective: every rank calls it.
        """
        from mcore_rl.megatron.conversion import export_hf_weights

        chunks = unwrap(self.model)
        rank0 = dist.get_rank() == 0
        out = {}
        with without_heads(chunks):
            for name, t in export_hf_weights(chunks, backbone_arch(self.arch), self.vocab_size):
                if rank0:
                    out[name] = t.detach().to("cpu", copy=True)
        head = chunks[-1].output_layer if self._is_last_stage() else None
        hidden, dtype = self.arch.hidden_size, self._head_dtype()
        names = (("weight", (1, hidden)), ("bias", (1,))) if self.head_bias else (("weight", (1, hidden)),)
        for name, shape in names:
            t = getattr(head, name).detach().clone() if head is not None else None
            t = self._broadcast_from_last_stage(t, shape, dtype)
            if rank0:
                out[f"score.{name}"] = t.cpu()
        return out if rank0 else None


def backbone_arch(arch):
    """``arch`` as the conversion sees a model without an LM head: exported and loaded like a
    tied model, whose Hugging Face names have no ``lm_head.weight``."""
    return dataclasses.replace(arch, tie_word_embeddings=True)


def attach_scalar_heads(chunks: List[torch.nn.Module], dtype: torch.dtype, seed: int,
                        device: torch.device, bias: bool = True) -> None:
    """Replace the LM output layer of the last stage's chunk by a :class:`ScalarHead` (seeded
    by ``seed``); no chunk shares its embedding with an output layer any more (so
    ``finalize_model_grads`` skips the embedding all-reduce between the first and last
    stage)."""
    for chunk in chunks:
        chunk.share_embeddings_and_output_weights = False
        if chunk.post_process:
            config = chunk.config
            chunk.output_layer = ScalarHead(config.hidden_size, dtype, config.init_method_std,
                                            seed, device, bias, config.sequence_parallel)


def unwrap(model: List[torch.nn.Module]) -> List[torch.nn.Module]:
    """The ``GPTModel`` chunks inside DDP (and ``Float16Module`` with precision bf16)."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(list(model))


def load_backbone(chunks: List[torch.nn.Module], hf_state_dict: Dict[str, torch.Tensor], arch) -> None:
    """HF weights into the chunks' backbone: the conversion sees the chunks without their
    head (as a language model whose output layer is absent). A causal LM's ``lm_head.weight``
    and a classification model's ``score.*`` are not backbone tensors and are skipped; a tied
    model is loaded as it is (the conversion checks its ``lm_head.weight``)."""
    from mcore_rl.megatron import conversion

    if not arch.tie_word_embeddings or any(k.startswith("score.") for k in hf_state_dict):
        hf_state_dict = {k: v for k, v in hf_state_dict.items()
                         if k != "lm_head.weight" and not k.startswith("score.")}
        arch = backbone_arch(arch)
    with without_heads(chunks):
        conversion.load_hf_weights(chunks, hf_state_dict, arch)


@contextmanager
def without_heads(chunks: List[torch.nn.Module]):
    """The chunks with no output layer inside the block (restored after)."""
    heads = [c.output_layer if c.post_process else None for c in chunks]
    try:
        for c, h in zip(chunks, heads):
            if h is not None:
                c.output_layer = None
        yield
    finally:
        for c, h in zip(chunks, heads):
            if h is not None:
                c.output_layer = h

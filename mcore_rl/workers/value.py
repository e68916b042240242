"""The value (critic) worker: the policy's GPT backbone with a scalar value head, on Megatron.

Adds to :class:`~mcore_rl.workers.megatron_worker.MegatronTrainWorker`: the same Megatron
``GPTModel`` as the policy (same builder, same Hugging Face weights or the same seeded
initialisation), whose LM output layer is replaced by :class:`ValueHead` (``hidden -> 1``),
and right-shifted per-token values.

Convention (``docs/design.md``, "Values"): ``values[b, t] = V(state before token t)`` = the head applied to
the final hidden state at position ``t - 1``; ``values[:, 0] = 0``. The shift matters: a critic
read at position ``t`` (which has already seen token ``t``) trains without error and silently
costs reward.

Tensor parallelism: the hidden states after the final norm are replicated over the TP ranks
(the last row-parallel layer all-reduces them), so the head is replicated and every TP rank
computes the same values, loss and head gradients: no TP reduction is needed, and Megatron
counts the head in the gradient norm on TP rank 0 only, as any replicated parameter. Sequence
parallelism (``s / TP`` positions per rank after the norm) is refused by the local layer spec;
a spec that allows it will need the head's output gathered along the sequence and the head's
gradients summed over TP.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from mcore_rl.data.batch import Batch
from mcore_rl.data.packing import CU_SEQLENS, unpack
from mcore_rl.workers.megatron_worker import LossOutput, MegatronTrainWorker, requires_device_state
from mcore_rl.workers.policy import initial_hf_state_dict


class ValueHead(torch.nn.Module):
    """Scalar head ``v = h @ w^T + b`` in place of ``GPTModel.output_layer``.

    Called by ``GPTModel`` as its output layer: ``forward(hidden_states [s, b, h], weight=None,
    runtime_gather_output=None) -> (values [s, b, 1], None)`` (the two keyword arguments are
    those of the LM output layer and are ignored). Parameters are named ``weight`` ``[1, h]``
    and ``bias`` ``[1]`` (Megatron's checkpointing of a language model expects
    ``output_layer.weight``); replicated over TP.

    Args:
        hidden_size: ``h``.
        dtype: parameter dtype; hidden states are cast to it (float32 for an fp32 head on a
            bf16 model).
        init_std: the weight is drawn from ``N(0, init_std^2)``; the bias starts at 0.
        seed: seeds the weight's draw (a CPU generator), so every TP rank and every parallel
            layout starts from the same head.
        device: parameter device.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, init_std: float, seed: int,
                 device: torch.device):
        super().__init__()
        g = torch.Generator(device="cpu").manual_seed(seed)
        weight = torch.randn(1, hidden_size, generator=g, dtype=torch.float32) * init_std
        self.weight = torch.nn.Parameter(weight.to(device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, device=device, dtype=dtype))
        for p in (self.weight, self.bias):  # stays fp32 in a bf16 model (model.wrap_float16)
            p.keep_fp32 = dtype == torch.float32

    def forward(self, hidden_states: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        values = torch.nn.functional.linear(hidden_states.to(self.weight.dtype), self.weight, self.bias)
        return values, None


def _values(output: torch.Tensor, mb: Batch) -> torch.Tensor:
    """Right-shifted values ``[b, s]`` float32 of a micro-batch from the head output
    ``[b, s, 1]``; a packed micro-batch (:mod:`mcore_rl.data.packing`, output ``[1, T, 1]``) is
    shifted within each sequence and put back in the ``[b, s]`` layout."""
    if CU_SEQLENS in mb:
        return unpack(output[..., 0].float(), mb[CU_SEQLENS], mb["input_ids"].shape[1], shift=1,
                      num_rows=mb["input_ids"].shape[0])
    return shift_right(output[..., 0])


def shift_right(head_values: torch.Tensor) -> torch.Tensor:
    """``values[:, t] = head_values[:, t - 1]``, ``values[:, 0] = 0`` (``docs/design.md``, "Values": the value
    of the state before token ``t`` is read from the hidden state that has seen tokens ``< t``).

    Args:
        head_values: ``[b, s]`` the head at every position.
    Returns:
        ``[b, s]`` float32. Raises ``ValueError`` if the input is not 2-D.
    """
    if head_values.dim() != 2:
        raise ValueError(f"shift_right: expected [b, s], got shape {tuple(head_values.shape)}")
    head_values = head_values.float()
    return torch.cat([torch.zeros_like(head_values[:, :1]), head_values[:, :-1]], dim=1)


class ValueWorker(MegatronTrainWorker):
    """Critic on Megatron-Core: the policy's backbone plus :class:`ValueHead`.

    Args (beyond :class:`MegatronTrainWorker`'s):
        hf_path: Hugging Face causal-LM checkpoint whose backbone initialises the critic, or
            None to use the seeded initialisation of ``hf_config`` (the policy's, with the same
            ``seed``: the same starting backbone as the policy). The LM head is not used; the
            value head is always freshly initialised.
        hf_config: the transformers config (a dict from ``to_dict()``).
        vocab_size: real vocabulary size (the embedding may be padded for TP).
        head_fp32: keep the value head in float32 whatever ``megatron.precision`` is.
    """

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
        from transformers import AutoConfig

        from mcore_rl.megatron import conversion

        if self.hf_path:
            return conversion.load_hf_checkpoint(self.hf_path)[1]
        cfg = dict(self.hf_config_dict)
        return initial_hf_state_dict(AutoConfig.for_model(cfg.pop("model_type"), **cfg), self._seed)

    def _build_output_model(self) -> List[torch.nn.Module]:
        from mcore_rl.megatron.model import build_model

        chunks = build_model(self.arch, self.megatron_cfg, self.vocab_size, self.device)
        for chunk in chunks:
            # No LM output layer, so nothing is tied to the embedding (finalize_model_grads
            # then skips the embedding all-reduce between the first and last stage).
            chunk.share_embeddings_and_output_weights = False
            if chunk.post_process:
                config = chunk.config
                chunk.output_layer = ValueHead(config.hidden_size, self._head_dtype(),
                                               config.init_method_std, self._seed, self.device)
        _load_backbone(chunks, self._initial_hf_state(), self.arch)
        return chunks

    def _head_dtype(self) -> torch.dtype:
        return torch.float32 if self.head_fp32 or self.megatron_cfg.precision == "fp32" else torch.bfloat16

    @requires_device_state(training=True)
    def load_backbone(self, hf_state_dict: Dict[str, torch.Tensor]) -> None:
        """Copy a causal LM's Hugging Face-named weights (for example the policy's after a
        supervised warm start, from ``PolicyWorker.get_hf_weights``) into the backbone; the
        value head is left as it is. Rebuilds the optimizer and schedule (fresh state).
        Collective. Raises ``ValueError`` (from the conversion) when names or shapes do not
        match ``arch``."""
        _load_backbone(_unwrap(self.model), hf_state_dict, self.arch)
        self.rebuild_optimizer()

    # ------------------------------------------------------------------ values
    def _loss_output(self, output: torch.Tensor, mb: Batch, loss_fn) -> LossOutput:
        loss_sum, count, metrics = loss_fn(_values(output, mb), mb)
        return loss_sum, count.detach().to(torch.int64), metrics

    @requires_device_state(training=False)
    def get_values(self, batch: Batch, micro_batch_size: int) -> torch.Tensor:
        """Right-shifted values of ``batch["input_ids"]``: ``values[b, t] = V(x_<t)``.

        Returns a float32 CPU tensor ``[B, S]`` (S of the input; 0 at ``t = 0`` and past each
        row's length), identical on every rank. Collective over the worker world.
        """
        return self._per_token_forward(batch, micro_batch_size,
                                       _values)

    # ------------------------------------------------------------------ export
    @requires_device_state(training=False)
    def get_hf_weights(self) -> Optional[Dict[str, torch.Tensor]]:
        """The critic as Hugging Face names of a token-classification model with one label
        (``AutoModelForTokenClassification`` with ``num_labels=1``): the backbone's ``model.*``
        tensors (gathered across TP and PP, vocabulary padding stripped) plus ``score.weight``
        ``[1, h]`` and ``score.bias`` ``[1]``. That model's logits at position ``t`` are the
        head at ``t``; :meth:`get_values` is them shifted right by one.

        Returns CPU tensors on rank 0, None on other ranks. Collective: every rank calls it.
        """
        from mcore_rl.megatron.conversion import export_hf_weights

        chunks = _unwrap(self.model)
        # The backbone has no LM head: exported like a tied model, whose names have none.
        backbone_arch = dataclasses.replace(self.arch, tie_word_embeddings=True)
        rank0 = dist.get_rank() == 0
        out = {}
        with _without_heads(chunks):
            for name, t in export_hf_weights(chunks, backbone_arch, self.vocab_size):
                if rank0:
                    out[name] = t.detach().to("cpu", copy=True)
        head = chunks[-1].output_layer if self._is_last_stage() else None
        hidden, dtype = self.arch.hidden_size, self._head_dtype()
        for name, shape in (("weight", (1, hidden)), ("bias", (1,))):
            t = getattr(head, name).detach().clone() if head is not None else None
            t = self._broadcast_from_last_stage(t, shape, dtype)
            if rank0:
                out[f"score.{name}"] = t.cpu()
        return out if rank0 else None


def _unwrap(model: List[torch.nn.Module]) -> List[torch.nn.Module]:
    """The ``GPTModel`` chunks inside DDP (and ``Float16Module`` with precision bf16)."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(list(model))


def _load_backbone(chunks: List[torch.nn.Module], hf_state_dict: Dict[str, torch.Tensor], arch) -> None:
    """HF weights into the chunks' backbone: the conversion sees the chunks without their
    value head (as a language model whose output layer is absent)."""
    from mcore_rl.megatron import conversion

    with _without_heads(chunks):
        conversion.load_hf_weights(chunks, hf_state_dict, arch)


@contextmanager
def _without_heads(chunks: List[torch.nn.Module]):
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

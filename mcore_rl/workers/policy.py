"""The policy worker: a Megatron GPT language model trained with a policy-gradient loss.

Adds to :class:`~mcore_rl.workers.megatron_worker.MegatronTrainWorker`: weights from a Hugging
Face checkpoint (or a seeded Hugging Face initialisation of a config, so every layout starts
from the same weights), per-token logprobs from vocab-parallel logits, a frozen reference
policy for the KL term, and the refit exporter that yields Hugging Face-named tensors.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from mcore_rl.data.batch import Batch
from mcore_rl.data.packing import CU_SEQLENS, PACKED_IDS, packed_targets, unpack
from mcore_rl.megatron import context_parallel
from mcore_rl.workers.megatron_worker import LossOutput, MegatronTrainWorker, requires_device_state


def initial_hf_state_dict(hf_config, seed: int) -> Dict[str, torch.Tensor]:
    """Weights of a freshly initialised Hugging Face model for ``hf_config`` (fp32), seeded,
    so that the same seed gives the same starting policy in every parallel layout; under the
    checkpoint names (:func:`~mcore_rl.megatron.conversion.hf_checkpoint_state_dict`)."""
    from transformers import AutoModelForCausalLM

    from mcore_rl.megatron.conversion import hf_checkpoint_state_dict

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    return hf_checkpoint_state_dict(model)


class PolicyWorker(MegatronTrainWorker):
    """Policy on Megatron-Core.

    Args (beyond :class:`MegatronTrainWorker`'s):
        hf_path: Hugging Face checkpoint directory to load, or None to initialise from
            ``hf_config`` with ``seed``.
        hf_config: the transformers config of the policy (a dict from ``to_dict()``).
        vocab_size: real vocabulary size (the model may pad it for TP).
        temperature: logits are divided by it before logprobs (the rollout's sampling
            temperature, so trainer and rollout logprobs describe the same distribution).
        use_reference: keep a frozen copy of the initial weights for reference logprobs.
        init: without ``hf_path``, ``"transformers"`` (a seeded transformers model built on the
            host: :func:`initial_hf_state_dict`) or ``"normal"`` (each tensor drawn on this
            worker's device from its own seed: :class:`~mcore_rl.megatron.conversion.
            SeededNormalInit`, for models too large for the first); ``model.init``.
    """

    def __init__(self, *, hf_path: Optional[str], hf_config: Dict[str, Any], vocab_size: int,
                 temperature: float = 1.0, use_reference: bool = False, init: str = "transformers",
                 **kwargs):
        self.hf_path = hf_path
        self.init = init
        self.hf_config_dict = hf_config
        self.vocab_size = vocab_size
        self.temperature = temperature
        self._use_reference = use_reference
        self._seed = kwargs["seed"]
        super().__init__(**kwargs)
        self._reference: Optional[List[torch.Tensor]] = None
        if use_reference:
            self.set_reference_to_current()

    # ------------------------------------------------------------------ construction
    def _hf_config(self):
        from transformers import AutoConfig

        cfg = dict(self.hf_config_dict)
        return AutoConfig.for_model(cfg.pop("model_type"), **cfg)

    def _build_output_model(self):
        from mcore_rl.megatron import conversion
        from mcore_rl.megatron.model import build_model

        chunks = build_model(self.arch, self.megatron_cfg, self.vocab_size, self.device)
        if self.hf_path:
            _, state = conversion.load_hf_checkpoint(self.hf_path)
        elif self.init == "normal":
            state = conversion.SeededNormalInit(
                self.arch, self.vocab_size, self._seed,
                std=self.hf_config_dict.get("initializer_range", 0.02), device=self.device)
        else:
            state = initial_hf_state_dict(self._hf_config(), self._seed)
        conversion.load_hf_weights(chunks, state, self.arch)
        return chunks

    # ------------------------------------------------------------------ logprobs
    def _token_logprobs(self, output: torch.Tensor, mb: Batch) -> torch.Tensor:
        """``logprobs[b, t] = log pi(x_t | x_<t)`` from vocab-parallel logits, ``[:, 0] = 0``.

        Args:
            output: logits ``[b, s, V_pad / TP]`` of this TP rank's vocabulary shard (bf16
                with precision bf16: the model keeps them in bf16, ``fp32_output=False``);
                with context parallelism ``[b, s / CP, V_pad / TP]``, the positions of this CP
                rank's two chunks: their logprobs are all-gathered to ``[b, s]``
                (:func:`~mcore_rl.megatron.context_parallel.gather`, backward: the local slice).
            mb: micro-batch with ``input_ids`` ``[b, s]``; a packed one
                (:mod:`mcore_rl.data.packing`) has logits ``[1, T, V_pad / TP]`` of its packed
                row (with CP ``[1, T / CP, V_pad / TP]``: this rank's chunks of every
                sequence): targets are the next tokens within each sequence, and the result is
                put back in the ``[b, s]`` layout (``[:, 0] = 0`` per sequence).
        Returns:
            float32 ``[b, s]``, of ``logits / temperature``, from
            :func:`~mcore_rl.megatron.logprobs.vocab_parallel_logprobs` (max and sum-exp
            reduced across TP as in Megatron's ``vocab_parallel_cross_entropy``, computed in
            fp32 inside fused kernels without a full-vocabulary fp32 copy; padded vocabulary
            columns are left out of the softmax).
        """
        from mcore_rl.megatron.logprobs import vocab_parallel_logprobs

        cu = mb.get(CU_SEQLENS)
        ids = mb["input_ids"] if cu is None else mb[PACKED_IDS]
        target = torch.roll(ids, shifts=-1, dims=1) if cu is None else packed_targets(ids, cu)
        cp = self.ps.get_context_parallel_world_size()
        if cp > 1:  # logits of this rank's two chunks: their targets, then the full width
            target = context_parallel.split(target, 1, cp, self.ps.get_context_parallel_rank(), cu)
        next_lp = vocab_parallel_logprobs(output, target, self.vocab_size, self.temperature)
        if cp > 1:
            next_lp = context_parallel.gather(next_lp, dim=1,
                                              group=self.ps.get_context_parallel_group(),
                                              cu_seqlens=cu)
        if cu is not None:
            return unpack(next_lp, cu, mb["input_ids"].shape[1], shift=1,
                          num_rows=mb["input_ids"].shape[0], lengths=mb["input_lengths"])
        return torch.cat([torch.zeros_like(next_lp[:, :1]), next_lp[:, :-1]], dim=1)

    def _cp_output(self, output: torch.Tensor, mb: Batch) -> torch.Tensor:
        """The local logits as they are: :meth:`_token_logprobs` gathers the logprobs instead
        (``[b, s]``, not ``[b, s, V / TP]``)."""
        return output

    def _loss_output(self, output: torch.Tensor, mb: Batch, loss_fn) -> LossOutput:
        logprobs = self._token_logprobs(output, mb)
        loss_sum, count, metrics = loss_fn(logprobs, mb)
        return loss_sum, count.detach().to(torch.int64), metrics

    @requires_device_state(training=False)
    def get_logprobs(self, batch: Batch, micro_batch_size: int) -> torch.Tensor:
        """Per-token logprobs of ``batch["input_ids"]`` under the current policy.

        Returns a float32 CPU tensor ``[B, S]`` (S of the input; 0 at t=0 and past each row's
        length), identical on every rank. Collective over the worker world.
        """
        return self._per_token_forward(batch, micro_batch_size, self._token_logprobs)

    # ------------------------------------------------------------------ rollouts
    _decoder = None  # made by the first generate call's decoder factory, kept for the next

    @requires_device_state(training=False)
    def generate(self, prompts: List[List[int]], first_row: int, seed: int, greedy: bool, *,
                 decoder: Callable, cfg, eos_token_id: int, pad_token_id: int,
                 max_total_length: int, row_sink: Any = None) -> list:
        """Decode ``prompts`` (this DP rank's share) with the policy's own model and weights
        (``generation.backend: megatron``).

        ``decoder`` is the decoder's factory, ``(model chunk, policy.megatron config, vocab
        size) -> decoder``, injected by the generation backend that calls this
        (:class:`mcore_rl.generation.megatron.MegatronDecoder`, whose ``generate`` documents
        the other arguments and returns one ``Response`` per prompt; the workers' floor does
        not import the generation floor above it). The decoder (KV cache, CUDA graphs) is made
        at the first call and kept for the next; it raises ``NotImplementedError`` for pipeline
        or sequence parallelism. Collective over TP (every TP rank of one DP group gets the
        same prompts); the weights are left unchanged. ``row_sink``: passed to the decoder
        (where it sends finished rows before the call returns)."""
        if self._decoder is None:
            self._decoder = decoder(self.model[0], self.megatron_cfg, self.vocab_size)
        return self._decoder.generate(prompts, first_row, seed, greedy, cfg, eos_token_id,
                                      pad_token_id, max_total_length, row_sink=row_sink)

    def release_decoder(self) -> None:
        """Free the decoder's KV cache, row states and CUDA graphs (``MegatronDecoder.release``;
        the next :meth:`generate` makes them again). Called by the colocated ``megatron``
        backend before logprobs and training (``MegatronGenerationBackend.offload``)."""
        if self._decoder is not None:
            self._decoder.release()

    def offload_after_refit(self) -> None:
        """As :meth:`MegatronTrainWorker.offload_after_refit`; also frees the decoder's buffers
        (:meth:`release_decoder`: the device is handed over)."""
        self.release_decoder()
        super().offload_after_refit()

    # ------------------------------------------------------------------ reference policy
    def _offload_extra_tensors(self) -> List[torch.Tensor]:
        return list(self._reference or [])

    def _params(self) -> List[torch.Tensor]:
        return [p for m in self.model for p in m.module.parameters()]

    @requires_device_state(training=False)
    def set_reference_to_current(self) -> None:
        """Freeze a copy of the current weights as the reference policy (for example after a
        supervised warm start)."""
        self._reference = [p.detach().clone() for p in self._params()]

    @contextmanager
    def _reference_weights(self):
        if self._reference is None:
            raise RuntimeError("get_reference_logprobs: the policy was built without a reference "
                               "model (use_reference=False; set loss.kl_coef > 0)")
        current = [p.detach().clone() for p in self._params()]
        try:
            with torch.no_grad():
                for p, r in zip(self._params(), self._reference):
                    p.copy_(r)
            yield
        finally:
            with torch.no_grad():
                for p, c in zip(self._params(), current):
                    p.copy_(c)

    @requires_device_state(training=False)
    def get_reference_logprobs(self, batch: Batch, micro_batch_size: int) -> torch.Tensor:
        """Like :meth:`get_logprobs`, under the frozen reference weights (swapped in and back,
        so no second model is kept on the device). Raises ``RuntimeError`` without one."""
        with self._reference_weights():
            return self.get_logprobs(batch, micro_batch_size)

    def _extra_sharded_state(self) -> Dict[str, Any]:
        if self._reference is None:
            return {}
        # The reference shares the model's sharding: reuse its sharded tensors' metadata.
        import dataclasses as dc

        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        model_state = {}
        for i, m in enumerate(self.model):
            model_state.update({f"{i}.{k}": v for k, v in m.module.sharded_state_dict().items()})
        by_param = {id(p): r for p, r in zip(self._params(), self._reference)}
        ref = {}
        for k, sh in model_state.items():
            if isinstance(sh, (ShardedTensor, ShardedTensorFactory)) and id(sh.data) in by_param:
                ref[k] = dc.replace(sh, key="reference." + sh.key, data=by_param[id(sh.data)].clone())
        return {"reference": ref}

    def _load_extra_state(self, loaded: Dict[str, Any]) -> None:
        if self._reference is None or "reference" not in loaded:
            return
        model_state = {}
        for i, m in enumerate(self.model):
            model_state.update({f"{i}.{k}": v for k, v in m.module.sharded_state_dict().items()})
        index = {id(p): j for j, p in enumerate(self._params())}
        for k, t in loaded["reference"].items():
            j = index[id(model_state[k].data)]
            self._reference[j].copy_(t)

    # ------------------------------------------------------------------ refit / export
    @requires_device_state(training=False)
    def get_hf_weights(self) -> Optional[Dict[str, torch.Tensor]]:
        """Full Hugging Face-named weights (gathered across TP and PP) as CPU tensors on rank 0,
        None on other ranks. Collective: every rank calls it."""
        from mcore_rl.megatron.conversion import export_hf_weights

        out = {}
        for name, t in export_hf_weights([m.module for m in self.model], self.arch, self.vocab_size):
            if dist.get_rank() == 0:
                out[name] = t.detach().to("cpu", copy=True)
        return out if dist.get_rank() == 0 else None

    @requires_device_state(training=False)
    def send_hf_weights(self, sender) -> int:
        """Stream the full Hugging Face-named weights (as :meth:`get_hf_weights`, left on the
        device) into ``sender``, a rollout engine's refit channel with ``send(named_tensors, rank)
        -> bytes`` (e.g. :class:`mcore_rl.generation.vllm.RefitSender`; it decides which ranks
        send). Collective: every rank calls it. Returns the bytes this rank sent."""
        from mcore_rl.megatron.conversion import export_hf_weights

        return sender.send(export_hf_weights([m.module for m in self.model], self.arch, self.vocab_size),
                           rank=dist.get_rank())

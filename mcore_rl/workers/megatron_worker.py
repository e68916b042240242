"""The shared Megatron training worker: model, DDP, optimizer, schedule, forward plumbing.

One instance lives in each rank of the worker's ``torch.distributed`` world (a Ray actor or a
plain process). The policy worker and the value worker specialise the model output and what a
forward step computes. :class:`MegatronTrainWorker` is built from its parts, one module each:

- here: construction (model, DDP, optimizer, LR schedule), layout facts, the forward plumbing
  (padded and packed micro-batches through Megatron's pipeline schedule), per-token forwards;
- :mod:`mcore_rl.workers.train_step`: ``train`` and the split train step, the step contract and
  the loss normalization in one place;
- :mod:`mcore_rl.workers.offload`: the offload lifecycle of colocated generation and its guard
  (:func:`~mcore_rl.workers.offload.requires_device_state`);
- :mod:`mcore_rl.workers.checkpointing`: distributed checkpoints of model, optimizer and schedule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from mcore_rl.config.families import microbatch_width_multiple, packed_sequence_multiple
from mcore_rl.config.schema import ModelArchConfig, MegatronConfig, OptimizerConfig
from mcore_rl.data.batch import Batch
from mcore_rl.data.microbatching import ROW_INDEX, gather_rows, make_microbatches, shapes_vary
from mcore_rl.data.packing import (CU_SEQLENS, MAX_SEQLEN, PACKED_IDS, PACKED_POSITIONS,
                                   computed_tokens, make_packed_microbatches)
from mcore_rl.megatron import context_parallel, parallel, rope
from mcore_rl.workers.checkpointing import CheckpointMixin
from mcore_rl.workers.offload import OffloadLifecycleMixin, requires_device_state
from mcore_rl.workers.train_step import LossOutput, TrainStepMixin


def _use_fused_torch_adam(optimizer) -> None:
    """Switch a fresh Megatron optimizer's torch Adam/AdamW to torch's single-kernel CUDA
    implementation (``fused=True``). Megatron uses Transformer Engine's or Apex's FusedAdam
    when importable and otherwise torch's optimizer with its default multi-tensor ``foreach``
    path, several kernels per step over every fp32 main param and state tensor. Same update
    rule (Loshchilov & Hutter 2019, AdamW, Algorithm 2); state must not exist yet (fused keeps
    the step count on the device)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Adam) and not inner.state:
            for group in inner.param_groups:
                group["fused"], group["foreach"] = True, False


class MegatronTrainWorker(TrainStepMixin, OffloadLifecycleMixin, CheckpointMixin):
    """A Megatron-Core model chunk list with DDP, a Megatron optimizer and LR schedule.

    Args:
        arch: decoder shape (resolved: ``vocab_size`` set).
        megatron: parallel layout, precision and DDP options (config ``policy.megatron``).
        optimizer: optimizer and schedule (config ``policy.optimizer``).
        rank, world_size, master_addr, master_port: this process in the worker world.
        device: "cpu" or "cuda" (``cluster.device`` after "auto" is resolved).
        seed: Megatron's model-parallel RNG seed.
        total_optimizer_steps: for the LR decay.
        global_batch_size: sequences per optimizer step (the scheduler counts samples).
        threads: CPU threads for torch in this process (0: cores / local workers).
        max_tokens_per_microbatch: None: micro-batches of the ``micro_batch_size`` rows each
            call names; else a token budget (config ``policy.max_tokens_per_microbatch``) that
            replaces it in every call (:mod:`mcore_rl.data.microbatching`).
        sequence_packing: run every training and forward-only micro-batch packed (THD: the
            rows' tokens concatenated, no padding; :mod:`mcore_rl.data.packing`) under a token
            budget: ``max_tokens_per_microbatch``, or when None ``micro_batch_size`` x the
            call's longest row (the padded path's bound). Needs PP = 1, no experts, and a layer
            spec with THD attention (``torch`` or ``transformer_engine``); checked at config
            load (``policy.sequence_packing``).
        manual_gc_interval: 0: Python's automatic garbage collection. N > 0: automatic
            collection is turned off in this process and a full collection runs after every
            N-th optimizer step (``trainer_version`` a multiple of N), the same point on every
            rank (config ``cluster.manual_gc_interval``; Megatron-LM's ``--manual-gc``). A full
            collection of a worker's ~0.7M Python objects takes ~0.2 s; left automatic it lands
            on each rank at its own time, and the other ranks wait for it at the next
            collective.

    Attributes:
        trainer_version: optimizer steps taken (int, starts at 0, saved in checkpoints). Bumped
            by exactly 1 when :meth:`train` or :meth:`finish_train_step` has stepped the
            optimizer and the LR schedule (also when the optimizer skipped a non-finite update:
            it counts steps as the schedule does), never by ``begin_train_step``,
            ``train_microbatch`` or ``abort_train_step``. Rollouts tagged with it name the
            weights that produced them.
    """

    def __init__(
        self,
        arch: ModelArchConfig,
        megatron: MegatronConfig,
        optimizer: OptimizerConfig,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        device: str,
        seed: int,
        total_optimizer_steps: int,
        global_batch_size: int,
        threads: int = 0,
        max_tokens_per_microbatch: Optional[int] = None,
        manual_gc_interval: int = 0,
        sequence_packing: bool = False,
    ):
        if manual_gc_interval < 0:
            raise ValueError(f"manual_gc_interval must be >= 0 (got {manual_gc_interval})")
        if device == "cpu":
            torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // max(1, world_size)))
        self.arch = arch
        self.megatron_cfg = megatron
        self.optimizer_cfg = optimizer
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.sequence_packing = sequence_packing
        if sequence_packing and (megatron.pipeline_model_parallel_size > 1
                                 or megatron.virtual_pipeline_model_parallel_size is not None
                                 or arch.num_experts is not None
                                 or megatron.layer_spec == "local"):
            raise ValueError("sequence_packing needs pipeline_model_parallel_size=1, no virtual "
                             "stages, a dense model and layer_spec torch or transformer_engine")
        rope.install()  # RoPE in fewer kernels; packed: one pass per micro-batch (rope.py)
        self.rank = rank
        self.device = parallel.initialize(
            rank,
            world_size,
            master_addr,
            master_port,
            device,
            megatron.tensor_model_parallel_size,
            megatron.pipeline_model_parallel_size,
            megatron.virtual_pipeline_model_parallel_size,
            seed=seed,
            expert_model_parallel_size=megatron.expert_model_parallel_size,
            expert_tensor_parallel_size=megatron.expert_tensor_parallel_size,
            context_parallel_size=megatron.context_parallel_size,
        )
        from megatron.core import parallel_state as ps

        self.ps = ps
        self.model = self._build_model()
        self._schedule_args = (total_optimizer_steps, global_batch_size)
        self.rebuild_optimizer()
        self.trainer_version = 0
        self.manual_gc_interval = manual_gc_interval
        if manual_gc_interval:
            gc.disable()
            gc.collect()

    # ------------------------------------------------------------------ construction
    def _build_output_model(self) -> List[torch.nn.Module]:
        """The model chunks (one per virtual stage), before DDP. Subclasses decide the head."""
        raise NotImplementedError

    def _build_model(self):
        """The subclass's chunks (weights loaded), in Megatron's ``Float16Module`` for bf16
        (:func:`~mcore_rl.megatron.model.wrap_float16`), each in Megatron DDP."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from mcore_rl.megatron.model import wrap_float16

        chunks = wrap_float16(self._build_output_model(), self.megatron_cfg.precision)
        ddp = self.megatron_cfg.ddp
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=ddp.grad_reduce_in_fp32,
            overlap_grad_reduce=ddp.overlap_grad_reduce,
            use_distributed_optimizer=ddp.use_distributed_optimizer,
            overlap_param_gather=ddp.overlap_param_gather,
            check_for_nan_in_grad=ddp.check_for_nan_in_grad,
            bucket_size=ddp.bucket_size,
            average_in_collective=ddp.average_in_collective,
        )
        model = [
            DistributedDataParallel(chunk.config, ddp_config, chunk,
                                    disable_bucketing=(i > 0))
            for i, chunk in enumerate(chunks)
        ]
        return model

    @requires_device_state(training=True)
    def rebuild_optimizer(self, lr: Optional[float] = None) -> None:
        """(Re)create the Megatron optimizer and LR schedule over the current weights: fresh
        optimizer state. ``lr`` given: a constant learning rate (a warm-start phase); None:
        the configured optimizer and schedule (``policy.optimizer``). Raises ``RuntimeError``
        while a split train step is open (it would reinstall the hooks that step nulled)."""
        self._refuse_during_split_step("rebuild_optimizer")
        o = self.optimizer_cfg
        if lr is not None:
            o = dataclasses.replace(o, lr=lr, min_lr=lr, lr_warmup_steps=0, lr_decay_style="constant")
        self._build_optimizer(o)

    def _build_optimizer(self, o: OptimizerConfig) -> None:
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig as MOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.utils import get_model_config

        bf16 = self.megatron_cfg.precision == "bf16"
        self.optimizer = get_megatron_optimizer(
            MOptimizerConfig(
                optimizer=o.name,
                lr=o.lr,
                min_lr=o.min_lr,
                weight_decay=o.weight_decay,
                adam_beta1=o.adam_beta1,
                adam_beta2=o.adam_beta2,
                adam_eps=o.adam_eps,
                clip_grad=o.clip_grad,
                bf16=bf16,
                params_dtype=torch.bfloat16 if bf16 else torch.float32,
                use_distributed_optimizer=self.megatron_cfg.ddp.use_distributed_optimizer,
            ),
            self.model,
        )
        if self.device.type == "cuda":
            _use_fused_torch_adam(self.optimizer)
        self._build_scheduler(o)
        config = get_model_config(self.model[0])
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = [m.no_sync for m in self.model] if len(self.model) > 1 else self.model[0].no_sync
        if self.megatron_cfg.ddp.overlap_grad_reduce:
            config.grad_sync_func = (
                [m.start_grad_sync for m in self.model] if len(self.model) > 1 else self.model[0].start_grad_sync
            )
        self.model_config = config

    def _build_scheduler(self, o: OptimizerConfig) -> None:
        """Megatron's ``OptimizerParamScheduler`` for ``o``: warmup from 0 to ``o.lr`` over
        ``o.lr_warmup_steps``, then ``o.lr_decay_style`` down to ``o.min_lr`` by the run's last
        optimizer step, constant weight decay. It counts samples, so every step count is
        multiplied by the global batch size. The configuration is the source of truth on
        resume (``override_opt_param_scheduler``): a checkpoint gives the schedule only its
        progress (:meth:`load_checkpoint`). A run shorter than its warmup (a smoke run of
        ``grpo.max_steps=2`` on a config with ``lr_warmup_steps: 5``) ends while still warming up:
        the decay is then counted to one step past the warmup, as Megatron's scheduler needs
        warmup < decay (it asserts otherwise)."""
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        total_optimizer_steps, global_batch_size = self._schedule_args
        gbs = max(1, global_batch_size)
        total_optimizer_steps = max(total_optimizer_steps, o.lr_warmup_steps + 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if o.lr_warmup_steps > 0 else o.lr,
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=o.lr_warmup_steps * gbs,
            lr_decay_steps=total_optimizer_steps * gbs,
            lr_decay_style=o.lr_decay_style,
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=total_optimizer_steps * gbs,
            wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=False,
            override_opt_param_scheduler=True,
        )

    # ------------------------------------------------------------------ layout facts
    def layout(self) -> Dict[str, int]:
        """This rank's coordinates: ``rank``, ``dp_rank``, ``dp_size``, ``tp_rank``, ``pp_rank``."""
        ps = self.ps
        return {
            "rank": dist.get_rank(),
            "dp_rank": ps.get_data_parallel_rank(),
            "dp_size": ps.get_data_parallel_world_size(),
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
        }

    def _is_last_stage(self) -> bool:
        return self.ps.is_pipeline_last_stage(ignore_virtual=True)

    def _broadcast_from_last_stage(self, tensor: Optional[torch.Tensor], shape, dtype) -> torch.Tensor:
        """Every pipeline stage gets the last stage's tensor (same shape on all stages)."""
        if self.ps.get_pipeline_model_parallel_world_size() == 1:
            return tensor
        if tensor is None:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(
            tensor,
            src=self.ps.get_pipeline_model_parallel_last_rank(),
            group=self.ps.get_pipeline_model_parallel_group(),
        )
        return tensor

    # ------------------------------------------------------------------ forward plumbing
    def _model_forward(self, model, mb: Batch) -> torch.Tensor:
        """Run one model chunk on a micro-batch; returns its output tensor (``[b, s, ...]``, or
        ``[1, T, ...]`` for a packed micro-batch: :meth:`_packed_params`). With context
        parallelism (CP > 1) the chunk sees this CP rank's two chunks of the ids and positions
        (of every sequence of a packed micro-batch: :func:`mcore_rl.megatron.context_parallel.
        split`; Megatron's RoPE slices its frequencies alike) and the last chunk's output goes
        through :meth:`_cp_output`."""
        from mcore_rl.megatron.model import attention_mask, position_ids

        # bf16: the last stage returns bf16 (Float16Module would upcast the whole output, a
        # full-vocabulary fp32 copy of the logits); consumers compute in fp32 themselves.
        kwargs = {"fp32_output": False} if self.megatron_cfg.precision == "bf16" else {}
        router_losses = contextlib.nullcontext()
        cu = mb.get(CU_SEQLENS)
        if cu is not None:
            ids, positions = mb[PACKED_IDS], mb[PACKED_POSITIONS]
            kwargs["packed_seq_params"] = self._packed_params(mb)
        else:
            ids = mb["input_ids"]
            positions = position_ids(*ids.shape, ids.device)
            if self.arch.num_experts is not None:
                kwargs["padding_mask"], router_losses = self._router_losses(model, mb)
        cp = self.ps.get_context_parallel_world_size()
        if cp > 1:  # this rank's two chunks (of every packed sequence)
            rank = self.ps.get_context_parallel_rank()
            ids, positions = (context_parallel.split(t, 1, cp, rank, cu) for t in (ids, positions))
        mask = None if cu is not None else \
            attention_mask(self.megatron_cfg.layer_spec, ids.shape[0], ids.shape[1], ids.device)
        with router_losses:
            out = model(ids, positions, mask, **kwargs)
        if cp > 1 and self._is_output_chunk(model):
            out = self._cp_output(out, mb)
        return out

    def _is_output_chunk(self, model) -> bool:
        """Whether the chunk ``model`` ends the network (its output is the head's)."""
        from megatron.core.utils import unwrap_model

        return bool(unwrap_model(model).post_process)

    def _cp_output(self, output: torch.Tensor, mb: Batch) -> torch.Tensor:
        """Context parallelism: the head output of this CP rank's two sequence chunks ``[b, 2 c,
        ...]`` (of every sequence of a packed micro-batch ``mb``) -> the full width ``[b, S,
        ...]`` (the packed row ``[1, T, ...]``) on every CP rank (:func:`~mcore_rl.megatron.
        context_parallel.gather`, whose backward keeps this rank's slice), so the per-token
        outputs and the loss are computed whole, as at CP = 1. Subclasses whose output is wide
        (the policy's logits) gather something smaller instead."""
        return context_parallel.gather(output, dim=1, group=self.ps.get_context_parallel_group(),
                                       cu_seqlens=mb.get(CU_SEQLENS))

    def _packed_params(self, mb: Batch):
        """Megatron's ``PackedSeqParams(qkv_format='thd')`` of a packed micro-batch
        (``packed_input_ids [1, T]``, :mod:`mcore_rl.data.packing`): ``cu_seqlens`` (int32 ``[n +
        1]``) for attention and RoPE (positions restart in every sequence) and ``max_seqlen``
        (its longest sequence, a host int).

        ``cu_seqlens`` stays where the micro-batch has it (the ``local`` and ``torch`` specs take
        a host copy and move it once), except on the ``transformer_engine`` spec, whose fused
        attention kernels read it on the device (int32): there it is copied to the worker's
        device (measured on an H100: a host ``cu_seqlens`` fails in TE's ``fused_attn_fwd``
        with "CUDAGuardImpl initialized with non-CUDA DeviceType: cpu").

        Context parallelism (CP > 1): every sequence is padded to a multiple of ``2 CP`` right
        after its tokens, the padding part of its sequence in ``cu_seqlens`` (positions count
        on through it), and the worker gives each CP rank chunks ``r`` and ``2 CP - 1 - r`` of
        every sequence (:func:`~mcore_rl.megatron.context_parallel.split`: TE's
        ``thd_get_partitioned_indices``). Megatron's THD RoPE takes ``cu_seqlens_q_padded`` when
        set and divides each length by CP; TE's CP attention on THD needs
        ``cu_seqlens_q_padded`` / ``cu_seqlens_kv_padded`` (the per-rank split: its
        ``attn_forward_func_with_cp`` asserts them; its backends default them to
        ``cu_seqlens_q``). On the TE spec all four fields are the same tensor object, the
        padded one, and ``max_seqlen`` is the longest padded sequence: the padding counts as
        tokens of its sequence, which causal attention never lets a valid token see, so every
        valid token's output is the one without padding (the ``torch`` spec's semantics; what
        NeMo RL's ``_pack_sequences_for_megatron``, verl's ``preprocess_packed_seqs`` and
        recent Megatron-LM's ``pretrain_gpt.forward_step`` pass). The same object keeps TE's
        ``pad_between_seqs`` off (TE 2.18 on tests ``cu_seqlens_q_padded is cu_seqlens_q``,
        without a sync; TE 2.16 and older compare them with ``torch.equal``, a sync), so TE
        takes its path without inter-sequence padding. Unpadded lengths in ``cu_seqlens_q``
        would turn ``pad_between_seqs`` on (no FlashAttention-2; cuDNN skips the padding) to
        save at most ``2 CP - 1`` tokens per sequence; not done.
        """
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = mb[CU_SEQLENS]
        te = self.megatron_cfg.layer_spec == "transformer_engine"
        if te and cu.device != self.device:
            cu = cu.to(device=self.device, dtype=torch.int32, non_blocking=True)
        longest = int(mb[MAX_SEQLEN])  # a CPU tensor: no device sync
        padded = cu if te and self.megatron_cfg.context_parallel_size > 1 else None
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                               max_seqlen_q=longest, max_seqlen_kv=longest)

    def _router_losses(self, model, mb: Batch):
        """``(padding_mask, context)`` of an MoE model's forward on ``mb``: the router losses
        count the loss positions only, and are off for a micro-batch without any
        (:mod:`mcore_rl.megatron.moe`). Megatron splits the mask over the sequence-parallel
        ranks on the first pipeline stage only; later stages get their slice here."""
        from megatron.core.utils import unwrap_model

        from mcore_rl.megatron import moe

        mask = moe.router_padding_mask(mb)
        off = moe.router_losses_off(self.model_config) if bool(mask.all()) else contextlib.nullcontext()
        if self.megatron_cfg.sequence_parallel and not unwrap_model(model).pre_process:
            tp, rank = self.ps.get_tensor_model_parallel_world_size(), self.ps.get_tensor_model_parallel_rank()
            mask = mask.chunk(tp, dim=1)[rank]
        return mask, off

    def _run_schedule(
        self,
        batch: Batch,
        micro_batch_size: int,
        forward_only: bool,
        output_fn: Callable[[torch.Tensor, Batch], Any],
    ) -> List[Any]:
        """Feed ``batch`` through Megatron's pipeline schedule in micro-batches.

        ``output_fn(model_output, microbatch)`` runs on the last stage and returns what Megatron
        calls the loss function's outputs (a 3-tuple when training). Returns the list of the
        per-micro-batch values Megatron stores (last stage; empty on other stages).

        Micro-batches (:func:`~mcore_rl.data.microbatching.make_microbatches`): of
        ``micro_batch_size`` rows, or under :attr:`max_tokens_per_microbatch` when set; each
        carries ``row_index`` (input row, -1 for padding rows). Layout needs met here: widths
        are a multiple of :func:`~mcore_rl.config.families.microbatch_width_multiple` (TP under
        sequence parallelism: Megatron splits the sequence evenly; 2 CP; 8 tokens with FP8);
        the micro-batch count is a multiple of PP with virtual stages (the interleaved
        schedule runs them in groups of PP); micro-batches of different shapes (token budget,
        or a last micro-batch of fewer rows) turn on Megatron's ``variable_seq_lengths`` so pipeline stages exchange each shape,
        except with virtual stages, where the budget makes equal shapes (``uniform_shapes``:
        the interleaved schedule's shape exchange swaps shapes with PP=2).
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        mg = self.megatron_cfg
        interleaved = mg.virtual_pipeline_model_parallel_size is not None
        width_multiple = microbatch_width_multiple(mg)  # SP: TP; CP: 2 CP; FP8: 8 tokens
        if self.sequence_packing:
            mbs = self._packed_microbatches(batch, micro_batch_size, width_multiple)
        else:
            mbs = make_microbatches(
                batch, micro_batch_size, self.max_tokens_per_microbatch,
                width_multiple=width_multiple,
                count_multiple=mg.pipeline_model_parallel_size if interleaved else 1,
                uniform_shapes=interleaved)
        if not forward_only:
            sizes = [computed_tokens(mb) for mb in mbs]
            self._largest_microbatch = max(self._largest_microbatch, max(sizes))
            self._computed_tokens += sum(sizes)
            self._valid_tokens += int(batch["input_lengths"].sum())
        # cu_seqlens stays on the host: Megatron's THD RoPE reads it with .tolist() in every
        # layer (a device copy would sync the stream there); attention copies it once.
        mbs = [{k: v if k in (MAX_SEQLEN, CU_SEQLENS) else self._to_device(v)
                for k, v in mb.items()} for mb in mbs]
        num_mb = len(mbs)
        if not forward_only and self.arch.num_experts is not None:
            from mcore_rl.megatron.moe import router_padding_mask

            self._router_microbatches += sum(not bool(router_padding_mask(mb).all()) for mb in mbs)
        seq_len, rows = mbs[0]["input_ids"].shape[1], mbs[0]["input_ids"].shape[0]
        self.model_config.variable_seq_lengths = shapes_vary(mbs)

        def data_iter() -> Iterator[Batch]:
            return iter(mbs)

        iters = [data_iter() for _ in self.model] if len(self.model) > 1 else data_iter()

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            out = self._model_forward(model, mb)
            return out, lambda output: output_fn(output, mb)

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iters,
            model=self.model,
            num_microbatches=num_mb,
            seq_length=seq_len,
            micro_batch_size=rows,
            forward_only=forward_only,
        )

    def _packed_microbatches(self, batch: Batch, micro_batch_size: int,
                             width_multiple: int) -> List[Batch]:
        """Packed micro-batches of ``batch`` (:func:`~mcore_rl.data.packing.
        make_packed_microbatches`; with CP every sequence padded to ``2 CP``) under
        :attr:`max_tokens_per_microbatch` (or ``micro_batch_size`` x the longest row with its
        padding), as many on this rank as on the DP rank with
        the most (one all-reduce over DP: Megatron's schedule and the gradient all-reduce need
        the same count on every rank)."""
        budget = self.max_tokens_per_microbatch
        multiple = packed_sequence_multiple(self.megatron_cfg)  # CP: every sequence to 2 CP
        if budget is None:
            longest = max(1, int(batch["input_lengths"].max()))
            budget = micro_batch_size * -(-longest // multiple) * multiple
        count = torch.tensor(len(make_packed_microbatches(batch, budget, width_multiple,
                                                          sequence_multiple=multiple)),
                             device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.ps.get_data_parallel_group())
        return make_packed_microbatches(batch, budget, width_multiple, min_count=int(count),
                                        sequence_multiple=multiple)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on this rank's device. On a GPU through pinned host memory and an
        asynchronous copy: a copy from pageable memory blocks the host until the stream has
        run everything queued before it, so each split-step call (:meth:`train_microbatch`)
        would drain the GPU and then wait for its own kernel launches (measured: +15% per
        optimizer step at 8 calls of 2 x 2048 tokens, 1.1B model, H200)."""
        if self.device.type != "cuda":
            return tensor.to(self.device)
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _per_token_forward(self, batch: Batch, micro_batch_size: int,
                           per_token: Callable[[torch.Tensor, Batch], torch.Tensor]) -> torch.Tensor:
        """Forward-only pass of ``batch`` that returns ``per_token(model_output, microbatch)``
        (float32 ``[b, s]``, computed on the last stage) for all rows.

        Returns a float32 CPU tensor ``[B, S]`` (S of the input), 0 past each row's length,
        identical on every rank (broadcast from the last pipeline stage). Collective.
        """
        n, width = batch["input_ids"].shape
        with torch.no_grad():
            outputs = self._run_schedule(
                batch, micro_batch_size, forward_only=True,
                output_fn=lambda out, mb: (out.new_zeros(()), {"per_token": per_token(out, mb),
                                                               ROW_INDEX: mb[ROW_INDEX]}),
            )
        values = None
        trimmed = int(batch["input_lengths"].max())
        if self._is_last_stage():
            values = gather_rows([o["per_token"] for o in outputs], [o[ROW_INDEX] for o in outputs],
                                 n, trimmed).float().contiguous()
        values = self._broadcast_from_last_stage(values, (n, trimmed), torch.float32).cpu()
        values = values * (torch.arange(trimmed)[None, :] < batch["input_lengths"][:, None])
        return torch.nn.functional.pad(values, (0, width - trimmed))

    # ------------------------------------------------------------------ training
    def _loss_output(self, output: torch.Tensor, mb: Batch, loss_fn) -> LossOutput:
        """Turn the model output of a micro-batch into ``(loss_sum, count, metrics)``."""
        raise NotImplementedError

    def memory_stats(self, reset: bool = False) -> Dict[str, int]:
        """This rank's CUDA memory in bytes (``torch.cuda`` caching allocator):
        ``allocated`` and ``reserved`` now, ``max_allocated`` and ``max_reserved`` since the
        last reset (or the start); with ``reset`` the peaks restart from now after they are
        read. All 0 off CUDA. For comparing the planner's prediction
        (:mod:`mcore_rl.megatron.memory`) with a run (``scripts/gpu/memory_check.py``)."""
        if self.device.type != "cuda":
            return {"allocated": 0, "reserved": 0, "max_allocated": 0, "max_reserved": 0}
        out = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
               "max_allocated": torch.cuda.max_memory_allocated(),
               "max_reserved": torch.cuda.max_memory_reserved()}
        if reset:
            torch.cuda.reset_peak_memory_stats()
        return out

    def shutdown(self) -> None:
        parallel.destroy()
        if self.manual_gc_interval:
            gc.enable()

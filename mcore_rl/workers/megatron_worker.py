"""The shared Megatron training worker: model, DDP, optimizer, schedule, train, checkpoints.

One instance lives in each rank of the worker's ``torch.distributed`` world (a Ray actor or a
plain process). The policy worker (and later the value worker) specialise the model output
and what a forward step computes; everything about gradients lives here.

Loss normalization (the exact global mean, whatever the layout). A loss function returns, per
micro-batch, an un-normalized ``loss_sum`` and the ``count`` of valid tokens (token-level loss)
or valid sequences (sequence-level loss). The model's TransformerConfig has
``calculate_per_token_loss=True``, so Megatron's schedule neither divides by the number of
micro-batches nor does DDP average over DP ranks; Megatron's ``finalize_model_grads`` then
all-reduces the summed counts over DP (after broadcasting them from the last pipeline stage)
and scales the gradients by ``1/N``. Clipping in ``optimizer.step()`` sees those scaled
gradients. Metrics are reduced the same way (:meth:`MegatronTrainWorker._reduce_metrics`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import inspect
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from mcore_rl.config.schema import ModelArchConfig, MegatronConfig, OptimizerConfig
from mcore_rl.data.batch import Batch
from mcore_rl.data.microbatching import ROW_INDEX, gather_rows, make_microbatches, shapes_vary
from mcore_rl.data.packing import (CU_SEQLENS, MAX_SEQLEN, PACKED_IDS, PACKED_POSITIONS,
                                   computed_tokens, make_packed_microbatches, padding_fraction)
from mcore_rl.megatron import parallel
from mcore_rl.megatron.offload import StorageOffloader

# What a loss function returns per micro-batch: (loss_sum, count, raw metric sums).
LossOutput = Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]


@dataclasses.dataclass
class _SplitStep:
    """An open split train step (:meth:`MegatronTrainWorker.begin_train_step`).

    ``hooks``: the model config's saved ``(grad_sync_func, no_sync_func,
    finalize_model_grads_func)``. ``num_tokens``: scalar ``torch.int`` (the dtype of Megatron's
    own ``total_num_tokens``), this rank's sum of the loss function's counts (valid tokens or
    sequences; non-zero on the last pipeline stage only). ``outputs``: the raw metric dicts of
    every micro-batch (last stage), in order, for :meth:`MegatronTrainWorker._reduce_metrics`.
    """

    loss_fn: Any
    global_batch_size: int
    micro_batch_size: int
    hooks: Tuple[Any, Any, Any]
    num_tokens: torch.Tensor
    outputs: List[Dict[str, torch.Tensor]]


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


# Optimizer settings that follow the configuration on resume, reported by
# MegatronTrainWorker.load_checkpoint when a checkpoint's differ: name -> key of Megatron's
# OptimizerParamScheduler state (it counts the schedule in samples: optimizer steps x global
# batch size) ...
SCHEDULE_SETTINGS = {
    "lr": "max_lr",
    "min_lr": "min_lr",
    "lr_decay_style": "lr_decay_style",
    "weight_decay": "start_wd",
    "lr_warmup_samples": "lr_warmup_steps",
    "lr_decay_samples": "lr_decay_steps",
}
# ... and -> key of the optimizer's param groups, whose saved copies the optimizer's
# load_state_dict would restore (Megatron keeps each group's peak and final lr there too).
PARAM_GROUP_SETTINGS = {"lr": "max_lr", "min_lr": "min_lr", "adam_betas": "betas", "adam_eps": "eps"}


def _group_settings(group: Dict[str, Any]) -> Dict[str, Any]:
    """The :data:`PARAM_GROUP_SETTINGS` of an optimizer param group (those it has; betas as a
    tuple, whatever container a checkpoint gave back)."""
    return {name: tuple(group[key]) if isinstance(group[key], list) else group[key]
            for name, key in PARAM_GROUP_SETTINGS.items() if key in group}


def requires_device_state(training: bool):
    """Decorator of a GPU-bound public worker method (the offload guard).

    Before the method runs, :meth:`MegatronTrainWorker._check_device_state` raises
    ``RuntimeError`` naming the method and the prepare step the caller skipped when what the
    method needs is offloaded (:meth:`MegatronTrainWorker.offload_after_refit`,
    :meth:`MegatronTrainWorker.offload_before_refit`): the weights for inference
    (``training=False``: ``prepare_for_lp_inference()``), the weights, gradient buffers and
    optimizer state for training (``training=True``: ``prepare_for_training()``). The call then
    never reaches the model, instead of failing inside CUDA on freed memory.
    """

    def decorate(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            self._check_device_state(method.__name__, training)
            return method(self, *args, **kwargs)

        return guarded

    return decorate


class MegatronTrainWorker:
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
        if sequence_packing:  # one RoPE pass per packed micro-batch, not one per sequence
            from mcore_rl.megatron import rope

            rope.install()
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
        """Run one model chunk on a micro-batch; returns its output tensor."""
        from mcore_rl.megatron.model import attention_mask, position_ids

        if PACKED_IDS in mb:
            return self._packed_forward(model, mb)
        ids = mb["input_ids"]
        b, s = ids.shape
        # bf16: the last stage returns bf16 (Float16Module would upcast the whole output, a
        # full-vocabulary fp32 copy of the logits); consumers compute in fp32 themselves.
        kwargs = {"fp32_output": False} if self.megatron_cfg.precision == "bf16" else {}
        router_losses = contextlib.nullcontext()
        if self.arch.num_experts is not None:
            kwargs["padding_mask"], router_losses = self._router_losses(model, mb)
        with router_losses:
            return model(
                ids,
                position_ids(b, s, ids.device),
                attention_mask(self.megatron_cfg.layer_spec, b, s, ids.device),
                **kwargs,
            )

    def _packed_forward(self, model, mb: Batch) -> torch.Tensor:
        """One model chunk on a packed micro-batch (``packed_input_ids [1, T]``): Megatron's
        ``PackedSeqParams(qkv_format='thd')`` carries ``cu_seqlens`` to attention and RoPE
        (positions restart in every sequence). Returns the output ``[1, T, ...]``."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = mb[CU_SEQLENS]
        longest = int(mb[MAX_SEQLEN])  # a CPU tensor: no device sync
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=longest, max_seqlen_kv=longest)
        kwargs = {"fp32_output": False} if self.megatron_cfg.precision == "bf16" else {}
        return model(mb[PACKED_IDS], mb[PACKED_POSITIONS], None, packed_seq_params=params,
                     **kwargs)

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
        are a multiple of TP under sequence parallelism (Megatron splits the sequence evenly);
        the micro-batch count is a multiple of PP with virtual stages (the interleaved
        schedule runs them in groups of PP); micro-batches of different shapes (token budget,
        or a last micro-batch of fewer rows) turn on Megatron's ``variable_seq_lengths`` so pipeline stages exchange each shape,
        except with virtual stages, where the budget makes equal shapes (``uniform_shapes``:
        the interleaved schedule's shape exchange swaps shapes with PP=2).
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        mg = self.megatron_cfg
        interleaved = mg.virtual_pipeline_model_parallel_size is not None
        width_multiple = mg.tensor_model_parallel_size if mg.sequence_parallel else 1
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
        make_packed_microbatches`) under :attr:`max_tokens_per_microbatch` (or
        ``micro_batch_size`` x the longest row), as many on this rank as on the DP rank with
        the most (one all-reduce over DP: Megatron's schedule and the gradient all-reduce need
        the same count on every rank)."""
        budget = self.max_tokens_per_microbatch
        if budget is None:
            budget = micro_batch_size * max(1, int(batch["input_lengths"].max()))
        count = torch.tensor(len(make_packed_microbatches(batch, budget, width_multiple)),
                             device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.ps.get_data_parallel_group())
        return make_packed_microbatches(batch, budget, width_multiple, min_count=int(count))

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

    @requires_device_state(training=True)
    def train(self, batch: Batch, loss_fn, global_batch_size: int, micro_batch_size: int) -> Dict[str, float]:
        """One optimizer step on this DP rank's share of a global batch.

        Args:
            batch: this rank's rows (every TP/PP rank of one DP group gets the same rows).
            loss_fn: callable ``(model_output_values, microbatch) -> (loss_sum, count, metrics)``
                with attributes ``loss_type`` ("token"/"sequence") and ``metric_kinds``.
            global_batch_size: sequences in the global batch (all DP ranks); the LR schedule
                advances by it.
            micro_batch_size: rows per forward/backward.

        Returns:
            metrics, the same on every rank: each loss metric as the exact global mean
            (raw sum over all micro-batches and DP ranks / global count of its kind), plus
            ``grad_norm`` (after scaling, before clipping), ``lr`` (used by this step),
            ``num_valid_tokens``/``num_valid_sequences`` (global sums),
            ``microbatch_tokens_max`` (:meth:`_optimizer_step`); with experts and a router
            loss coefficient set, ``moe_aux_loss`` / ``moe_z_loss``
            (:func:`~mcore_rl.megatron.moe.router_loss_metrics`).

        Raises:
            RuntimeError: a split train step is open (:meth:`begin_train_step`).
        """
        self._refuse_during_split_step("train")
        self._zero_grads()
        outputs = self._run_schedule(
            batch, micro_batch_size, forward_only=False,
            output_fn=lambda out, mb: self._loss_output(out, mb, loss_fn),
        )
        return self._optimizer_step(outputs, loss_fn, global_batch_size)

    # Rows x padded width of the largest training micro-batch since the last _zero_grads (the
    # start of a step): the step's ``microbatch_tokens_max`` metric.
    _largest_microbatch: int = 0
    # Token positions computed (padded or packed) and valid tokens of the step's training
    # micro-batches, this rank: the step's ``padding_fraction`` metric.
    _computed_tokens: int = 0
    _valid_tokens: int = 0

    def _zero_grads(self) -> None:
        """Zero the DDP grad buffers and the optimizer's grads (and the step's largest
        micro-batch). Megatron's ``DistributedDataParallel.zero_grad_buffer`` also resets each
        bucket group (``per_param_grad_ready_counts``, ``is_last_microbatch``) and each
        parameter's ``grad_added_to_main_grad``, so no grad-ready state of one step leaks into
        the next."""
        self._largest_microbatch = 0
        self._computed_tokens = self._valid_tokens = 0
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.arch.num_experts is not None:
            from mcore_rl.megatron.moe import clear_router_losses

            clear_router_losses()
            self._router_microbatches = 0

    def _optimizer_step(self, outputs: List[Dict[str, torch.Tensor]], loss_fn,
                        global_batch_size: int) -> Dict[str, float]:
        """``optimizer.step()`` on finalized gradients (reduced, scaled by ``1/N``), then the
        LR schedule, the ``trainer_version`` bump and the metrics; shared by :meth:`train` and
        :meth:`finish_train_step` so both return the same names and meanings. The lr is read
        after ``optimizer.step()`` and before ``scheduler.step(increment=global_batch_size)``:
        the lr this step used. Metrics: :meth:`_reduce_metrics` plus ``grad_norm``, ``lr``,
        ``update_successful`` (1.0 or 0.0), ``microbatch_tokens_max`` (rows x padded width
        of the step's largest training micro-batch, padding rows included, or its packed length;
        max over DP ranks: at most ``max_tokens_per_microbatch`` when a budget is set, up to the
        TP rounding) and ``padding_fraction`` (padding positions / computed positions of the
        step's training micro-batches, summed over DP ranks)."""
        success, grad_norm, _ = self.optimizer.step()
        if self.megatron_cfg.ddp.overlap_param_gather:
            # The distributed optimizer leaves the all-gather of the updated params to the next
            # forward's pre-hooks; refit export, the reference copy and checkpoints read the
            # params before any forward, so gather them now (Megatron-LM does the same before
            # evaluation and saving: disable_forward_pre_hook(param_sync=True)).
            for m in self.model:
                m.start_param_sync(force_sync=True)
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step(increment=global_batch_size)
        self.trainer_version += 1
        if self.manual_gc_interval and self.trainer_version % self.manual_gc_interval == 0:
            gc.collect()
        metrics = self._reduce_metrics(outputs, loss_fn)
        if self.arch.num_experts is not None:
            from mcore_rl.megatron.moe import router_loss_metrics

            metrics.update(router_loss_metrics(self.model_config, self._router_microbatches,
                                               self.device))
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = float(lr)
        metrics["update_successful"] = float(bool(success))
        largest = torch.tensor(float(self._largest_microbatch), device=self.device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.ps.get_data_parallel_group())
        metrics["microbatch_tokens_max"] = float(largest)
        tokens = torch.tensor([float(self._computed_tokens), float(self._valid_tokens)],
                              dtype=torch.float64, device=self.device)
        dist.all_reduce(tokens, group=self.ps.get_data_parallel_group())
        metrics["padding_fraction"] = padding_fraction(int(tokens[0]), int(tokens[1]))
        return metrics

    def _reduce_metrics(self, outputs: List[Dict[str, torch.Tensor]], loss_fn) -> Dict[str, float]:
        """Sum raw metrics over micro-batches (last stage), all-reduce over DP, broadcast to
        every pipeline stage, then divide each by the global count of its kind; a metric of
        kind ``"max"`` is the maximum over micro-batches and DP ranks instead (0 when none
        reports it)."""
        kinds = loss_fn.metric_kinds
        needed = ["num_valid_tokens", "num_valid_sequences"]
        names = sorted(set(kinds) | set(needed))
        maxima = [n for n in names if kinds.get(n) == "max"]
        sums = [n for n in names if n not in maxima]
        vec = None
        if self._is_last_stage():
            totals = torch.zeros(len(sums), dtype=torch.float64, device=self.device)
            peaks = torch.zeros(len(maxima), dtype=torch.float64, device=self.device)
            for out in outputs:
                for i, n in enumerate(sums):
                    if n in out:
                        totals[i] += out[n].detach().to(torch.float64)
                for i, n in enumerate(maxima):
                    if n in out:
                        peaks[i] = torch.maximum(peaks[i], out[n].detach().to(torch.float64))
            dist.all_reduce(totals, group=self.ps.get_data_parallel_group())
            if maxima:
                dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=self.ps.get_data_parallel_group())
            vec = torch.cat([totals, peaks])
        vec = self._broadcast_from_last_stage(vec, (len(names),), torch.float64)
        raw = dict(zip(sums + maxima, vec.tolist()))
        denominators = {
            "tokens": raw["num_valid_tokens"],
            "sequences": raw["num_valid_sequences"],
            "none": 1.0,
            "max": 1.0,
        }
        default = "tokens" if loss_fn.loss_type == "token" else "sequences"
        out = {}
        for n in names:
            kind = kinds.get(n, default)
            d = denominators[kind]
            out[n] = raw[n] / d if d else 0.0
        return out

    # ------------------------------------------------------------------ split train step
    # One optimizer step fed one micro-batch at a time (a controller that trains while
    # rollouts still arrive), with exactly the gradient and metrics of :meth:`train` on the
    # same rows: begin_train_step, train_microbatch (any number of times, and a different
    # number on each DP rank), finish_train_step; abort_train_step drops an open step.
    _split_step: Optional[_SplitStep] = None  # the open split step, if any
    _router_microbatches = 0  # MoE: this step's micro-batches with loss positions, this rank

    @requires_device_state(training=True)
    def begin_train_step(self, loss_fn, global_batch_size: int, micro_batch_size: int) -> None:
        """Open a split train step.

        Args:
            loss_fn: as in :meth:`train` (``loss_type``, ``metric_kinds``, ``__call__``
                returning ``(loss_sum, count, metrics)``).
            global_batch_size: sequences of the whole step over all DP ranks; the LR schedule
                advances by it in :meth:`finish_train_step`.
            micro_batch_size: rows per forward/backward inside :meth:`train_microbatch`.

        What it does, and why:

        * zeroes the DDP grad buffers (resetting Megatron's per-parameter grad-ready state)
          and the optimizer's grads: the step's gradient is the raw sum of its micro-batches;
        * saves and nulls ``config.grad_sync_func``: the pipeline schedules call it on the
          last micro-batch of every call (the PP>1 "last microbatch" bypass) and would start
          the DP reduction of a partial gradient;
        * saves ``config.no_sync_func`` and sets it to a null context:
          :meth:`train_microbatch` holds ``model.no_sync()`` itself, and DDP's ``no_sync`` is
          not reentrant (leaving it sets ``is_last_microbatch = True``), while the PP=1
          schedule runs its last micro-batch outside its own ``no_sync`` on purpose, to
          trigger the gradient all-reduce;
        * saves and nulls ``config.finalize_model_grads_func``: the schedule calls it after
          every ``forward_backward`` call (DP reduce and ``1/N`` scaling), here it must run
          once, in :meth:`finish_train_step`.

        Raises:
            RuntimeError: a split step is already open (finish or abort it first).
            ValueError: ``global_batch_size`` or ``micro_batch_size`` is below 1.
        """
        self._refuse_during_split_step("begin_train_step")
        if global_batch_size < 1 or micro_batch_size < 1:
            raise ValueError(f"begin_train_step: global_batch_size ({global_batch_size}) and "
                             f"micro_batch_size ({micro_batch_size}) must be >= 1")
        self._zero_grads()
        config = self.model_config
        hooks = (config.grad_sync_func, config.no_sync_func, config.finalize_model_grads_func)
        config.grad_sync_func = None
        config.no_sync_func = contextlib.nullcontext
        config.finalize_model_grads_func = None
        self._split_step = _SplitStep(
            loss_fn=loss_fn,
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            hooks=hooks,
            num_tokens=torch.zeros((), dtype=torch.int, device=self.device),
            outputs=[],
        )

    @requires_device_state(training=True)
    def train_microbatch(self, data: Batch) -> None:
        """Forward and backward ``data`` (this DP rank's rows; every TP/PP rank of one DP
        group gets the same rows) and add its raw gradient to the open step.

        One call of Megatron's pipeline schedule over the rows of ``data`` cut into
        micro-batches of the step's ``micro_batch_size`` (padded with masked rows like
        :meth:`train`), inside ``model.no_sync()`` of every model chunk so no DP reduction
        starts. The count handed to Megatron is a placeholder 1: with
        ``calculate_per_token_loss=True`` (set by the model builder) the schedule then leaves
        the loss unscaled, so the gradients are raw sums; the real count (valid tokens or
        sequences, by the loss type) and the raw metrics are kept by the worker for
        :meth:`finish_train_step`. No collective over DP: DP ranks may call it different
        numbers of times (zero included). :meth:`get_logprobs` (forward only, no grads) may
        run between calls: it leaves the accumulated gradients as they are.

        Raises:
            RuntimeError: no step is open.
            Any exception of the forward, the loss function or the backward, re-raised after
            the step is aborted (:meth:`abort_train_step`: hooks restored, grads zeroed): a
            partial backward cannot be told apart from the earlier micro-batches' gradients.
            With PP > 1 an exception on one stage leaves the other stages waiting in the
            schedule's point-to-point calls.
        """
        step = self._open_split_step("train_microbatch")

        def output_fn(out: torch.Tensor, mb: Batch) -> LossOutput:
            loss_sum, count, metrics = self._loss_output(out, mb, step.loss_fn)
            step.num_tokens += count
            return loss_sum, torch.ones_like(count), metrics

        try:
            with contextlib.ExitStack() as no_sync:
                for m in self.model:
                    no_sync.enter_context(m.no_sync())
                outputs = self._run_schedule(data, step.micro_batch_size, forward_only=False,
                                             output_fn=output_fn)
        except BaseException:
            self._close_split_step(zero_grads=True)
            raise
        step.outputs.extend(outputs)

    @requires_device_state(training=True)
    def finish_train_step(self) -> Dict[str, float]:
        """Reduce and scale the step's gradient once, step the optimizer, close the step.

        Order, and why:

        1. ``start_grad_sync()`` on every chunk only with ``overlap_grad_reduce``: no backward
           hook dispatched the reduction (all ran under ``no_sync``), and ``finish_grad_sync``
           then only waits for it. Without overlap ``finish_grad_sync`` dispatches the
           (synchronous) reduction itself: calling both would reduce twice and scale the
           gradients by the DP size.
        2. The saved ``finalize_model_grads_func`` (Megatron's ``finalize_model_grads``) with
           this rank's count: it reduces the grads over DP, all-reduces the layer-norm grads of
           sequence parallelism and the shared embedding grads of the first and last stages,
           then broadcasts the count from the last pipeline stage, all-reduces it over DP into
           N (valid tokens or sequences of the whole step, by the loss type) and scales the
           gradients by ``1/N`` (``scale_gradients``). That is the call, order and argument of
           :meth:`train`'s schedule, so the gradient equals :meth:`train`'s (scaling before the
           reduction would round differently), and it is scaled before the optimizer, so
           clipping sees the real gradient.
        3. ``optimizer.step()``, the lr read before ``scheduler.step(increment=
           global_batch_size)``, ``trainer_version`` + 1 (:meth:`_optimizer_step`).
        4. The hooks restored and the step closed (also when a step above raised).

        Returns:
            the metrics of :meth:`train` (same names and meanings, the same on every rank),
            each raw metric summed over all micro-batches and DP ranks and divided by the
            global count of its kind from ``loss_fn.metric_kinds`` (tokens, sequences, none;
            the loss type for names it does not list): :meth:`_reduce_metrics`.

        Raises:
            RuntimeError: no step is open (never begun, already finished, or aborted by an
            exception); any exception of the steps above is re-raised after the step is
            aborted (hooks restored, grads zeroed).
        """
        step = self._open_split_step("finish_train_step")
        try:
            for m in self.model:
                if m.ddp_config.overlap_grad_reduce:
                    m.start_grad_sync()
            finalize_model_grads = step.hooks[2]
            finalize_model_grads(self.model, step.num_tokens)
            metrics = self._optimizer_step(step.outputs, step.loss_fn, step.global_batch_size)
        except BaseException:
            self._close_split_step(zero_grads=True)
            raise
        self._close_split_step(zero_grads=False)
        return metrics

    def abort_train_step(self) -> None:
        """Drop the open split step: restore the saved hooks, zero the grad buffers (and the
        grad-ready state, :meth:`_zero_grads`) and the optimizer's grads, forget the counts
        and metrics. The weights, optimizer state, LR schedule and ``trainer_version`` are
        untouched, and the worker is ready for :meth:`train` or a new step at once.
        Idempotent: without an open step it does nothing."""
        if self._split_step is not None:
            self._close_split_step(zero_grads=True)

    def _open_split_step(self, method: str) -> _SplitStep:
        if self._split_step is None:
            raise RuntimeError(
                f"{method}: no split train step is open; call begin_train_step(loss_fn, "
                f"global_batch_size, micro_batch_size) first (a step is closed by "
                f"finish_train_step, abort_train_step, or an exception in train_microbatch or "
                f"finish_train_step)")
        return self._split_step

    def _refuse_during_split_step(self, method: str) -> None:
        if self._split_step is not None:
            raise RuntimeError(f"{method}: a split train step is open (begin_train_step was "
                               f"called); call finish_train_step or abort_train_step first")

    def _close_split_step(self, zero_grads: bool) -> None:
        """Restore the hooks saved by :meth:`begin_train_step` and forget the step."""
        step, self._split_step = self._split_step, None
        config = self.model_config
        config.grad_sync_func, config.no_sync_func, config.finalize_model_grads_func = step.hooks
        if zero_grads:
            self._zero_grads()

    # ------------------------------------------------------------------ offload lifecycle
    # Colocated generation (the rollout engine on the same GPUs): between two training phases
    # the worker's GPU memory is handed to the engine. Order per RL step, by the controller:
    # offload_before_refit -> (refit: get_hf_weights) -> offload_after_refit -> (generation)
    # -> prepare_for_lp_inference -> (get_logprobs ...) -> prepare_for_training -> (train).
    _weights_offloaded: bool = False  # weights off the device (offload_after_refit)
    _train_state_offloaded: bool = False  # grad buffers and optimizer state off the device
    _weights_host: Optional[StorageOffloader] = None
    _optimizer_host: Optional[StorageOffloader] = None

    def _offload_extra_tensors(self) -> List[torch.Tensor]:
        """Device tensors of a subclass that go and come with the weights (a reference copy)."""
        return []

    def _weight_tensors(self) -> List[torch.Tensor]:
        return [p for m in self.model for p in m.parameters()] + self._offload_extra_tensors()

    def _optimizer_tensors(self) -> List[torch.Tensor]:
        """The optimizer's parameters (fp32 main params; the model's own with fp32 precision,
        which then move with the weights instead) and its state tensors on this device."""
        weights = {t.untyped_storage().data_ptr() for t in self._weight_tensors()}
        out = []
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = opt.optimizer
            out += [p for g in inner.param_groups for p in g["params"]]
            out += [v for st in inner.state.values() for v in st.values() if torch.is_tensor(v)]
        return [t for t in out if t.device == self.device
                and t.untyped_storage().data_ptr() not in weights]

    def _check_device_state(self, method: str, training: bool) -> None:
        """The guard of :func:`requires_device_state`; raises ``RuntimeError`` (see there)."""
        if self._weights_offloaded or (training and self._train_state_offloaded):
            what = "weights" if self._weights_offloaded else "gradient buffers and optimizer state"
            prepare = "prepare_for_training()" if training else "prepare_for_lp_inference()"
            raise RuntimeError(f"{method}: the worker's {what} are offloaded from the device "
                               f"(offload_before_refit/offload_after_refit); call {prepare} "
                               f"first")

    def _empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def offload_before_refit(self) -> None:
        """Free the training state before the refit: the DDP gradient buffers (dropped: every
        step zeroes them first; Megatron's ``offload_grad_buffers``) and the optimizer's fp32
        main params and state (to host memory, :class:`~mcore_rl.megatron.offload.
        StorageOffloader`). The weights stay for the refit export. Idempotent.

        Raises:
            RuntimeError: a split train step is open (its accumulated gradients would be lost).
        """
        self._refuse_during_split_step("offload_before_refit")
        if self._train_state_offloaded:
            return
        for m in self.model:
            m.offload_grad_buffers(synchronize=self.device.type == "cuda", empty_cache=False)
        self._optimizer_host = self._optimizer_host or StorageOffloader()
        self._optimizer_host.offload(self._optimizer_tensors())
        self._train_state_offloaded = True
        self._empty_cache()

    def offload_after_refit(self) -> None:
        """After the refit: the weights (and any subclass copy, such as the reference policy)
        to host memory too, so the worker holds no weights, gradients or optimizer state on the
        device (:meth:`offload_before_refit` first if it was not called). Every GPU-bound
        method then raises until a prepare step. Idempotent.

        Raises:
            RuntimeError: a split train step is open.
        """
        self.offload_before_refit()
        if self._weights_offloaded:
            return
        self._weights_host = self._weights_host or StorageOffloader()
        self._weights_host.offload(self._weight_tensors())
        self._weights_offloaded = True
        self._empty_cache()

    def prepare_for_lp_inference(self, keep_train_buffers: bool = False) -> None:
        """Weights back on the device for forward-only calls (logprobs, values, refit).

        Args:
            keep_train_buffers: also bring the gradient buffers and optimizer state back (as
                :meth:`prepare_for_training`), for a training step that follows at once;
                False leaves them off the device, so inference runs with the most free memory.
        """
        if self._weights_offloaded:
            self._weights_host.restore()
            self._weights_offloaded = False
        if keep_train_buffers:
            self.prepare_for_training()

    def prepare_for_training(self) -> None:
        """Weights, gradient buffers (zeroed) and optimizer state back on the device."""
        self.prepare_for_lp_inference()
        if self._train_state_offloaded:
            for m in self.model:
                m.restore_grad_buffers(synchronize=self.device.type == "cuda")
            self._optimizer_host.restore()
            self._train_state_offloaded = False

    # ------------------------------------------------------------------ checkpoints
    def _sharded_state_dict(self, is_loading: bool, with_optimizer: bool = True) -> Dict[str, Any]:
        """Model chunks (``model`` or ``model0..k`` with virtual stages, Megatron's naming) and,
        with ``with_optimizer``, the optimizer state mapped onto them. ``is_loading`` makes
        Megatron create the optimizer state a fresh optimizer does not have yet, so it can be
        loaded into."""
        if len(self.model) == 1:
            state = {"model": self.model[0].module.sharded_state_dict()}
        else:
            state = {f"model{i}": m.module.sharded_state_dict() for i, m in enumerate(self.model)}
        if with_optimizer:
            state["optimizer"] = self.optimizer.sharded_state_dict(state, is_loading=is_loading)
        return state

    def _optimizer_has_state(self) -> bool:
        """Whether the optimizer holds per-parameter state (Adam moments) on any rank: False
        from its (re)build until its first step (a policy frozen during critic warm-up, say).
        Megatron saves no state for such an optimizer but expects it on loading. Collective."""
        local = any(len(st) > 0 for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer])
                    for st in opt.optimizer.state.values())
        flag = torch.tensor([float(local)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    @requires_device_state(training=True)
    def save_checkpoint(self, path: str, async_save: bool = False) -> None:
        """Save model, optimizer and LR schedule with Megatron dist-checkpointing (torch_dist
        format: resharding-capable) into directory ``path``; Megatron writes its
        ``metadata.json`` when the save is complete. Collective: every rank calls it.

        With ``async_save``, Megatron's asynchronous save (``async_sharded_save``, in
        megatron-core since 0.7; its own ``"mcore"`` writer from 0.17 on, where the default
        needs nvidia-resiliency-ext): the tensors are staged on the host and each rank forks a
        writer process; training may go on, and :meth:`finalize_async_save` completes the save.
        """
        from megatron.core import dist_checkpointing

        os.makedirs(path, exist_ok=True)
        has_optimizer_state = self._optimizer_has_state()
        state = self._sharded_state_dict(is_loading=False, with_optimizer=has_optimizer_state)
        state.update(self._extra_sharded_state())
        state["scheduler"] = self.scheduler.state_dict()
        state["trainer_version"] = self.trainer_version
        state["optimizer_has_state"] = has_optimizer_state
        if not async_save:
            dist_checkpointing.save(state, path)
            dist.barrier()
            return
        kwargs = {"async_sharded_save": True}
        if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
            kwargs["async_strategy"] = "mcore"  # megatron-core >= 0.17; "nvrx" needs another package
        self._async_saves.schedule_async_request(dist_checkpointing.save(state, path, **kwargs))

    @functools.cached_property
    def _async_saves(self):
        """Megatron's queue of this rank's asynchronous checkpoint saves."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        return AsyncCallsQueue()

    def finalize_async_save(self, blocking: bool = True) -> bool:
        """Finish the asynchronous saves (:meth:`save_checkpoint` with ``async_save``) whose
        writers are done on every rank (with ``blocking``: all, waiting for them); Megatron
        then writes each one's ``metadata.json``. Returns whether none is left in flight.
        Collective: every rank calls it.

        Raises:
            megatron.core.dist_checkpointing.core.CheckpointingException: a writer failed.
        """
        self._async_saves.maybe_finalize_async_calls(blocking=blocking)
        return self._async_saves.get_num_unfinalized_calls() == 0

    @requires_device_state(training=True)
    def load_checkpoint(self, path: str) -> Dict[str, Tuple[Any, Any]]:
        """Restore what :meth:`save_checkpoint` wrote. A checkpoint saved before the optimizer's
        first step (no optimizer state) restores a fresh optimizer over the loaded weights.
        Collective.

        The LR schedule keeps the checkpoint's progress (samples seen) and takes its shape
        from this worker's configuration, and so do the optimizer's betas and epsilon: the
        ``optimizer.*`` keys can be changed on resume (Megatron's defaults would silently keep
        the checkpoint's values). The Adam moments and step counts are the checkpoint's.

        Returns:
            the settings that differ, ``{name: (checkpoint value, configured value)}`` with
            names from :data:`SCHEDULE_SETTINGS` and :data:`PARAM_GROUP_SETTINGS` (empty when
            none do).

        Raises:
            FileNotFoundError: ``path`` holds no checkpoint.
        """
        from megatron.core import dist_checkpointing

        if not os.path.isdir(path):
            raise FileNotFoundError(f"no checkpoint directory at {path}")
        has_optimizer_state = dist_checkpointing.load_common_state_dict(path).get("optimizer_has_state", True)
        state = self._sharded_state_dict(is_loading=True, with_optimizer=has_optimizer_state)
        state.update(self._extra_sharded_state())
        loaded = dist_checkpointing.load(state, path)
        for key in [k for k in loaded if k.startswith("model")]:
            idx = int(key[5:]) if key != "model" else 0
            self.model[idx].module.load_state_dict(loaded[key])
        changed = {}
        if has_optimizer_state:
            configured = [_group_settings(g) for g in self.optimizer.param_groups]
            self.optimizer.load_state_dict(loaded["optimizer"])
            for group, settings in zip(self.optimizer.param_groups, configured):
                saved = _group_settings(group)
                changed.update({name: (saved.get(name), v) for name, v in settings.items()
                                if saved.get(name) != v})
                group.update({PARAM_GROUP_SETTINGS[name]: v for name, v in settings.items()})
            self._build_scheduler(self.optimizer_cfg)  # at step 0: loading adds the progress
        else:  # fp32 main params copied from the loaded weights, no Adam moments
            self.rebuild_optimizer()
        saved, configured = loaded["scheduler"], self.scheduler.state_dict()
        changed.update({name: (saved[key], configured[key]) for name, key in SCHEDULE_SETTINGS.items()
                        if saved[key] != configured[key]})
        self.scheduler.load_state_dict(saved)
        self.trainer_version = int(loaded["trainer_version"])
        self._load_extra_state(loaded)
        return changed

    def _extra_sharded_state(self) -> Dict[str, Any]:
        """Subclass state saved with the model (for example the reference weights)."""
        return {}

    def _load_extra_state(self, loaded: Dict[str, Any]) -> None:
        pass

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

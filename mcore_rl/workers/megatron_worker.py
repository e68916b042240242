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

import dataclasses
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from mcore_rl.config.schema import ModelArchConfig, MegatronConfig, OptimizerConfig
from mcore_rl.data.batch import Batch, microbatches, select, trim_padding
from mcore_rl.megatron import parallel

# What a loss function returns per micro-batch: (loss_sum, count, raw metric sums).
LossOutput = Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]


def _pad_rows(batch: Batch, multiple: int) -> Batch:
    """Append all-zero rows (masked out: token_mask = sample_mask = 0) so the row count is a
    multiple of ``multiple``: pipeline schedules need equal micro-batch shapes."""
    n = next(iter(batch.values())).shape[0]
    extra = (-n) % multiple
    if extra == 0:
        return batch
    out = {}
    for k, v in batch.items():
        pad = torch.zeros((extra, *v.shape[1:]), dtype=v.dtype, device=v.device)
        if k == "input_lengths":
            pad.fill_(1)
        out[k] = torch.cat([v, pad], dim=0)
    return out


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
    ):
        if device == "cpu":
            torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // max(1, world_size)))
        self.arch = arch
        self.megatron_cfg = megatron
        self.optimizer_cfg = optimizer
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
        )
        from megatron.core import parallel_state as ps

        self.ps = ps
        self.model = self._build_model()
        self._schedule_args = (total_optimizer_steps, global_batch_size)
        self.rebuild_optimizer()
        self.trainer_version = 0

    # ------------------------------------------------------------------ construction
    def _build_output_model(self) -> List[torch.nn.Module]:
        """The model chunks (one per virtual stage), before DDP. Subclasses decide the head."""
        raise NotImplementedError

    def _build_model(self):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        chunks = self._build_output_model()
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

    def rebuild_optimizer(self, lr: Optional[float] = None) -> None:
        """(Re)create the Megatron optimizer and LR schedule over the current weights: fresh
        optimizer state. ``lr`` given: a constant learning rate (a warm-start phase); None:
        the configured optimizer and schedule (``policy.optimizer``)."""
        o = self.optimizer_cfg
        if lr is not None:
            o = dataclasses.replace(o, lr=lr, min_lr=lr, lr_warmup_steps=0, lr_decay_style="constant")
        self._build_optimizer(o, *self._schedule_args)

    def _build_optimizer(self, o: OptimizerConfig, total_optimizer_steps: int, global_batch_size: int) -> None:
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig as MOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
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
        gbs = max(1, global_batch_size)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if o.lr_warmup_steps > 0 else o.lr,
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=o.lr_warmup_steps * gbs,
            lr_decay_steps=max(1, total_optimizer_steps) * gbs,
            lr_decay_style=o.lr_decay_style,
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=max(1, total_optimizer_steps) * gbs,
            wd_incr_style="constant",
        )
        config = get_model_config(self.model[0])
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = [m.no_sync for m in self.model] if len(self.model) > 1 else self.model[0].no_sync
        if self.megatron_cfg.ddp.overlap_grad_reduce:
            config.grad_sync_func = (
                [m.start_grad_sync for m in self.model] if len(self.model) > 1 else self.model[0].start_grad_sync
            )
        self.model_config = config

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
        from mcore_rl.megatron.model import causal_attention_mask, position_ids

        ids = mb["input_ids"]
        b, s = ids.shape
        return model(
            ids,
            position_ids(b, s, ids.device),
            causal_attention_mask(b, s, ids.device),
        )

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
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batch = trim_padding(batch)
        batch = _pad_rows(batch, micro_batch_size)
        mbs = [{k: v.to(self.device) for k, v in mb.items()}
               for mb in microbatches(batch, micro_batch_size)]
        num_mb = len(mbs)
        seq_len = batch["input_ids"].shape[1]

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
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )

    # ------------------------------------------------------------------ training
    def _loss_output(self, output: torch.Tensor, mb: Batch, loss_fn) -> LossOutput:
        """Turn the model output of a micro-batch into ``(loss_sum, count, metrics)``."""
        raise NotImplementedError

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
            ``num_valid_tokens``/``num_valid_sequences`` (global sums).
        """
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run_schedule(
            batch, micro_batch_size, forward_only=False,
            output_fn=lambda out, mb: self._loss_output(out, mb, loss_fn),
        )
        success, grad_norm, _ = self.optimizer.step()
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step(increment=global_batch_size)
        self.trainer_version += 1
        metrics = self._reduce_metrics(outputs, loss_fn)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = float(lr)
        metrics["update_successful"] = float(bool(success))
        return metrics

    def _reduce_metrics(self, outputs: List[Dict[str, torch.Tensor]], loss_fn) -> Dict[str, float]:
        """Sum raw metrics over micro-batches (last stage), all-reduce over DP, broadcast to
        every pipeline stage, then divide each by the global count of its kind."""
        names = sorted(loss_fn.metric_kinds)
        kinds = loss_fn.metric_kinds
        needed = ["num_valid_tokens", "num_valid_sequences"]
        names = sorted(set(names) | set(needed))
        vec = None
        if self._is_last_stage():
            vec = torch.zeros(len(names), dtype=torch.float64, device=self.device)
            for out in outputs:
                for i, n in enumerate(names):
                    if n in out:
                        vec[i] += out[n].detach().to(torch.float64)
            dist.all_reduce(vec, group=self.ps.get_data_parallel_group())
        vec = self._broadcast_from_last_stage(vec, (len(names),), torch.float64)
        raw = dict(zip(names, vec.tolist()))
        denominators = {
            "tokens": raw["num_valid_tokens"],
            "sequences": raw["num_valid_sequences"],
            "none": 1.0,
        }
        default = "tokens" if loss_fn.loss_type == "token" else "sequences"
        out = {}
        for n in names:
            kind = kinds.get(n, default)
            d = denominators[kind]
            out[n] = raw[n] / d if d else 0.0
        return out

    # ------------------------------------------------------------------ checkpoints
    def _sharded_state_dict(self, is_loading: bool) -> Dict[str, Any]:
        """Model chunks (``model`` or ``model0..k`` with virtual stages, Megatron's naming) and
        the optimizer state mapped onto them. ``is_loading`` makes Megatron create the
        optimizer state a fresh optimizer does not have yet, so it can be loaded into."""
        if len(self.model) == 1:
            state = {"model": self.model[0].module.sharded_state_dict()}
        else:
            state = {f"model{i}": m.module.sharded_state_dict() for i, m in enumerate(self.model)}
        state["optimizer"] = self.optimizer.sharded_state_dict(state, is_loading=is_loading)
        return state

    def save_checkpoint(self, path: str, extra_common: Optional[Dict[str, Any]] = None) -> None:
        """Save model, optimizer and LR schedule with Megatron dist-checkpointing (torch_dist
        format: resharding-capable). Collective: every rank calls it."""
        from megatron.core import dist_checkpointing

        os.makedirs(path, exist_ok=True)
        state = self._sharded_state_dict(is_loading=False)
        state.update(self._extra_sharded_state())
        state["scheduler"] = self.scheduler.state_dict()
        state["trainer_version"] = self.trainer_version
        dist_checkpointing.save(state, path)
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote. Collective. Raises ``FileNotFoundError``
        when ``path`` holds no checkpoint."""
        from megatron.core import dist_checkpointing

        if not os.path.isdir(path):
            raise FileNotFoundError(f"no checkpoint directory at {path}")
        state = self._sharded_state_dict(is_loading=True)
        state.update(self._extra_sharded_state())
        loaded = dist_checkpointing.load(state, path)
        for key in [k for k in loaded if k.startswith("model")]:
            idx = int(key[5:]) if key != "model" else 0
            self.model[idx].module.load_state_dict(loaded[key])
        self.optimizer.load_state_dict(loaded["optimizer"])
        self.scheduler.load_state_dict(loaded["scheduler"])
        self.trainer_version = int(loaded["trainer_version"])
        self._load_extra_state(loaded)

    def _extra_sharded_state(self) -> Dict[str, Any]:
        """Subclass state saved with the model (for example the reference weights)."""
        return {}

    def _load_extra_state(self, loaded: Dict[str, Any]) -> None:
        pass

    def shutdown(self) -> None:
        parallel.destroy()

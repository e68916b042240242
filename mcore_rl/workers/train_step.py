"""The training step of :class:`~mcore_rl.workers.megatron_worker.MegatronTrainWorker`, its contract
in one place (docs/design.md, "Conventions" and "Split train-step API"): ``train`` (one optimizer
step on a whole batch through Megatron's schedule) and the split step, ``begin_train_step`` /
``train_microbatch`` / ``finish_train_step`` / ``abort_train_step`` train one optimizer step fed a
micro-batch at a time, with exactly the gradient and metrics of the worker's ``train()`` on the
same rows; Megatron's ``grad_sync_func``, ``no_sync_func`` and ``finalize_model_grads_func`` are
saved, nulled and always restored. A mixin of the worker (it uses the worker's model, optimizer,
schedule and forward plumbing).

Loss normalization (the exact global mean, whatever the layout): a loss function returns, per
micro-batch, an un-normalized ``loss_sum`` and the ``count`` of valid tokens or sequences
(:data:`LossOutput`); with ``calculate_per_token_loss=True`` Megatron's schedule neither divides
by the number of micro-batches nor does DDP average over DP ranks, and ``finalize_model_grads``
all-reduces the counts and scales the gradients by ``1/N`` before clipping.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from mcore_rl.data.batch import Batch
from mcore_rl.data.packing import padding_fraction
from mcore_rl.workers.offload import requires_device_state

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


class TrainStepMixin:
    """The training step of :class:`~mcore_rl.workers.megatron_worker.MegatronTrainWorker`
    (module docstring): ``train`` and the split step, with what both share (zeroing the grads,
    the optimizer step, the metric reduction). Uses the worker's ``model``, ``optimizer``,
    ``scheduler``, ``model_config``, ``_run_schedule``, ``_loss_output`` and layout facts."""

    # ------------------------------------------------------------------ training
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
            output_fn=lambda out, mb: self._counted_once(*self._loss_output(out, mb, loss_fn)),
        )
        return self._optimizer_step(outputs, loss_fn, global_batch_size)

    def _counted_once(self, loss_sum: torch.Tensor, count: torch.Tensor,
                      metrics: Dict[str, torch.Tensor]) -> LossOutput:
        """The loss output with its count kept on context-parallel rank 0 only (0 on the other
        CP ranks). With CP every CP rank computes the whole micro-batch's loss (the per-token
        outputs are gathered to the full width: :mod:`mcore_rl.megatron.context_parallel`) and
        back-propagates it through its own tokens, so the gradients summed over DP x CP are
        the full ones; Megatron's ``finalize_model_grads`` all-reduces the count over the same
        DP x CP group, where each micro-batch's count must appear once. The metrics are reduced
        over DP only (:meth:`_reduce_metrics`) and stay as they are. Without CP: unchanged."""
        if self.ps.get_context_parallel_world_size() > 1 and self.ps.get_context_parallel_rank():
            count = torch.zeros_like(count)
        return loss_sum, count, metrics

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
        every pipeline stage, then divide each by the global count of its kind (0 over a count
        of 0); a metric of kind ``"max"`` is the maximum over micro-batches and DP ranks
        instead (0 when none reports it); a kind that names a metric of kind ``"none"``
        divides by that metric's global sum.

        Raises:
            ValueError: a kind that is none of these."""
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
            if kind in denominators:
                d = denominators[kind]
            elif kinds.get(kind) == "none":
                d = raw[kind]
            else:
                raise ValueError(f"{type(loss_fn).__name__}.metric_kinds[{n!r}] is {kind!r}: "
                                 f"one of tokens, sequences, none, max, or the name of a metric "
                                 f"of kind none")
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
            loss_sum, count, metrics = self._counted_once(*self._loss_output(out, mb, step.loss_fn))
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
            global count of its kind from ``loss_fn.metric_kinds`` (tokens, sequences, none,
            or a count metric's name; the loss type for names it does not list):
            :meth:`_reduce_metrics`.

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

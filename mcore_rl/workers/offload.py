"""The offload lifecycle of :class:`~mcore_rl.workers.megatron_worker.MegatronTrainWorker` (colocated
generation; docs/design.md, "Offload lifecycle"): weights, gradient buffers and optimizer state
handed to the host and back between the training phases, and the guard that refuses a GPU-bound
call while what it needs is offloaded (:func:`requires_device_state`).
A mixin of the worker"""

from __future__ import annotations

import functools
from typing import List, Optional

import torch

from mcore_rl.megatron.offload import StorageOffloader


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


class OffloadLifecycleMixin:
    """The offload lifecycle's methods of :class:`~mcore_rl.workers.megatron_worker.MegatronTrainWorker`
    (module docstring). Uses the worker's ``model``, ``optimizer`` and ``device``."""

    # ------------------------------------------------------------------ offload lifecycle
    # Colocated generation (the rollout engine on the same GPUs): between two training phases
    # the worker's GPU memory is handed to the engine. Order per RL step, by the controller:
    # offload_before_refit -> (refit: get_hf_weights) -> offload_after_refit -> (generation)
    # -> prepare_for_lp_inference -> (get_logprobs ...) -> prepare_for_training -> (train).
    _weights_offloaded: bool = False  # weights off the device (offload_after_refit)
    _train_state_offloaded: bool = False  # grad buffers and optimizer state off the device
    _grads_dropped: bool = False  # grad buffers alone off the device (drop_grad_buffers)
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
        if self._weights_offloaded or (training and (self._train_state_offloaded
                                                     or self._grads_dropped)):
            what = ("weights" if self._weights_offloaded else "gradient buffers and optimizer "
                    "state" if self._train_state_offloaded else "gradient buffers")
            prepare = "prepare_for_training()" if training else "prepare_for_lp_inference()"
            raise RuntimeError(f"{method}: the worker's {what} are offloaded from the device "
                               f"(offload_before_refit/offload_after_refit); call {prepare} "
                               f"first")

    def _empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _drop_grads(self) -> None:
        for m in self.model:
            m.offload_grad_buffers(synchronize=self.device.type == "cuda", empty_cache=False)

    def drop_grad_buffers(self) -> None:
        """Free the DDP gradient buffers alone (Megatron's ``offload_grad_buffers``: dropped,
        not copied, since every step zeroes them first) and return the freed and cached
        blocks to the device (``torch.cuda.empty_cache``), so a colocated engine can wake into
        them; the weights and optimizer state stay (``cluster.offload_train_state=grads``).
        :meth:`prepare_for_training` brings the buffers back, zeroed. Idempotent.

        Raises:
            RuntimeError: a split train step is open (its accumulated gradients would be lost).
        """
        self._refuse_during_split_step("drop_grad_buffers")
        if not (self._grads_dropped or self._train_state_offloaded):
            self._drop_grads()
            self._grads_dropped = True
        self._empty_cache()

    def release_cached_memory(self) -> None:
        """Return the caching allocator's free blocks to the device (``torch.cuda.empty_cache``;
        nothing on CPU): the last training step's activations, freed but still reserved by this
        process. Weights, gradient buffers and optimizer state stay. Called before a colocated
        engine in another process wakes with ``cluster.offload_train_state=false``, whose plan
        counts the policy's resident state, not its train transients, beside the engine."""
        self._empty_cache()

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
        if not self._grads_dropped:
            self._drop_grads()
        self._grads_dropped = False  # now part of the whole training state's offload
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
        if self._grads_dropped:
            for m in self.model:
                m.restore_grad_buffers(synchronize=self.device.type == "cuda")
            self._grads_dropped = False
        if self._train_state_offloaded:
            for m in self.model:
                m.restore_grad_buffers(synchronize=self.device.type == "cuda")
            self._optimizer_host.restore()
            self._train_state_offloaded = False

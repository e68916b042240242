"""Checkpoints of :class:`~mcore_rl.workers.megatron_worker.MegatronTrainWorker`: Megatron's
distributed checkpointing of the model chunks, the optimizer and the LR schedule (synchronous or
asynchronous saves), and the configuration as the source of truth on resume (the settings a
checkpoint's schedule or optimizer groups disagree with are reported). A mixin of the worker"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist
from mcore_rl.workers.offload import requires_device_state

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


def _init_sgd_momentum(opt, config=None) -> None:
    """Zero momentum buffers for the parameters of torch SGD ``opt`` that have none yet, so
    that a checkpoint's buffers can be loaded into them."""
    for group in opt.param_groups:
        for p in group["params"]:
            if len(opt.state[p]) == 0:
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p.data)


def _init_sgd_state_fn(optimizer) -> None:
    """Megatron builds SGD (momentum ``sgd_momentum``) without the ``init_state_fn`` that
    loading its sharded state calls (``'NoneType' object is not callable`` on resuming an SGD
    run after its first step): give each of ``optimizer``'s SGD optimizers with momentum
    :func:`_init_sgd_momentum`. Others are left as they are."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if (getattr(opt, "init_state_fn", False) is None and isinstance(inner, torch.optim.SGD)
                and any(g.get("momentum", 0) for g in inner.param_groups)):
            opt.init_state_fn = _init_sgd_momentum


class CheckpointMixin:
    """The checkpoint methods of :class:`~mcore_rl.workers.megatron_worker.MegatronTrainWorker`
    (module docstring). Uses the worker's ``model``, ``optimizer``, ``scheduler`` and
    ``optimizer_cfg``; subclasses add state through ``_extra_sharded_state`` /
    ``_load_extra_state``."""

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
            if is_loading:
                _init_sgd_state_fn(self.optimizer)
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

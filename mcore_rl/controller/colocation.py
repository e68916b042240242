"""Colocation: the policy and the rollout backend taking turns on the same GPUs.

With ``cluster.colocate_generation`` the rollout engine runs on the policy's GPUs, so between
phases one side frees its device memory for the other: the policy through its offload
lifecycle (``MegatronTrainWorker.offload_before_refit``, ``offload_after_refit``,
``prepare_for_lp_inference``, ``prepare_for_training``), the backend through its own hooks
(:meth:`GenerationBackend.prepare_for_refit`, :meth:`~GenerationBackend.prepare_for_generation`,
:meth:`~GenerationBackend.offload`: vLLM's wake-up and sleep). Order per RL step:

1. :meth:`Colocation.refit`: the policy's training state leaves the device
   (``offload_before_refit``); the backend takes back its weight memory; the backend's refit
   channel runs (:meth:`GenerationBackend.refit`); the policy's weights leave too
   (``offload_after_refit``), unless the backend decodes with them
   (``shares_policy_weights``); the backend takes back its decoding memory.
2. generation; then :meth:`Colocation.rollout_done`: a backend that decodes with the policy's
   own weights (the megatron decoder's KV cache and CUDA graphs, in the policy's processes) frees
   its memory at once, before the rewards, logprobs and training.
3. :meth:`Colocation.prepare_for_lp_inference` / :meth:`Colocation.prepare_for_training`:
   the backend frees its memory (once), the policy comes back as far as the next call needs.

With ``offload_train_state`` ``"false"`` (``cluster.offload_train_state`` resolved to false:
the policy's training state and the engine's awake memory fit the GPU together) the policy
never moves: in step 1 it only returns its allocator's cached blocks (the last step's
activations: ``release_cached_memory``) when the engine lives in processes of its own, since
the plan counts the policy's resident state, not its train transients, beside the awake
engine; no policy call in step 3; the backend still frees its memory before logprobs and
training. With
``"grads"`` only the policy's gradient buffers leave, dropped without a copy
(``drop_grad_buffers`` before the refit; ``prepare_for_training`` brings them back zeroed):
the weights and optimizer state stay, so no hand-over moves bytes over PCIe.

:meth:`Colocation.prepare_for_generation` hands the device back to the backend without a refit
(after a checkpoint save; at the end of an RL step that trained no policy: PPO's critic
warm-up), so the next generation finds it awake, as after step 1. Without colocation nothing moves and :meth:`refit` is the
backend's refit alone. The controller calls only these; which side moves is decided here.
"""

from __future__ import annotations

import time
from typing import Dict

from mcore_rl.generation.base import GenerationBackend
from mcore_rl.workers.interfaces import PolicyAPI


class Colocation:
    """The device hand-over between a policy and a rollout backend.

    Args:
        policy: the policy's :class:`~mcore_rl.distributed.worker_group.DataParallelGroup`
            (its ``call`` reaches every rank).
        backend: the rollout backend.
        enabled: ``cluster.colocate_generation``; False makes every method but :meth:`refit` a
            no-op.
        offload_train_state: ``cluster.offload_train_state`` resolved
            (:func:`mcore_rl.megatron.memory.offload_train_state_decision`): what of the
            policy leaves the device while the backend holds it: ``"true"`` (or True) all of
            it, ``"grads"`` its gradient buffers, ``"false"`` (or False) nothing (module
            docstring).

    Raises:
        ValueError: ``offload_train_state`` is none of those.
    """

    MODES = ("true", "grads", "false")

    def __init__(self, policy, backend: GenerationBackend, enabled: bool,
                 offload_train_state="true"):
        if isinstance(offload_train_state, bool):
            offload_train_state = str(offload_train_state).lower()
        if offload_train_state not in self.MODES:
            raise ValueError(f"Colocation: offload_train_state must be one of {self.MODES} "
                             f"(cluster.offload_train_state resolved), got "
                             f"{offload_train_state!r}")
        self.policy = policy
        self.backend = backend
        self.enabled = enabled
        self.offload_train_state = offload_train_state
        self._backend_on_device = True  # a fresh engine holds its memory

    @property
    def _moves_all(self) -> bool:
        return self.offload_train_state == "true"

    def _release_cache(self) -> bool:
        """With ``"false"`` and an engine in processes of its own: the policy's cached
        allocator blocks back to the device (module docstring); whether it called."""
        if self.offload_train_state != "false" or self.backend.shares_policy_weights:
            return False
        self.policy.call(PolicyAPI).release_cached_memory()
        return True

    def _policy_yields(self) -> None:
        """The policy off the device, except the weights the backend decodes with (its
        gradient buffers alone with ``"grads"``, its cached blocks alone with ``"false"``)."""
        if self.offload_train_state == "grads":
            self.policy.call(PolicyAPI).drop_grad_buffers()
        self._release_cache()
        if not self._moves_all:
            return
        policy = self.policy.call(PolicyAPI)
        if self.backend.shares_policy_weights:
            policy.offload_before_refit()
        else:
            policy.offload_after_refit()

    def _backend_yields(self) -> None:
        if self._backend_on_device:
            self.backend.offload()
            self._backend_on_device = False

    def refit(self) -> Dict[str, float]:
        """The backend's refit from the policy (:meth:`GenerationBackend.refit`), colocated in
        the order of the module docstring; after it the backend holds the device. Returns the
        backend's stats and, colocated, the seconds of each hand-over: ``refit/offload_train_s``
        (the policy's gradients and optimizer state leave), ``refit/wake_weights_s``,
        ``refit/transfer_s`` (the backend's refit itself), ``refit/offload_weights_s``,
        ``refit/wake_kv_s`` (the backend takes back its decoding memory); with
        ``offload_train_state`` ``"grads"`` ``refit/offload_train_s`` is the gradient buffers'
        drop and there is no ``refit/offload_weights_s``; with ``"false"`` the policy stays
        and neither ``offload_*`` is there (``refit/release_cache_s`` instead, where the
        engine lives in processes of its own)."""
        if not self.enabled:
            return self.backend.refit(self.policy)
        times, start = {}, time.perf_counter()

        def lap(name: str) -> None:
            nonlocal start
            now = time.perf_counter()
            times[f"refit/{name}_s"] = now - start
            start = now

        if self._moves_all:
            self.policy.call(PolicyAPI).offload_before_refit()
            lap("offload_train")
        elif self.offload_train_state == "grads":
            self.policy.call(PolicyAPI).drop_grad_buffers()
            lap("offload_train")
        elif self._release_cache():
            lap("release_cache")
        self.backend.prepare_for_refit()
        self._backend_on_device = True
        lap("wake_weights")
        stats = self.backend.refit(self.policy)
        lap("transfer")
        if self._moves_all:
            if not self.backend.shares_policy_weights:
                self.policy.call(PolicyAPI).offload_after_refit()
            lap("offload_weights")
        self.backend.prepare_for_generation()
        lap("wake_kv")
        return {**stats, **times}

    def prepare_for_generation(self) -> None:
        """Colocated: the policy leaves the device (as after a refit), the backend takes it
        back, with the weights of its last refit (a step without refit: the policy did not
        change). A backend that discarded its weights while it slept (``needs_refit``: vLLM
        ``generation.vllm.sleep_level=2``) gets them again by a whole :meth:`refit` instead
        (the policy's weights are those of the last refit)."""
        if self.enabled and self.backend.needs_refit:
            self.refit()
        elif self.enabled:
            self._policy_yields()
            self.backend.prepare_for_refit()
            self.backend.prepare_for_generation()
            self._backend_on_device = True

    def rollout_done(self) -> None:
        """Colocated, after the step's rollout is generated (nothing decodes again before the
        next refit): a backend that decodes with the policy's weights
        (``shares_policy_weights``: the megatron decoder) frees its buffers now, so they do
        not sit in the policy's processes through the rewards and the logprob phase (the
        memory plan's ``logprobs`` and ``train`` count none of them). Freeing them costs only
        the next generation's allocation, which the hand-over before logprobs or training
        would cause anyway. Other backends (vLLM engines in processes of their own, whose
        sleep moves memory and takes time) yield at that hand-over, as before."""
        if self.enabled and self.backend.shares_policy_weights:
            self._backend_yields()

    def prepare_for_lp_inference(self) -> None:
        """Colocated: the backend frees the device; the policy's weights come back (its
        training state stays off; with ``"grads"`` or ``"false"`` the weights never left)."""
        if self.enabled:
            self._backend_yields()
            if self._moves_all:
                self.policy.call(PolicyAPI).prepare_for_lp_inference()

    def prepare_for_training(self) -> None:
        """Colocated: the backend frees the device; the policy's weights, gradient buffers and
        optimizer state come back (with ``"grads"`` the gradient buffers; with ``"false"``
        nothing was off)."""
        if self.enabled:
            self._backend_yields()
            if self.offload_train_state != "false":
                self.policy.call(PolicyAPI).prepare_for_training()

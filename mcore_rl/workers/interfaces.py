"""The public methods of the workers, as :class:`typing.Protocol` s: what a controller or a
rollout backend may call on a worker group.

A worker group forwards a call by name to every rank's worker (the workers run in processes
or Ray actors of their own; :mod:`mcore_rl.distributed.worker_group`). A caller names the
method through these protocols instead of a string: ``policy.call(PolicyAPI).get_hf_weights()``
or ``policy.gather_rows(PolicyAPI).get_logprobs(batch, micro_batch_size)``. The group's typed
proxy (:class:`~mcore_rl.distributed.worker_group.TypedCalls`) checks the name against the
protocol once, at attribute access, so a misspelled or removed method fails there, before
anything is sent, with an error naming the protocol and its methods; and a reader finds every
call of a worker method by its name. ``tests/test_worker_interfaces.py`` checks that every
method of a protocol exists on its worker class with the protocol's parameters.

- :class:`WorkerAPI`: what every hosted worker answers (``layout``, ``shutdown``).
- :class:`TrainWorkerAPI`: what every Megatron worker (:class:`MegatronTrainWorker`) has:
  layout, optimizer, the training step and the split step, the offload lifecycle,
  checkpoints, Hugging Face export.
- :class:`PolicyAPI`: the policy (:class:`~mcore_rl.workers.policy.PolicyWorker`): logprobs,
  the reference policy, decoding (the megatron backend), refit export.
- :class:`ValueAPI`: the critic (:class:`~mcore_rl.workers.value.ValueWorker`): values, the
  backbone from the policy.
- :class:`RewardModelAPI`: the reward model (:class:`~mcore_rl.workers.reward_model.
  RewardModelWorker`): last-token scores.
- :class:`GenerationWorkerAPI`: a rollout engine's process of the hf backend in processes of
  its own (:class:`mcore_rl.generation.remote.GenerationWorker`).
- :class:`VLLMEngineAPI`: a vLLM engine's process (:class:`mcore_rl.generation.vllm.VLLMEngine`).

The bodies are ``...``: the workers' own docstrings document the behaviour.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, Union

from mcore_rl.data.batch import Batch


class WorkerAPI(Protocol):
    """What every worker a group hosts answers: ``layout()`` (the group's start probe: at
    least the worker's ``rank``) and ``shutdown()``."""

    def layout(self) -> Dict[str, Any]: ...

    def shutdown(self) -> None: ...


class TrainWorkerAPI(WorkerAPI, Protocol):
    """Every Megatron worker's public methods (:class:`MegatronTrainWorker`, its
    mixins in ``train_step.py``, ``offload.py``, ``checkpointing.py``)."""

    def rebuild_optimizer(self, lr: Optional[float] = None) -> None: ...

    def train(self, batch: Batch, loss_fn: Any, global_batch_size: int,
              micro_batch_size: int) -> Dict[str, float]: ...

    def begin_train_step(self, loss_fn: Any, global_batch_size: int,
                         micro_batch_size: int) -> None: ...

    def train_microbatch(self, data: Batch) -> None: ...

    def finish_train_step(self) -> Dict[str, float]: ...

    def abort_train_step(self) -> None: ...

    def drop_grad_buffers(self) -> None: ...

    def release_cached_memory(self) -> None: ...

    def offload_before_refit(self) -> None: ...

    def offload_after_refit(self) -> None: ...

    def prepare_for_lp_inference(self, keep_train_buffers: bool = False) -> None: ...

    def prepare_for_training(self) -> None: ...

    def save_checkpoint(self, path: str, async_save: bool = False) -> None: ...

    def finalize_async_save(self, blocking: bool = True) -> bool: ...

    def load_checkpoint(self, path: str) -> Dict[str, Tuple[Any, Any]]: ...

    def get_hf_weights(self) -> Optional[Dict[str, Any]]: ...

    def memory_stats(self, reset: bool = False) -> Dict[str, int]: ...


class PolicyAPI(TrainWorkerAPI, Protocol):
    """The policy worker's public methods (:class:`~mcore_rl.workers.policy.PolicyWorker`)."""

    def get_logprobs(self, batch: Batch, micro_batch_size: int) -> Any: ...

    def get_reference_logprobs(self, batch: Batch, micro_batch_size: int) -> Any: ...

    def set_reference_to_current(self) -> None: ...

    def generate(self, prompts: List[List[int]], first_row: int, seed: int, greedy: bool, *,
                 decoder: Callable, cfg: Any, eos_token_id: Union[int, List[int]],
                 pad_token_id: int, max_total_length: int,
                 row_sink: Any = None) -> list: ...

    def release_decoder(self) -> None: ...

    def send_hf_weights(self, sender: Any) -> int: ...


class ValueAPI(TrainWorkerAPI, Protocol):
    """The critic worker's public methods (:class:`~mcore_rl.workers.value.ValueWorker`)."""

    def get_values(self, batch: Batch, micro_batch_size: int) -> Any: ...

    def load_backbone(self, hf_state_dict: Dict[str, Any]) -> None: ...


class RewardModelAPI(TrainWorkerAPI, Protocol):
    """The reward-model worker's public methods
    (:class:`~mcore_rl.workers.reward_model.RewardModelWorker`)."""

    def get_scores(self, batch: Batch, micro_batch_size: int) -> Any: ...


class GenerationWorkerAPI(WorkerAPI, Protocol):
    """A process of the hf engine run apart (``generation.num_workers``;
    :class:`mcore_rl.generation.remote.GenerationWorker`)."""

    def update_weights(self, weights: Dict[str, Any], version: int) -> None: ...

    def generate(self, prompts: List[List[int]], seed: int, greedy: bool, group_size: int,
                 first_row: int, stop_token_ids: Optional[List[int]] = None
                 ) -> Tuple[int, list]: ...


class VLLMEngineAPI(WorkerAPI, Protocol):
    """A vLLM engine's process (:class:`mcore_rl.generation.vllm.VLLMEngine`)."""

    def generate(self, prompts: List[List[int]], seeds: List[int], budgets: List[int],
                 greedy: bool, eos_token_id: Union[int, List[int]]) -> Tuple[int, list]: ...

    def load_weights(self, transport: Dict[str, Any], version: int) -> None: ...

    def device_uuids(self) -> List[str]: ...

    def linear_weights(self, prefix: str) -> Dict[str, Any]: ...

    def sleep(self) -> None: ...

    def wake_up(self, tags: Optional[List[str]] = None) -> None: ...

"""The typed worker interfaces (``mcore_rl/workers/interfaces.py``) and the worker groups'
typed proxies (:class:`~mcore_rl.distributed.worker_group.TypedCalls`): a misspelled method
fails at attribute access, before anything is sent, naming the protocol and its methods; a
typed call sends what the call by name sends; every method of a protocol exists on its worker
class with the protocol's parameters; the controller and the rollout backends name no worker
method by a string."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from mcore_rl.distributed.worker_group import DataParallelGroup, TypedCalls, api_methods, typed
from mcore_rl.workers.interfaces import (GenerationWorkerAPI, PolicyAPI, RewardModelAPI,
                                         TrainWorkerAPI, ValueAPI, VLLMEngineAPI, WorkerAPI)

ROOT = Path(__file__).resolve().parents[1]


class RecordingGroup:
    """A stand-in of a two-rank worker group (one DP rank each) that records the calls sent."""

    def __init__(self):
        self.sent = []

    @property
    def call(self):
        return typed(self._call)

    def _call(self, method, *args, **kwargs):
        self.sent.append((method, args, kwargs))
        if method == "layout":
            return [{"dp_rank": r, "dp_size": 2} for r in range(2)]
        return [f"{method} answer"] * 2


def test_a_misspelled_method_fails_at_once_naming_the_protocol():
    inner = RecordingGroup()
    policy = DataParallelGroup(inner)
    inner.sent.clear()
    proxy = policy.call(PolicyAPI)
    with pytest.raises(AttributeError, match=r"call\(PolicyAPI\)\.get_logprob: PolicyAPI has no "
                                             r"method 'get_logprob' .*get_logprobs"):
        proxy.get_logprob
    with pytest.raises(AttributeError, match="ValueAPI has no method 'get_logprobs'"):
        policy.gather_rows(ValueAPI).get_logprobs
    with pytest.raises(AttributeError, match="no method '_call'"):
        proxy._call
    assert inner.sent == []  # nothing reached a worker


def test_a_typed_call_sends_what_the_call_by_name_sends():
    inner = RecordingGroup()
    policy = DataParallelGroup(inner)
    assert policy.call(PolicyAPI).rebuild_optimizer(0.5) == policy.call("rebuild_optimizer", 0.5)
    assert inner.sent[-2:] == [("rebuild_optimizer", (0.5,), {})] * 2
    proxy = policy.call(TrainWorkerAPI)
    assert proxy.abort_train_step is proxy.abort_train_step  # resolved once
    with pytest.raises(TypeError, match=r"the arguments go to the method"):
        policy.call(PolicyAPI, 0.5)
    with pytest.raises(TypeError, match="a worker protocol"):
        TypedCalls(dict, print)


def test_protocols_list_their_methods_with_their_bases():
    assert {"layout", "shutdown"} <= api_methods(TrainWorkerAPI)
    assert api_methods(TrainWorkerAPI) < api_methods(PolicyAPI)
    assert "get_values" in api_methods(ValueAPI) and "get_values" not in api_methods(PolicyAPI)
    assert api_methods(WorkerAPI) == {"layout", "shutdown"}


def _parameters(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("api, worker", [
    (PolicyAPI, "mcore_rl.workers.policy:PolicyWorker"),
    (ValueAPI, "mcore_rl.workers.value:ValueWorker"),
    (RewardModelAPI, "mcore_rl.workers.reward_model:RewardModelWorker"),
    (GenerationWorkerAPI, "mcore_rl.generation.remote:GenerationWorker"),
    (VLLMEngineAPI, "mcore_rl.generation.vllm:VLLMEngine"),
])
def test_each_worker_has_its_protocols_methods(api, worker):
    """Same names, parameters (kinds and defaults) as the worker's methods: a method renamed
    or changed on one side fails here."""
    from mcore_rl.config.registry import load

    cls = load(worker)
    for name in sorted(api_methods(api)):
        assert hasattr(cls, name), f"{cls.__name__} has no method {name} of {api.__name__}"
        method = inspect.unwrap(getattr(cls, name))
        assert _parameters(method) == _parameters(getattr(api, name)), (cls.__name__, name)


# A worker method named by a string at a call of a worker group (.call("name", ...), ...).
_BY_NAME = re.compile(r"\.(call|call_async|call_each|call_each_async|call_sharded|call_per_dp|"
                      r"call_per_dp_async|gather_rows)\(\s*[\"']")


@pytest.mark.parametrize("package", ["controller", "generation"])
def test_callers_name_worker_methods_through_the_protocols(package):
    found = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
             for path in sorted((ROOT / "mcore_rl" / package).rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if _BY_NAME.search(line) and not line.lstrip().startswith(("#", "``", "Face"))
             and "``" not in line]
    assert not found, "\n".join(found)

"""Placement of worker groups: the plan (which groups share GPUs, how much of a GPU each rank
takes), and the plan made real on a local Ray cluster that declares 4 GPUs it does not have
(Ray only counts them: each actor sees the GPU ids Ray assigned it)."""

from __future__ import annotations

import os
import sys

import pytest

from mcore_rl.config.schema import FP8_BLOCK_SCALES_ENV, ClusterConfig
from mcore_rl.distributed.placement import Placement, config_plan, plan_placement, with_env_vars

# What this module saw of Transformer Engine's variable when it was imported: in a worker
# process of EnvProbe, whether the group's environment came before the worker's module.
AT_IMPORT = os.environ.get(FP8_BLOCK_SCALES_ENV)


class GpuProbe:
    """A worker that reports the GPUs Ray gave its actor."""

    def __init__(self, rank, **_):
        self.rank = rank

    def layout(self):
        return {"rank": self.rank}

    def gpu_ids(self):
        import ray

        return [str(i) for i in ray.get_gpu_ids()]

    def fail(self):
        raise ValueError("a method that raises")

    def exit(self):
        import os

        os._exit(1)

    def shutdown(self):
        pass


class EnvProbe:
    """A worker that reports Transformer Engine's variable at its module's import and at its
    construction."""

    def __init__(self, rank, **_):
        self.at_init = os.environ.get(FP8_BLOCK_SCALES_ENV)

    def seen(self):
        return AT_IMPORT, self.at_init, os.environ.get("LOCAL_RANK")

    def shutdown(self):
        pass


def test_a_process_group_has_its_environment_before_the_worker_module(monkeypatch):
    """make_group's env reaches every rank's process before the worker's module is imported
    there (Transformer Engine reads its variables at import; spawn used to unpickle the class,
    importing its module, before the process set env_per_rank)."""
    monkeypatch.delenv(FP8_BLOCK_SCALES_ENV, raising=False)
    placement = Placement(config_plan(ClusterConfig(num_workers=2), {"policy": 2}, {}),
                          use_ray=False, gpus=False)
    group = placement.make_group("policy", EnvProbe, {}, env={FP8_BLOCK_SCALES_ENV: "1"})
    try:
        assert group.call("seen") == [("1", "1", None)] * 2
    finally:
        group.shutdown()
    group = placement.make_group("policy", EnvProbe, {})
    try:
        assert group.call("seen") == [(None, None, None)] * 2
    finally:
        group.shutdown()


def test_ray_actors_get_the_environment_in_their_runtime_env(monkeypatch):
    """Under Ray, make_group's env is each actor's runtime_env env_vars (merged with any
    runtime_env of the options; no Ray cluster needed: the group is replaced)."""
    assert with_env_vars({"num_gpus": 1}, {}) == {"num_gpus": 1}
    assert with_env_vars({"num_gpus": 1}, {"A": "1"}) == {
        "num_gpus": 1, "runtime_env": {"env_vars": {"A": "1"}}}
    options = {"runtime_env": {"pip": ["x"], "env_vars": {"A": "0", "B": "2"}}}
    assert with_env_vars(options, {"A": "1"}) == {
        "runtime_env": {"pip": ["x"], "env_vars": {"A": "1", "B": "2"}}}
    assert options["runtime_env"]["env_vars"]["A"] == "0"  # the options given stay as they were
    from mcore_rl.distributed import worker_group

    made = {}
    monkeypatch.setattr(worker_group, "RayWorkerGroup",
                        lambda cls, size, kwargs, actor_options, **_: made.update(
                            options=actor_options))
    placement = Placement(config_plan(ClusterConfig(num_workers=2), {"policy": 2}, {}),
                          use_ray=False, gpus=False)
    placement.use_ray = True  # on the CPU the actor options need no Ray
    placement.make_group("policy", EnvProbe, {}, env={FP8_BLOCK_SCALES_ENV: "0"})
    assert made["options"] == [{"num_gpus": 0, "num_cpus": 0, "runtime_env": {
        "env_vars": {FP8_BLOCK_SCALES_ENV: "0"}}}] * 2
    placement.make_group("policy", EnvProbe, {})
    assert made["options"] == [{"num_gpus": 0, "num_cpus": 0}] * 2


def test_plan_shares_or_separates_gpus():
    ppo = {"policy": 4, "value": 4}
    colocated = plan_placement(ppo, [["value", "policy"]])
    assert colocated.pools == (4,) and colocated.num_gpus == 4
    assert [colocated.gpu_index("value", r) for r in range(4)] == [0, 1, 2, 3]
    assert {s.gpu_fraction for s in colocated.groups.values()} == {0.5}
    separate = plan_placement(ppo)
    assert separate.pools == (4, 4) and separate.num_gpus == 8
    assert [separate.gpu_index("value", r) for r in range(4)] == [4, 5, 6, 7]
    assert {s.gpu_fraction for s in separate.groups.values()} == {1.0}

    def cluster(**kw):
        return ClusterConfig(num_workers=4, **kw)

    assert config_plan(cluster(), ppo, {}) == colocated
    assert config_plan(cluster(placement="separate"), ppo, {}) == separate
    # an engine group of its own: on the policy's GPUs with colocate_generation
    engine = config_plan(cluster(placement="separate", colocate_generation=True), ppo, {"engine": 2})
    assert engine.pools == (4, 4)
    assert engine.groups["engine"].pool == engine.groups["policy"].pool == 0
    assert engine.groups["engine"].gpu_fraction == 0.5 and engine.groups["value"].pool == 1
    assert config_plan(cluster(), {"policy": 4}, {"engine": 2}).pools == (4, 2)
    with pytest.raises(ValueError, match=r"unknown groups \['critic'\]"):
        plan_placement(ppo, [["policy", "critic"]])
    with pytest.raises(ValueError, match=r"already in another set \['policy'\]"):
        plan_placement(ppo, [["policy", "value"], ["policy"]])
    with pytest.raises(ValueError, match="need >= 1 rank"):
        plan_placement({"policy": 0})
    with pytest.raises(ValueError, match="cluster.placement must be one of colocated, separate"):
        config_plan(cluster(placement="spread"), ppo, {})


class RayTPEngine:
    """Stands in for a vLLM engine of TP > 1 under Ray (:class:`mcore_rl.generation.vllm.
    VLLMEngine` with ``ray_executor``): takes its executor backend as the engine does, then
    places its TP workers as vLLM's Ray executor does (``vllm/v1/executor/ray_executor.py``
    ``_init_workers_ray``): in the actor's own placement group, at the bundles of
    ``VLLM_RAY_BUNDLE_INDICES``, ``VLLM_RAY_PER_WORKER_GPUS`` of a GPU each, no CPU."""

    def __init__(self, rank, vllm, ray_executor=None, **_):
        import os

        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from mcore_rl.generation.vllm import executor_backend

        self.rank = rank
        self.backend = executor_backend(vllm.tensor_parallel_size, ray_executor[rank])
        self.visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        pg = ray.util.get_current_placement_group()
        share = float(os.environ["VLLM_RAY_PER_WORKER_GPUS"])
        self.workers = [
            ray.remote(num_cpus=0, num_gpus=share)(GpuProbe).options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=int(b))).remote(rank=t)
            for t, b in enumerate(os.environ["VLLM_RAY_BUNDLE_INDICES"].split(","))]

    def layout(self):
        return {"rank": self.rank}

    def placed(self):
        """The backend, this actor's GPUs and CUDA_VISIBLE_DEVICES, and each worker's GPU."""
        import ray

        return (self.backend, [str(i) for i in ray.get_gpu_ids()], self.visible,
                [ray.get(w.gpu_ids.remote())[0] for w in self.workers])

    def shutdown(self):
        pass


@pytest.fixture(scope="module")
def fake_gpu_ray():
    ray = pytest.importorskip("ray")
    ray.shutdown()  # an earlier test's cluster has no GPUs
    ray.init(num_cpus=8, num_gpus=4, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # GpuProbe for the actors
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("mode", ["colocated", "separate"])
def test_ray_places_ppo_groups(fake_gpu_ray, mode):
    ray = fake_gpu_ray
    plan = config_plan(ClusterConfig(num_workers=2, placement=mode), {"policy": 2, "value": 2}, {})
    placement = Placement(plan, use_ray=True, gpus=True)
    groups = {name: placement.make_group(name, GpuProbe, {}) for name in ("policy", "value")}
    try:
        gpus = {name: [ids[0] for ids in g.call("gpu_ids")] for name, g in groups.items()}
        assert all(len(set(ids)) == 2 for ids in gpus.values())  # one GPU per rank
        if mode == "colocated":
            assert gpus["policy"] == gpus["value"]  # rank r of both on the same GPU
        else:
            assert not set(gpus["policy"]) & set(gpus["value"])
        assert ray.available_resources().get("GPU", 0) == 4 - plan.num_gpus
    finally:
        for g in groups.values():
            g.shutdown()
        placement.shutdown()


def test_too_few_gpus_is_one_clear_error(fake_gpu_ray):
    plan = config_plan(ClusterConfig(num_workers=4, placement="separate"), {"policy": 4, "value": 4}, {})
    with pytest.raises(RuntimeError, match=r"needs 8 GPUs \(policy 4 x 1 \+ value 4 x 1; "
                                           r"cluster.placement.*the Ray cluster has 4"):
        Placement(plan, use_ray=True, gpus=True)


def test_a_dead_actor_fails_its_calls_as_gone(fake_gpu_ray):
    """On Ray, as with plain processes (tests/test_worker_groups.py): an actor that dies fails
    its pending and later calls with WorkerError.gone naming its rank (the streaming loop
    drops that generation process and requeues its prompt groups); a method that raises is not
    "gone"; the other ranks go on."""
    from mcore_rl.distributed.worker_group import WorkerError

    placement = Placement(config_plan(ClusterConfig(num_workers=2), {"policy": 2}, {}),
                          use_ray=True, gpus=False)
    group = placement.make_group("policy", GpuProbe, {})
    try:
        with pytest.raises(WorkerError, match="a method that raises") as err:
            group.call("fail")
        assert err.value.gone == set()
        dying = group.call_async("exit", ranks=[1])
        later = group.call_async("layout", ranks=[1])
        for f in (dying, later):
            with pytest.raises(WorkerError, match=r"\[rank 1\]") as err:
                f.result(timeout=120)
            assert err.value.gone == {1}
        assert group.call_async("layout", ranks=[0]).result() == [{"rank": 0}]
    finally:
        group.shutdown()
        placement.shutdown()


@pytest.mark.parametrize("colocate", [True, False])
def test_ray_places_tensor_parallel_engine_workers_on_their_plan_gpus(fake_gpu_ray, monkeypatch, colocate):
    """vLLM engines of TP 2 under Ray (VLLMGenerationBackend._start_engines, the engine replaced
    by RayTPEngine): engine e's worker t on the GPU of rank e * tp + t of the plan, which is
    policy rank e * tp + t's GPU when colocated (the CUDA IPC refit pairs them by GPU) and a GPU
    of the engines' own otherwise; the engine actor holds no GPU; the reservation adds up."""
    import mcore_rl.generation.vllm as vllm_module
    from mcore_rl.config.schema import VLLMConfig

    ray = fake_gpu_ray
    monkeypatch.setattr(vllm_module, "VLLMEngine", RayTPEngine)
    n, tp = (2, 2) if colocate else (1, 2)
    policy_ranks = 4 if colocate else 2
    vllm = VLLMConfig(num_engines=n, tensor_parallel_size=tp)
    plan = config_plan(ClusterConfig(num_workers=policy_ranks, colocate_generation=colocate),
                       {"policy": policy_ranks}, {vllm_module.GROUP: n * tp})
    placement = Placement(plan, use_ray=True, gpus=True)
    backend = object.__new__(vllm_module.VLLMGenerationBackend)
    backend.vllm = vllm
    policy = placement.make_group("policy", GpuProbe, {})
    engines = backend._start_engines({"vllm": vllm}, placement)
    try:
        policy_gpus = [ids[0] for ids in policy.call("gpu_ids")]
        placed = engines.call("placed")
        assert [p[:3] for p in placed] == [("ray", [], None)] * n
        workers = [gpu for p in placed for gpu in p[3]]
        assert len(set(workers)) == n * tp
        if colocate:
            assert workers == policy_gpus
        else:
            assert not set(workers) & set(policy_gpus)
        assert ray.available_resources().get("GPU", 0) == 0  # 4 GPUs: every share taken
    finally:
        engines.shutdown()
        policy.shutdown()
        placement.shutdown()

"""Placement: which GPUs each worker group of a run takes, and which groups share them.

A run has worker groups (the policy; PPO's value; a rollout engine in processes of its own),
each of some ranks, every rank a GPU's worth of work. ``cluster.placement`` decides how the
training groups share GPUs:

- ``colocated`` (default): PPO's policy and value on the same GPUs, rank ``r`` of each on GPU
  ``r``, each taking ``1/k`` of it (k groups sharing; Ray's fractional GPUs): the run needs
  ``cluster.num_workers`` GPUs;
- ``separate``: every group on GPUs of its own: ``2 x cluster.num_workers`` for PPO.

``cluster.colocate_generation`` puts a backend's own worker groups
(:meth:`GenerationBackend.worker_groups`) on the policy's GPUs too.

The plan (:func:`plan_placement`, pure) is a list of pools, each a Ray placement group of one
bundle ``{"GPU": 1, "CPU": 1}`` per GPU (strategy ``PACK``: as few nodes as possible, so a
group's ranks fill a node before the next), and for each group its pool, each rank's bundle and
its share of the GPU. :class:`Placement` realizes it: on Ray, the placement groups and each
actor's options; without Ray (one host), each process's GPU (``LOCAL_RANK``); on the CPU there
is nothing to reserve (actors and processes take no resources).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Collection, Dict, List, Mapping, Optional, Sequence, Tuple

from mcore_rl.config.checks import check_value
from mcore_rl.config.schema import ClusterConfig


@dataclasses.dataclass(frozen=True)
class GroupSlots:
    """Where one group's ranks go.

    Attributes:
        pool: index of its pool in :attr:`PlacementPlan.pools`.
        bundles: rank ``r``'s bundle (GPU) in that pool.
        gpu_fraction: each rank's share of its GPU (1 / the groups sharing the pool).
    """

    pool: int
    bundles: Tuple[int, ...]
    gpu_fraction: float


@dataclasses.dataclass(frozen=True)
class PlacementPlan:
    """Pools of GPUs and each group's slots in them.

    Attributes:
        pools: GPUs (bundles) per pool.
        groups: group name -> :class:`GroupSlots`.
    """

    pools: Tuple[int, ...]
    groups: Dict[str, GroupSlots]

    @property
    def num_gpus(self) -> int:
        """GPUs the run reserves."""
        return sum(self.pools)

    def gpu_index(self, group: str, rank: int) -> int:
        """Rank ``rank`` of ``group``'s GPU among all the run's GPUs (pools in order): its
        device index on a single host."""
        slots = self.groups[group]
        return sum(self.pools[:slots.pool]) + slots.bundles[rank]


def plan_placement(sizes: Mapping[str, int], shared: Sequence[Collection[str]] = ()) -> PlacementPlan:
    """The placement of groups of ``sizes`` ranks (name -> ranks).

    Args:
        sizes: every group, in the order its pool is made.
        shared: sets of groups that share GPUs: one pool of ``max(size)`` GPUs, rank ``r`` of
            each on GPU ``r``, each rank ``1/len(set)`` of it. Any other group gets a pool of
            its own, a whole GPU per rank.

    Raises:
        ValueError: a size below 1, or a shared set naming an unknown group or a group already
            in another set.
    """
    bad = {n: s for n, s in sizes.items() if s < 1}
    if bad:
        raise ValueError(f"plan_placement: groups need >= 1 rank, got {bad}")
    set_of: Dict[str, Tuple[str, ...]] = {}
    for names in shared:
        unknown = [n for n in names if n not in sizes]
        taken = [n for n in names if n in set_of]
        if unknown or taken:
            raise ValueError(f"plan_placement: shared set {sorted(names)}: unknown groups "
                             f"{unknown}, groups already in another set {taken}")
        members = tuple(n for n in sizes if n in names)
        set_of.update({n: members for n in members})
    pools: List[int] = []
    groups: Dict[str, GroupSlots] = {}
    for name in sizes:  # a pool per group or shared set, in the order of its first group
        if name in groups:
            continue
        members = set_of.get(name, (name,))
        for n in members:
            groups[n] = GroupSlots(len(pools), tuple(range(sizes[n])), 1.0 / len(members))
        pools.append(max(sizes[n] for n in members))
    return PlacementPlan(tuple(pools), groups)


def config_plan(cluster: ClusterConfig, training: Mapping[str, int],
                generation: Mapping[str, int]) -> PlacementPlan:
    """The plan of a run: ``training`` groups (the policy first) shared by
    ``cluster.placement``, ``generation`` groups (a backend's own) on the policy's GPUs with
    ``cluster.colocate_generation``, else on GPUs of their own.

    Raises:
        ConfigError: ``cluster.placement`` is not one of
            :data:`~mcore_rl.config.schema.PLACEMENTS`.
    """
    check_value("cluster.placement", cluster.placement)
    policy = next(iter(training))
    with_policy = list(training) if cluster.placement == "colocated" else [policy]
    if cluster.colocate_generation:
        with_policy += list(generation)
    return plan_placement({**training, **generation}, [with_policy] if len(with_policy) > 1 else [])


def with_env_vars(options: Mapping[str, Any], env: Mapping[str, str]) -> Dict[str, Any]:
    """Ray actor ``options`` whose ``runtime_env`` also sets ``env`` (its ``env_vars`` merged,
    ``env`` winning; the rest of a ``runtime_env`` kept): Ray sets them in the actor's worker
    process before the actor's class is loaded there. ``options`` as they are (a copy) when
    ``env`` is empty."""
    options = dict(options)
    if env:
        runtime_env = dict(options.get("runtime_env") or {})
        runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **env}
        options["runtime_env"] = runtime_env
    return options


class Placement:
    """A plan made real: reserves the GPUs and builds worker groups on them.

    Args:
        plan: the :class:`PlacementPlan`.
        use_ray: Ray actors (``ray.init(address=ray_address)`` here if Ray is not initialized
            yet) or plain processes on this host.
        gpus: reserve GPUs (``cluster.device`` is cuda); False: nothing is reserved.
        ray_address: ``cluster.ray_address``.
        dump_dir: where the processes of the groups it builds write their Python stacks on
            :data:`~mcore_rl.distributed.worker_group.DUMP_SIGNAL` (the hang watchdog's
            ``<run.output_dir>/hang``); None: nowhere.

    Raises:
        RuntimeError: the Ray cluster (or, without Ray, this host) has fewer GPUs than the plan
            needs; the message names ``cluster.placement`` and ``cluster.num_workers``.
    """

    def __init__(self, plan: PlacementPlan, use_ray: bool, gpus: bool,
                 ray_address: Optional[str] = None, dump_dir: Optional[str] = None):
        self.plan = plan
        self.dump_dir = dump_dir
        self.use_ray = use_ray
        self.gpus = gpus
        self._placement_groups: List[Any] = []
        if use_ray:
            import ray

            if not ray.is_initialized():
                ray.init(address=ray_address, include_dashboard=False, log_to_driver=True,
                         ignore_reinit_error=True)
            if gpus:
                self._check_gpus(int(ray.cluster_resources().get("GPU", 0)), "the Ray cluster")
                from ray.util.placement_group import placement_group

                self._placement_groups = [placement_group([{"GPU": 1, "CPU": 1}] * n, strategy="PACK")
                                          for n in plan.pools]
                ray.get([pg.ready() for pg in self._placement_groups])
        elif gpus:
            import torch

            self._check_gpus(torch.cuda.device_count(), "this host")

    def _check_gpus(self, available: int, where: str) -> None:
        if available < self.plan.num_gpus:
            need = " + ".join(f"{n} {len(s.bundles)} x {s.gpu_fraction:g}"
                              for n, s in self.plan.groups.items())
            raise RuntimeError(
                f"the run needs {self.plan.num_gpus} GPUs ({need}; cluster.placement, "
                f"cluster.num_workers) but {where} has {available}: lower cluster.num_workers "
                f"or set cluster.placement=colocated")

    def actor_options(self, group: str, rank: int, gpu: bool = True) -> Dict[str, Any]:
        """Ray options of rank ``rank`` of ``group``'s actor: its GPU share and CPU (the same
        fraction of the bundle's CPU) in its bundle; on the CPU, no resources. ``gpu=False``:
        in the bundle without a GPU share (an actor whose own Ray actors take the GPUs: a
        tensor-parallel vLLM engine's workers)."""
        if not self.gpus:
            return {"num_gpus": 0, "num_cpus": 0}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        slots = self.plan.groups[group]
        return {"num_gpus": slots.gpu_fraction if gpu else 0, "num_cpus": slots.gpu_fraction,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self._placement_groups[slots.pool],
                    placement_group_bundle_index=slots.bundles[rank])}

    def bundle_nodes(self, group: str) -> Optional[List[str]]:
        """The Ray node id of each rank of ``group``'s bundle (where Ray put it: ``PACK`` fills
        a node before the next but does not promise which bundles share one); None without
        placement groups (no Ray, or the CPU)."""
        if not self._placement_groups:
            return None
        from ray.util.placement_group import placement_group_table

        slots = self.plan.groups[group]
        nodes = placement_group_table(self._placement_groups[slots.pool])["bundles_to_node_id"]
        return [nodes[b] for b in slots.bundles]

    def make_group(self, group: str, worker_cls, kwargs: Dict[str, Any],
                   env: Optional[Mapping[str, str]] = None):
        """The worker group ``group`` of the plan: ``worker_cls(**kwargs, rank=...,
        world_size=..., master_addr=..., master_port=...)`` per rank, placed
        (:class:`~mcore_rl.distributed.worker_group.RayWorkerGroup` or
        :class:`~mcore_rl.distributed.worker_group.ProcessWorkerGroup`).

        Args:
            env: environment variables of every rank's process, set before the worker's module
                is imported (Transformer Engine's: :func:`mcore_rl.megatron.te.
                te_environment`): a Ray actor's ``runtime_env`` (:func:`with_env_vars`), a
                process's ``env_per_rank`` (with its ``LOCAL_RANK`` on GPUs).
        """
        from mcore_rl.distributed.worker_group import ProcessWorkerGroup, RayWorkerGroup

        size, env = len(self.plan.groups[group].bundles), dict(env or {})
        if self.use_ray:
            return RayWorkerGroup(worker_cls, size, kwargs,
                                  [with_env_vars(self.actor_options(group, r), env)
                                   for r in range(size)],
                                  name=group, dump_dir=self.dump_dir)
        per_rank = [dict(env, **({"LOCAL_RANK": str(self.plan.gpu_index(group, r))}
                                 if self.gpus else {})) for r in range(size)]
        return ProcessWorkerGroup(worker_cls, size, kwargs,
                                  env_per_rank=per_rank if any(per_rank) else None, name=group,
                                  dump_dir=self.dump_dir)

    def shutdown(self) -> None:
        """Release the placement groups (after the groups on them are shut down)."""
        if self._placement_groups:
            from ray.util.placement_group import remove_placement_group

            for pg in self._placement_groups:
                remove_placement_group(pg)
            self._placement_groups = []

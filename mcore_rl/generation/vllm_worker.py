"""The receiving end of a refit, run inside vLLM's worker processes.

:class:`RefitWorkerExtension` is handed to vLLM as ``worker_extension_cls``: vLLM mixes it into
its worker class, and :meth:`vllm.LLM.collective_rpc` calls its methods on every worker of an
engine (every tensor-parallel rank). Weights arrive by Hugging Face name in buckets: flat
``uint8`` buffers holding several tensors at aligned offsets, described by :data:`Entry` lists
(:func:`pack_bucket` writes one, :func:`unpack_bucket` reads one). Three transports carry a
bucket's bytes:

- host memory: a file in ``/dev/shm`` mapped by the sender and the workers (CPU engines);
- CUDA IPC: a GPU buffer of the policy rank on the same GPU, opened in place by the worker
  (engines on the policy's GPUs: every policy rank holds the full tensors);
- NCCL: a broadcast from the policy's rank 0 to every engine worker (engines on GPUs of their
  own), the bucket's entries sent ahead over the group's TCP store.

Every worker loads the full tensors through the model's own ``load_weights`` (vLLM fuses and
shards them: q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``, TP slices), inside vLLM's
layerwise reload (``initialize_layerwise_reload`` ... ``finalize_layerwise_reload``), which
re-runs each layer's post-load processing (on CPU the weights are repacked for the CPU kernels;
plain ``load_weights`` after start-up would leave the packed copies stale; an FP8 engine,
``generation.vllm.quantization=fp8``, quantizes each layer's bf16 weights again with vLLM's own
op) and copies the result into the storage the engine already had (captured CUDA graphs stay
valid). The GPU transports
ran on H100s (bench/RESULTS.md) and are not run in this repository's tests (CPU).
"""

from __future__ import annotations

import pickle
from typing import Any, Dict, Iterable, Iterator, List, Set, Tuple

import torch

# One tensor of a bucket: (HF name, dtype name as in torch, e.g. "float32", shape, byte offset).
Entry = Tuple[str, str, Tuple[int, ...], int]
_ALIGN = 64  # byte alignment of each tensor in a bucket (any dtype's view of it is aligned)


def bucket_layout(tensors: Iterable[Tuple[str, torch.Tensor]]) -> Tuple[List[Entry], int]:
    """Entries of ``(name, tensor)`` pairs packed one after another at ``_ALIGN``-byte offsets,
    and the bucket's size in bytes."""
    entries, offset = [], 0
    for name, t in tensors:
        entries.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return entries, offset


def pack_bucket(buffer: torch.Tensor, tensors: List[Tuple[str, torch.Tensor]]) -> List[Entry]:
    """Copy ``tensors`` into ``buffer`` (flat ``uint8``, at least :func:`bucket_layout`'s size,
    on any device); returns their entries."""
    entries, _ = bucket_layout(tensors)
    for (_, t), view in zip(tensors, unpack_bucket(buffer, entries)):
        view[1].copy_(t)
    return entries


def unpack_bucket(buffer: torch.Tensor, entries: List[Entry]) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into ``buffer`` (flat ``uint8``) for ``entries``."""
    for name, dtype, shape, offset in entries:
        dt = getattr(torch, dtype)
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dt).element_size()
        yield name, buffer[offset:offset + nbytes].view(dt).view(shape)


class RefitWorkerExtension:
    """Refit methods on every vLLM worker of an engine (names prefixed ``mcore_rl_`` so they
    cannot clash with vLLM's own worker methods). Sequence: :meth:`mcore_rl_begin_refit`, then
    buckets by one transport, then :meth:`mcore_rl_finish_refit`."""

    def mcore_rl_begin_refit(self) -> None:
        """Open a refit: the model's layers wait for their weights (vLLM layerwise reload)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        model = self.model_runner.get_model()
        initialize_layerwise_reload(model)
        self._mcore_rl_loaded: Set[str] = set()
        # The parameters a refit must write: the model's checkpoint format, which the reload
        # has put back (meta tensors). Those its layers' processing makes (an FP8 layer's
        # weight_scale) are not among them.
        self._mcore_rl_expected = {n for n, _ in model.named_parameters()}

    def _mcore_rl_load(self, tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        model = self.model_runner.get_model()
        tensors = [(name, t.to(self.device)) for name, t in tensors]
        self._mcore_rl_loaded |= set(model.load_weights(iter(tensors)) or ())
        # Tied embeddings: the model's load_weights skips lm_head (it shares the embedding's
        # parameter), so the reload would put back lm_head's old kernel state (on CPU a packed
        # copy of the old weights). Loading the embedding into lm_head too re-processes it.
        if getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False):
            for name, t in tensors:
                if name == "model.embed_tokens.weight" and hasattr(model, "lm_head"):
                    param = model.lm_head.weight
                    param.weight_loader(param, t)

    def mcore_rl_receive(self, transport: Dict[str, Any]) -> None:
        """Load every bucket of a refit by ``transport``: ``"host"``, the host-memory files
        ``transport["buckets"]`` (``(path, nbytes, entries)`` each); ``"cuda_ipc"`` or
        ``"nccl"`` (:func:`mcore_rl.generation.vllm.RefitSender.receiver_spec`), until the
        sender's end mark."""
        if transport["kind"] == "host":
            for path, nbytes, entries in transport["buckets"]:
                buffer = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
                self._mcore_rl_load(unpack_bucket(buffer, entries))
        elif transport["kind"] == "cuda_ipc":
            self._mcore_rl_receive_ipc(transport)
        else:
            self._mcore_rl_receive_nccl(transport)

    def mcore_rl_device_uuid(self) -> str:
        """This worker's GPU (CUDA IPC pairs it with the policy rank on the same GPU)."""
        return device_uuid(self.device)

    def _mcore_rl_receive_ipc(self, transport: Dict[str, Any]) -> None:
        import zmq

        sock = zmq.Context.instance().socket(zmq.REP)
        sock.setsockopt(zmq.RCVTIMEO, transport["timeout_ms"])
        sock.bind(transport["addresses"][transport["first_worker"] + self.rank])
        try:
            while True:
                try:
                    msg = pickle.loads(sock.recv())
                except zmq.Again:
                    raise RuntimeError(
                        f"refit over CUDA IPC: no bucket within {transport['timeout_ms'] / 1000:.0f} s "
                        f"from the policy rank on this worker's GPU ({device_uuid(self.device)}); "
                        f"colocated engines (cluster.colocate_generation) must sit on the policy's "
                        f"GPUs") from None
                if msg is None:
                    break
                rebuild, args, entries = msg
                args = list(args)
                args[6] = self.device.index  # the same GPU, as this process numbers it
                self._mcore_rl_load(unpack_bucket(rebuild(*args), entries))
                torch.cuda.synchronize()
                sock.send(b"ok")
            sock.send(b"ok")
        finally:
            sock.close(linger=0)

    def _mcore_rl_receive_nccl(self, transport: Dict[str, Any]) -> None:
        group, comm = nccl_group(transport, transport["first_worker"] + self.rank + 1, self.device)
        while True:
            entries = group.broadcast_obj(None, src=0)
            if entries is None:
                break
            buffer = torch.empty(entries[1], dtype=torch.uint8, device=self.device)
            comm.broadcast(buffer, src=0, stream=torch.cuda.current_stream())
            torch.cuda.synchronize()
            self._mcore_rl_load(unpack_bucket(buffer, entries[0]))

    def mcore_rl_finish_refit(self) -> List[str]:
        """Close the refit (layers process what they received; a layer that got nothing keeps
        its previous weights). Returns the model's parameters no tensor was loaded into."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self.model_runner.get_model()
        finalize_layerwise_reload(model, self.vllm_config.model_config)
        names = {n for n, _ in model.named_parameters()} & self._mcore_rl_expected
        return sorted(names - self._mcore_rl_loaded)

    @torch.no_grad()
    def mcore_rl_linear_weights(self, prefix: str) -> Dict[str, torch.Tensor]:
        """The weights this worker's linear layers under ``prefix`` compute with, as vLLM's
        own kernels apply them: each layer applied (without bias) to the identity matrix in the
        model's dtype, so an FP8 layer's weight comes back dequantized (its FP8 values times
        its scale) whatever layout its kernel keeps. Returns ``{module name: float32 [out,
        in]}`` on the host: this worker's TP shard; fused layers as vLLM fuses them
        (``qkv_proj``: q, k, v rows; ``gate_up_proj``: gate, up). For checks (a refit reached
        the layers: scripts/gpu/vllm_fp8.py, tests/test_vllm.py), not the run."""
        from vllm.model_executor.layers.linear import LinearBase

        model = self.model_runner.get_model()
        dtype = self.vllm_config.model_config.dtype
        out = {}
        for name, module in model.named_modules():
            if name.startswith(prefix) and isinstance(module, LinearBase):
                eye = torch.eye(module.input_size_per_partition, dtype=dtype, device=self.device)
                out[name] = module.quant_method.apply(module, eye).t().float().cpu()
        return out


_NCCL_GROUPS: Dict[str, Any] = {}


def nccl_group(transport: Dict[str, Any], rank: int, device: torch.device):
    """The refit's NCCL group as this process's ``rank`` (0: the policy's rank 0; 1..N: the
    engine workers), built once per address and kept: vLLM's ``StatelessProcessGroup`` (a TCP
    store at ``transport["host"]:transport["port"]``, for the bucket entries) and a
    ``PyNcclCommunicator`` on ``device`` (for the bytes). Keyed by the sender's tag: a sender
    made anew (engines died) is a new group even where the OS hands out the old port again."""
    key = transport["tag"]
    if key not in _NCCL_GROUPS:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=transport["host"], port=transport["port"],
                                             rank=rank, world_size=transport["world_size"])
        _NCCL_GROUPS[key] = (group, PyNcclCommunicator(group, device=device))
    return _NCCL_GROUPS[key]


def device_uuid(device: torch.device) -> str:
    """The physical identity of a CUDA device (the same in every process, whatever its
    ``CUDA_VISIBLE_DEVICES`` numbering)."""
    return str(torch.cuda.get_device_properties(device).uuid)

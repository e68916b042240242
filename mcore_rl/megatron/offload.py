"""Move the memory of a set of tensors to host memory and back, keeping every view valid.

The unit is the tensor's storage, not the tensor: Megatron's DDP and distributed optimizer
hold parameters and gradients as views into flat buffers (``param_data``, ``grad_data``, the
optimizer's ``main_grad`` and shard views). Replacing ``param.data`` would cut those views
off from their buffers, so an optimizer step would no longer reach the model. Resizing the
storage to 0 frees the device memory while the tensor objects and their views stay; restoring
resizes it back and copies the bytes in, so every view sees its old values again. This is what
Megatron-Core itself does for its grad and param buffers
(``_ParamAndGradBuffer.offload_to_cpu`` / ``reload_from_cpu``), applied to any tensor set.
"""

from __future__ import annotations

from typing import Iterable, List

import torch


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor ``[storage.nbytes()]`` over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StorageOffloader:
    """Host copies of the storages of a tensor set, with their device memory freed meanwhile.

    ``offload(tensors)`` copies each distinct storage (tensors sharing one are moved once) to
    host memory (pinned when the storage is on CUDA, so the copies run at PCIe/NVLink-C2C
    speed) and frees its device memory (``UntypedStorage.resize_(0)``); ``restore()`` puts
    the same bytes back. Host buffers are kept and reused by the next offload of storages of
    the same sizes (pinned allocation is slow). While offloaded, any read of the tensors is
    undefined: callers guard their methods.

    Raises:
        RuntimeError: ``offload`` while already offloaded, or ``restore`` when not offloaded.
    """

    def __init__(self):
        self._storages: List[torch.UntypedStorage] = []
        self._host: List[torch.Tensor] = []
        self._offloaded = False  # also for an empty set (an optimizer before its first step)

    @property
    def offloaded(self) -> bool:
        """True between :meth:`offload` and :meth:`restore`."""
        return self._offloaded

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Move the distinct non-empty storages of ``tensors`` to host memory and free them.

        Returns the bytes moved (the device memory freed, before the caching allocator's own
        bookkeeping)."""
        if self.offloaded:
            raise RuntimeError("StorageOffloader.offload: already offloaded; restore() first")
        seen, storages = set(), []
        for t in tensors:
            s = t.untyped_storage()
            if s.nbytes() > 0 and s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                storages.append(s)
        sizes = [s.nbytes() for s in storages]
        if [h.numel() for h in self._host] != sizes:
            self._host = [torch.empty(n, dtype=torch.uint8,
                                      pin_memory=s.device.type == "cuda")
                          for s, n in zip(storages, sizes)]
        for s, host in zip(storages, self._host):
            host.copy_(_bytes_view(s), non_blocking=True)
        for device in {s.device for s in storages}:
            _sync(device)
        for s in storages:
            s.resize_(0)
        self._storages = storages
        self._offloaded = True
        return sum(sizes)

    def restore(self) -> int:
        """Reallocate every offloaded storage and copy its bytes back. Returns the bytes moved."""
        if not self.offloaded:
            raise RuntimeError("StorageOffloader.restore: nothing is offloaded")
        for s, host in zip(self._storages, self._host):
            s.resize_(host.numel())
            _bytes_view(s).copy_(host, non_blocking=True)
        for device in {s.device for s in self._storages}:
            _sync(device)
        storages, self._storages = self._storages, []
        self._offloaded = False
        return sum(s.nbytes() for s in storages)

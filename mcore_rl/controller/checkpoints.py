"""Checkpoints of a run: atomic saves of every worker group with the controller's state,
``latest`` as the newest complete checkpoint, pruning, and resuming with a fallback.

Layout: ``<run_dir>/checkpoints/step_<N>/`` holds one Megatron dist checkpoint per worker group
(``policy/``, ``value/``: written by
:meth:`~mcore_rl.workers.megatron_worker.MegatronTrainWorker.save_checkpoint`), the controller's
``controller.json`` (the RL step, the prompt sampler's state, ...), where the controller has
tensors to keep (the streaming loop's finished, untrained rollouts) ``controller.pt``
(``torch.save``), and ``manifest.json``.

A save is atomic: everything is written under ``step_<N>.tmp/``; once every group has finished
(with ``checkpoint.async_save``, once Megatron's background writers have), ``manifest.json``
(every file with its size in bytes) is written last, the directory is verified (:func:`verify`)
and only then renamed to ``step_<N>``. A crash at any point leaves either the previous state or
a complete ``step_<N>``; a leftover ``step_<N>.tmp`` is never loaded and is deleted by the next
completed save. Verification is cheap: file sizes against the manifest and Megatron's own
``metadata.json`` in each group directory (written when that group's save finished), no tensor
is read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from mcore_rl.config.schema import CheckpointConfig
from mcore_rl.distributed.worker_group import WorkerError
from mcore_rl.workers.interfaces import TrainWorkerAPI

_log = logging.getLogger(__name__)

CONTROLLER_STATE = "controller.json"
CONTROLLER_TENSORS = "controller.pt"
# The key under which :meth:`CheckpointManager.load` returns what ``controller.pt`` holds.
TENSORS_KEY = "tensors"
MANIFEST = "manifest.json"
# Directory names under <run_dir>/checkpoints: step_<N> (complete when verified), step_<N>.tmp (a
# save in progress or interrupted), step_<N>.old (a complete step_<N> being replaced by a new save
# of the same step: left only by a crash between two renames).
_ENTRY = re.compile(r"step_(\d+)(\.tmp|\.old)?")


class DamagedCheckpointError(FileNotFoundError):
    """A checkpoint directory that cannot be loaded: its save did not finish (no manifest), a
    file is missing or has another size than when it was saved, a group directory is not a
    Megatron dist checkpoint, or loading it failed. The message names the checkpoint and the
    file. A ``FileNotFoundError``: the complete checkpoint asked for is not there."""


def verify(path: str, groups: Iterable[str]) -> None:
    """Check that ``path`` is a complete checkpoint of ``groups`` without reading a tensor: its
    manifest exists, every file it lists exists with the listed size, and each group's
    directory is a Megatron dist checkpoint (Megatron's ``metadata.json``).

    Raises:
        DamagedCheckpointError: naming the checkpoint and the first file that differs.
    """
    from megatron.core.dist_checkpointing import check_is_distributed_checkpoint

    manifest = os.path.join(path, MANIFEST)
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        raise DamagedCheckpointError(f"{path}: no {MANIFEST}, its save did not finish") from None
    except (ValueError, KeyError) as e:
        raise DamagedCheckpointError(f"{manifest}: unreadable ({e!r})") from None
    for name, size in files.items():
        file = os.path.join(path, name)
        try:
            actual = os.path.getsize(file)
        except FileNotFoundError:
            raise DamagedCheckpointError(f"{file} is missing (checkpoint {path})") from None
        if actual != size:
            raise DamagedCheckpointError(
                f"{file} has {actual} bytes, {size} when saved (checkpoint {path} is damaged)")
    for name in groups:
        if not check_is_distributed_checkpoint(os.path.join(path, name)):
            raise DamagedCheckpointError(
                f"{os.path.join(path, name)} is not a Megatron dist checkpoint (no metadata.json)")


def _write_json(path: str, obj: Any) -> None:
    """``obj`` as JSON, on disk (fsync) when this returns."""
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_torch(path: str, obj: Any) -> None:
    """``obj`` with ``torch.save``, on disk (fsync) when this returns."""
    import torch

    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _last_line(error: Exception) -> str:
    """The last line of a worker's error (the exception of its remote traceback)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1].strip() if lines else repr(error)


@dataclasses.dataclass
class _Pending:
    """A save whose group directories are (being) written under ``tmp``."""

    step: int
    tmp: str
    state: Dict[str, Any]
    tensors: Any = None


class CheckpointManager:
    """Saves and loads the checkpoints of one run directory (see the module docstring).

    Args:
        run_dir: the run directory (``run.output_dir``).
        cfg: the ``checkpoint`` config section (``keep_last``, ``async_save``).
        groups: returns the worker groups by sub-directory name (``{"policy": group}``); each
            answers ``call(method, *args)`` on all its ranks with one result per rank for
            ``save_checkpoint(path, async_save)``, ``finalize_async_save(blocking)`` and
            ``load_checkpoint(path)``.

    Attributes:
        last_step: the RL step of the newest checkpoint saved (its save may still be pending)
            or loaded by this manager; None before either.
    """

    def __init__(self, run_dir: str, cfg: CheckpointConfig, groups: Callable[[], Dict[str, Any]]):
        self.root = os.path.join(run_dir, "checkpoints")
        self.cfg = cfg
        self.groups = groups
        self.last_step: Optional[int] = None
        self._pending: Optional[_Pending] = None

    def step_dir(self, step: int) -> str:
        """The checkpoint directory of RL step ``step``."""
        return os.path.join(self.root, f"step_{step}")

    # ------------------------------------------------------------------ saving
    def save(self, step: int, state: Dict[str, Any], tensors: Any = None) -> str:
        """Save every worker group and the controller's ``state`` (JSON-serialisable; a
        ``tensors`` key is reserved) as the checkpoint of RL step ``step``; ``tensors`` (not
        None: lists, dicts, numbers and tensors, what ``torch.load(weights_only=True)`` reads)
        goes to ``controller.pt`` and comes back from :meth:`load` as the state's ``tensors``. A pending asynchronous save completes first. With
        ``checkpoint.async_save`` the groups write in the background and the checkpoint
        becomes ``step_<step>`` at a later :meth:`poll` or :meth:`wait`; otherwise before this
        returns. Returns the step directory."""
        self.wait()
        tmp = self.step_dir(step) + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)  # an earlier, interrupted save of this step
        os.makedirs(tmp)
        for name, group in self.groups().items():
            group.call(TrainWorkerAPI).save_checkpoint(os.path.join(tmp, name), self.cfg.async_save)
        self._pending = _Pending(step, tmp, state, tensors)
        self.last_step = step
        if not self.cfg.async_save:
            self._commit()
        return self.step_dir(step)

    def poll(self) -> None:
        """Complete a pending asynchronous save whose writers have all finished; returns at
        once otherwise. Collective: every rank of every group takes part."""
        if self._pending is not None and all(
                all(group.call(TrainWorkerAPI).finalize_async_save(False))
                for group in self.groups().values()):
            self._commit()

    def after_step(self, step: int, save: Callable[[], Any]) -> None:
        """After step ``step`` of a run: :meth:`poll`, then ``save()`` every
        ``checkpoint.every`` steps (0: never)."""
        self.poll()
        if self.cfg.every > 0 and step % self.cfg.every == 0:
            save()

    def finish(self, step: int, save: Callable[[], Any]) -> None:
        """After a run's last step ``step``: ``save()`` with ``checkpoint.save_final`` unless
        this step is saved already, then :meth:`wait`."""
        if self.cfg.save_final and self.last_step != step:
            save()
        self.wait()

    def wait(self) -> None:
        """Complete a pending asynchronous save, waiting for its writers."""
        if self._pending is None:
            return
        for group in self.groups().values():
            group.call(TrainWorkerAPI).finalize_async_save(True)
        self._commit()

    def _commit(self) -> None:
        """The pending save's controller state and manifest, then verify and rename."""
        pending, self._pending = self._pending, None
        _write_json(os.path.join(pending.tmp, CONTROLLER_STATE), pending.state)
        if pending.tensors is not None:
            _write_torch(os.path.join(pending.tmp, CONTROLLER_TENSORS), pending.tensors)
        files = {}
        for folder, _, names in os.walk(pending.tmp):
            for name in names:
                path = os.path.join(folder, name)
                files[os.path.relpath(path, pending.tmp)] = os.path.getsize(path)
        _write_json(os.path.join(pending.tmp, MANIFEST), {"step": pending.step, "files": files})
        verify(pending.tmp, self.groups())
        final = self.step_dir(pending.step)
        if os.path.exists(final):  # a checkpoint of the same step (a run resumed from before it)
            os.replace(final, final + ".old")
        os.replace(pending.tmp, final)
        _fsync_dir(self.root)
        self._prune(keep=pending.step)

    def _entries(self) -> List[Tuple[int, str, str]]:
        """``(step, suffix, path)`` of every directory under the root, newest step first."""
        if not os.path.isdir(self.root):
            return []
        found = [(int(m.group(1)), m.group(2) or "", os.path.join(self.root, name))
                 for name in os.listdir(self.root) if (m := _ENTRY.fullmatch(name))]
        return sorted(found, key=lambda e: (-e[0], e[1]))

    def _prune(self, keep: int) -> None:
        """Delete leftovers of interrupted saves, damaged checkpoints, and complete ones
        beyond the newest ``checkpoint.keep_last`` (0: none), never the one of step ``keep``
        (just completed)."""
        complete = 0
        for step, suffix, path in self._entries():
            if not suffix:
                try:
                    verify(path, self.groups())
                    complete += 1
                    if step == keep or self.cfg.keep_last <= 0 or complete <= self.cfg.keep_last:
                        continue
                except DamagedCheckpointError:
                    pass
            shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------ loading
    def load(self, path: str, warn_schedule: bool = True) -> Tuple[str, Dict[str, Any]]:
        """Load checkpoint directory ``path`` into every worker group, or with ``"latest"``
        the newest complete checkpoint that loads: each one skipped (an interrupted save, a
        damaged file, a failed load) is named in a warning with the reason. Each group's LR
        schedule keeps the checkpoint's progress and takes its settings from the
        configuration; with ``warn_schedule`` a warning names the settings that changed.

        Returns:
            the directory loaded and the controller state saved with it (with what
            ``controller.pt`` holds under ``tensors`` where the save had tensors).

        Raises:
            DamagedCheckpointError: ``path`` is not a complete checkpoint or does not load (the
                message names the file).
            FileNotFoundError: ``path`` is no directory, or ``"latest"`` and no checkpoint
                loads (the message lists those skipped).
        """
        if path != "latest":
            if not os.path.isdir(path):
                raise FileNotFoundError(f"checkpoint.resume={path}: no such directory")
            try:
                verify(path, self.groups())
                return path, self._load(path, warn_schedule)
            except DamagedCheckpointError as e:
                raise DamagedCheckpointError(f"checkpoint.resume={path}: {e}") from e.__cause__
        skipped = []
        for _, suffix, candidate in self._entries():
            try:
                if suffix:
                    raise DamagedCheckpointError(f"{candidate}: a save that did not finish")
                verify(candidate, self.groups())
                state = self._load(candidate, warn_schedule)
            except DamagedCheckpointError as e:
                _log.warning("checkpoint.resume=latest: skipped %s", e)
                skipped.append(str(e))
                continue
            if skipped:
                _log.warning("checkpoint.resume=latest: loaded %s (the newest complete checkpoint)",
                             candidate)
            return candidate, state
        raise FileNotFoundError(f"checkpoint.resume=latest: no checkpoint under {self.root}"
                                + "".join(f"; skipped {s}" for s in skipped))

    def _load(self, path: str, warn_schedule: bool) -> Dict[str, Any]:
        with open(os.path.join(path, CONTROLLER_STATE)) as f:
            state = json.load(f)
        tensors = os.path.join(path, CONTROLLER_TENSORS)
        if os.path.exists(tensors):
            import torch

            try:
                state[TENSORS_KEY] = torch.load(tensors, weights_only=True)
            except Exception as e:  # verified sizes, yet unreadable
                raise DamagedCheckpointError(f"{tensors} does not load: {e!r}") from e
        for name, group in self.groups().items():
            try:
                changed = group.call(TrainWorkerAPI).load_checkpoint(os.path.join(path, name))[0]
            except WorkerError as e:
                raise DamagedCheckpointError(
                    f"loading {os.path.join(path, name)} failed: {_last_line(e)}") from e
            if changed and warn_schedule:
                _log.warning(
                    "checkpoint.resume: %s.optimizer's LR schedule differs from %s; the "
                    "configured one applies from step %d on (checkpoint -> config): %s", name,
                    path, state["step"], ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()))
        self.last_step = state["step"]
        return state

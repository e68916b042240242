"""Preemption: SIGTERM or SIGUSR1 (what Slurm sends before a time limit with
``--signal=B:USR1@<seconds>``, or on preemption and ``scancel``) asks the controller to stop:
the open RL step finishes, a checkpoint is saved, and the process exits with
:data:`EXIT_CODE`. ``scripts/slurm/ray_job.sbatch`` answers that code by requeueing the job,
and the requeued job resumes with ``checkpoint.resume=latest``.

Only the controller process handles the signals: the workers must still be there to save. Under
``ray_job.sbatch`` the signal reaches the driver's step only (``B:`` sends it to the batch
shell, which passes it on), and Ray's workers live in other steps. Workers that are plain
processes of the controller (``cluster.use_ray=false``) keep Python's default for these signals,
so a signal sent to all of the driver step's processes ends them.
"""

from __future__ import annotations

import signal
import threading
from typing import Optional

# The exit status of a controller that stopped for a signal after saving a checkpoint:
# EX_TEMPFAIL of sysexits.h ("temporary failure; the user is invited to retry").
EXIT_CODE = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(SystemExit):
    """Raised by the controller after it saved a checkpoint for a preemption signal: the
    process exits with :data:`EXIT_CODE` (``code``) unless a caller catches it.

    Attributes:
        signal_name: ``"SIGTERM"`` or ``"SIGUSR1"``.
        checkpoint: the checkpoint directory written (or loaded) at the step it stopped.
    """

    def __init__(self, signal_name: str, checkpoint: str):
        super().__init__(EXIT_CODE)
        self.signal_name = signal_name
        self.checkpoint = checkpoint


class PreemptionSignals:
    """Records SIGTERM and SIGUSR1 instead of ending the process, between :meth:`install` and
    :meth:`restore`. Outside the main thread (where Python cannot set handlers) nothing is
    installed and :attr:`received` stays None.

    Attributes:
        received: the name of the first signal received (``"SIGTERM"``), else None.
    """

    def __init__(self):
        self.received: Optional[str] = None
        self._previous = {}

    def _record(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._record) for s in SIGNALS}

    def restore(self) -> None:
        """The handlers from before :meth:`install`."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

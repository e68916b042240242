"""Where a run's host-device synchronizations come from (a diagnostic, GPU only).

With this folder on ``PYTHONPATH`` and ``MCORE_RL_SYNC_SOURCES=<dir>`` set, every Python process
of the run (the driver and its worker processes) turns on ``torch.cuda.set_sync_debug_mode(1)``
and, instead of printing torch's "called a synchronizing CUDA operation" warning, counts it by
the call stack that caused it (the innermost frames outside torch's own files). Each process
writes ``<dir>/syncs_<pid>.txt``: one line per stack, ``count  stack`` (innermost first), most
frequent first, rewritten every 100 synchronizations and at exit. ``scripts/gpu/session.sh
syncs`` runs the GSM8K step this way.
"""

import os

_OUT = os.environ.get("MCORE_RL_SYNC_SOURCES")

if _OUT:
    import atexit
    import collections
    import traceback
    import warnings

    _counts = collections.Counter()
    _show = warnings.showwarning

    def _write():
        os.makedirs(_OUT, exist_ok=True)
        with open(os.path.join(_OUT, f"syncs_{os.getpid()}.txt"), "w") as f:
            for stack, n in _counts.most_common():
                f.write(f"{n:7d}  {stack}\n")

    def _where():
        frames = [fr for fr in traceback.extract_stack()[:-3]
                  if "/torch/" not in fr.filename and "sitecustomize" not in fr.filename
                  and "warnings" not in fr.filename]
        return " <- ".join(f"{'/'.join(fr.filename.split('/')[-2:])}:{fr.lineno}({fr.name})"
                           for fr in reversed(frames[-7:]))

    def _showwarning(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" not in str(message):
            return _show(message, category, filename, lineno, file, line)
        _counts[f"[{filename.split('/')[-1]}:{lineno}] " + _where()] += 1
        if sum(_counts.values()) % 100 == 0:
            _write()

    warnings.showwarning = _showwarning
    warnings.filterwarnings("always", message=".*synchronizing CUDA operation.*")
    atexit.register(_write)
    try:
        import torch

        torch.cuda.set_sync_debug_mode(1)
    except Exception as exc:  # noqa: BLE001 - a diagnostic: say so and go on
        print(f"sync_sources: not armed ({exc})")

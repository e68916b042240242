"""In which RL step a run captures CUDA graphs (a diagnostic, GPU only).

With this folder on ``PYTHONPATH`` and ``MCORE_RL_CAPTURE_TIMES=<dir>`` set, every Python process
of the run appends one line per finished ``torch.cuda.CUDAGraph`` capture to
``<dir>/captures_<pid>.txt``: the RL step it happened in (the lines of the run's
``metrics.jsonl``, path in ``MCORE_RL_CAPTURE_METRICS``, plus one: steps finished before it, plus
the one running) and the wall-clock time. Every second it also writes the process's peak CUDA
memory so far (``torch.cuda.max_memory_allocated``, GiB) to ``<dir>/peak_<pid>.txt``, once the
process has initialized CUDA. ``scripts/gpu/session.sh gsm8k`` runs every variant this way with
``GSM8K_CAPTURE_TIMES=1``: how many decode steps are still captured in the steady-state steps
that the median reads, and the run's peak memory.
"""

import os

_OUT = os.environ.get("MCORE_RL_CAPTURE_TIMES")

if _OUT:
    import time

    try:
        import torch.cuda.graphs as _graphs
    except Exception:  # no torch here: nothing to count
        _graphs = None
    if _graphs is not None:
        _end = _graphs.CUDAGraph.capture_end

        def _step() -> int:
            try:
                with open(os.environ.get("MCORE_RL_CAPTURE_METRICS", "")) as f:
                    return sum(1 for _ in f) + 1
            except OSError:
                return 0

        def _capture_end(self, *args, **kwargs):
            out = _end(self, *args, **kwargs)
            os.makedirs(_OUT, exist_ok=True)
            with open(os.path.join(_OUT, f"captures_{os.getpid()}.txt"), "a") as f:
                f.write(f"step {_step()} {time.time():.3f}\n")
            return out

        _graphs.CUDAGraph.capture_end = _capture_end

        import threading

        import torch

        def _poll_peak():
            while True:
                time.sleep(1.0)
                if torch.cuda.is_initialized():
                    peak = torch.cuda.max_memory_allocated() / 2 ** 30
                    with open(os.path.join(_OUT, f"peak_{os.getpid()}.txt"), "w") as f:
                        f.write(f"{peak:.2f}\n")

        os.makedirs(_OUT, exist_ok=True)
        threading.Thread(target=_poll_peak, daemon=True, name="peak-memory").start()

"""Diagnostics and experiment settings of a GPU run, each turned on by an environment variable
(with this folder on ``PYTHONPATH``, every Python process of the run, the driver and its
workers, runs this at start-up; ``scripts/gpu/session.sh gsm8k`` puts it there).

``MCORE_RL_CAPTURE_TIMES=<dir>``: one line per finished ``torch.cuda.CUDAGraph`` capture
appended to ``<dir>/captures_<pid>.txt``: the RL step it happened in (the lines of the run's
``metrics.jsonl``, path in ``MCORE_RL_CAPTURE_METRICS``, plus one: steps finished before it,
plus the one running) and the wall-clock time; and every second the process's peak CUDA memory
so far (``torch.cuda.max_memory_allocated``, GiB) in ``<dir>/peak_<pid>.txt``, once the process
has initialized CUDA. With ``GSM8K_CAPTURE_TIMES=1`` the gsm8k stage prints, per variant, how
many decode steps are still captured in the steady-state steps the median reads, and the peak.

``MCORE_RL_INDUCTOR="name=value,..."``: those ``torch._inductor.config`` attributes set before
anything is compiled (values parsed as Python literals: ``combo_kernels=True``), so a setting
can be measured on the GSM8K step without a config key for it (the gsm8k stage's
``variant_env`` table). A name Inductor does not have raises ``AttributeError`` naming it.
"""

import os


def _capture_times(out: str) -> None:
    import threading
    import time

    import torch
    import torch.cuda.graphs as graphs

    end = graphs.CUDAGraph.capture_end

    def step() -> int:
        try:
            with open(os.environ.get("MCORE_RL_CAPTURE_METRICS", "")) as f:
                return sum(1 for _ in f) + 1
        except OSError:
            return 0

    def capture_end(self, *args, **kwargs):
        result = end(self, *args, **kwargs)
        with open(os.path.join(out, f"captures_{os.getpid()}.txt"), "a") as f:
            f.write(f"step {step()} {time.time():.3f}\n")
        return result

    def poll_peak():
        while True:
            time.sleep(1.0)
            if torch.cuda.is_initialized():
                peak = torch.cuda.max_memory_allocated() / 2 ** 30
                with open(os.path.join(out, f"peak_{os.getpid()}.txt"), "w") as f:
                    f.write(f"{peak:.2f}\n")

    os.makedirs(out, exist_ok=True)
    graphs.CUDAGraph.capture_end = capture_end
    threading.Thread(target=poll_peak, daemon=True, name="peak-memory").start()


def _inductor_options(settings: str) -> None:
    import ast

    import torch._inductor.config as config

    for item in settings.split(","):
        name, _, value = item.partition("=")
        name = name.strip()
        if not hasattr(config, name):
            raise AttributeError(f"MCORE_RL_INDUCTOR: torch._inductor.config has no {name!r}")
        setattr(config, name, ast.literal_eval(value.strip()))


if os.environ.get("MCORE_RL_CAPTURE_TIMES"):
    _capture_times(os.environ["MCORE_RL_CAPTURE_TIMES"])
if os.environ.get("MCORE_RL_INDUCTOR", "").strip():
    _inductor_options(os.environ["MCORE_RL_INDUCTOR"].strip())

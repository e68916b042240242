"""CPU benchmark: seconds per Python sandbox call, isolated (bwrap) vs not; prints one table.

Each case runs ``--calls`` sandbox calls of one program in this process, the cases taking turns
call by call, after ``--warmup`` calls each (the first ``bwrap`` call of a process also builds
the interpreter's view, ``ldd`` over the standard library's extension modules, about a second,
reported on its own), through :func:`mcore_rl.environments.sandbox.run_python`:

- ``before``: the sandbox of the commit before issue 40 (``git show <rev>:<module>``: a plain
  ``python -I -S`` subprocess in a temporary directory), when ``--before-rev`` is given;
- ``unsafe_subprocess``: ``env.sandbox=unsafe_subprocess`` (the same plain subprocess);
- ``bwrap``: ``env.sandbox=bwrap``, the default (namespaces, the interpreter's read-only view,
  a private /tmp, the seccomp filter).

Programs: ``print``: ``print(6 * 7)``; ``compute``: a few imports and a little arithmetic (what a
model's tool call does); ``raise``: a program that fails with a traceback. Columns: median,
mean and 90th-percentile milliseconds of a call (wall clock, as the environment step waits
for it). Example::

    python bench/sandbox.py --calls 50 --before-rev 56b40a7
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mcore_rl.environments import sandbox  # noqa: E402

PROGRAMS = {
    "print": "print(6 * 7)",
    "compute": ("import math, fractions, json\n"
                "print(json.dumps([math.comb(40, 20), str(fractions.Fraction(22, 7) ** 3), "
                "sum(i * i for i in range(10_000))]))"),
    "raise": "def f():\n    raise ValueError('boom')\nf()\n",
}


def load_before(rev: str) -> Callable[..., object]:
    """``run_python`` of ``mcore_rl/environments/sandbox.py`` at git revision ``rev``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = subprocess.run(["git", "-C", root, "show", f"{rev}:mcore_rl/environments/sandbox.py"],
                            capture_output=True, text=True, check=True).stdout
    with tempfile.TemporaryDirectory(prefix="bench_sandbox_") as tmp:
        path = os.path.join(tmp, "sandbox_before.py")
        with open(path, "w") as f:
            f.write(source)
        spec = importlib.util.spec_from_file_location("sandbox_before", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return module.run_python


def time_calls(runners: Dict[str, Callable[[str], object]], code: str, calls: int,
               warmup: int) -> Dict[str, List[float]]:
    """Seconds of each call per runner, the runners taking turns call by call (a machine whose
    load changes affects them alike)."""
    out: Dict[str, List[float]] = {name: [] for name in runners}
    for i in range(warmup + calls):
        for name, run in runners.items():
            start = time.perf_counter()
            result = run(code)
            seconds = time.perf_counter() - start
            assert result.exit_code is not None, result  # the sandbox started
            if i >= warmup:
                out[name].append(seconds)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--before-rev", default=None,
                        help="git revision whose sandbox is the 'before' case (e.g. 56b40a7)")
    args = parser.parse_args()

    runners: Dict[str, Callable[[str], object]] = {}
    if args.before_rev:
        runners["before"] = load_before(args.before_rev)
    runners["unsafe_subprocess"] = lambda code: sandbox.run_python(
        code, isolation=sandbox.UNSAFE_SUBPROCESS)
    runners["bwrap"] = lambda code: sandbox.run_python(code, isolation=sandbox.BWRAP)

    start = time.perf_counter()
    first = sandbox.run_python(PROGRAMS["print"], isolation=sandbox.BWRAP)
    first_s = time.perf_counter() - start
    assert first.stdout == "42\n", first
    start = time.perf_counter()
    sandbox.isolation_problem.cache_clear()
    problem = sandbox.isolation_problem()
    probe_s = time.perf_counter() - start

    print(f"# {args.calls} calls per case after {args.warmup} warm-up calls; load average "
          f"{os.getloadavg()[0]:.2f} at start, {os.cpu_count()} CPUs")
    print(f"# bwrap first call in this process (builds the interpreter's view): "
          f"{first_s * 1e3:.0f} ms; load-time probe (env.sandbox check): {probe_s * 1e3:.0f} ms"
          f" ({problem or 'ok'})")
    print(f"| {'sandbox':<17} | {'program':<8} | {'median ms':>9} | {'mean ms':>8} | "
          f"{'p90 ms':>7} |")
    print(f"|{'-' * 19}|{'-' * 10}|{'-' * 10}:|{'-' * 9}:|{'-' * 8}:|")
    for program, code in PROGRAMS.items():
        for name, seconds in time_calls(runners, code, args.calls, args.warmup).items():
            seconds = sorted(seconds)
            p90 = seconds[min(len(seconds) - 1, int(0.9 * len(seconds)))]
            print(f"| {name:<17} | {program:<8} | {statistics.median(seconds) * 1e3:>9.1f} | "
                  f"{statistics.mean(seconds) * 1e3:>8.1f} | {p90 * 1e3:>7.1f} |", flush=True)


if __name__ == "__main__":
    main()

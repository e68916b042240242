"""A Python sandbox tool: the model's code in a fresh, resource-limited interpreter.

:func:`run_python` runs a program in a subprocess ``python -I -S`` (isolated mode: no
``PYTHON*`` environment variables, no user site directory, the current directory not on
``sys.path``; ``-S``: no ``site``, so no installed packages, only the standard library), with an
empty environment except ``PATH`` and ``LANG``, in a fresh temporary working directory deleted
afterwards, in a session of its own (the whole process group is killed at the end). Before the
program runs, a small bootstrap sets :mod:`resource` limits:

- ``RLIMIT_CPU``: CPU seconds (``env.sandbox_cpu_seconds``); past it the kernel kills it
  (``SIGXCPU``/``SIGKILL``), reported as a timeout;
- ``RLIMIT_AS``: address space (``env.sandbox_memory_mb``); past it allocations fail
  (``MemoryError``, a nonzero exit status);
- ``RLIMIT_FSIZE``: 16 MiB per file written; ``RLIMIT_NOFILE``: 64 open files;
  ``RLIMIT_NPROC``: 0 new processes or threads for an unprivileged user (root is exempt);
  ``RLIMIT_CORE``: no core files.

On top, a wall-clock limit (``env.tool_timeout_seconds``) kills the process group (a program
that sleeps uses no CPU). Standard output and error are read as they come and truncated at
``env.max_output_chars`` characters each (the rest is read and dropped, so a program printing
without end is stopped by its limits, never by a full pipe, and costs no memory here).

What this does **not** isolate, honestly: the program runs as the same user as the trainer, so
it can read every file that user can read and write wherever that user can (bounded in size
per file, not in count); the network is not blocked (no network namespace: it is simply not
offered anything); it sees the host's processes. For untrusted code at scale put the
environment workers in a container or a VM (gVisor, Firecracker, a Kubernetes job) - the
executor's process boundary is where such a sandbox plugs in.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

from mcore_rl.environments.tools import ToolResult, error_content

# Sets the limits, then runs the program file (argv[1]) as __main__. Runs under -I -S.
_BOOTSTRAP = """\
import resource, sys
cpu, mem, fsize = (int(v) for v in sys.argv[2:5])
for limit, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (mem, mem)),
                     (resource.RLIMIT_FSIZE, (fsize, fsize)), (resource.RLIMIT_NOFILE, (64, 64)),
                     (resource.RLIMIT_CORE, (0, 0)), (resource.RLIMIT_NPROC, (0, 0))):
    try:
        resource.setrlimit(limit, value)
    except (ValueError, OSError):
        pass
path = sys.argv[1]
sys.argv = [path]
with open(path) as f:
    source = f.read()
del resource, cpu, mem, fsize, limit, value, f
try:
    exec(compile(source, path, "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as e:  # the traceback without this bootstrap's frame
    import traceback
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
"""

FILE_SIZE_LIMIT = 16 << 20  # RLIMIT_FSIZE of the sandbox, bytes
_READ_CHUNK = 1 << 16


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run gives back.

    Attributes:
        stdout, stderr: the program's output, each cut at ``max_output_chars`` characters.
        exit_code: the process's exit status (negative: killed by that signal); None when
            it could not be started.
        timed_out: stopped at the wall-clock limit or the CPU limit.
        truncated: an output was longer than ``max_output_chars`` (the rest was dropped).
        seconds: wall-clock seconds of the run.
    """

    stdout: str
    stderr: str
    exit_code: Optional[int]
    timed_out: bool
    truncated: bool
    seconds: float

    def to_json(self) -> str:
        """The result as the JSON object a tool response shows the model."""
        out: Dict[str, Any] = {"exit_code": self.exit_code, "stdout": self.stdout,
                               "stderr": self.stderr}
        if self.timed_out:
            out["timed_out"] = True
        if self.truncated:
            out["truncated"] = True
        return json.dumps(out)


class _Reader(threading.Thread):
    """Reads a pipe to its end, keeping the first ``limit`` bytes."""

    def __init__(self, pipe, limit: int):
        super().__init__(daemon=True)
        self.pipe, self.limit = pipe, limit
        self.kept: List[bytes] = []
        self.size = 0

    def run(self) -> None:
        try:
            while True:
                chunk = self.pipe.read1(_READ_CHUNK) if hasattr(self.pipe, "read1") \
                    else self.pipe.read(_READ_CHUNK)
                if not chunk:
                    break
                room = self.limit - sum(len(c) for c in self.kept)
                if room > 0:
                    self.kept.append(chunk[:room])
                self.size += len(chunk)
        except (OSError, ValueError):
            pass

    def text(self, max_chars: int) -> "tuple[str, bool]":
        data = b"".join(self.kept).decode("utf-8", errors="replace")
        return data[:max_chars], len(data) > max_chars or self.size > len(b"".join(self.kept))


def run_python(code: str, *, timeout_seconds: float = 10.0, cpu_seconds: int = 5,
               memory_mb: int = 512, max_output_chars: int = 4096) -> SandboxResult:
    """Run ``code`` as a Python program in the sandbox described in this module's docstring.

    Args:
        code: the program's source.
        timeout_seconds: wall-clock limit; the process group is killed past it.
        cpu_seconds: CPU-time limit (``RLIMIT_CPU``), whole seconds.
        memory_mb: address-space limit (``RLIMIT_AS``) in MiB (the interpreter itself takes
            about 20 of them).
        max_output_chars: characters kept of stdout and of stderr each.

    Returns:
        A :class:`SandboxResult`; a program that raises, runs out of memory, or is killed is a
        result (exit status, stderr, ``timed_out``), not an exception here.

    Raises:
        ValueError: a limit is not positive.
    """
    if timeout_seconds <= 0 or cpu_seconds < 1 or memory_mb < 1 or max_output_chars < 1:
        raise ValueError(f"run_python: limits must be positive (timeout_seconds="
                         f"{timeout_seconds}, cpu_seconds={cpu_seconds}, memory_mb={memory_mb}, "
                         f"max_output_chars={max_output_chars})")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mcore_rl_sandbox_") as workdir:
        path = os.path.join(workdir, "main.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(code)
        argv = [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, path, str(int(cpu_seconds)),
                str(int(memory_mb) << 20), str(FILE_SIZE_LIMIT)]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        try:
            proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True, close_fds=True)
        except OSError as e:
            return SandboxResult("", f"could not start the sandbox: {e}", None, False, False,
                                 time.monotonic() - start)
        readers = [_Reader(proc.stdout, 4 * max_output_chars),
                   _Reader(proc.stderr, 4 * max_output_chars)]
        for r in readers:
            r.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout_seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc)
        proc.wait()
        for r in readers:
            r.join(timeout=5)
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()
    # Not stopped by us but killed by SIGXCPU (RLIMIT_CPU's soft limit) or SIGKILL (its hard
    # limit; the OOM killer's reads the same, rare under RLIMIT_AS): the CPU limit.
    cpu_limit = not timed_out and proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL)
    (stdout, cut_out), (stderr, cut_err) = (r.text(max_output_chars) for r in readers)
    return SandboxResult(stdout, stderr, proc.returncode, timed_out or cpu_limit,
                         cut_out or cut_err, time.monotonic() - start)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the sandbox's process group (the program and anything it started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass(frozen=True)
class PythonSandbox:
    """The ``python`` tool: ``{"code": "print(2**100)"}`` -> the run's
    :meth:`SandboxResult.to_json`; a nonzero exit status counts as an error, a run stopped at
    a limit as a timeout."""

    timeout_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_mb: int = 512
    max_output_chars: int = 4096
    name: str = "python"
    description: str = ("Run a Python program (standard library only, no input) and return its "
                        "exit code, stdout and stderr; print what you need to see.")

    @property
    def parameters(self) -> Dict[str, Any]:
        return {"type": "object", "required": ["code"],
                "properties": {"code": {"type": "string", "description": "Python source"}}}

    def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult(error_content("python needs {\"code\": <string>}"), error=True)
        result = run_python(code, timeout_seconds=self.timeout_seconds,
                            cpu_seconds=self.cpu_seconds, memory_mb=self.memory_mb,
                            max_output_chars=self.max_output_chars)
        return ToolResult(result.to_json(), error=result.exit_code != 0 and not result.timed_out,
                          timed_out=result.timed_out)

"""A Python sandbox tool: the model's code in a fresh, isolated, resource-limited interpreter.

:func:`run_python` runs a program with ``python -I -S`` (isolated mode: no ``PYTHON*``
environment variables, no user site directory, the current directory not on ``sys.path``;
``-S``: no ``site``, so no installed packages, only the standard library), with an empty
environment except ``PATH`` and ``LANG``, in a session of its own, by one of two isolations
(``env.sandbox``):

- ``bwrap`` (the default): in new namespaces with bubblewrap
  (:mod:`mcore_rl.environments.isolation`): no network, a read-only view of only the
  interpreter and its standard library, a private ``/tmp`` (its working directory), its own
  PID namespace killed with the runner, uid/gid 65534 without capabilities inside, and no new
  process or thread (a seccomp filter: the process bound that holds for root);
- ``unsafe_subprocess``: a plain subprocess in a fresh temporary directory, as the trainer's
  user: it reads and writes what that user can, uses the network, sees and signals the host's
  processes, and as root forks without bound (``RLIMIT_NPROC`` does not bind root). Chosen
  explicitly only; the rollout logs a warning every step (:func:`unsafe_warning`).

Before the program runs, a small bootstrap sets :mod:`resource` limits:

- ``RLIMIT_CPU``: CPU seconds (``env.sandbox_cpu_seconds``); past it the kernel kills it
  (``SIGXCPU``/``SIGKILL``), reported as a timeout;
- ``RLIMIT_AS``: address space (``env.sandbox_memory_mb``); past it allocations fail
  (``MemoryError``, a nonzero exit status);
- ``RLIMIT_FSIZE``: 16 MiB per file written; ``RLIMIT_NOFILE``: 64 open files;
  ``RLIMIT_NPROC``: 0 new processes or threads for an unprivileged user (root is exempt: under
  ``bwrap`` the seccomp filter is the bound); ``RLIMIT_CORE``: no core files.

On top, a wall-clock limit (``env.tool_timeout_seconds``) kills the process group (a program
that sleeps uses no CPU; under ``bwrap`` the namespace dies with it). Standard output and error
are read as they come and truncated at ``env.max_output_chars`` characters each (the rest is
read and dropped, so a program printing without end is stopped by its limits, never by a full
pipe, and costs no memory here).

Where ``bwrap`` cannot run (not installed, user namespaces not allowed), the config loader
refuses ``env.sandbox=bwrap`` with one line (:func:`sandbox_config_errors`, after one probe
run: :func:`isolation_problem`). What ``bwrap`` does not isolate: the kernel (a kernel exploit
escapes any namespace: for hostile code at scale use a VM sandbox such as gVisor or
Firecracker around the environment workers), the CPU time and memory of the machine beyond the
limits above, and timing side channels.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

from mcore_rl.environments.isolation import (PROGRAM, IsolationUnavailable, bwrap_command,
                                             seccomp_program)
from mcore_rl.environments.tools import ToolResult, error_content

if TYPE_CHECKING:
    from mcore_rl.config.schema import TrainConfig

logger = logging.getLogger("mcore_rl.environments")

# env.sandbox: the isolations of run_python (the first is the default).
BWRAP, UNSAFE_SUBPROCESS = "bwrap", "unsafe_subprocess"
ISOLATIONS = (BWRAP, UNSAFE_SUBPROCESS)
BWRAP_MISSING = ("bubblewrap (bwrap) is not installed (apt-get install bubblewrap; make setup "
                 "does as root)")
_MAX_SIGNAL = 64

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
               memory_mb: int = 512, max_output_chars: int = 4096,
               isolation: str = BWRAP) -> SandboxResult:
    """Run ``code`` as a Python program in the sandbox described in this module's docstring.

    Args:
        code: the program's source.
        timeout_seconds: wall-clock limit; the process group is killed past it.
        cpu_seconds: CPU-time limit (``RLIMIT_CPU``), whole seconds.
        memory_mb: address-space limit (``RLIMIT_AS``) in MiB (the interpreter itself takes
            about 20 of them).
        max_output_chars: characters kept of stdout and of stderr each.
        isolation: ``"bwrap"`` (namespaces, :mod:`mcore_rl.environments.isolation`) or
            ``"unsafe_subprocess"`` (none): ``env.sandbox``.

    Returns:
        A :class:`SandboxResult`; a program that raises, runs out of memory, or is killed is a
        result (exit status, stderr, ``timed_out``), not an exception here; so is a sandbox
        that cannot start (``exit_code`` None, the reason in ``stderr``). Under ``bwrap`` a
        program killed by signal N reports ``-N`` (bubblewrap exits 128 + N, as a shell does:
        a program's own exit status above 128 reads as a signal too).

    Raises:
        ValueError: a limit is not positive, or an unknown ``isolation``.
    """
    if timeout_seconds <= 0 or cpu_seconds < 1 or memory_mb < 1 or max_output_chars < 1:
        raise ValueError(f"run_python: limits must be positive (timeout_seconds="
                         f"{timeout_seconds}, cpu_seconds={cpu_seconds}, memory_mb={memory_mb}, "
                         f"max_output_chars={max_output_chars})")
    if isolation not in ISOLATIONS:
        raise ValueError(f"env.sandbox must be one of {', '.join(ISOLATIONS)} (got "
                         f"{isolation!r})")
    start = time.monotonic()
    limits = [str(int(cpu_seconds)), str(int(memory_mb) << 20), str(FILE_SIZE_LIMIT)]
    with contextlib.ExitStack() as stack:
        try:
            if isolation == BWRAP:
                launch = _bwrap_launch(code, limits, stack)
            else:
                launch = _subprocess_launch(code, limits, stack)
        except (OSError, IsolationUnavailable) as e:
            return SandboxResult("", f"could not start the sandbox: {e}", None, False, False,
                                 time.monotonic() - start)
        argv, cwd, fds = launch
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        try:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True, close_fds=True, pass_fds=fds)
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
    returncode = proc.returncode
    if isolation == BWRAP and 128 < returncode <= 128 + _MAX_SIGNAL:
        returncode = 128 - returncode  # bwrap's 128 + N for a program killed by signal N
    # Not stopped by us but killed by SIGXCPU (RLIMIT_CPU's soft limit) or SIGKILL (its hard
    # limit; the OOM killer's reads the same, rare under RLIMIT_AS): the CPU limit.
    cpu_limit = not timed_out and returncode in (-signal.SIGXCPU, -signal.SIGKILL)
    (stdout, cut_out), (stderr, cut_err) = (r.text(max_output_chars) for r in readers)
    return SandboxResult(stdout, stderr, returncode, timed_out or cpu_limit,
                         cut_out or cut_err, time.monotonic() - start)


def _memfd(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding ``data``, its offset at 0 (the descriptor)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd


_Launch = Tuple[List[str], Optional[str], Tuple[int, ...]]  # argv, working directory, pass_fds


def _bwrap_launch(code: str, limits: List[str], stack: contextlib.ExitStack) -> _Launch:
    """``(argv, cwd, pass_fds)`` of a ``bwrap`` run: the program and the seccomp filter in
    memory files that ``bwrap`` copies in (closed by ``stack``)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise IsolationUnavailable(BWRAP_MISSING)
    program = _memfd("mcore_rl_sandbox_program", code.encode("utf-8", "surrogatepass"))
    stack.callback(os.close, program)
    seccomp = _memfd("mcore_rl_sandbox_seccomp", seccomp_program())
    stack.callback(os.close, seccomp)
    argv = bwrap_command(bwrap, program, seccomp, ["-I", "-S", "-c", _BOOTSTRAP, PROGRAM,
                                                    *limits])
    return argv, None, (program, seccomp)


def _subprocess_launch(code: str, limits: List[str], stack: contextlib.ExitStack) -> _Launch:
    """``(argv, cwd, pass_fds)`` of a plain subprocess: the program in a fresh temporary
    directory (its working directory, removed by ``stack``)."""
    workdir = tempfile.mkdtemp(prefix="mcore_rl_sandbox_")
    stack.callback(shutil.rmtree, workdir, ignore_errors=True)
    path = os.path.join(workdir, "main.py")
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(code)
    return [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, path, *limits], workdir, ()


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
    a limit as a timeout. The fields are :func:`run_python`'s limits and ``isolation``
    (``env.sandbox``)."""

    timeout_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_mb: int = 512
    max_output_chars: int = 4096
    isolation: str = BWRAP
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
                            max_output_chars=self.max_output_chars, isolation=self.isolation)
        return ToolResult(result.to_json(), error=result.exit_code != 0 and not result.timed_out,
                          timed_out=result.timed_out)


# ---------------------------------------------------------------------------- env.sandbox

# Environments (env.name) that run model-written code in this sandbox: their env.sandbox is
# checked at load.
CODE_ENVIRONMENTS = ("tool_use",)

# The probe's program: prints "ok", or what the sandbox failed to hold.
_PROBE = """\
import os, socket
problems = []
if os.getuid() == 0 or os.path.exists("/etc"):
    problems.append("runs as uid 0 or sees the host's /etc")
try:
    pid = os.fork()
except OSError:
    pass
else:
    if pid == 0:
        os._exit(0)
    problems.append("forks")
try:
    os.setuid(0)
    problems.append("can take uid 0")
except OSError:
    pass
print("; ".join(problems) or "ok")
"""


@functools.cache
def isolation_problem() -> Optional[str]:
    """Why ``env.sandbox=bwrap`` cannot run here (``bwrap`` missing, user namespaces not
    allowed, the interpreter's view not buildable, a probe program that was not isolated), as
    one sentence; None when it can. Runs one probe program under ``bwrap`` (a tenth of a second
    on an idle machine), once per process."""
    if shutil.which("bwrap") is None:
        return BWRAP_MISSING
    result = run_python(_PROBE, timeout_seconds=120.0, cpu_seconds=60, memory_mb=256,
                        isolation=BWRAP)
    if result.exit_code == 0 and result.stdout == "ok\n":
        return None
    lines = [line for line in (result.stderr + result.stdout).splitlines() if line.strip()]
    why = lines[-1].strip() if lines else f"exit status {result.exit_code}"
    if result.timed_out:
        why = "the probe program did not finish in 120 s"
    return f"a probe program under bwrap failed: {why}"


def sandbox_config_errors(cfg: "TrainConfig") -> List[str]:
    """The load-time check of ``env.sandbox`` (through its entry in
    :data:`mcore_rl.config.registry.SANDBOXES`): with an environment that runs code
    (:data:`CODE_ENVIRONMENTS`), ``bwrap`` must work here (:func:`isolation_problem`); one
    message naming ``env.sandbox`` and its choices, else none. Torch-free."""
    if cfg.env.name not in CODE_ENVIRONMENTS or cfg.env.sandbox != BWRAP:
        return []
    problem = isolation_problem()
    if problem is None:
        return []
    return [f"env.sandbox=bwrap cannot isolate model-written code here: {problem}; choose "
            f"env.sandbox=bwrap on a machine where bwrap runs with user namespaces allowed, or "
            f"env.sandbox={UNSAFE_SUBPROCESS} (no isolation: the code runs as the trainer's "
            f"user, with a warning every step)"]


def unsafe_warning(env: Any) -> Optional[str]:
    """The warning a rollout logs every step while ``env``'s tools run code without isolation
    (a :class:`PythonSandbox` with ``isolation="unsafe_subprocess"``); None when none does."""
    unsafe = sorted(t.name for t in getattr(env, "tools", ())
                    if isinstance(t, PythonSandbox) and t.isolation == UNSAFE_SUBPROCESS)
    if not unsafe:
        return None
    return (f"env.sandbox={UNSAFE_SUBPROCESS}: tool(s) {', '.join(unsafe)} run model-written "
            f"code without isolation, as the trainer's user (host files, network, processes); "
            f"use env.sandbox={BWRAP}")

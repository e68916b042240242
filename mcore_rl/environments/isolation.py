"""The bubblewrap command line of the Python sandbox (``env.sandbox=bwrap``, issue 40).

:func:`bwrap_command` turns a sandbox call into a ``bwrap`` (bubblewrap, the unprivileged
namespace tool of Flatpak; Debian package ``bubblewrap``) command line whose program runs:

- in new user, PID, network, IPC, UTS and (where the kernel has them) cgroup namespaces
  (``--unshare-*``): no network interface but its own loopback, no process of the host to see
  or signal, no SysV IPC object of the host;
- as uid/gid 65534 (``nobody``/``nogroup``) inside, every capability dropped (``--cap-drop
  ALL``), in a session of its own (``--new-session``), killed with its parent
  (``--die-with-parent``: when the runner kills ``bwrap``, the PID namespace and all in it go);
- on an empty root file system holding only a read-only view of the interpreter and its
  standard library (:func:`interpreter_view`: the binary at ``/sandbox/python/bin/python3``,
  the standard library under ``/sandbox/python/lib``, the shared libraries they load in
  ``/sandbox/python/shlib``, the dynamic loader at its own path; the standard library's
  ``site-packages`` covered by an empty directory), a minimal ``/dev`` and a private ``/tmp``
  (a tmpfs of :data:`TMP_SIZE_LIMIT` bytes holding the program as ``/tmp/main.py``, its working
  directory, the one place it can write: the root and ``/dev`` are remounted read-only);
- with no new process or thread at all: a seccomp filter (:func:`seccomp_program`) answers
  ``clone``, ``clone3``, ``fork`` and ``vfork`` with ``EAGAIN``. ``RLIMIT_NPROC`` does not bind
  root (nor a user namespace that root made: the kernel exempts the host's uid 0), and a pids
  cgroup cannot be made in most containers; the filter holds for any user, in any container
  that allows seccomp. It is the limit the unprivileged ``RLIMIT_NPROC=0`` of the plain
  subprocess sandbox gave, now for root too. The same filter refuses ``unshare`` and ``setns``
  (no further namespaces: what ``bwrap --disable-userns`` does, at no cost per call).

The CPU, memory, file-size and open-file limits stay the bootstrap's ``setrlimit`` calls
(:mod:`mcore_rl.environments.sandbox`), the wall-clock limit and the output cut the runner's.
"""

from __future__ import annotations

import errno
import functools
import glob
import hashlib
import os
import platform
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from typing import List, Sequence, Tuple

SANDBOX_UID = SANDBOX_GID = 65534  # nobody / nogroup inside the sandbox
PYTHON_PREFIX = "/sandbox/python"  # the interpreter's prefix inside the sandbox
PYTHON = PYTHON_PREFIX + "/bin/python3"
LIB_DIR = PYTHON_PREFIX + "/shlib"  # the shared libraries the interpreter and its modules load
PROGRAM = "/tmp/main.py"  # the program inside the sandbox
TMP_SIZE_LIMIT = 64 << 20  # bytes of the private /tmp (a tmpfs: memory the sandbox may fill)


class IsolationUnavailable(RuntimeError):
    """The bubblewrap sandbox cannot be built on this machine (the message says why)."""


@dataclass(frozen=True)
class InterpreterView:
    """What of the host the sandbox sees: read-only ``(host path, sandbox path)`` binds, and
    directories inside them covered by an empty tmpfs (``site-packages``)."""

    binds: Tuple[Tuple[str, str], ...]
    hidden: Tuple[str, ...]


def _shared_libraries(files: Sequence[str]) -> Tuple[List[Tuple[str, str]], List[str]]:
    """``([(soname, host path)], [dynamic loader paths])`` that ``files`` load, from ``ldd``.

    Raises:
        IsolationUnavailable: no ``ldd``, or a library it cannot find.
    """
    ldd = shutil.which("ldd")
    if ldd is None:
        raise IsolationUnavailable("ldd (glibc's libc-bin) is not installed: the sandbox "
                                   "cannot list the interpreter's shared libraries")
    out = subprocess.run([ldd, *files], capture_output=True, text=True, check=False).stdout
    libs, loaders = {}, []
    for line in out.splitlines():
        line = line.strip()
        if "=>" in line:
            name, _, rest = line.partition("=>")
            path = rest.split("(")[0].strip()
            if path == "not found":
                raise IsolationUnavailable(f"ldd: {name.strip()} not found (needed by the "
                                           f"interpreter's standard library)")
            if path:
                libs.setdefault(name.strip(), path)
        elif line.startswith("/") and "(" in line:
            loader = line.split("(")[0].strip()
            if loader not in loaders:
                loaders.append(loader)
    return sorted(libs.items()), loaders


def _cache_root() -> str:
    """A directory of this user's for the staged interpreter files: ``$XDG_CACHE_HOME`` or
    ``~/.cache``, under ``mcore_rl/sandbox``; where that cannot be made, a directory of this
    uid's own (mode 0700) in the system's temporary directory."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    root = os.path.join(base, "mcore_rl", "sandbox")
    try:
        os.makedirs(root, exist_ok=True)
        return root
    except OSError:
        root = os.path.join(tempfile.gettempdir(), f"mcore_rl_sandbox_{os.getuid()}")
        os.makedirs(root, mode=0o700, exist_ok=True)
        st = os.lstat(root)
        if st.st_uid != os.getuid() or st.st_mode & 0o077 or not os.path.isdir(root):
            raise OSError(f"{root} is not a private directory of uid {os.getuid()}")
        return root


def _staged_prefix(executable: str, stdlib_dir: str, libs: Sequence[Tuple[str, str]]) -> str:
    """A host directory laid out as the sandbox's :data:`PYTHON_PREFIX`: ``bin/python3``, the
    shared libraries in ``shlib/`` (hard links where allowed, else copies), an empty
    ``stdlib_dir`` (the standard library's mount point). Made once per machine and
    interpreter (named by a hash of the files' paths, sizes and times; built aside and renamed
    into place, so processes racing to make it agree), so that a sandbox call binds one
    directory instead of one file per library (bubblewrap's cost grows with each mount).

    Raises:
        OSError: the directory cannot be made.
    """
    files = [("bin/python3", executable)] + [(f"shlib/{name}", path) for name, path in libs]
    key = hashlib.sha256(stdlib_dir.encode())
    for inner, host in files:
        st = os.stat(host)
        key.update(f"{inner}\0{host}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    root = _cache_root()
    target = os.path.join(root, f"python-{key.hexdigest()[:16]}")
    if os.path.isdir(target):
        return target
    work = tempfile.mkdtemp(prefix=".staging-", dir=root)
    try:
        os.makedirs(os.path.join(work, stdlib_dir))
        for inner, host in files:
            dest = os.path.join(work, inner)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            try:
                os.link(os.path.realpath(host), dest)
            except OSError:  # another file system, or protected_hardlinks
                shutil.copy2(host, dest)
        os.chmod(work, 0o755)
        try:
            os.rename(work, target)
        except OSError:
            if not os.path.isdir(target):  # not a race lost to another process
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


@functools.cache
def interpreter_view() -> InterpreterView:
    """The read-only view of this interpreter (the base one, outside any virtual environment)
    and its standard library that the sandbox gets. Computed once per process (``ldd`` over the
    interpreter and its extension modules takes about a second), from a staged prefix
    (:func:`_staged_prefix`) where one can be made, else one bind per file.

    Raises:
        IsolationUnavailable: the standard library's layout is not one this view handles, or
            a shared library cannot be found.
    """
    executable = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    stdlib = os.path.realpath(sysconfig.get_path("stdlib"))
    dynload = os.path.realpath(sysconfig.get_config_var("DESTSHARED") or
                               os.path.join(stdlib, "lib-dynload"))
    if not os.path.isfile(os.path.join(stdlib, "os.py")) or \
            os.path.commonpath([stdlib, dynload]) != stdlib:
        raise IsolationUnavailable(f"the standard library's layout ({stdlib}, extension "
                                   f"modules in {dynload}) is not <stdlib>/os.py with "
                                   f"<stdlib>/lib-dynload")
    stdlib_dir = f"{sys.platlibdir}/python{sys.version_info[0]}.{sys.version_info[1]}"
    inner_stdlib = f"{PYTHON_PREFIX}/{stdlib_dir}"
    libs, loaders = _shared_libraries([executable, *sorted(glob.glob(dynload + "/*.so"))])
    try:
        binds = [(_staged_prefix(executable, stdlib_dir, libs), PYTHON_PREFIX)]
    except OSError:
        binds = [(executable, PYTHON)] + [(path, f"{LIB_DIR}/{name}") for name, path in libs]
    binds.append((stdlib, inner_stdlib))
    binds += [(os.path.realpath(loader), loader) for loader in loaders]
    hidden = tuple(f"{inner_stdlib}/{d}" for d in ("site-packages", "dist-packages")
                   if os.path.isdir(os.path.join(stdlib, d)))
    return InterpreterView(tuple(binds), hidden)


# ---------------------------------------------------------------------------- seccomp

# Classic BPF over struct seccomp_data {int nr; u32 arch; ...} (linux/seccomp.h, filter.h).
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
# machine -> (AUDIT_ARCH_*, the syscalls that make a process, a thread or a namespace, x32 ABI
# numbers exist)
_ARCHES = {
    # clone, fork, vfork, clone3, unshare, setns
    "x86_64": (0xC000003E, (56, 57, 58, 435, 272, 308), True),
    # clone, clone3, unshare, setns (no fork, vfork)
    "aarch64": (0xC00000B7, (220, 435, 97, 268), False),
}


@functools.cache
def seccomp_program() -> bytes:
    """A seccomp filter (``struct sock_filter[]``, what ``bwrap --seccomp FD`` reads) that
    answers every syscall making a process, a thread or a namespace with ``EAGAIN`` (Python
    raises ``BlockingIOError`` / ``RuntimeError: can't start new thread``), kills the process on
    a syscall of another ABI (i386, x32: numbers this filter does not check), allows the rest.

    Raises:
        IsolationUnavailable: a machine other than x86_64 and aarch64.
    """
    machine = platform.machine()
    if machine not in _ARCHES:
        raise IsolationUnavailable(f"no process-bounding seccomp filter for machine "
                                   f"{machine!r} (x86_64 and aarch64 have one)")
    arch, blocked, x32 = _ARCHES[machine]
    # (code, true target, false target, k); targets: the label of a return, or None: next.
    program: List[Tuple[int, object, object, int]] = [(_LD_W_ABS, None, None, 4),  # arch
                                                      (_JEQ_K, None, "kill", arch),
                                                      (_LD_W_ABS, None, None, 0)]  # nr
    if x32:
        program.append((_JGE_K, "kill", None, 0x40000000))
    program += [(_JEQ_K, "deny", None, nr) for nr in blocked]
    returns = {"allow": _RET_ALLOW, "deny": _RET_ERRNO | errno.EAGAIN, "kill": _RET_KILL_PROCESS}
    at = {label: len(program) + i for i, label in enumerate(returns)}
    out = b""
    for i, (code, true, false, k) in enumerate(program):
        jt, jf = (0 if t is None else at[t] - i - 1 for t in (true, false))
        out += struct.pack("HBBI", code, jt, jf, k)
    return out + b"".join(struct.pack("HBBI", _RET_K, 0, 0, k) for k in returns.values())


# ---------------------------------------------------------------------------- command line

def bwrap_command(bwrap: str, program_fd: int, seccomp_fd: int,
                  python_args: Sequence[str]) -> List[str]:
    """The ``bwrap`` command line that runs ``PYTHON python_args...`` isolated as this
    module's docstring says, the program read from ``program_fd`` into :data:`PROGRAM` and the
    filter from ``seccomp_fd`` (both inherited by ``bwrap``: ``pass_fds``).

    Raises:
        IsolationUnavailable: as :func:`interpreter_view` and :func:`seccomp_program`.
    """
    view = interpreter_view()
    seccomp_program()  # refuse an unknown machine before bwrap reads the descriptor
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent",
            "--new-session", "--cap-drop", "ALL", "--uid", str(SANDBOX_UID),
            "--gid", str(SANDBOX_GID), "--hostname", "sandbox"]
    for host, inner in view.binds:
        argv += ["--ro-bind", host, inner]
    for inner in view.hidden:
        argv += ["--tmpfs", inner, "--remount-ro", inner]
    argv += ["--dev", "/dev", "--remount-ro", "/dev",
             "--size", str(TMP_SIZE_LIMIT), "--tmpfs", "/tmp", "--file", str(program_fd), PROGRAM,
             "--remount-ro", "/", "--chdir", "/tmp",
             "--seccomp", str(seccomp_fd),
             "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
             "--setenv", "LD_LIBRARY_PATH", LIB_DIR,
             "--", PYTHON, *python_args]
    return argv

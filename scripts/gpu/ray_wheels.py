"""Ray's wheels and their requirements, for scripts/gpu/ray_carry.sh and session.sh's stage ray.

    python3 scripts/gpu/ray_wheels.py closed DIR   # carry: every requirement of every wheel in
                                                   # DIR (Python 3.12, Linux x86-64) is met by a
                                                   # wheel in DIR; exit 1 naming those that are not
    python3 scripts/gpu/ray_wheels.py needed DIR   # device: the wheels of DIR to install, one a
                                                   # line: their distribution is not importable
                                                   # here, or is at a version outside what the
                                                   # wheels of DIR require of it
    python3 scripts/gpu/ray_wheels.py met DIR      # device, after the install: DIR has Ray's
                                                   # wheel, that Ray is importable and every
                                                   # requirement of DIR's wheels holds for what
                                                   # is (exit 1 naming what does not)

A requirement's markers are evaluated for the interpreter that runs this (``closed``: for
CPython 3.12 on Linux x86-64, the GPU machines'); extras are not followed (Ray's core install).
Uses pip's own copy of ``packaging``: the device may lack the package until Ray's is installed.
"""

from __future__ import annotations

import re
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # pragma: no cover - the device before Ray's packaging is installed
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

DEVICE = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def wheels(folder: str) -> dict[str, tuple[Path, str]]:
    """``{distribution: (wheel path, version)}`` of the wheels in ``folder``."""
    out = {}
    for path in sorted(Path(folder).glob("*.whl")):
        name, ver, _, _ = parse_wheel_filename(path.name)
        out[canonicalize_name(name)] = (path, str(ver))
    return out


def requirements(path: Path, env: dict | None) -> list[Requirement]:
    """The Requires-Dist of the wheel at ``path`` (its own dist-info's METADATA, not that of a
    package it vendors) whose markers hold for ``env`` (None: this interpreter) with no extra."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        text = z.read(meta).decode()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in text.split("\n\n", 1)[0].splitlines()
            if line.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({**(env or {}), "extra": ""})]


def all_requirements(found: dict[str, tuple[Path, str]], env: dict | None) -> list[tuple[str, Requirement]]:
    """``(distribution that requires, requirement)`` over every wheel of ``found``."""
    return [(name, req) for name, (path, _) in found.items() for req in requirements(path, env)]


def installed(name: str) -> str | None:
    """The version of distribution ``name`` importable here, or None."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main(argv: list[str]) -> int:
    """``COMMAND FOLDER`` (the module docstring's commands ``closed``, ``needed``, ``met``);
    returns the exit status: 1 with each unmet requirement on stderr, else 0. Raises
    ``SystemExit`` with the usage for an unknown command."""
    command, folder = argv
    found = wheels(folder)
    if command == "closed":
        bad = [f"{who} requires '{req}', and {folder} has "
               + (f"{canonicalize_name(req.name)} {found[canonicalize_name(req.name)][1]}"
                  if canonicalize_name(req.name) in found else "no wheel of it")
               for who, req in all_requirements(found, DEVICE)
               if canonicalize_name(req.name) not in found
               or not req.specifier.contains(found[canonicalize_name(req.name)][1], prereleases=True)]
    elif command == "needed":
        reqs = all_requirements(found, None)
        for name, (path, ver) in found.items():
            have = installed(name)
            if have is None or (name == "ray" and have != ver) or any(
                    canonicalize_name(r.name) == name and not r.specifier.contains(have, prereleases=True)
                    for _, r in reqs):
                print(path)
        return 0
    elif command == "met":
        bad = [f"{who} requires '{req}', importable: {installed(req.name) or 'none'}"
               for who, req in all_requirements(found, None)
               if installed(req.name) is None
               or not req.specifier.contains(installed(req.name), prereleases=True)]
        if "ray" not in found:
            bad.append(f"no ray wheel in {folder}")
        elif installed("ray") != found["ray"][1]:
            bad.append(f"ray {found['ray'][1]} carried, importable: {installed('ray') or 'none'}")
    else:
        raise SystemExit(__doc__)
    for line in bad:
        print(line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

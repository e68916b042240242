"""JSONL files that config keys name (GSM8K records, preference pairs): read line by line with
every error naming the key, the file and the line.

The file is UTF-8; a leading byte-order mark (as Windows editors and some exporters write) is
skipped, as pandas and ``datasets`` do; blank lines are skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, TypeVar

from mcore_rl.config.checks import ConfigError
from mcore_rl.config.paths import file_problem

T = TypeVar("T")


def read_jsonl(path: str | Path, key: Optional[str], parse: Callable[[str, str, str], T],
               empty: str) -> List[T]:
    """``parse(line, source, prefix)`` of every non-blank line of ``path``, in order;
    ``source`` is ``"<path>:<line>"`` (1-based), ``prefix`` is ``"<key>: "`` (empty without a
    key), for the parser's own errors.

    Raises:
        ConfigError: ``"[<key>: ]<path>: no such file"`` (or a directory);
            ``"[<key>: ]<path>:<line>: not UTF-8 text (...)"``; ``"[<key>: ]<path>: <empty>"``
            when no line holds a record; and what ``parse`` raises.
    """
    prefix = f"{key}: " if key else ""
    problem = file_problem(str(path))
    if problem:
        raise ConfigError(f"{prefix}{path}: {problem}")
    records = []
    with Path(path).open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            source = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{prefix}{source}: not UTF-8 text ({e.reason} at byte "
                                  f"{e.start})") from None
            if line.strip():
                records.append(parse(line, source, prefix))
    if not records:
        raise ConfigError(f"{prefix}{path}: {empty}")
    return records


def json_object(line: str, source: str, prefix: str) -> Dict[str, Any]:
    """The JSON object of one line.

    Raises:
        ConfigError: ``"<prefix><source>: malformed JSON: ..."`` or ``"...: expected a JSON
            object, got <type>"``.
    """
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{prefix}{source}: malformed JSON: {e}") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{prefix}{source}: expected a JSON object, got "
                          f"{type(record).__name__}")
    return record

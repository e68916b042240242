"""The generic prompt data set, ``data.task=dataset``: the user's own data in the formats the
field uses (TRL's ``datasets`` datasets, verl's Parquet, OpenRLHF's and slime's JSONL), with
its columns named by config keys.

- Formats (:func:`read_records`): JSON lines (``.jsonl``, ``.ndjson``), JSON (``.json``: an
  array of objects, or JSON lines under a ``.json`` name), Parquet (``.parquet``, read with
  ``pyarrow``), or a directory written by ``datasets``' ``save_to_disk`` (read with
  ``datasets.load_from_disk``; of a ``DatasetDict``, ``data.train_path`` takes its ``train``
  split and ``data.test_path`` its ``test`` split).
- Columns (:func:`to_example`): ``data.prompt_key`` (the prompt text), ``data.answer_key``
  (the ground truth the reward reads, as text; null: none), ``data.messages_key`` (a
  chat-format prompt: ``[{"role", "content"}, ...]`` with a ``user`` turn, in place of the
  prompt text). Every other column reaches the reward and the environment in
  :attr:`Example.fields <mcore_rl.data.example.Example.fields>`.
- Splits (:func:`task_examples`): ``data.test_path``, or ``data.test_fraction`` of the train
  rows held out by a seeded shuffle (:func:`hold_out`), or none.

A row is named in errors by its file and line (``train.jsonl:3``, 1-based, as editors count) or
its row (``train.parquet: row 2``, 0-based, as pandas and ``datasets`` count); every bad input
is one :class:`~mcore_rl.config.checks.ConfigError` line that names the key too
(``data.train_path: train.jsonl:3: empty prompt (data.prompt_key 'prompt')``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple

from mcore_rl.config.checks import ConfigError
from mcore_rl.data.example import Example

if TYPE_CHECKING:
    from mcore_rl.config.schema import DataConfig

JSONL_SUFFIXES = (".jsonl", ".ndjson")
JSON_SUFFIXES = (".json",)
PARQUET_SUFFIXES = (".parquet", ".pq")
# Files that mark a `datasets` save_to_disk directory: a Dataset's, a DatasetDict's.
SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")
FORMATS = "a .jsonl, .json or .parquet file, or a datasets save_to_disk directory"
# The split of a saved DatasetDict each path key takes.
SPLITS = {"data.train_path": "train", "data.test_path": "test"}

Record = Tuple[str, Dict[str, Any]]  # (source: "<file>:<line>" or "<file>: row <i>", the row)


def path_problem(path: str) -> Optional[str]:
    """Why ``path`` cannot be read as a data set (no such file, a directory that is no
    ``save_to_disk`` output, a file of an unknown format), or None."""
    p = Path(path).expanduser()
    if p.is_dir():
        if any((p / name).is_file() for name in SAVED_DATASET_FILES):
            return None
        return (f"a directory without {' or '.join(SAVED_DATASET_FILES)} (not a datasets "
                f"save_to_disk directory)")
    if not p.is_file():
        return "no such file"
    if p.suffix.lower() not in JSONL_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES:
        return f"unknown format {p.suffix or '(no suffix)'!r}: expected {FORMATS}"
    return None


def read_records(path: str, key: Optional[str]) -> List[Record]:
    """The rows of the data set at ``path``, each with its source.

    Args:
        path: a file or directory (:data:`FORMATS`).
        key: the config key that named it (``"data.train_path"``) or None; errors start with
            ``"<key>: "`` when given, and it picks a saved ``DatasetDict``'s split
            (:data:`SPLITS`; ``train`` for None).

    Raises:
        ConfigError: :func:`path_problem`; a JSON line or file that is not UTF-8, not JSON or
            not an object per row (naming the line or row); a Parquet file pyarrow cannot read
            ("not a Parquet file"); a ``DatasetDict`` without the key's split; no rows at all
            ("empty dataset").
    """
    prefix = f"{key}: " if key else ""
    problem = path_problem(path)
    if problem:
        raise ConfigError(f"{prefix}{path}: {problem}")
    p = Path(path).expanduser()
    if p.is_dir():
        records, what = _saved_dataset(p, path, prefix, SPLITS.get(key, "train")), "rows"
    elif p.suffix.lower() in PARQUET_SUFFIXES:
        records, what = _parquet(p, path, prefix), "rows"
    elif p.suffix.lower() in JSON_SUFFIXES:
        records, what = _json(p, path, prefix), "JSON records"
    else:
        records, what = list(read_jsonl(p, path, prefix)), "JSON records"
    if not records:
        raise ConfigError(f"{prefix}{path}: empty dataset (no {what})")
    return records


def read_jsonl(p: Path, path: str, prefix: str) -> Iterator[Record]:
    """The JSON objects of a JSON-lines file, one a line (UTF-8, a leading byte-order mark
    skipped as pandas and ``datasets`` do; blank lines skipped), with ``"<path>:<line>"``.

    Raises:
        ConfigError: ``"<prefix><path>:<line>: ..."`` for a line that is not UTF-8, not JSON,
            or not a JSON object.
    """
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            source = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{prefix}{source}: not UTF-8 text ({e.reason} at byte "
                                  f"{e.start})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{prefix}{source}: malformed JSON: {e}") from None
            yield source, _object(record, source, prefix)


def _object(record: Any, source: str, prefix: str) -> Dict[str, Any]:
    if not isinstance(record, dict):
        raise ConfigError(f"{prefix}{source}: expected a JSON object, got {type(record).__name__}")
    return record


def _json(p: Path, path: str, prefix: str) -> List[Record]:
    """A ``.json`` file: an array of objects (rows 0-based), or JSON lines under that name."""
    try:
        text = p.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{prefix}{path}: not UTF-8 text ({e.reason} at byte "
                          f"{e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # one value, then more: JSON lines
            return list(read_jsonl(p, path, prefix))
        raise ConfigError(f"{prefix}{path}: malformed JSON: {e}") from None
    if not isinstance(data, list):
        raise ConfigError(f"{prefix}{path}: expected a JSON array of objects (or JSON lines), "
                          f"got a JSON {type(data).__name__}")
    return [(f"{path}: row {i}", _object(r, f"{path}: row {i}", prefix))
            for i, r in enumerate(data)]


def _parquet(p: Path, path: str, prefix: str) -> List[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(p)
    except (pa.ArrowException, OSError) as e:
        reason = " ".join(str(e).split())
        raise ConfigError(f"{prefix}{path}: not a Parquet file (pyarrow: {reason})") from None
    return [(f"{path}: row {i}", row) for i, row in enumerate(table.to_pylist())]


def _saved_dataset(p: Path, path: str, prefix: str, split: str) -> List[Record]:
    """A ``save_to_disk`` directory: a ``Dataset``'s rows, or those of a ``DatasetDict``'s
    ``split`` (sources ``"<path>[<split>]: row <i>"``)."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(p))
    except Exception as e:  # datasets raises FileNotFoundError, ValueError, ArrowInvalid, ...
        reason = " ".join(str(e).split())
        raise ConfigError(f"{prefix}{path}: datasets.load_from_disk cannot read it ({reason})") \
            from None
    where = path
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(f"{prefix}{path}: a DatasetDict without a {split!r} split (splits: "
                              f"{', '.join(loaded)}); name the split's directory instead")
        loaded, where = loaded[split], f"{path}[{split}]"
    return [(f"{where}: row {i}", row) for i, row in enumerate(loaded.to_list())]


def _column(record: Dict[str, Any], column: str, key: str, source: str, prefix: str) -> Any:
    if column not in record:
        found = ", ".join(repr(k) for k in record) or "none"
        raise ConfigError(f"{prefix}{source}: no column {column!r} ({key}); found {found}")
    return record[column]


def _messages(value: Any, column: str, source: str, prefix: str) -> Tuple[Dict[str, str], ...]:
    """A row's chat messages, checked: a non-empty list of ``{"role": str, "content": str}``
    with at least one ``user`` turn whose content is not empty."""
    where = f"{prefix}{source}: data.messages_key {column!r}"
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"{where} must be a non-empty list of {{'role', 'content'}} messages, "
                          f"got {type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise ConfigError(f"{where}: message {i} is not a {{'role': str, 'content': str}} "
                              f"object")
        out.append({"role": m["role"], "content": m["content"]})
    users = [m for m in out if m["role"] == "user"]
    if not users:
        roles = ", ".join(m["role"] for m in out)
        raise ConfigError(f"{where} has no 'user' turn (roles: {roles})")
    if not users[-1]["content"].strip():
        raise ConfigError(f"{where}: the last 'user' turn is empty")
    return tuple(out)


def to_example(source: str, record: Dict[str, Any], data: "DataConfig", prefix: str) -> Example:
    """One row as an :class:`~mcore_rl.data.example.Example` under ``data``'s column mapping:
    ``prompt`` the ``data.prompt_key`` text (or the last ``user`` turn of ``data.messages_key``),
    ``answer`` and ``solution`` the ``data.answer_key`` value as text (``str()`` of a number;
    empty with no answer key), ``fields`` the other columns.

    Raises:
        ConfigError: ``"<prefix><source>: ..."``: a missing column (naming its key and the
            columns found), a prompt that is not a string or is empty, messages that are not a
            list of role/content objects or have no ``user`` turn, a null answer.
    """
    used = [data.answer_key] if data.answer_key is not None else []
    if data.messages_key is not None:
        messages = _messages(_column(record, data.messages_key, "data.messages_key", source,
                                     prefix), data.messages_key, source, prefix)
        prompt = [m for m in messages if m["role"] == "user"][-1]["content"]
        used.append(data.messages_key)
    else:
        messages = None
        prompt = _column(record, data.prompt_key, "data.prompt_key", source, prefix)
        if not isinstance(prompt, str):
            hint = "; for chat messages set data.messages_key" if isinstance(prompt, list) else ""
            raise ConfigError(f"{prefix}{source}: the prompt (data.prompt_key {data.prompt_key!r}) "
                              f"is a {type(prompt).__name__}, not a string{hint}")
        if not prompt.strip():
            raise ConfigError(f"{prefix}{source}: empty prompt (data.prompt_key "
                              f"{data.prompt_key!r})")
        used.append(data.prompt_key)
    answer = ""
    if data.answer_key is not None:
        value = _column(record, data.answer_key, "data.answer_key; null for none", source, prefix)
        if value is None:
            raise ConfigError(f"{prefix}{source}: the answer (data.answer_key "
                              f"{data.answer_key!r}) is null")
        answer = value if isinstance(value, str) else str(value)
    fields = {k: v for k, v in record.items() if k not in used}
    return Example(prompt=prompt, answer=answer, solution=answer, source=source,
                   messages=messages, fields=fields)


def load_examples(path: str, key: str, data: "DataConfig") -> List[Example]:
    """:func:`read_records` of ``path`` (named by config key ``key``), each row through
    :func:`to_example`."""
    return [to_example(source, record, data, f"{key}: ")
            for source, record in read_records(path, key)]


def hold_out(examples: Sequence[Example], fraction: float,
             seed: int) -> Tuple[List[Example], List[Example]]:
    """``(train, test)``: ``max(1, round(fraction x N))`` of the ``N`` examples drawn by
    ``random.Random(seed)`` are the test split, the rest the train split, each in file order.

    Raises:
        ConfigError: nothing would be left to train on (names ``data.test_fraction``).
    """
    n = len(examples)
    k = max(1, round(fraction * n))
    if k >= n:
        raise ConfigError(f"data.test_fraction={fraction} holds out {k} of the {n} rows of "
                          f"data.train_path: none left to train on")
    test = set(random.Random(seed).sample(range(n), k))
    return ([ex for i, ex in enumerate(examples) if i not in test],
            [ex for i, ex in enumerate(examples) if i in test])


def split_errors(data: "DataConfig") -> List[str]:
    """``data.test_fraction`` and ``data.test_path`` are not both set (the tasks that read
    files: ``gsm8k``, ``dataset``)."""
    if data.test_fraction > 0 and data.test_path:
        return [f"data.test_fraction={data.test_fraction} and data.test_path are both set: hold "
                f"out a fraction of data.train_path or read data.test_path, not both"]
    return []


def task_errors(data: "DataConfig") -> List[str]:
    """The load-time check of ``data.task=dataset`` (its entry in
    :data:`mcore_rl.config.registry.TASKS`), one message per problem naming its keys:
    ``data.train_path`` set, each path readable (:func:`path_problem`), one way to the test
    split."""
    missing = [] if data.train_path else [f"data.task=dataset needs data.train_path ({FORMATS})"]
    paths = {key: getattr(data, key.partition(".")[2]) for key in SPLITS}
    return missing + [f"{key}: {path}: {problem}" for key, path in paths.items()
                      if path and (problem := path_problem(path))] + split_errors(data)


def task_examples(data: "DataConfig", seed: int) -> Tuple[List[Example], List[Example]]:
    """``data.task=dataset``: the examples of ``data.train_path`` and of ``data.test_path``
    (:func:`load_examples`), or the train rows split by ``data.test_fraction`` (seed
    ``data.split_seed``, else ``seed``: the run seed), or no test split."""
    train = load_examples(data.train_path, "data.train_path", data)
    if data.test_path is not None:
        return train, load_examples(data.test_path, "data.test_path", data)
    if data.test_fraction > 0:
        return hold_out(train, data.test_fraction,
                        seed if data.split_seed is None else data.split_seed)
    return train, []

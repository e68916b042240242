"""GSM8K-schema JSONL loader (Cobbe et al. 2021, "Training Verifiers to Solve Math Word
Problems"; https://github.com/openai/grade-school-math).

One JSON object per line with ``question`` and ``answer``; the answer's reasoning ends with a
final line ``#### N``. The file is UTF-8; a leading byte-order mark (as Windows editors and some
exporters write) is skipped, as pandas and ``datasets`` do. The loaded
:class:`~mcore_rl.data.example.Example` has:

- ``answer``: ``N`` without thousands separators (``"#### 1,080"`` gives ``"1080"``).
- ``solution``: the reasoning with the calculator annotations ``<<48/2=24>>`` removed and the
  ``#### N`` line rewritten as ``The answer is N.``: natural text for a warm start, in the form
  the ``math`` verifier anchors on (it also accepts ``#### N``).
- ``source``: ``"<path>:<line>"`` (1-based line number).

A small sample (the first 64 train and 32 test lines of GSM8K, MIT licence) ships in
:data:`GSM8K_SAMPLE_DIR` for CPU runs and tests.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Tuple

from mcore_rl.config.checks import ConfigError
from mcore_rl.config.paths import file_problem
from mcore_rl.data.example import Example
from mcore_rl.data.jsonl import json_object, read_jsonl

if TYPE_CHECKING:
    from mcore_rl.config.schema import DataConfig

GSM8K_SAMPLE_DIR = Path(__file__).resolve().parent / "samples" / "gsm8k"

_CALCULATOR_ANNOTATION = re.compile(r"<<[^>]*>>")


def load_gsm8k(path: str | Path, key: Optional[str] = None) -> List[Example]:
    """Read a GSM8K-schema JSONL file (UTF-8, with or without a byte-order mark); blank lines
    are skipped.

    Args:
        path: the JSONL file.
        key: the config key that named ``path`` (e.g. ``"data.train_path"``); errors start
            with ``"<key>: "`` when given.

    Raises:
        ConfigError: ``"[<key>: ]<path>: no such file"`` (or a directory);
            ``"[<key>: ]<path>:<line>: ..."`` for a line that is not UTF-8 or not a JSON
            object, lacks ``question`` or ``answer`` (or has a non-string one), or whose answer
            has no ``#### N`` final answer; ``"[<key>: ]<path>: empty dataset"`` when no line
            holds a record.
    """
    return read_jsonl(path, key, _parse_record, "empty dataset (no JSON records)")


def _parse_record(line: str, source: str, prefix: str) -> Example:
    """One JSONL line into an Example; errors start with ``prefix`` and ``source``
    (``path:line``)."""
    record = json_object(line, source, prefix)
    for field in ("question", "answer"):
        if not isinstance(record.get(field), str):
            found = ", ".join(repr(k) for k in record) or "none"
            raise ConfigError(f"{prefix}{source}: missing or non-string field {field!r} (a GSM8K "
                              f"record has string fields 'question' and 'answer'; found {found})")
    reasoning, sep, final = record["answer"].rpartition("####")
    answer = final.strip().replace(",", "")
    if not sep or not answer:
        raise ConfigError(f"{prefix}{source}: answer has no final '#### N' line")
    steps = _CALCULATOR_ANNOTATION.sub("", reasoning).strip()
    solution = f"{steps}\nThe answer is {answer}." if steps else f"The answer is {answer}."
    return Example(prompt=record["question"], answer=answer, solution=solution, source=source)


def task_errors(data: "DataConfig") -> List[str]:
    """The load-time check of ``data.task=gsm8k`` (its entry in
    :data:`mcore_rl.config.registry.TASKS`), one message per problem naming its keys:
    ``data.train_path`` set, and each path set an existing file."""
    missing = [] if data.train_path else ["data.task=gsm8k needs data.train_path (a GSM8K "
                                          "JSONL file)"]
    paths = {f"data.{name}": getattr(data, name) for name in ("train_path", "test_path")}
    return missing + [f"{key}: {path}: {problem}" for key, path in paths.items()
                      if path and (problem := file_problem(path))]


def task_examples(data: "DataConfig", seed: int) -> Tuple[List[Example], List[Example]]:
    """``data.task=gsm8k``: :func:`load_gsm8k` of ``data.train_path`` and of
    ``data.test_path`` (empty when null: no validation set; the train file is never split, so
    the training prompts stay what the file says). ``seed`` is unused."""
    train = load_gsm8k(data.train_path, key="data.train_path")
    test = load_gsm8k(data.test_path, key="data.test_path") if data.test_path is not None else []
    return train, test

"""GSM8K-schema JSONL loader (Cobbe et al. 2021, "Training Verifiers to Solve Math Word
Problems"; https://github.com/openai/grade-school-math): a configuration of the generic data set
(:mod:`mcore_rl.data.dataset`: its reader, formats and test split) with GSM8K's columns and
answer parsing.

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
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from mcore_rl.config.checks import ConfigError
from mcore_rl.data.dataset import hold_out, path_problem, read_records, split_errors
from mcore_rl.data.example import Example

if TYPE_CHECKING:
    from mcore_rl.config.schema import DataConfig

GSM8K_SAMPLE_DIR = Path(__file__).resolve().parent / "samples" / "gsm8k"

_CALCULATOR_ANNOTATION = re.compile(r"<<[^>]*>>")


def load_gsm8k(path: str | Path, key: Optional[str] = None) -> List[Example]:
    """Read a GSM8K-schema data set: JSONL (UTF-8, with or without a byte-order mark; blank
    lines skipped) or any other format of the generic reader
    (:func:`mcore_rl.data.dataset.read_records`: JSON, Parquet, a ``save_to_disk`` directory).

    Args:
        path: the data set.
        key: the config key that named ``path`` (e.g. ``"data.train_path"``); errors start
            with ``"<key>: "`` when given.

    Raises:
        ConfigError: ``"[<key>: ]<path>: no such file"`` (or a directory that is no saved
            data set, an unknown format); ``"[<key>: ]<path>:<line>: ..."`` for a line that is
            not UTF-8 or not a JSON object, lacks ``question`` or ``answer`` (or has a
            non-string one), or whose answer has no ``#### N`` final answer;
            ``"[<key>: ]<path>: empty dataset"`` when no line holds a record.
    """
    prefix = f"{key}: " if key else ""
    return [_gsm8k_example(record, source, prefix) for source, record in
            read_records(str(path), key)]


def _gsm8k_example(record: Dict[str, Any], source: str, prefix: str) -> Example:
    """One GSM8K record into an Example; errors start with ``prefix`` and ``source``
    (``path:line``)."""
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
    ``data.train_path`` set, each path set readable, one way to the test split."""
    missing = [] if data.train_path else ["data.task=gsm8k needs data.train_path (a GSM8K "
                                          "JSONL file)"]
    paths = {f"data.{name}": getattr(data, name) for name in ("train_path", "test_path")}
    return missing + [f"{key}: {path}: {problem}" for key, path in paths.items()
                      if path and (problem := path_problem(path))] + split_errors(data)


def task_examples(data: "DataConfig", seed: int) -> Tuple[List[Example], List[Example]]:
    """``data.task=gsm8k``: :func:`load_gsm8k` of ``data.train_path`` and of
    ``data.test_path``; without a test path, ``data.test_fraction`` of the train rows held out
    (:func:`~mcore_rl.data.dataset.hold_out`, seed ``data.split_seed`` else ``seed``), or no
    validation set (the default: the train file is not split, so the training prompts stay
    what the file says)."""
    train = load_gsm8k(data.train_path, key="data.train_path")
    if data.test_path is not None:
        return train, load_gsm8k(data.test_path, key="data.test_path")
    if data.test_fraction > 0:
        return hold_out(train, data.test_fraction,
                        seed if data.split_seed is None else data.split_seed)
    return train, []

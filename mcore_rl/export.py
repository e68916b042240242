"""``mcore-rl export``: a run's policy (or reward-model) checkpoint to a Hugging Face model
directory.

Input: a checkpoint step directory ``<run_dir>/checkpoints/step_<k>`` as training writes it:
``policy/`` (an RL run) or ``reward_model/`` (``algorithm: rm``) is a Megatron dist checkpoint
(torch_dist format, saved at any TP/PP/VPP layout) and the run directory holds
``hf_config.json`` (the model's transformers config) and ``tokenizer/``, both written by the
trainer (:mod:`mcore_rl.controller.trainer`, :mod:`mcore_rl.controller.rm`) at start.

The checkpoint format is resharding-capable, so the exporter loads it in a one-process world
of its own (TP = PP = 1, on the CPU): it builds the Megatron model of the config's shape,
loads only the model tensors (optimizer state and the reference policy stay on disk), and
converts them to Hugging Face names with
:func:`~mcore_rl.megatron.conversion.export_hf_weights`, the refit path.

Output: ``config.json`` (``dtype`` set to the checkpoint's parameter dtype; a reward model's
names the family's ``*ForSequenceClassification`` class with ``num_labels=1``),
``generation_config.json`` (a policy's bos/eos/pad ids, when the config has an eos id), safetensors
weights written by ``huggingface_hub.save_torch_state_dict`` (one ``model.safetensors``, or
shards up to ``max_shard_size`` each plus ``model.safetensors.index.json``; every tensor once,
no ``lm_head.weight`` when embeddings are tied; a reward model's backbone and ``score.weight``),
and the run's tokenizer files.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path

import torch

HF_CONFIG_FILE = "hf_config.json"  # in the run directory
TOKENIZER_DIR = "tokenizer"  # in the run directory
POLICY_DIR = "policy"  # in a checkpoint step directory
REWARD_MODEL_DIR = "reward_model"  # in a step directory of an algorithm=rm run
_EMBEDDING_KEY = "embedding.word_embeddings.weight"  # Megatron's sharded key of the embedding
_PRECISIONS = {torch.float32: "fp32", torch.bfloat16: "bf16"}
# What huggingface_hub's max_shard_size accepts: bytes, or a number with KB/MB/GB/TB.
_SHARD_SIZE = re.compile(r"\d+|\d+(\.\d+)?\s*[KMGT]B", re.IGNORECASE)


def _sources(checkpoint: Path, hf_config: Path | None, tokenizer: Path | None):
    """``(policy checkpoint dir, config file, tokenizer dir)``; raises ``FileNotFoundError``
    naming the first path that is missing."""
    if not checkpoint.is_dir():
        raise FileNotFoundError(
            f"--checkpoint {checkpoint}: no such directory (expected "
            f"<run_dir>/checkpoints/step_<k>)"
        )
    policy = checkpoint / POLICY_DIR
    if not (policy / "metadata.json").is_file() and (checkpoint / REWARD_MODEL_DIR).is_dir():
        policy = checkpoint / REWARD_MODEL_DIR
    if not (policy / "metadata.json").is_file():
        raise FileNotFoundError(
            f"{policy}: no Megatron dist checkpoint (metadata.json missing); --checkpoint must be "
            f"a step directory <run_dir>/checkpoints/step_<k> written by training"
        )
    run_dir = checkpoint.absolute().parent.parent
    config = hf_config or run_dir / HF_CONFIG_FILE
    if config.is_dir():
        config = config / "config.json"
    if not config.is_file():
        raise FileNotFoundError(
            f"{config}: no Hugging Face config of the policy (training writes "
            f"<run_dir>/{HF_CONFIG_FILE}; else pass --hf-config with the model's config.json)"
        )
    tokenizer = tokenizer or run_dir / TOKENIZER_DIR
    if not tokenizer.is_dir():
        raise FileNotFoundError(
            f"{tokenizer}: no tokenizer directory (training writes <run_dir>/{TOKENIZER_DIR}; "
            f"else pass --tokenizer)"
        )
    return policy, config, tokenizer


@contextlib.contextmanager
def load_on_cpu():
    """Within the block, ``torch.load`` maps what it reads to the CPU unless told otherwise.

    A checkpoint saved by GPU workers keeps CUDA tensors in its common (unsharded) state, which
    Megatron's ``load_common_state_dict`` reads through ``torch.distributed.checkpoint`` with a
    bare ``torch.load``; on a machine without the GPU (export runs on CPU) that load fails with
    "Attempted to set the storage of a tensor on device cpu to a storage on ... cuda:0"
    (seen exporting a reward model trained on an H100)."""
    original = torch.load

    def load(*args, **kwargs):
        if len(args) < 2:
            kwargs.setdefault("map_location", "cpu")
        return original(*args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = original


def _check_against_checkpoint(request, saved, policy: Path, arch) -> None:
    """Raise ``ValueError`` when a tensor the model needs is absent from the checkpoint or has
    another global shape there (the config does not describe the saved model)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(request)
    missing, differ = [], []
    for tensor in nested_values(request):
        if not isinstance(tensor, ShardedTensor):
            continue
        if tensor.key not in saved:
            missing.append(tensor.key)
        elif tuple(saved[tensor.key].global_shape) != tuple(tensor.global_shape):
            differ.append(f"{tensor.key}: saved {tuple(saved[tensor.key].global_shape)}, "
                          f"config gives {tuple(tensor.global_shape)}")
    if missing or differ:
        raise ValueError(
            f"{policy} does not hold the config's model ({arch.family}, {arch.num_layers} "
            f"layers, hidden_size {arch.hidden_size}): missing tensors {sorted(set(missing))}; "
            f"shapes {sorted(set(differ))}"
        )


def load_hf_state_dict(policy: str | Path, hf_config,
                       reward_model: bool = False) -> dict[str, torch.Tensor]:
    """The Hugging Face-named weights of a policy (or reward-model) dist checkpoint.

    Args:
        policy: a Megatron dist checkpoint directory written by
            :meth:`~mcore_rl.workers.megatron_worker.MegatronTrainWorker.save_checkpoint`
            (the ``policy/`` of a step directory), at any TP/PP/VPP layout.
        hf_config: the policy's transformers config (Llama or Qwen2 family).
        reward_model: the checkpoint is a reward model's (``reward_model/``): the backbone
            with a scalar score head (:class:`~mcore_rl.workers.reward_model.RewardModelWorker`).

    Returns:
        ``{hf_name: tensor}``, CPU tensors in the saved parameter dtype (fp32 or bf16), in
        the HF model's ``state_dict`` order, vocabulary padding removed, no ``lm_head.weight``
        when embeddings are tied; a reward model's: the backbone's ``model.*`` and
        ``score.weight`` ``[1, h]`` (a ``*ForSequenceClassification`` model's names).

    Runs a one-process ``torch.distributed`` world (gloo, TP = PP = 1, Megatron's CPU
    redirects) and tears it down; raises ``RuntimeError`` if this process already has a
    process group (call it from a fresh process, as the CLI does). Raises ``ValueError``
    naming the checkpoint when it holds no embedding, fewer vocabulary rows than
    ``hf_config.vocab_size`` or non-zero rows past it (the Megatron model's vocabulary
    padding is zero, trained rows are not), an unsupported dtype, or tensors that do not
    match the config; ``ValueError`` from
    :func:`~mcore_rl.megatron.conversion.hf_config_to_arch` for a config the Megatron model
    cannot reproduce.
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from mcore_rl.config.schema import MegatronConfig
    from mcore_rl.distributed.worker_group import free_port
    from mcore_rl.megatron import parallel
    from mcore_rl.megatron.conversion import export_hf_weights, hf_config_to_arch
    from mcore_rl.megatron.model import build_model
    from mcore_rl.workers.scalar_head import (SCORE_WEIGHT, attach_scalar_heads, backbone_arch,
                                              without_heads)

    policy = Path(policy)
    arch = hf_config_to_arch(hf_config)
    saved = dist_checkpointing.load_tensors_metadata(str(policy))
    if _EMBEDDING_KEY not in saved:
        raise ValueError(f"{policy}: no {_EMBEDDING_KEY} tensor; not a policy checkpoint")
    embedding = saved[_EMBEDDING_KEY]
    rows = embedding.global_shape[0]  # the vocabulary padded for the saving TP size
    if rows < arch.vocab_size:
        raise ValueError(
            f"{policy}: the embedding has {rows} rows, fewer than the config's vocab_size "
            f"{arch.vocab_size}"
        )
    if embedding.dtype not in _PRECISIONS:
        raise ValueError(f"{policy}: parameters in {embedding.dtype}, expected one of "
                         f"{sorted(map(str, _PRECISIONS))}")
    if dist.is_initialized():
        raise RuntimeError("load_hf_state_dict runs a torch.distributed world of its own; this "
                           "process already has one")
    parallel.initialize(0, 1, "127.0.0.1", free_port(), "cpu")
    try:
        # Built with the saved row count: with TP = 1 it is not padded further.
        (model,) = build_model(arch, MegatronConfig(precision=_PRECISIONS[embedding.dtype]),
                               rows, "cpu")
        if reward_model:
            attach_scalar_heads([model], embedding.dtype, 0, torch.device("cpu"), bias=False)
        _check_against_checkpoint(model.sharded_state_dict(), saved, policy, arch)
        with load_on_cpu():
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(policy))
        model.load_state_dict(loaded["model"])
        # Padding rows stay zero in training (no token reaches them); trained rows do not.
        if model.embedding.word_embeddings.weight[arch.vocab_size:].count_nonzero():
            raise ValueError(
                f"{policy}: embedding rows from {arch.vocab_size} on are not padding (not "
                f"zero): the config's vocab_size {arch.vocab_size} is smaller than the model's"
            )
        # Vocab tensors are views of the padded rows: safetensors wants whole storages.
        if not reward_model:
            return {name: t if t.untyped_storage().nbytes() == t.nbytes else t.clone()
                    for name, t in export_hf_weights([model], arch, arch.vocab_size)}
        with without_heads([model]):
            out = {name: t.clone() for name, t in
                   export_hf_weights([model], backbone_arch(arch), arch.vocab_size)}
        return {**out, SCORE_WEIGHT: model.output_layer.weight.detach().clone()}
    finally:
        parallel.destroy()


def export_checkpoint(
    checkpoint: str | Path,
    output: str | Path,
    *,
    hf_config: str | Path | None = None,
    tokenizer: str | Path | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write a Hugging Face model directory from a run's checkpoint (``mcore-rl export``).

    Args:
        checkpoint: ``<run_dir>/checkpoints/step_<k>``.
        output: the directory to create (absent or empty).
        hf_config: the policy's transformers config file (or a directory with
            ``config.json``); default ``<run_dir>/hf_config.json``.
        tokenizer: tokenizer directory to copy; default ``<run_dir>/tokenizer``.
        max_shard_size: largest safetensors shard, bytes or a string such as ``"500MB"``.

    Returns the output directory, from which ``AutoModelForCausalLM.from_pretrained`` (a
    reward model's: ``AutoModelForSequenceClassification``) and
    ``AutoTokenizer.from_pretrained`` load.

    Raises ``FileNotFoundError`` naming the missing path (checkpoint directory, its
    ``policy/metadata.json``, the config, the tokenizer), ``FileExistsError`` when ``output``
    is a non-empty directory or a file, ``ValueError`` for a malformed ``max_shard_size``, and
    what :func:`load_hf_state_dict` raises (its ``ValueError`` with the config file named).
    """
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)

    policy, config_file, tokenizer_dir = _sources(
        Path(checkpoint), hf_config and Path(hf_config), tokenizer and Path(tokenizer))
    if not _SHARD_SIZE.fullmatch(str(max_shard_size).strip()):
        raise ValueError(f"--max-shard-size {max_shard_size!r}: expected bytes or a size such "
                         f"as 500MB or 5GB")
    if isinstance(max_shard_size, str) and max_shard_size.strip().isdigit():
        max_shard_size = int(max_shard_size)
    output = Path(output)
    if output.is_file() or (output.is_dir() and any(output.iterdir())):
        raise FileExistsError(f"--output {output}: exists and is not an empty directory")
    config = AutoConfig.from_pretrained(config_file)
    reward_model = policy.name == REWARD_MODEL_DIR
    try:
        state = load_hf_state_dict(policy, config, reward_model)
    except ValueError as e:
        raise ValueError(f"{e} (config: {config_file})") from e
    config.dtype = next(iter(state.values())).dtype
    if reward_model:  # transformers pools the last non-pad token: pad_token_id from the run
        config.architectures = [MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES[config.model_type]]
        config.num_labels = 1
    elif not config.architectures:
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    output.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(state, output, max_shard_size=max_shard_size)
    config.save_pretrained(output)
    if config.eos_token_id is not None and not reward_model:
        GenerationConfig.from_model_config(config).save_pretrained(output)
    for f in sorted(tokenizer_dir.iterdir()):
        if f.is_file():
            shutil.copy2(f, output / f.name)
    return output

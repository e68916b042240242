"""Load-time checks of learned rewards and reward-model training, torch-free: the reward model
(``reward.name=model``, ``reward_model.*``), the generative judge (``reward.name=judge``,
``judge.*``) and ``algorithm: rm`` (``rm.*``). :func:`learned_reward_rules` is one rule of
:data:`mcore_rl.config.rules.RULES`.

What is read here besides the config: the names of a checkpoint's tensors (the safetensors
header or index, :func:`checkpoint_tensor_names`), to refuse a reward-model checkpoint without a
score head before any worker starts. Tokenizers are compared where they are loaded (the
trainer, before any worker starts): that needs transformers.
"""

from __future__ import annotations

import dataclasses
import json
import re
import string
import struct
from pathlib import Path
from typing import List, Optional, Sequence, Set

from mcore_rl.config.paths import (HF_WEIGHTS, HF_WEIGHTS_INDEX, file_problem,
                                   hf_checkpoint_errors, tokenizer_dir_error)
from mcore_rl.config.registry import LEARNED_REWARDS, backend_errors
from mcore_rl.config.schema import TrainConfig

# The judge template's fields: the decoded response (required), the task's question and answer.
JUDGE_FIELDS = ("response", "prompt", "answer")
SCORE_HEAD = "score.weight"
_MAX_HEADER = 100_000_000  # the safetensors format's limit on its JSON header, in bytes


def checkpoint_tensor_names(directory: str) -> Optional[Set[str]]:
    """The tensor names of a Hugging Face checkpoint directory: the keys of
    ``model.safetensors``'s JSON header (its first 8 bytes give the header's length, little
    endian), or of ``model.safetensors.index.json``'s ``weight_map``; None when neither reads
    (:func:`~mcore_rl.config.paths.hf_checkpoint_errors` names what is missing) or the file is
    no safetensors file (a header length past the file's end or the format's 100 MB)."""
    p = Path(directory).expanduser()
    try:
        if (p / HF_WEIGHTS).is_file():
            with (p / HF_WEIGHTS).open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if size > min(_MAX_HEADER, (p / HF_WEIGHTS).stat().st_size - 8):
                    return None  # not a safetensors file
                header = json.loads(f.read(size))
            return {k for k in header if k != "__metadata__"}
        return set(json.loads((p / HF_WEIGHTS_INDEX).read_text())["weight_map"])
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None


def judge_template_errors(template: str, key: str = "judge.template") -> List[str]:
    """Why ``template`` cannot render a judge prompt: it lacks the ``{response}`` placeholder,
    has fields other than :data:`JUDGE_FIELDS`, or is not a valid format string."""
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:
        return [f"{key}={template!r}: not a format string ({e})"]
    errors = []
    if "response" not in fields:
        errors.append(f"{key}={template!r} has no {{response}} placeholder: the judge would not "
                      f"see the response it rates")
    unknown = sorted(fields - set(JUDGE_FIELDS))
    if unknown:
        errors.append(f"{key}={template!r}: unknown fields {unknown} (the fields are "
                      f"{', '.join('{' + f + '}' for f in JUDGE_FIELDS)})")
    return errors


def judge_run_config(cfg: TrainConfig) -> TrainConfig:
    """The config the judge's generation backend is built from: the run's, with the judge's
    decoding as ``generation``, its layout as ``policy.megatron``, its checkpoint as
    ``model`` (when ``judge.hf_path`` is set), prompt lengths of ``judge.max_prompt_length``
    (+ ``judge.generation.max_new_tokens``), and no streaming (the judge is called by the
    controller, not driven by the streaming loop)."""
    j, r = cfg.judge, dataclasses.replace
    model = cfg.model if j.hf_path is None else r(cfg.model, hf_path=j.hf_path, tokenizer=j.tokenizer)
    return r(cfg, generation=j.generation, policy=r(cfg.policy, megatron=j.megatron), model=model,
             data=r(cfg.data, max_prompt_length=j.max_prompt_length,
                    max_total_length=j.max_prompt_length + j.generation.max_new_tokens),
             grpo=r(cfg.grpo, streaming=False), ppo=r(cfg.ppo, streaming=False))


def _as_judge_message(message: str) -> str:
    """A backend check's message about the judge's config, with its keys named as the user
    writes them (``judge.generation.*``, ``judge.megatron.*``)."""
    message = message.replace("policy.megatron", "judge.megatron")
    return "judge: " + re.sub(r"(?<![\w.])generation\.", "judge.generation.", message)


def reward_model_errors(cfg: TrainConfig) -> List[str]:
    """A reward model (``model`` in ``reward.name`` or ``reward.names``):
    ``reward_model.hf_path`` names a Hugging Face checkpoint with a tokenizer (or
    ``reward_model.tokenizer``) and a score head (``score.weight``: a
    ``*ForSequenceClassification`` with one label); the scoring token budget holds a row."""
    rm = cfg.reward_model
    if rm.hf_path is None:
        return ["a reward model (model in reward.name or reward.names) needs "
                "reward_model.hf_path: a *ForSequenceClassification "
                "checkpoint with one label (e.g. `mcore-rl export` of an algorithm=rm run)"]
    errors = hf_checkpoint_errors("reward_model.hf_path", rm.hf_path, tokenizer=rm.tokenizer is None)
    if rm.tokenizer is not None:
        errors += filter(None, [tokenizer_dir_error("reward_model.tokenizer", rm.tokenizer)])
    names = None if errors else checkpoint_tensor_names(rm.hf_path)
    if names is not None and SCORE_HEAD not in names:
        heads = sorted(n for n in names if not n.startswith("model."))
        errors.append(f"reward_model.hf_path: {rm.hf_path}: no score head ({SCORE_HEAD}; a "
                      f"*ForSequenceClassification checkpoint with num_labels=1); tensors outside "
                      f"the backbone: {heads or 'none'}")
    budget = rm.max_tokens_per_microbatch
    if budget is not None and not rm.retokenize and budget < cfg.data.max_total_length:
        errors.append(f"reward_model.max_tokens_per_microbatch ({budget}) must be null or >= "
                      f"data.max_total_length ({cfg.data.max_total_length}): a micro-batch "
                      f"holds at least one whole sequence")
    return errors


def judge_errors(cfg: TrainConfig) -> List[str]:
    """A judge (``judge`` in ``reward.name`` or ``reward.names``): the template
    (:func:`judge_template_errors`), the score pattern and range, the judge's checkpoint, and
    its generation backend's own check on :func:`judge_run_config` (keys named ``judge.*``)."""
    j = cfg.judge
    errors = judge_template_errors(j.template)
    try:
        re.compile(j.score_pattern)
    except re.error as e:
        errors.append(f"judge.score_pattern={j.score_pattern!r}: not a regular expression ({e})")
    if not j.max_score > j.min_score:
        errors.append(f"judge.max_score ({j.max_score}) must be > judge.min_score ({j.min_score})")
    if j.hf_path is not None:
        errors += hf_checkpoint_errors("judge.hf_path", j.hf_path, tokenizer=j.tokenizer is None)
    if j.tokenizer is not None:
        errors += filter(None, [tokenizer_dir_error("judge.tokenizer", j.tokenizer)])
    return errors + [_as_judge_message(m) for m in backend_errors(judge_run_config(cfg))]


def rm_errors(cfg: TrainConfig) -> List[str]:
    """``algorithm: rm``: ``rm.train_path`` set and a file, ``rm.test_path`` a file when set,
    ``rm.pairs_per_step`` divisible by the reward model's DP size (a DP shard of the step's
    rows holds whole pairs), and no ``reward_model.hf_path`` (the run trains ``model.*``)."""
    rm, mg = cfg.rm, cfg.reward_model.megatron
    errors = [] if rm.train_path else ["algorithm=rm needs rm.train_path (preference pairs, "
                                       "JSONL: prompt, chosen, rejected)"]
    errors += [f"rm.{name}: {path}: {problem}" for name in ("train_path", "test_path")
               if (path := getattr(rm, name)) and (problem := file_problem(path))]
    model_parallel = mg.tensor_model_parallel_size * mg.pipeline_model_parallel_size
    if model_parallel >= 1 and cfg.cluster.num_workers % model_parallel == 0:
        dp = cfg.cluster.num_workers // model_parallel
        if rm.pairs_per_step % dp:
            errors.append(f"rm.pairs_per_step ({rm.pairs_per_step}) must be divisible by the "
                          f"reward model's data-parallel size ({dp} = cluster.num_workers / "
                          f"reward_model.megatron TP x PP): each DP rank trains whole pairs")
    if cfg.reward_model.hf_path is not None:
        errors.append(f"algorithm=rm trains model.* (model.hf_path: a causal LM or a "
                      f"*ForSequenceClassification checkpoint to start from); "
                      f"reward_model.hf_path ({cfg.reward_model.hf_path}) names a reward model "
                      f"to score with (reward.name=model): unset it")
    return errors


def learned_names(reward) -> List[str]:
    """The learned rewards (:data:`~mcore_rl.config.registry.LEARNED_REWARDS`: ``model``,
    ``judge``) among the run's rewards (``reward.names``, else ``reward.name``), in order; a
    run that passes :func:`learned_reward_rules` has at most one."""
    names = reward.names if reward.names is not None else [reward.name]
    return [n for n in names if n in LEARNED_REWARDS]


def learned_reward_name(reward) -> Optional[str]:
    """The run's learned reward (the first of :func:`learned_names`), or None."""
    return next(iter(learned_names(reward)), None)


def learned_reward_rules(cfg: TrainConfig, field_errors: Sequence[str]) -> List[str]:
    """The rule of :data:`mcore_rl.config.rules.RULES`: :func:`rm_errors` for ``algorithm:
    rm``; for a learned reward (:data:`~mcore_rl.config.registry.LEARNED_REWARDS`) as
    ``reward.name`` or one weighted component of ``reward.names``: at most one of them, its
    checks (:func:`reward_model_errors`, :func:`judge_errors`) and the one-turn path
    (``env.name=single_turn``: a multi-turn environment's rewards are its own);
    ``reward.verifier`` only beside a learned reward."""
    if cfg.algorithm == "rm":
        return rm_errors(cfg)
    r = cfg.reward
    key = "reward.names" if r.names is not None else "reward.name"
    learned = learned_names(r)
    if not learned:
        if r.verifier is None or any(e.startswith("reward.") for e in field_errors):
            return []
        return [f"reward.verifier={r.verifier} tracks a verifier beside a learned reward "
                f"({' or '.join(LEARNED_REWARDS)} in reward.name or reward.names); "
                f"{key}={_listed(r)} has none: unset reward.verifier (a verifier of "
                f"reward.names is logged as reward/<name>)"]
    if len(learned) > 1:
        return [f"reward.names={_listed(r)} names {len(learned)} learned rewards "
                f"({', '.join(learned)}): a run scores with at most one; keep one of them"]
    name = learned[0]
    errors = reward_model_errors(cfg) if name == "model" else judge_errors(cfg)
    if cfg.env.name != "single_turn":
        errors.append(f"{key}={_listed(r)}: the learned reward {name} scores one-turn rollouts: "
                      f"it needs env.name=single_turn (got {cfg.env.name}, whose environment "
                      f"gives the rewards)")
    return errors


def _listed(reward) -> str:
    """``reward.names`` as the user writes it (``[math,model]``), else ``reward.name``."""
    return reward.name if reward.names is None else "[" + ",".join(reward.names) + "]"

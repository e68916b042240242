"""Learned rewards in the RL step: a reward model (``reward.name=model``) and a generative
judge (``reward.name=judge``), each scoring whole rollouts with a float per sample
(``docs/design.md``, "Learned rewards").

The seam, for combining rewards: a learned reward is an object (its class named in
:data:`mcore_rl.config.registry.LEARNED_REWARDS`) built as ``cls(cfg, tokenizer)`` before any
worker starts (it reads and checks its inputs, raising
:class:`~mcore_rl.config.checks.ConfigError`), asked for the worker groups it places
(:meth:`training_groups`, :meth:`generation_groups`), started on the run's placement
(:meth:`start`), then called as ::

    score(rollout, texts, examples) -> Scored(rewards [B] float32, errors, metrics)

with the rollout batch (``input_ids``, ``input_lengths``, ``prompt_lengths``, ``truncated``),
the decoded responses and the examples they answer, and closed with :meth:`close`. A verifier's
``(response_text, Example) -> float`` and this give the same thing per sample, so a weighted sum
of components takes either (``reward.names=[math,model]``, ``reward.weights``; at most one
learned reward a run). :class:`LearnedRewards` runs one in the RL step: in a thread of its own
(its forward overlaps the policy's logprob forward), alone or weighted among the other rewards
of ``reward.names`` (scored in their pool as without it), with the verifier of
``reward.verifier`` scored beside it for the curves only (reward hacking shows as the learned
reward rising while the verifier's falls).

- :class:`RewardModelReward`: a :class:`~mcore_rl.workers.reward_model.RewardModelWorker` group
  (``reward_model.*``) of the checkpoint ``reward_model.hf_path``; its score of the last token
  is the reward. A tokenizer other than the policy's is refused unless
  ``reward_model.retokenize`` (then each rollout is decoded and tokenized again). With
  ``cluster.colocate_generation`` its weights leave the device after each scoring and come back
  before the next (the worker's offload lifecycle, ``docs/design.md``, "Offload lifecycle").
- :class:`JudgeReward`: a causal LM behind any generation backend: a
  :class:`~mcore_rl.workers.policy.PolicyWorker` group of the judge's weights (``judge.*``)
  from which the backend of ``judge.generation.backend`` is built and refit exactly as the
  policy's backend is (the megatron backend decodes on that group; the others take a copy,
  after which the group is shut down). Its prompt is ``judge.template``; the first match of
  ``judge.score_pattern`` in its answer, scaled to [0, 1], is the reward; an answer without one
  gives 0 and counts as an error.
"""

from __future__ import annotations

import concurrent.futures as cf
import re
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from mcore_rl.config.checks import ConfigError
from mcore_rl.config.schema import OptimizerConfig, TrainConfig
from mcore_rl.data import batch as B
from mcore_rl.data.example import Example
from mcore_rl.rewards import weighted_total
from mcore_rl.utils.logging import pop_prefixed
from mcore_rl.workers.interfaces import PolicyAPI, RewardModelAPI

# A frozen model's optimizer: SGD without momentum keeps no state (the group needs one).
FROZEN = OptimizerConfig(name="sgd", lr=0.0, clip_grad=0.0)


class Scored(NamedTuple):
    """A learned reward's answer for a batch: ``rewards`` ``[B]`` float32 (0 where it failed),
    ``errors`` (the samples it could not score), ``metrics`` (its figures, unprefixed)."""

    rewards: torch.Tensor
    errors: int
    metrics: Dict[str, float]


def checkpoint_arch(key: str, path: str) -> Tuple[Any, Any]:
    """``(transformers config, ModelArchConfig)`` of the checkpoint ``path`` (config key
    ``key``). Raises :class:`ConfigError` naming both for an unreadable config.json or a model
    the Megatron side does not build."""
    from transformers import AutoConfig

    from mcore_rl.megatron.conversion import hf_config_to_arch

    try:
        config = AutoConfig.from_pretrained(path)
        return config, hf_config_to_arch(config)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: {path}: {' '.join(str(e).split())}") from e


def check_shape(arch, megatron, section: str, source: str) -> None:
    """Raise :class:`ConfigError` when ``arch`` (read from ``source``) does not fit the layout
    ``<section>.megatron`` (heads over TP, layers over PP, ...)."""
    from mcore_rl.config.families import parallel_shape_errors

    problems = parallel_shape_errors(arch, megatron, f"{section}.megatron", source)
    if problems:
        raise ConfigError("; ".join(problems))


class RewardModelReward:
    """``reward.name=model``: the last-token score of a reward model (module docstring).

    Args:
        cfg: the run's config (``reward_model.*``, ``data.*``, ``cluster.*``).
        tokenizer: the policy's tokenizer.

    Raises:
        ConfigError: ``reward_model.hf_path`` unreadable or of a model not built here, its
            shape against ``reward_model.megatron``, its tokenizer unloadable, or different
            from the policy's without ``reward_model.retokenize`` (the message says how).
    """

    name = "reward_model"

    def __init__(self, cfg: TrainConfig, tokenizer):
        from mcore_rl.config.schema import ModelConfig
        from mcore_rl.data.tokenizer import load_tokenizer, tokenizer_difference

        self.cfg, r = cfg, cfg.reward_model
        self.hf_config, self.arch = checkpoint_arch("reward_model.hf_path", r.hf_path)
        check_shape(self.arch, r.megatron, "reward_model", f"reward_model.hf_path={r.hf_path}")
        self.tokenizer = load_tokenizer(ModelConfig(hf_path=r.hf_path, tokenizer=r.tokenizer))
        difference = tokenizer_difference(tokenizer, self.tokenizer)
        if difference and not r.retokenize:
            raise ConfigError(
                f"reward_model.hf_path={r.hf_path}: the reward model's tokenizer "
                f"({r.tokenizer or r.hf_path}) differs from the policy's: {difference}; set "
                f"reward_model.retokenize=true (each rollout decoded and tokenized again) or give "
                f"a reward model with the policy's tokenizer")
        self.retokenize = difference is not None
        self.colocated = cfg.cluster.colocate_generation
        self.group = None

    def training_groups(self) -> Dict[str, int]:
        """``{"reward_model": cluster.num_workers}``: placed with the training groups."""
        return {"reward_model": self.cfg.cluster.num_workers}

    def generation_groups(self) -> Dict[str, int]:
        """None."""
        return {}

    def start(self, trainer: Any) -> None:
        """The reward model's worker group (``trainer.megatron_group``: the run's placement,
        seed and threads), frozen, its weights off the device when generation is colocated."""
        from mcore_rl.workers.reward_model import RewardModelWorker

        r = self.cfg.reward_model
        self.hf_config.pad_token_id = self.tokenizer.pad_token_id
        self.group = trainer.megatron_group(
            "reward_model", RewardModelWorker, r.megatron, FROZEN, 1, 1, hf_path=r.hf_path,
            hf_config=self.hf_config.to_dict(), arch=self.arch, vocab_size=self.arch.vocab_size,
            require_score_head=True, score_tokens_per_microbatch=r.max_tokens_per_microbatch)
        if self.colocated:
            self.group.call(RewardModelAPI).offload_after_refit()

    def _rows(self, rollout: B.Batch, texts: Sequence[str], examples: Sequence[Example]) -> B.Batch:
        """The rows the reward model reads: the rollout's own ids, or with another tokenizer
        each prompt and response rendered and tokenized again (module docstring), cut from the
        left to the model's positions (the last token, the one scored, stays)."""
        if not self.retokenize:
            return {"input_ids": rollout["input_ids"], "input_lengths": rollout["input_lengths"]}
        from mcore_rl.data.prompts import response_rows

        tok, data = self.tokenizer, self.cfg.data
        chat = data.use_chat_template and tok.chat_template is not None
        rows = []
        for text, example, truncated in zip(texts, examples, rollout["truncated"].tolist()):
            question = data.prompt_template.format(question=example.prompt)
            if chat:
                rendered = tok.apply_chat_template(
                    [{"role": "user", "content": question}, {"role": "assistant", "content": text}],
                    tokenize=False)
                ids = tok(rendered, add_special_tokens=False)["input_ids"]
            else:
                ids = tok(question + text)["input_ids"] + ([] if truncated else [tok.eos_token_id])
            rows.append((ids[-self.arch.max_position_embeddings:], []))
        return response_rows(rows)

    def score(self, rollout: B.Batch, texts: Sequence[str], examples: Sequence[Example]) -> Scored:
        """The reward model's score of each rollout row (``[B]`` float32), no errors; metric
        ``reward_model_score`` (the mean)."""
        rows = self._rows(rollout, texts, examples)
        if self.colocated:
            self.group.call(RewardModelAPI).prepare_for_lp_inference()
        scores = self.group.gather_rows(RewardModelAPI).get_scores(
            rows, self.cfg.reward_model.score_micro_batch_size)
        if self.colocated:
            self.group.call(RewardModelAPI).offload_after_refit()
        return Scored(scores.float(), 0, {"reward_model_score": float(scores.mean())})

    def close(self) -> None:
        if self.group is not None:
            self.group.shutdown()


class PrefixedPlacement:
    """The run's :class:`~mcore_rl.distributed.placement.Placement` as a generation backend
    sees it, with ``prefix`` before every group name it uses (``make_group``,
    ``actor_options``, ``plan.gpu_index``): the judge's engines are planned as ``judge_<name>``
    beside the policy's ``<name>``."""

    def __init__(self, placement: Any, prefix: str):
        self._placement, self._prefix = placement, prefix
        self.use_ray, self.gpus = placement.use_ray, placement.gpus
        self.dump_dir = placement.dump_dir
        self.plan = self

    def gpu_index(self, group: str, rank: int) -> int:
        return self._placement.plan.gpu_index(self._prefix + group, rank)

    def actor_options(self, group: str, rank: int) -> Dict[str, Any]:
        return self._placement.actor_options(self._prefix + group, rank)

    def make_group(self, group: str, worker_cls, kwargs: Dict[str, Any],
                   env: Optional[Dict[str, str]] = None):
        return self._placement.make_group(self._prefix + group, worker_cls, kwargs, env=env)


def parse_score(text: str, pattern: "re.Pattern[str]", low: float, high: float) -> Optional[float]:
    """The reward of a judge's answer: the first match of ``pattern`` in ``text`` (its group 1
    when it has groups) read as a number ``s``, scaled to ``(s - low) / (high - low)``; None
    when there is no match, it is not a number, or ``s`` is outside ``[low, high]``."""
    match = pattern.search(text)
    if match is None:
        return None
    try:
        value = float(match.group(1) if pattern.groups else match.group(0))
    except (TypeError, ValueError):
        return None
    if not low <= value <= high:
        return None
    return (value - low) / (high - low)


class JudgeReward:
    """``reward.name=judge``: a generative judge's parsed rating (module docstring).

    Args:
        cfg: the run's config (``judge.*``).
        tokenizer: the policy's tokenizer (the judge's when neither ``judge.hf_path`` nor
            ``judge.tokenizer`` is set).

    Raises:
        ConfigError: the judge's checkpoint unreadable or of a model not built here, its shape
            against ``judge.megatron``, its tokenizer unloadable (or without a chat template
            while ``judge.use_chat_template``).
    """

    name = "judge"

    def __init__(self, cfg: TrainConfig, tokenizer):
        from mcore_rl.config.learned import judge_run_config
        from mcore_rl.data.tokenizer import load_tokenizer

        self.cfg, j = cfg, cfg.judge
        self.run_cfg = judge_run_config(cfg)
        self.hf_config = self.arch = None  # the policy's, given at start
        if j.hf_path is not None:
            self.hf_config, self.arch = checkpoint_arch("judge.hf_path", j.hf_path)
            check_shape(self.arch, j.megatron, "judge", f"judge.hf_path={j.hf_path}")
        own = j.hf_path is not None or j.tokenizer is not None
        self.tokenizer = load_tokenizer(self.run_cfg.model, j.use_chat_template) if own else tokenizer
        if j.use_chat_template and self.tokenizer.chat_template is None:
            raise ConfigError("judge.use_chat_template=true but the judge's tokenizer has no chat "
                              "template")
        self.pattern = re.compile(j.score_pattern)
        self.group = self.backend = None
        self._calls = 0

    def training_groups(self) -> Dict[str, int]:
        """``{"judge": cluster.num_workers}``: the judge's Megatron model."""
        return {"judge": self.cfg.cluster.num_workers}

    def generation_groups(self) -> Dict[str, int]:
        """The judge backend's own groups, as ``judge_<name>``."""
        from mcore_rl.generation.registry import backend_class

        groups = backend_class(self.run_cfg.generation.backend).worker_groups(self.run_cfg)
        return {f"judge_{name}": n for name, n in groups.items()}

    def start(self, trainer: Any) -> None:
        """The judge's Megatron group and its generation backend, refit once (module
        docstring); the group is shut down when the backend keeps a copy of the weights."""
        from mcore_rl.generation.base import BackendContext
        from mcore_rl.generation.registry import build_backend
        from mcore_rl.workers.policy import PolicyWorker

        j, tok = self.cfg.judge, self.tokenizer
        if self.arch is None:
            self.hf_config, self.arch = trainer.hf_config, trainer.arch
        hf_config = type(self.hf_config).from_dict(self.hf_config.to_dict())
        hf_config.eos_token_id, hf_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
        self.group = trainer.megatron_group(
            "judge", PolicyWorker, j.megatron, FROZEN, 1, 1,
            hf_path=j.hf_path or self.cfg.model.hf_path, hf_config=hf_config.to_dict(),
            arch=self.arch, vocab_size=self.arch.vocab_size,
            temperature=j.generation.temperature)
        self.backend = build_backend(BackendContext(
            cfg=self.run_cfg, hf_config=hf_config, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id, vocab_size=self.arch.vocab_size, device=trainer.device,
            policy=self.group, placement=PrefixedPlacement(trainer.placement, "judge_")))
        self.backend.refit(self.group)
        if not self.backend.shares_policy_weights:
            self.group.shutdown()
            self.group = None

    def _prompt(self, text: str, example: Example) -> Optional[List[int]]:
        """The judge's prompt ids for one response, None when longer than
        ``judge.max_prompt_length``."""
        j, tok = self.cfg.judge, self.tokenizer
        content = j.template.format(response=text, prompt=example.prompt, answer=example.answer)
        if j.use_chat_template:
            content = tok.apply_chat_template([{"role": "user", "content": content}],
                                              tokenize=False, add_generation_prompt=True)
        ids = tok(content, add_special_tokens=not j.use_chat_template)["input_ids"]
        return ids if 1 <= len(ids) <= j.max_prompt_length else None

    def score(self, rollout: B.Batch, texts: Sequence[str], examples: Sequence[Example]) -> Scored:
        """The judge's reward of each response (``[B]`` float32); an over-long prompt or an
        answer without a score in range is 0 and counts as an error. Metrics
        ``judge_errors`` (those samples) and ``judge_response_length`` (tokens, mean)."""
        j = self.cfg.judge
        prompts = [self._prompt(t, ex) for t, ex in zip(texts, examples)]
        keep = [i for i, p in enumerate(prompts) if p is not None]
        rewards = torch.zeros(len(texts), dtype=torch.float32)
        lengths = 0.0
        if keep:
            self._calls += 1
            out = self.backend.generate([prompts[i] for i in keep],
                                        seed=(self.cfg.run.seed * 7919 + self._calls) % (2**31 - 1),
                                        greedy=j.greedy)
            for row, i in enumerate(keep):
                p, n = int(out["prompt_lengths"][row]), int(out["input_lengths"][row])
                answer = self.tokenizer.decode(out["input_ids"][row, p:n].tolist(),
                                               skip_special_tokens=True)
                value = parse_score(answer, self.pattern, j.min_score, j.max_score)
                if value is None:
                    prompts[i] = None
                else:
                    rewards[i] = value
            lengths = float(out["response_lengths"].float().mean())
        errors = sum(p is None for p in prompts)
        return Scored(rewards, errors, {"judge_errors": float(errors),
                                        "judge_response_length": lengths})

    def close(self) -> None:
        if self.backend is not None:
            self.backend.shutdown()
        if self.group is not None:
            self.group.shutdown()


class _Pending:
    """A learned reward's scores being computed (with the other rewards of ``reward.names`` and
    the tracked verifier beside them), with the interface of
    :class:`~mcore_rl.rewards.pool.PendingRewards`: :meth:`result` gives ``(rewards [B]
    float32, errors, busy_seconds)``, :meth:`components` each reward's own scores."""

    def __init__(self, owner: "LearnedRewards", future: cf.Future, others: Any, tracked: Any,
                 prefix: str):
        self._owner, self._future, self._others, self._tracked = owner, future, others, tracked
        self._prefix = prefix
        self._result: Optional[Tuple[torch.Tensor, int, float]] = None
        self._components: Dict[str, torch.Tensor] = {}

    @property
    def early_fraction(self) -> Optional[float]:
        """The other rewards' (scored while decoding:
        :attr:`~mcore_rl.rewards.pool.StreamingRewards.early_fraction`), or None."""
        return getattr(self._others, "early_fraction", None)

    def done(self) -> bool:
        """Whether :meth:`result` would return without waiting."""
        return self._future.done() and all(p is None or p.done()
                                           for p in (self._others, self._tracked))

    def result(self) -> Tuple[torch.Tensor, int, float]:
        """``(rewards [B] float32, errors, busy seconds)``: the weighted sum of the learned
        reward and the others (:meth:`LearnedRewards.combine`), their errors, the verifiers'
        own seconds; the metrics recorded once (:meth:`LearnedRewards.pop_metrics`)."""
        if self._result is None:
            scored, seconds = self._future.result()
            verifier, busy = None, 0.0
            if self._tracked is not None:
                verifier, _, busy = self._tracked.result()
            rewards, errors, others_busy, self._components = self._owner.combine(scored,
                                                                                 self._others)
            self._owner._record(self._prefix, scored, seconds, verifier)
            self._result = rewards, errors, busy + others_busy
        return self._result

    def components(self) -> Dict[str, torch.Tensor]:
        """Each reward's own scores, unweighted, in ``reward.names`` order: ``reward/<name>``
        -> ``[B]`` float32 (the learned reward's included); waits like :meth:`result`."""
        self.result()
        return self._components


class LearnedRewards:
    """A learned reward (``reward``, module docstring) in the RL step: the run's reward alone,
    or one weighted component of ``reward.names`` beside the others (verifiers, environment
    rewards, the user's functions: the pool ``others``), with the verifier pool ``verifier`` of
    ``reward.verifier`` scored beside them and logged only.

    The learned reward scores the whole rollout after generation, in its thread; the others
    score as without a learned reward (in their pool, while decoding with
    ``reward.score_while_decoding``). A sample's reward is ``sum_k weights[k] * score_k`` over
    ``reward.names`` in order (:func:`~mcore_rl.rewards.weighted_total`: one learned reward of
    weight 1 is its own scores).

    Args:
        reward: the learned reward (``score(rollout, texts, examples) -> Scored``, ``close()``).
        verifier: the pool of ``reward.verifier`` (a
            :class:`~mcore_rl.rewards.pool.RewardScorer`), or None.
        others: the pool of the other rewards of ``reward.names``, in order, or None.
        weights: the weight of each reward of ``reward.names`` in order, the learned one's at
            ``index`` (default: ``[1.0]``, the learned reward alone).
        index: the learned reward's position in ``reward.names``.
        metric: its logged key (``reward/<name>``, :func:`~mcore_rl.rewards.weighted_names`).

    Metrics (:meth:`pop_metrics`, per prefix ``train/`` or ``val/``): the reward's own
    (``<prefix><metric>``), ``<prefix>verifier_reward`` (the verifier's mean) and
    ``timing/learned_reward_s`` (the wall seconds of a scoring call, in its thread, overlapping
    the step's other phases; training only). Each is the mean over the scoring calls since the
    last :meth:`pop_metrics` (one per RL step, several with GRPO's dynamic sampling). Each
    reward's own scores come with the pending rewards (:meth:`_Pending.components`).

    Raises:
        ValueError: ``weights`` not one per reward (``others``' and the learned one), or
            ``index`` outside them.
    """

    def __init__(self, reward: Any, verifier: Any = None, others: Any = None,
                 weights: Sequence[float] = (1.0,), index: int = 0, metric: str = "reward/learned"):
        self.reward, self.verifier, self.others = reward, verifier, others
        count = 1 + (len(others.components) if others is not None else 0)
        if len(weights) != count or not 0 <= index < count:
            raise ValueError(f"LearnedRewards: {len(weights)} weights and index {index} for "
                             f"{count} rewards")
        self.weights, self.index, self.metric = [float(w) for w in weights], index, metric
        self._thread = cf.ThreadPoolExecutor(1, thread_name_prefix="mcore-rl-learned-reward")
        self._metrics: List[Dict[str, float]] = []

    def _timed(self, rollout, texts, examples) -> Tuple[Scored, float]:
        start = time.perf_counter()
        scored = self.reward.score(rollout, texts, examples)
        return scored, time.perf_counter() - start

    def _record(self, prefix: str, scored: Scored, seconds: float,
                verifier: Optional[torch.Tensor]) -> None:
        m = {f"{prefix}{k}": v for k, v in scored.metrics.items()}
        if verifier is not None:
            m[f"{prefix}verifier_reward"] = float(verifier.mean())
        if prefix == "train/":
            m["timing/learned_reward_s"] = seconds
        self._metrics.append(m)

    def combine(self, scored: Scored, others: Any
                ) -> Tuple[torch.Tensor, int, float, Dict[str, torch.Tensor]]:
        """The learned reward's ``scored`` with the other rewards' pending scores ``others``
        (a :class:`~mcore_rl.rewards.pool.PendingRewards`, waited for; None without others):
        ``(rewards [B] float32, errors, the others' busy seconds, components)``, rewards the
        weighted sum over ``reward.names`` in order, components each reward's own ``[B]``
        float32 scores by ``reward/<name>``."""
        learned = scored.rewards.float()
        if others is None:
            values, errors, busy, theirs = [[] for _ in range(len(learned))], 0, 0.0, {}
        else:
            _, errors, busy = others.result()
            values, theirs = others.values(), others.components()
        i = self.index
        rows = [v[:i] + [s] + v[i:] for v, s in zip(values, learned.tolist())]
        items = list(theirs.items())
        components = dict(items[:i] + [(self.metric, learned)] + items[i:])
        return weighted_total(rows, self.weights), scored.errors + errors, busy, components

    def submit(self, rollout: B.Batch, texts: Sequence[str], examples: Sequence[Example],
               prefix: str = "train/", others: Any = None) -> _Pending:
        """Start scoring (the learned reward in its thread, the others and the verifier in
        their pools); returns at once with the pending rewards, whose metrics wait under
        ``prefix`` in :meth:`pop_metrics`. ``others``: the other rewards' scoring already
        started (``reward.score_while_decoding``), else started here."""
        future = self._thread.submit(self._timed, rollout, list(texts), list(examples))
        if others is None and self.others is not None:
            others = self.others.submit(texts, examples)
        tracked = None if self.verifier is None else self.verifier.submit(texts, examples)
        return _Pending(self, future, others, tracked, prefix)

    def score(self, rollout: B.Batch, texts: Sequence[str], examples: Sequence[Example],
              prefix: str = "train/") -> Tuple[torch.Tensor, int, float]:
        """Score now: :meth:`submit` and wait, ``(rewards [B] float32, errors, the verifiers'
        busy seconds)``."""
        return self.submit(rollout, texts, examples, prefix).result()

    def pop_metrics(self, prefix: str) -> Dict[str, float]:
        """The metrics under ``prefix`` (and training's timing) since the last call: means over
        the scorings, cleared."""
        out, self._metrics = pop_prefixed(self._metrics, prefix)
        return out

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self.reward.close()

"""The multi-turn rollout loop: episodes of an environment, one model turn at a time
(``docs/design.md``, "Rollout floor"; in the field's terms, verl's agent loop and NeMo RL's
multi-turn rollouts).

Per episode, :meth:`EnvironmentExecutor.reset`; then per turn, for all live episodes at once:

1. the conversation so far is a list of token ids (the rendered prompt, the model's earlier
   turns as sampled, the observations as rendered by the chat template);
2. the backend decodes one turn from those ids (``generate(..., stop_token_ids=...)``: it
   stops at eos, at the chat template's end-of-turn token, or at ``generation.max_new_tokens``
   or ``data.max_total_length``); the turn's tokens are appended as sampled, never
   re-tokenized, with ``token_mask`` 1 and their generation logprobs;
3. the executor steps every live episode with its turn's decoded text; an observation is
   rendered as the template's next ``tool`` message (plus the generation prompt of the next
   assistant turn), tokenized, and appended with ``token_mask`` 0 and logprob 0;
4. an episode ends when the environment says ``done``, after ``env.max_turns`` model turns, or
   when the conversation reaches ``data.max_total_length`` (an observation that does not fit
   ends it).

An episode's reward is the sum of its steps' rewards. The rollout batch follows
:mod:`mcore_rl.data.batch` (right-padded; ``token_mask`` 1 only on model tokens), so the
trainer's logprobs, losses and estimators read it unchanged: a loss's token counts
(``loss.aggregation``) count model tokens only. ``response_lengths`` counts model tokens;
``input_lengths`` counts everything (prompt, turns, observations).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from mcore_rl.data.batch import Batch
from mcore_rl.data.example import Example
from mcore_rl.environments.base import METRIC_KEYS, TOOL_CALLS, TURNS, EpisodeState
from mcore_rl.environments.executor import failed

# Text the probe conversation puts as the assistant's content, to find what the chat template
# writes after an assistant turn (its end-of-turn text).
_PROBE = "PROBE_7f3a"


class ChatFormat:
    """How a conversation becomes token ids: the prompt, the stop tokens of a model turn, and
    the tokens of an observation.

    With a chat template (``data.use_chat_template`` and a tokenizer that has one): the prompt is
    ``[system?, user]`` rendered with ``add_generation_prompt=True`` and the environment's tool
    schemas in ``tools=`` (a template that does not read ``tools`` gets them as a system message
    instead); a model turn stops at eos or at the template's end-of-turn token (the first token
    the template writes after an assistant message, e.g. ChatML's ``<|im_end|>``); an
    observation is what the template writes after the assistant turn (the end-of-turn text the
    model did not sample), a ``tool`` message with the observation, and the next assistant
    turn's generation prompt. Without one: the prompt is the data set's plain-text prompt, a
    turn stops at eos, and an observation is its text and a newline.

    Args:
        tokenizer: the run's Hugging Face tokenizer (eos set).
        use_chat_template: render with the tokenizer's chat template (it must have one).
        tools: function specs for ``tools=`` (:meth:`ToolUseEnvironment.tool_schemas`); None
            or empty: none.
        role: the chat role of observations (``"tool"``).

    Raises:
        ValueError: ``use_chat_template`` and the tokenizer has no chat template.
    """

    def __init__(self, tokenizer, use_chat_template: bool,
                 tools: Optional[List[Dict[str, Any]]] = None, role: str = "tool"):
        self.tokenizer = tokenizer
        self.tools = list(tools or [])
        self.role = role
        self.chat = bool(use_chat_template)
        if self.chat and tokenizer.chat_template is None:
            raise ValueError("env.name: a multi-turn environment with data.use_chat_template=true "
                             "needs a tokenizer with a chat template")
        stops = [int(tokenizer.eos_token_id)]
        self.end_of_turn = ""  # what the template writes after an assistant message's content
        if self.chat:
            self._tools_in_template = "tools" in (tokenizer.chat_template or "")
            text = self._render([{"role": "user", "content": "x"},
                                 {"role": "assistant", "content": _PROBE}])
            self.end_of_turn = text[text.rindex(_PROBE) + len(_PROBE):]
            ids = tokenizer(self.end_of_turn, add_special_tokens=False)["input_ids"]
            if ids and ids[0] in tokenizer.all_special_ids and ids[0] not in stops:
                stops.append(int(ids[0]))
        self.stop_token_ids: List[int] = stops

    def _render(self, messages: List[Dict[str, str]], generation_prompt: bool = False) -> str:
        kwargs = {}
        if self.tools and self._tools_in_template:
            kwargs["tools"] = self.tools
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt,
                                                  **kwargs)

    def _system(self) -> List[Dict[str, str]]:
        if not self.tools or self._tools_in_template:
            return []
        import json

        specs = "\n".join(json.dumps(t) for t in self.tools)
        name = self.tools[0].get("function", {}).get("name", "tool")
        return [{"role": "system", "content": (
            "You may call these tools, one JSON object per call inside <tool_call></tool_call> "
            f"tags (<tool_call>{{\"name\": \"{name}\", \"arguments\": {{...}}}}</tool_call>), "
            f"end your turn, and read their results in <tool_response> tags:\n{specs}")}]

    def prompt_ids(self, prompt: Union[str, Sequence[Dict[str, str]]],
                   plain_ids: Sequence[int]) -> List[int]:
        """The first prompt of an episode: ``prompt`` (the data set's prompt text, before any
        chat template: ``data.prompt_template`` applied; or its chat messages,
        :func:`mcore_rl.data.prompts.prompt_messages`) rendered with the tools (their system
        message after a system turn of the messages' own), or ``plain_ids`` (the data set's
        prompt ids) without a chat template."""
        if not self.chat:
            return list(plain_ids)
        messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                    else [dict(m) for m in prompt])
        system = self._system()
        if system and messages[0]["role"] == "system":
            messages[0]["content"] += "\n\n" + system[0]["content"]
        else:
            messages = system + messages
        rendered = self._render(messages, generation_prompt=True)
        return list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])

    def observation_ids(self, observation: str, last_token: Optional[int]) -> List[int]:
        """Token ids of ``observation`` after a model turn that ended with ``last_token`` (a
        stop token, or another token when the turn was cut at its budget: the template's whole
        end-of-turn text is added then), up to the next turn's generation prompt."""
        if not self.chat:
            return list(self.tokenizer(observation + "\n", add_special_tokens=False)["input_ids"])
        close = self.end_of_turn
        if last_token is not None and last_token in self.stop_token_ids:
            sampled = self.tokenizer.decode([last_token])
            close = close[len(sampled):] if close.startswith(sampled) else close
        base = self._render([{"role": "user", "content": "x"},
                             {"role": "assistant", "content": _PROBE}])
        full = self._render([{"role": "user", "content": "x"},
                             {"role": "assistant", "content": _PROBE},
                             {"role": self.role, "content": observation}],
                            generation_prompt=True)
        if not full.startswith(base):
            raise ValueError("the chat template renders an assistant turn differently once a "
                             f"{self.role!r} message follows it; cannot append observations")
        return list(self.tokenizer(close + full[len(base):], add_special_tokens=False)["input_ids"])


@dataclasses.dataclass
class Episode:
    """One episode's conversation and bookkeeping while the loop runs.

    Attributes:
        ids: token ids so far (prompt, model turns, observations).
        mask: per token, 1 on model tokens, 0 elsewhere.
        logprobs: per token, the generation logprob on model tokens, 0 elsewhere.
        prompt_length: tokens of the first prompt.
        state: the environment's :class:`EpisodeState`, None once the episode ended.
        reward: the sum of the steps' rewards so far.
        metadata: the environment's metadata after the last step (the metric keys).
        truncated: the episode ended at a length or turn limit, not by the environment.
        observation_tokens: tokens of observations appended.
        turn_rewards: each step's reward, in order.
    """

    ids: List[int]
    mask: List[float]
    logprobs: List[float]
    prompt_length: int
    state: Optional[EpisodeState]
    reward: float = 0.0
    metadata: Dict[str, Any] = dataclasses.field(default_factory=dict)
    truncated: bool = False
    observation_tokens: int = 0
    turn_rewards: List[float] = dataclasses.field(default_factory=list)

    def append(self, tokens: Sequence[int], model: bool,
               logprobs: Optional[Sequence[float]] = None) -> None:
        """Add ``tokens``: the model's (mask 1, with their ``logprobs``) or an observation's."""
        self.ids.extend(int(t) for t in tokens)
        self.mask.extend([1.0 if model else 0.0] * len(tokens))
        self.logprobs.extend([float(x) for x in logprobs] if model else [0.0] * len(tokens))
        if not model:
            self.observation_tokens += len(tokens)


def run_episodes(backend, executor, fmt: ChatFormat, examples: Sequence[Example],
                 prompts: Sequence[List[int]], seed: int, max_turns: int,
                 max_total_length: int, greedy: bool = False) -> Tuple[Batch, List[Episode]]:
    """Run one episode per example to its end; the rollout batch and the episodes.

    Args:
        backend: a :class:`~mcore_rl.generation.base.GenerationBackend` (its ``generate_async``
            with ``stop_token_ids``).
        executor: an :class:`~mcore_rl.environments.executor.EnvironmentExecutor` (or anything
            with its ``reset(examples)`` and ``step(states, texts)``).
        fmt: the :class:`ChatFormat` (prompt, stop tokens, observations).
        examples: B data examples; episode ``i`` starts from ``examples[i]``.
        prompts: B first prompts as token ids (:meth:`ChatFormat.prompt_ids`).
        seed: turn ``t`` is decoded with the seed ``seed * 1009 + t`` (the row streams of
            :mod:`~mcore_rl.generation.sampling`, by the episode's index among the live ones).
        max_turns: model turns per episode at most (``env.max_turns``).
        max_total_length: tokens per episode at most (``data.max_total_length``).
        greedy: argmax decoding (validation).

    Returns:
        ``(batch, episodes)``: the right-padded batch of :mod:`mcore_rl.data.batch`, rows in
        example order: ``input_ids`` [B, S] int64, ``input_lengths``, ``prompt_lengths``,
        ``response_lengths`` (model tokens) [B] int64, ``token_mask`` [B, S] float32 (1 on
        model tokens only), ``generation_logprobs`` [B, S] float32 (0 off model tokens),
        ``truncated`` [B] float32, ``rewards`` [B] float32 (sum of step rewards); and the
        :class:`Episode` of each row (metadata, observation tokens, step rewards).

    Raises:
        ValueError: ``len(examples) != len(prompts)``, ``max_turns < 1``; the backend's errors
            (a prompt with no room for a response). Environment failures never raise: the
            executor turns them into ended episodes with reward 0 and ``env_errors``.
    """
    if len(examples) != len(prompts):
        raise ValueError(f"run_episodes: {len(examples)} examples but {len(prompts)} prompts")
    if max_turns < 1:
        raise ValueError(f"env.max_turns must be >= 1 (got {max_turns})")
    episodes = []
    for example, prompt, (observation, metadata) in zip(examples, prompts,
                                                        executor.reset(list(examples))):
        ep = Episode(list(prompt), [0.0] * len(prompt), [0.0] * len(prompt), len(prompt),
                     None if failed(metadata) else EpisodeState(example, metadata),
                     metadata=dict(metadata))
        if ep.state is not None and observation:
            ep.append(fmt.tokenizer(observation, add_special_tokens=False)["input_ids"], False)
            ep.prompt_length = len(ep.ids)  # the first observation is part of the prompt
        episodes.append(ep)
    tokenizer = fmt.tokenizer
    for turn in range(max_turns):
        live = []
        for ep in episodes:
            if ep.state is not None and len(ep.ids) >= max_total_length:
                ep.state, ep.truncated = None, True  # no room for another turn
            elif ep.state is not None:
                live.append(ep)
        if not live:
            break
        responses = [None] * len(live)
        for group in backend.generate_async([ep.ids for ep in live], seed * 1009 + turn, greedy,
                                            stop_token_ids=fmt.stop_token_ids):
            responses[group.rows.start:group.rows.stop] = group.responses
        texts = []
        for ep, r in zip(live, responses):
            ep.append(r.tokens.tolist(), True, r.logprobs.tolist())
            texts.append(tokenizer.decode(r.tokens.tolist(), skip_special_tokens=True))
        results = executor.step([ep.state for ep in live], texts)
        for ep, r, result in zip(live, responses, results):
            ep.reward += float(result.reward)
            ep.turn_rewards.append(float(result.reward))
            ep.metadata = dict(result.metadata)
            if result.done:
                ep.state = None  # truncated: the turn hit its budget, or the env ended it unanswered
                ep.truncated = bool(r.truncated) or bool(ep.metadata.get("truncated", False))
                continue
            if turn + 1 == max_turns:
                ep.state, ep.truncated = None, True
                continue
            obs = fmt.observation_ids(result.observation or "", int(r.tokens[-1]))
            if len(ep.ids) + len(obs) >= max_total_length:
                ep.state, ep.truncated = None, True  # the observation leaves no room to answer
                continue
            ep.append(obs, False)
            ep.state = ep.state.advance(result)
    for ep in episodes:  # ended by the turn loop's exit
        if ep.state is not None:
            ep.state, ep.truncated = None, True
    return assemble_episodes(episodes, fmt.tokenizer.pad_token_id), episodes


def assemble_episodes(episodes: Sequence[Episode], pad_token_id: int) -> Batch:
    """The right-padded rollout batch of :func:`run_episodes` from its episodes (keys, shapes
    and dtypes there). Raises ``ValueError`` on no episodes."""
    if not episodes:
        raise ValueError("assemble_episodes: no episodes")
    b, s = len(episodes), max(len(ep.ids) for ep in episodes)
    input_ids = torch.full((b, s), int(pad_token_id), dtype=torch.long)
    token_mask = torch.zeros((b, s), dtype=torch.float32)
    logprobs = torch.zeros((b, s), dtype=torch.float32)
    for i, ep in enumerate(episodes):
        n = len(ep.ids)
        input_ids[i, :n] = torch.tensor(ep.ids, dtype=torch.long)
        token_mask[i, :n] = torch.tensor(ep.mask, dtype=torch.float32)
        logprobs[i, :n] = torch.tensor(ep.logprobs, dtype=torch.float32)
    return {
        "input_ids": input_ids,
        "input_lengths": torch.tensor([len(ep.ids) for ep in episodes], dtype=torch.long),
        "prompt_lengths": torch.tensor([ep.prompt_length for ep in episodes], dtype=torch.long),
        "response_lengths": token_mask.sum(1).long(),
        "token_mask": token_mask,
        "generation_logprobs": logprobs,
        "truncated": torch.tensor([float(ep.truncated) for ep in episodes], dtype=torch.float32),
        "rewards": torch.tensor([ep.reward for ep in episodes], dtype=torch.float32),
    }


def episode_metrics(episodes: Sequence[Episode], prefix: str = "env/") -> Dict[str, float]:
    """Per-episode means of a rollout's episodes: ``turns``, ``tool_calls``, ``tool_errors``,
    ``tool_timeouts``, ``env_errors`` (metadata keys), ``observation_tokens``,
    ``reward_per_turn`` (an episode's reward over its turns), and ``tool_use_rate`` (the
    fraction of episodes with at least one tool call), each under ``prefix``."""
    if not episodes:
        return {}
    n = len(episodes)
    out = {f"{prefix}{key}": sum(float(ep.metadata.get(key, 0)) for ep in episodes) / n
           for key in METRIC_KEYS}
    out[f"{prefix}observation_tokens"] = sum(ep.observation_tokens for ep in episodes) / n
    out[f"{prefix}reward_per_turn"] = sum(
        ep.reward / max(1, int(ep.metadata.get(TURNS, 0)) or len(ep.turn_rewards) or 1)
        for ep in episodes) / n
    out[f"{prefix}tool_use_rate"] = sum(
        float(ep.metadata.get(TOOL_CALLS, 0) > 0) for ep in episodes) / n
    return out


__all__ = ["ChatFormat", "Episode", "run_episodes", "assemble_episodes", "episode_metrics"]

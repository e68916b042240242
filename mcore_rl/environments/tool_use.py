"""A multi-turn tool-use environment: the model may call tools (Hermes / Qwen format,
:mod:`mcore_rl.environments.tools`) before it answers; its answer is scored by the task's
verifier.

Each step: if the model's turn has ``<tool_call>`` blocks, each is run (a calculator and a
Python sandbox by default) and their ``<tool_response>`` blocks are the observation, reward 0,
not done - unless that turn was the ``max_turns``-th, which ends the episode unanswered (reward
0, ``metadata["truncated"] = True``). A turn without a tool call is the final answer: the
verifier scores it and the episode is done. With the synthetic arithmetic task (``"23*45="``,
``reward.name=exact``) the model can ask the calculator and then answer with the integer.

Metrics per episode in the metadata: ``turns``, ``tool_calls``, ``tool_errors`` (malformed
calls, unknown tools, tool failures, nonzero exit statuses), ``tool_timeouts``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from mcore_rl.data.example import Example
from mcore_rl.environments.base import (TOOL_CALLS, TOOL_ERRORS, TOOL_TIMEOUTS, TURNS,
                                        EpisodeState, StepResult, new_metrics)
from mcore_rl.environments.sandbox import PythonSandbox
from mcore_rl.environments.tools import (Calculator, Tool, call_tool, parse_tool_calls,
                                         render_tool_response, tool_schemas)

if TYPE_CHECKING:
    from mcore_rl.config.schema import TrainConfig

# Tool calls run per turn at most; more are answered with an error each.
MAX_CALLS_PER_TURN = 8


@dataclass(frozen=True)
class ToolUseEnvironment:
    """``env.name=tool_use``: tools until an answer, the answer scored by a verifier.

    Attributes:
        reward_fn: the verifier of the final answer, ``(response_text, example) -> float``
            (module-level, so the executor's workers can import it).
        tools: the tools offered, by their ``name``.
        max_turns: model turns at most (>= 1); the last one's tool calls are not run.
    """

    reward_fn: Callable[[str, Example], float]
    tools: Sequence[Tool] = field(default_factory=lambda: (Calculator(),))
    max_turns: int = 4

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"env.max_turns must be >= 1 (got {self.max_turns})")
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names repeat: {names}")

    @classmethod
    def from_config(cls, cfg: "TrainConfig") -> "ToolUseEnvironment":
        """The run's reward (``reward.name``'s verifier, or the weighted ``reward.names``:
        :func:`mcore_rl.rewards.build_reward`) with the calculator and the Python sandbox (its
        limits and isolation from ``env.*``: ``env.sandbox``), ``env.max_turns``.

        Raises:
            ValueError: unknown ``reward.name`` (names the key).
        """
        from mcore_rl.rewards import build_reward  # torch: imported when the env is built

        env = cfg.env
        sandbox = PythonSandbox(timeout_seconds=env.tool_timeout_seconds,
                                cpu_seconds=env.sandbox_cpu_seconds,
                                memory_mb=env.sandbox_memory_mb,
                                max_output_chars=env.max_output_chars,
                                isolation=env.sandbox)
        return cls(build_reward(cfg.reward), (Calculator(), sandbox), env.max_turns)

    def tool_schemas(self) -> List[Dict[str, Any]]:
        """The tools as function specs for the chat template's ``tools=`` (the prompt's
        system part)."""
        return tool_schemas(self.tools)

    def reset(self, example: Example) -> Tuple[Optional[str], Dict[str, Any]]:
        """No observation (the prompt is the question); the metric keys at 0."""
        return None, new_metrics()

    def step(self, state: EpisodeState, model_turn_text: str) -> StepResult:
        """Run the turn's tool calls (observation: their responses), or score the answer.

        Raises:
            Exception: whatever the verifier raises on the final answer; tools never raise
                (their failures are observations).
        """
        metadata = {**state.metadata, TURNS: state.turn + 1}
        calls = parse_tool_calls(model_turn_text)
        if not calls:
            reward = float(self.reward_fn(model_turn_text, state.example))
            return StepResult(None, reward, True, metadata)
        metadata[TOOL_CALLS] = metadata.get(TOOL_CALLS, 0) + len(calls)
        if state.turn + 1 >= self.max_turns:  # no turn left to read the responses
            return StepResult(None, 0.0, True, {**metadata, "truncated": True})
        by_name = {t.name: t for t in self.tools}
        responses = []
        for i, call in enumerate(calls):
            if i >= MAX_CALLS_PER_TURN:
                result_text = ('{"error": "more than %d tool calls in one turn: not run"}'
                               % MAX_CALLS_PER_TURN)
                metadata[TOOL_ERRORS] = metadata.get(TOOL_ERRORS, 0) + 1
                responses.append(render_tool_response(result_text))
                continue
            result = call_tool(call, by_name)
            metadata[TOOL_ERRORS] = metadata.get(TOOL_ERRORS, 0) + int(result.error)
            metadata[TOOL_TIMEOUTS] = metadata.get(TOOL_TIMEOUTS, 0) + int(result.timed_out)
            responses.append(render_tool_response(result.content))
        return StepResult("\n".join(responses), 0.0, False, metadata)

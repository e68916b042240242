"""Tools in the Hermes / Qwen tool-call format, and a safe calculator.

A model calls a tool by writing, anywhere in its turn::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*(3+4)"}}
    </tool_call>

(the format of the Hermes models and of the Qwen2.5 / Qwen3 chat templates, whose ``tools=``
argument renders :func:`tool_schemas` into the system prompt). :func:`parse_tool_calls` reads
every such block; a malformed one (not JSON, no name, arguments not an object, an unclosed
tag) becomes a :class:`ToolCall` with an ``error``, never an exception. The tool's result goes
back as an observation, ``<tool_response>...</tool_response>`` (:func:`render_tool_response`),
which the caller puts into a ``tool`` chat turn (the Qwen templates wrap ``tool`` messages in
a user turn themselves) or a ``user`` turn.

A tool (:class:`Tool`) is a name, a description, a JSON schema of its arguments and a call
``(arguments) -> ToolResult``; a tool reports its failures in the result (``error``,
``timed_out``) rather than raising.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE),
                        re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One ``<tool_call>`` block of a model turn.

    Attributes:
        name: the tool's name ("" when the block has none).
        arguments: the call's arguments (empty when malformed).
        error: None for a well-formed call, else why the block is not one (the text the
            observation reports to the model).
    """

    name: str
    arguments: Dict[str, Any]
    error: Optional[str] = None


@dataclass(frozen=True)
class ToolResult:
    """What a tool call gives back.

    Attributes:
        content: the text of the observation (a JSON object for this package's tools).
        error: the call failed (bad arguments, the tool's own error); counted per episode.
        timed_out: the call was stopped at its time limit; counted per episode.
    """

    content: str
    error: bool = False
    timed_out: bool = False


class Tool(Protocol):
    """A tool a model can call.

    Attributes:
        name: what the model writes as ``"name"``.
        description: one line for the model (the chat template's tool list).
        parameters: JSON schema of the ``"arguments"`` object.
    """

    name: str
    description: str
    parameters: Dict[str, Any]

    def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        """Run the call; report failures in the result, never raise."""
        ...


def parse_tool_calls(text: str) -> List[ToolCall]:
    """Every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block of ``text``, in
    order. ``"arguments"`` may be an object or a string holding a JSON object (some models
    write it so); missing, it is ``{}``. A block that is not such an object gives a
    :class:`ToolCall` with ``error`` set, and so does a ``<tool_call>`` tag left unclosed at
    the end of the text (a turn cut at the token limit). Never raises."""
    calls = [_parse_one(body) for body in _TOOL_CALL.findall(text)]
    tail = text[text.rfind(TOOL_CALL_CLOSE) + len(TOOL_CALL_CLOSE):] \
        if TOOL_CALL_CLOSE in text else text
    if TOOL_CALL_OPEN in tail:
        calls.append(ToolCall("", {}, f"unclosed {TOOL_CALL_OPEN}: expected {TOOL_CALL_CLOSE}"))
    return calls


def has_tool_call(text: str) -> bool:
    """Whether ``text`` has a ``<tool_call>`` tag (well-formed or not)."""
    return TOOL_CALL_OPEN in text


def _parse_one(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except (ValueError, RecursionError) as e:
        return ToolCall("", {}, f"tool call is not valid JSON: {e}")
    if not isinstance(call, dict):
        return ToolCall("", {}, "tool call must be a JSON object with \"name\" and \"arguments\"")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", {}, "tool call has no \"name\" string")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as e:
            return ToolCall(name, {}, f"tool call arguments are not valid JSON: {e}")
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, "tool call \"arguments\" must be a JSON object")
    return ToolCall(name, arguments)


def render_tool_response(content: str) -> str:
    """The observation text of one tool result: ``<tool_response>\\n...\\n</tool_response>``
    (the Qwen chat templates' rendering of a ``tool`` message's content)."""
    return f"<tool_response>\n{content}\n</tool_response>"


def error_content(message: str) -> str:
    """A tool result's content for an error: ``{"error": message}``."""
    return json.dumps({"error": message})


def call_tool(call: ToolCall, tools: Mapping[str, Tool]) -> ToolResult:
    """Run ``call`` with the tool of its name in ``tools``; a malformed call, an unknown tool
    or a tool that raises (a bug: tools report their errors in the result) gives an error
    result. Never raises."""
    if call.error is not None:
        return ToolResult(error_content(call.error), error=True)
    tool = tools.get(call.name)
    if tool is None:
        return ToolResult(error_content(f"unknown tool {call.name!r}; available: "
                                        f"{', '.join(sorted(tools))}"), error=True)
    try:
        return tool(call.arguments)
    except Exception as e:  # a tool's own bug must not end the episode
        return ToolResult(error_content(f"tool {call.name!r} failed: {e!r}"), error=True)


def tool_schemas(tools: Sequence[Tool]) -> List[Dict[str, Any]]:
    """The tools as OpenAI-style function specs, for ``tokenizer.apply_chat_template(...,
    tools=tool_schemas(tools))``."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in tools]


# ---------------------------------------------------------------------------- calculator

class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate (the message says why)."""


_BINARY: Dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: Dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate_arithmetic(expression: str, max_length: int = 1000, max_bits: int = 4096) -> Any:
    """The value of an arithmetic expression: numbers (int or float literals), ``+ - * / **
    % //``, unary ``+ -`` and parentheses, evaluated on the :mod:`ast` tree (no ``eval``).

    Limits, checked before the work is done: the expression's length (``max_length``
    characters); every integer, operand or result, at most ``max_bits`` bits (a power's size is
    estimated from its operands before it is computed, so ``2**10**10`` is refused at once);
    float results must be finite and real.

    Raises:
        CalculatorError: a syntax error, a name, call, attribute, subscript, comparison or any
            other construct, a limit passed, division by zero, an overflow.
    """
    if len(expression) > max_length:
        raise CalculatorError(f"expression longer than {max_length} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalculatorError(f"not an arithmetic expression: {e}") from None

    def check(value: Any) -> Any:
        if isinstance(value, complex):
            raise CalculatorError("result is not a real number")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("result is not finite")
        if isinstance(value, int) and value.bit_length() > max_bits:
            raise CalculatorError(f"number larger than {max_bits} bits")
        return value

    def power(base: Any, exponent: Any) -> Any:
        if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 \
                and abs(base) > 1 and (abs(base).bit_length() - 1) * exponent > max_bits:
            raise CalculatorError(f"power larger than {max_bits} bits")
        if isinstance(exponent, (int, float)) and abs(exponent) > 1e6 and isinstance(base, int) \
                and abs(base) > 1:
            raise CalculatorError("exponent too large")
        return operator.pow(base, exponent)

    def visit(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return visit(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return check(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = visit(node.left), visit(node.right)
            fn = power if isinstance(node.op, ast.Pow) else _BINARY[type(node.op)]
            return check(fn(left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return check(_UNARY[type(node.op)](visit(node.operand)))
        raise CalculatorError(f"not allowed in an arithmetic expression: "
                              f"{type(node).__name__}")

    try:
        return visit(tree)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except (OverflowError, MemoryError, RecursionError, ValueError) as e:
        if isinstance(e, CalculatorError):
            raise
        raise CalculatorError(f"cannot evaluate: {e!r}") from None


@dataclass(frozen=True)
class Calculator:
    """The ``calculator`` tool: ``{"expression": "12*(3+4)"}`` -> ``{"result": 84}``
    (:func:`evaluate_arithmetic`; its refusals as ``{"error": ...}``)."""

    max_length: int = 1000
    max_bits: int = 4096
    name: str = "calculator"
    description: str = ("Evaluate an arithmetic expression: numbers, + - * / ** % //, "
                        "parentheses.")

    @property
    def parameters(self) -> Dict[str, Any]:
        return {"type": "object", "required": ["expression"],
                "properties": {"expression": {"type": "string",
                                              "description": "e.g. 12*(3+4)"}}}

    def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return ToolResult(error_content("calculator needs {\"expression\": <string>}"),
                              error=True)
        try:
            value = evaluate_arithmetic(expression, self.max_length, self.max_bits)
        except CalculatorError as e:
            return ToolResult(error_content(str(e)), error=True)
        return ToolResult(json.dumps({"result": value}))

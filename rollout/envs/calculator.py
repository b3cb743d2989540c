"""Calculator tool-call task: the model may call a calculator, then answers in \\boxed{}.

Prompt record: {"prompt": "What is 12*7+3?", "answer": "87"}. Each model turn either
  - calls the tool: <tool_call>12*7+3</tool_call>  -> observation <tool_response>87</tool_response>
  - answers: ... \\boxed{87}                       -> done, reward 1.0 if equal to the answer else 0.0
  - does neither                                  -> an observation saying how to call the tool.
Episodes end after max_turns with reward 0. With tool_reward > 0 a tool call that computes the
answer earns that much too (a per-turn reward).
"""
from __future__ import annotations

import ast
import operator
import re
from typing import Callable

from rollout.generation.multiturn import Environment, EnvStep
from rollout.rewards import last_boxed

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPS: dict[type[ast.operator | ast.unaryop], Callable[..., float]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg, ast.UAdd: operator.pos}


def safe_eval(expr: str) -> float:
    """Arithmetic only (+ - * / parentheses, numbers); anything else raises ValueError."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not plain arithmetic: {ast.dump(node)[:80]}")
    if len(expr) > 200:
        raise ValueError("expression too long")
    try:
        return ev(ast.parse(expr.strip(), mode="eval"))
    except (SyntaxError, ZeroDivisionError) as e:
        raise ValueError(str(e)) from None


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.6g}"


class CalculatorEnv(Environment):
    """Arithmetic with a calculator tool the model may call, the answer in \\boxed{}.

    tool_reward: reward of a turn whose tool call computes the answer (a per-turn reward: the
    episode's reward is the sum, and GSPO-token's per-turn credit can use it); instructions:
    append the how-to-answer sentence to the question (off: the question alone, a shorter
    context for tiny models that learn the format in a warm start)."""
    name = "calculator"

    def __init__(self, max_turns: int = 4, tool_reward: float = 0.0, instructions: bool = True):
        self.max_turns, self.tool_reward, self.instructions = max_turns, tool_reward, instructions
        self.answer = ""

    def reset(self, prompt: dict) -> str:
        self.answer = str(prompt["answer"])
        if not self.instructions:
            return str(prompt["prompt"])
        return (f"{prompt['prompt']}\nYou may use a calculator: write <tool_call>EXPRESSION</tool_call>. "
                "Give the final answer as \\boxed{ANSWER}.")

    def step(self, model_turn: str) -> EnvStep:
        boxed = last_boxed(model_turn)
        if boxed is not None:
            try:
                ok = abs(float(boxed) - float(self.answer)) < 1e-6
            except ValueError:
                ok = boxed.strip() == self.answer.strip()
            return EnvStep("", float(ok), True)
        calls = _TOOL_CALL.findall(model_turn)
        if calls:
            reward = 0.0
            try:
                result = _fmt(safe_eval(calls[-1]))
                reward = self.tool_reward * (abs(float(result) - float(self.answer)) < 1e-6)
            except ValueError as e:
                result = f"error: {e}"
            return EnvStep(f"<tool_response>{result}</tool_response>", reward, False, tool_call=True)
        return EnvStep("No tool call or answer found. Use <tool_call>EXPRESSION</tool_call> "
                       "or \\boxed{ANSWER}.", 0.0, False)

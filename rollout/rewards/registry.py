"""Reward names -> what the reward workers call.

    reward = get_reward("math")                     # shipped: math, exact_match, format, code
    reward = get_reward("my_pkg.rewards:judge")     # yours: fn(record, response_text) -> float
    reward = get_reward("http://judge:8000/score")  # a reward service (http_service.py)
    reward(record, text)                            # one sample, in this process

A `Reward` is a scoring function plus two optional traits the workers use:
- `prepare(record)`: work done once per prompt, not once per sample (math parses the reference
  answer, code parses the tests); its result is passed to `score` as a third argument.
- `batched`: `score(records, texts) -> list[float]` scores a whole group in one call (judges that
  batch, the HTTP service). Mark your own function with `@batched`.
Your own `package.module:function` may carry both (a `prepare` attribute, `@batched`).
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

from rollout.rewards.answers import exact_match_reward, format_reward
from rollout.rewards.math_answers import prepare_gold, score_math
from rollout.rewards.settings import CodeSandboxSettings, RewardServiceSettings


class RewardSpecError(ValueError):
    """rollout.reward names nothing that can be called; the message says why."""


def batched(fn: Callable[[list[dict], list[str]], list[float]]) -> Callable:
    """Mark a reward function as batched: fn(records, response_texts) -> one float per response."""
    fn.reward_batched = True  # type: ignore[attr-defined]
    return fn


@dataclasses.dataclass
class Reward:
    """What the reward workers call (module docstring)."""

    name: str
    score: Callable[..., Any]
    prepare: Callable[[dict], Any] | None = None
    batched: bool = False
    warm: Callable[[], Any] | None = None
    """Run once by each worker before it says it is ready (imports, the sandbox probe), so the
    first call is not the slow one."""

    def __call__(self, record: dict, response_text: str) -> float:
        """One sample in this process (tests, tools): prepare (if any) then score."""
        if self.batched:
            return self.score([record], [response_text])[0]
        if self.prepare is not None:
            return self.score(record, response_text, self.prepare(record))
        return self.score(record, response_text)


SHIPPED = ("math", "exact_match", "format", "code")


def get_reward(name: str, code_sandbox: CodeSandboxSettings | None = None,
               reward_service: RewardServiceSettings | None = None) -> Reward:
    """A shipped reward by name, a reward service by URL, or your own as `package.module:function`:
    fn(record, response_text) -> float, where `record` is the prompt row (its "prompt", "answer" and
    every other field: data_source, extra_info, ...). RewardSpecError names what is wrong."""
    if name == "math":
        return Reward(name, score_math, prepare=prepare_gold, warm=lambda: prepare_gold({"answer": "1/2"}))
    if name == "exact_match":
        return Reward(name, exact_match_reward)
    if name == "format":
        return Reward(name, format_reward())
    if name == "code":
        from rollout.rewards.code_reward import CodeReward
        code = CodeReward(code_sandbox or CodeSandboxSettings())
        return Reward(name, code.score, prepare=code.prepare, warm=code.sandbox.probe)
    if name.startswith(("http://", "https://")):
        from rollout.rewards.http_service import RewardService
        service = RewardService(name, reward_service or RewardServiceSettings())
        return Reward(name, service.score, batched=True)
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise RewardSpecError(f"rollout.reward={name!r}: {type(e).__name__}: {e}") from None
        if not callable(fn):
            raise RewardSpecError(f"rollout.reward={name!r}: {attr} is not callable")
        prepare = getattr(fn, "prepare", None)
        return Reward(name, fn, prepare=prepare if callable(prepare) else None,
                      batched=bool(getattr(fn, "reward_batched", False)))
    raise RewardSpecError(f"unknown reward {name!r}; expected one of {list(SHIPPED)}, "
                          "package.module:function, or an http(s):// reward service")


def check_reward(name: str, code_sandbox: CodeSandboxSettings | None = None,
                 reward_service: RewardServiceSettings | None = None) -> str | None:
    """Start-up check of a run's reward, before any server starts: it builds (RewardSpecError
    otherwise), a code sandbox runs here (SandboxUnavailable), a reward service accepts connections
    (RewardServiceError). Returns a line for the run's output when there is something to say."""
    get_reward(name, code_sandbox, reward_service)
    if name == "code":
        from rollout.rewards.sandbox import Sandbox
        return Sandbox(code_sandbox or CodeSandboxSettings()).probe()
    if name.startswith(("http://", "https://")):
        from rollout.rewards.http_service import check_reachable
        check_reachable(name)
    return None

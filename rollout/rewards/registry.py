"""The one table of shipped rewards, and reward names -> what the reward workers call.

    reward = get_reward("math")                     # shipped: a name of SHIPPED, below
    reward = get_reward("my_pkg.rewards:judge")     # yours: fn(record, response_text) -> float
    reward = get_reward("http://judge:8000/score")  # a reward service (http_service.py)
    reward(record, text)                            # one sample, in this process

A `Reward` is a scoring function plus two optional traits the workers use:
- `prepare(record)`: work done once per prompt, not once per sample (math parses the reference
  answer, code parses the tests); its result is passed to `score` as a third argument.
- `batched`: `score(records, texts) -> list[float]` scores a whole group in one call (judges that
  batch, the HTTP service). Mark your own function with `@batched`.
Your own `package.module:function` may carry both (a `prepare` attribute, `@batched`).

A shipped reward is a name in SHIPPED: its function lives in a module of its own beside this one,
and its row says how to build its Reward (and, if it needs one, its start-up check). A URL and a
`package.module:function` are not names but forms, recognised by their shape.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

from gspo_errors import InputError
from rollout.rewards.answers import exact_match_reward, format_reward
from rollout.rewards.math_answers import prepare_gold, score_math
from rollout.rewards.settings import CodeSandboxSettings, RewardServiceSettings


class RewardSpecError(InputError, ValueError):
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


@dataclasses.dataclass(frozen=True)
class ShippedReward:
    """One row of SHIPPED: a reward the project ships, by name."""

    name: str
    build: Callable[[CodeSandboxSettings], Reward]
    """The run's code sandbox settings -> the Reward (imports what only it needs on first use)."""
    description: str
    """One line for `gspo-megatron config` (rollout.reward's choices): what it scores."""
    check: Callable[[CodeSandboxSettings], str | None] | None = None
    """Start-up check beyond building it (check_reward): raises when the reward cannot run here,
    or returns a line for the run's output; None: building it is the whole check."""


def _math(code_sandbox: CodeSandboxSettings) -> Reward:
    return Reward("math", score_math, prepare=prepare_gold, warm=lambda: prepare_gold({"answer": "1/2"}))


def _code(code_sandbox: CodeSandboxSettings) -> Reward:
    from rollout.rewards.code_reward import CodeReward
    code = CodeReward(code_sandbox)
    return Reward("code", code.score, prepare=code.prepare, warm=code.sandbox.probe)


def _probe_sandbox(code_sandbox: CodeSandboxSettings) -> str | None:
    from rollout.rewards.sandbox.run import Sandbox
    return Sandbox(code_sandbox).probe()


SHIPPED: dict[str, ShippedReward] = {r.name: r for r in (
    ShippedReward("math", _math, "the final answer against the row's, by math-verify"),
    ShippedReward("exact_match", lambda code_sandbox: Reward("exact_match", exact_match_reward),
                  "the final answer equals the row's, whitespace, $ and case aside"),
    ShippedReward("format", lambda code_sandbox: Reward("format", format_reward()),
                  "the response has a \\boxed{} answer"),
    ShippedReward("code", _code, "the response's program against the row's tests, in a sandbox "
                  "(rollout.code_sandbox)", check=_probe_sandbox),
)}


def _is_service(name: str) -> bool:
    return name.startswith(("http://", "https://"))


def _service(url: str, reward_service: RewardServiceSettings) -> Reward:
    from rollout.rewards.http_service import RewardService
    return Reward(url, RewardService(url, reward_service).score, batched=True)


def _user_function(name: str) -> Reward:
    """`package.module:function`, imported here; its `prepare` and `@batched` traits kept."""
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


def get_reward(name: str, code_sandbox: CodeSandboxSettings | None = None,
               reward_service: RewardServiceSettings | None = None) -> Reward:
    """A shipped reward by name, a reward service by URL, or your own as `package.module:function`:
    fn(record, response_text) -> float, where `record` is the prompt row (its "prompt", "answer" and
    every other field: data_source, extra_info, ...). RewardSpecError names what is wrong."""
    if name in SHIPPED:
        return SHIPPED[name].build(code_sandbox or CodeSandboxSettings())
    if _is_service(name):
        return _service(name, reward_service or RewardServiceSettings())
    if ":" in name:
        return _user_function(name)
    raise RewardSpecError(f"unknown reward {name!r}; expected one of {list(SHIPPED)}, "
                          "package.module:function, or an http(s):// reward service")


def check_reward(name: str, code_sandbox: CodeSandboxSettings | None = None,
                 reward_service: RewardServiceSettings | None = None) -> str | None:
    """Start-up check of a run's reward, before any server starts: it builds (RewardSpecError
    otherwise), a code sandbox runs here (SandboxUnavailable), a reward service accepts connections
    (RewardServiceError). Returns a line for the run's output when there is something to say."""
    get_reward(name, code_sandbox, reward_service)
    shipped = SHIPPED.get(name)
    if shipped is not None and shipped.check is not None:
        return shipped.check(code_sandbox or CodeSandboxSettings())
    if _is_service(name):
        from rollout.rewards.http_service import check_reachable
        check_reachable(name)
    return None

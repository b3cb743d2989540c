"""The one table of rewards, and reward names -> what the reward workers call.

    reward = get_reward("math")                     # a row of REWARDS, below
    reward = get_reward("code", {"memory_mb": 512}) # with the row's own settings (rollout.reward_args)
    reward = get_reward("my_pkg.rewards:judge")     # yours: fn(record, response_text) -> float
    reward = get_reward("my_pkg.rewards:JUDGE")     # yours with settings: a RewardSpec
    reward = get_reward("http://judge:8000/score")  # a reward service (http_service.py)
    reward(record, text)                            # one sample, in this process

A `Reward` is a scoring function plus two optional traits the workers use:
- `prepare(record)`: work done once per prompt, not once per sample (math parses the reference
  answer, code parses the tests); its result is passed to `score` as a third argument.
- `batched`: `score(records, texts) -> list[float]` scores a whole group in one call (judges that
  batch, the HTTP service). Mark your own function with `@batched`.
Your own `package.module:function` may carry both (a `prepare` attribute, `@batched`).

A row of REWARDS (a RewardSpec) says how to build its Reward from its own settings (a dataclass, or
none), and, if it needs one, its start-up check. A row from outside the package is a RewardSpec in
an installed module (`rollout.reward: my_pkg.rewards:JUDGE`), or registered by a `plugins:` module;
a plain function named the same way becomes a row without settings. A URL is not a name but a form,
recognised by its shape: its settings are RewardServiceSettings.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from gspo_errors import InputError
from gspo_tables import Table, TableError, is_reference, row_settings
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
class RewardSpec:
    """One row of REWARDS: a reward by name."""

    name: str
    build: Callable[[Any], Reward]
    """Its settings (an instance of `settings`, or None) -> the Reward (imports what only it needs
    on first use)."""
    description: str
    """One line for `gspo-megatron config` (rollout.reward's choices): what it scores."""
    settings: type | None = None
    """Its own settings (a dataclass) from rollout.reward_args; None: it takes none. A settings class
    may define `misfit(reward_timeout_s, where) -> str | None` (checked at load against the reward
    call's bound) and `within(reward_timeout_s)` (the settings a worker uses under that bound)."""
    check: Callable[[Any], str | None] | None = None
    """Start-up check beyond building it (check_reward), given its settings: raises when the reward
    cannot run here, or returns a line for the run's output; None: building it is the whole check."""


def _user_function(fn: object, name: str) -> RewardSpec | None:
    """A plain function named by `package.module:function`, as a row without settings (its
    `prepare` and `@batched` traits kept); None for anything else."""
    if isinstance(fn, type) or not callable(fn):
        return None
    prepare = getattr(fn, "prepare", None)
    reward = Reward(name, fn, prepare=prepare if callable(prepare) else None,
                    batched=bool(getattr(fn, "reward_batched", False)))
    return RewardSpec(name, lambda settings: reward, (fn.__doc__ or "").strip().split("\n")[0])


def _math(settings: None) -> Reward:
    return Reward("math", score_math, prepare=prepare_gold, warm=lambda: prepare_gold({"answer": "1/2"}))


def _code(settings: CodeSandboxSettings) -> Reward:
    from rollout.rewards.code_reward import CodeReward
    code = CodeReward(settings)
    return Reward("code", code.score, prepare=code.prepare, warm=code.sandbox.probe)


def _probe_sandbox(settings: CodeSandboxSettings) -> str | None:
    from rollout.rewards.sandbox.run import Sandbox
    return Sandbox(settings).probe()


REWARDS: Table[RewardSpec] = Table("reward", RewardSpec, (
    RewardSpec("math", _math, "the final answer against the row's, by math-verify"),
    RewardSpec("exact_match", lambda settings: Reward("exact_match", exact_match_reward),
               "the final answer equals the row's, whitespace, $ and case aside"),
    RewardSpec("format", lambda settings: Reward("format", format_reward()), "the response has a \\boxed{} answer"),
    RewardSpec("code", _code, "the response's program against the row's tests, in a sandbox",
               settings=CodeSandboxSettings, check=_probe_sandbox),
), field="rollout.reward", adapt=_user_function)


def _is_service(name: str) -> bool:
    return name.startswith(("http://", "https://"))


def _service(url: str) -> RewardSpec:
    def build(settings: RewardServiceSettings) -> Reward:
        from rollout.rewards.http_service import RewardService
        return Reward(url, RewardService(url, settings).score, batched=True)

    def check(settings: RewardServiceSettings) -> None:
        from rollout.rewards.http_service import check_reachable
        check_reachable(url)
        return None
    return RewardSpec(url, build, "a reward service", settings=RewardServiceSettings, check=check)


def reward_spec(name: str, field: str = "rollout.reward") -> RewardSpec:
    """The row `name` answers to: a row of REWARDS (or package.module:Name), or a reward service's
    URL. RewardSpecError names the field and what is wrong."""
    if _is_service(name):
        return _service(name)
    if not is_reference(name) and name not in REWARDS:
        raise RewardSpecError(f"{field}={name!r}: expected one of {', '.join(REWARDS)}, "
                              "package.module:function (or a RewardSpec), or an http(s):// reward service")
    try:
        return REWARDS.row(name, field)
    except TableError as e:
        raise RewardSpecError(str(e)) from None


def reward_settings(name: str, args: Mapping[str, Any] | None, field: str = "rollout.reward_args") -> Any:
    """The reward's own settings built from `args` (plain data), or None for a reward without."""
    return row_settings(reward_spec(name), args, field)


def get_reward(name: str, args: Mapping[str, Any] | None = None, reward_timeout_s: float | None = None) -> Reward:
    """The reward `name` names (module docstring), built with its own settings from `args` (plain
    data; its defaults where absent) under a reward call bounded by `reward_timeout_s` (None: the
    settings as they are). Your function gets `record`, the prompt row (its "prompt", "answer" and
    every other field: data_source, extra_info, ...), and the response's text. RewardSpecError
    names what is wrong."""
    spec = reward_spec(name)
    settings = row_settings(spec, args, "rollout.reward_args")
    if settings is not None and reward_timeout_s is not None and hasattr(settings, "within"):
        settings = settings.within(reward_timeout_s)
    return spec.build(settings)


def check_reward(name: str, args: Mapping[str, Any] | None = None) -> str | None:
    """Start-up check of a run's reward, before any server starts: it builds (RewardSpecError
    otherwise), a code sandbox runs here (SandboxUnavailable), a reward service accepts connections
    (RewardServiceError). Returns a line for the run's output when there is something to say."""
    spec = reward_spec(name)
    settings = row_settings(spec, args, "rollout.reward_args")
    spec.build(settings)
    return spec.check(settings) if spec.check is not None else None

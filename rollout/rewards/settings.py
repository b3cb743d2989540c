"""Settings of the shipped rewards that take options: `reward: code` (the sandbox) and
`reward: http(s)://...` (a remote reward service). They are sections of the run config's `rollout:`
(`rollout.code_sandbox.*`, `rollout.reward_service.*`), and travel to the reward workers as plain data.
No torch, no megatron: the config parser imports them.
"""
from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass
class CodeSandboxSettings:
    """How `reward: code` runs a response's program against the row's tests
    (rollout/rewards/sandbox.py; what it isolates and what it does not: docs/rewards.md)."""

    time_limit_s: float = 4.0
    """Per test: wall-clock limit of the program (a row's own `time_limit` wins); CPU seconds are
    limited to the same, rounded up. The sandbox's own start-up (~50 ms) is not counted."""
    memory_mb: int = 1024
    """Per test: address-space limit of the program (RLIMIT_AS); a larger allocation fails."""
    max_output_bytes: int = 4 * 1024 * 1024
    """Per test: the program is killed once its stdout exceeds this (the test fails)."""
    max_processes: int = 32
    """Processes the program may have at once (RLIMIT_NPROC inside its user namespace: a fork
    bomb stops there)."""
    max_file_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE); its files live in a private tmpfs of
    64 MiB that disappears with it."""
    scoring: Literal["fraction", "all_pass"] = "fraction"
    """The reward: the fraction of tests passed, or 1.0 only when every test passes (then the first
    failure stops the run of the remaining tests)."""
    isolation: Literal["auto", "namespaces", "process"] = "auto"
    """namespaces: each test in fresh user, mount, PID and network namespaces (no network, a read-only
    file system but a private /tmp, no other process visible, everything killed with it) as an
    unprivileged user; refuse to start where the machine does not allow it. process: rlimits, a
    process group and a temporary directory only (no file-system or network isolation). auto:
    namespaces where the machine allows them, else process, said once at start."""
    private_tests: bool = True
    """LiveCodeBench rows: also run `private_test_cases` (when the row has them), not only the
    tests the answer key points at."""
    python: str | None = None
    """Interpreter of the programs (null: this Python if the sandbox user can run it, else
    python3 on PATH). The start-up check runs it once inside the sandbox."""

    def __post_init__(self) -> None:
        if self.time_limit_s <= 0:
            raise ValueError(f"time_limit_s={self.time_limit_s!r}: expected > 0")
        for name in ("memory_mb", "max_output_bytes", "max_processes", "max_file_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected >= 1")


@dataclasses.dataclass
class RewardServiceSettings:
    """`reward: http(s)://host/path`: one POST per group of responses (docs/rewards.md has the format)."""

    timeout_s: float = 15.0
    """Bound on one request (connect + answer). All attempts together must fit in
    rollout.reward_timeout_s (checked at start)."""
    retries: int = 2
    """Retries of a failed request (connection error, timeout, HTTP 5xx or 429), with exponential
    backoff; a 4xx answer or a malformed body is not retried."""
    backoff_s: float = 1.0
    """First retry's delay; doubled at each retry."""
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    """Extra request headers (e.g. Authorization)."""

    def worst_case_s(self) -> float:
        """Every attempt timing out, with the backoffs between them."""
        return self.timeout_s * (self.retries + 1) + self.backoff_s * (2 ** self.retries - 1)

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s!r}: expected > 0")
        if self.retries < 0:
            raise ValueError(f"retries={self.retries!r}: expected >= 0")
        if self.backoff_s < 0:
            raise ValueError(f"backoff_s={self.backoff_s!r}: expected >= 0")

"""The own settings of the rewards that take some: `reward: code` (the sandbox) and `reward:
http(s)://...` (a remote reward service). Each is its row's `settings` (registry.py): the run config
gives them as `rollout.reward_args` (and `eval.reward_args`), and they travel to the reward workers
as plain data. No torch, no megatron: the config parser imports them.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

DEFAULT_REWARD_TIMEOUT_S = 60.0
"""The run config's default rollout.reward_timeout_s (the code reward's budget when no worker pool
set one, e.g. scored inline)."""
INTERPRETER_START_S = 0.5
"""Added to a test's time limit for the interpreter's start (~30-60 ms here)."""


def tests_margin_s(reward_timeout_s: float) -> float:
    """What a reward call keeps back from its bound for the last run's kill and the result's way
    back to the pool: 10%, at least 2 s, at most half."""
    return min(max(2.0, 0.1 * reward_timeout_s), 0.5 * reward_timeout_s)


@dataclasses.dataclass
class CodeSandboxSettings:
    """How `reward: code` runs a response's program against the row's tests
    (rollout/rewards/sandbox/run.py; what it isolates and what it does not: docs/rewards.md)."""

    time_limit_s: float = 4.0
    """Per test: wall-clock limit of the program (a row's own `time_limit` wins); CPU seconds are
    limited to the same, rounded up. The sandbox's own start-up (~50 ms) is not counted. The tests
    of one response stop at the first that times out (the rest count as failed)."""
    tests_budget_s: float | None = None
    """All of one response's tests together: once spent, the tests not run count as failed, so a
    slow or looping program scores 0 (or what it passed) in bounded time, never a reward error.
    null: rollout.reward_timeout_s less 10% (at least 2 s, at most half); set, it must fit in that
    (checked at start, as is one test's time_limit_s in it)."""
    memory_mb: int = 1024
    """Per test: memory of the whole run, every process, tmpfs file, shared memory and memfd
    included, where a cgroup can be made (docs/rewards.md says where); else of each process, with
    at most 4 processes. Also each process's address space (RLIMIT_AS): a larger allocation fails."""
    max_output_bytes: int = 4 * 1024 * 1024
    """Per test: the program is killed once its stdout exceeds this (the test fails)."""
    max_processes: int = 32
    """Processes and threads the program may have at once (the run's cgroup, and RLIMIT_NPROC inside
    its user namespace: a fork bomb stops there); 4 where no cgroup can be made."""
    max_file_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE); its files live in a private tmpfs of
    64 MiB that disappears with it."""
    scoring: Literal["fraction", "all_pass"] = "fraction"
    """The reward: the fraction of tests passed, or 1.0 only when every test passes (then the first
    failure stops the run of the remaining tests). fraction pays a guess: a program printing one
    constant earns the share of the tests expecting it (a constant YES: 0.5 on a YES/NO row), so
    pick all_pass for rows with few distinct outputs or few tests (docs/rewards.md)."""
    isolation: Literal["auto", "gvisor", "namespaces", "process"] = "auto"
    """auto: gvisor where it runs (root, Debian's runsc, installed on first use), else namespaces with
    a start-up line saying what the shared kernel leaves open. gvisor: each response's tests in a
    gVisor sandbox of their own (gVisor's kernel, not the host's: docs/rewards.md), refused at start
    where it cannot run. namespaces: each test in fresh user, mount, PID, network, IPC, UTS and
    cgroup namespaces, in a root holding only the interpreter's read-only files and a private /tmp
    (no project, data or run folder, no network, no other process visible, everything killed with
    it) as an unprivileged user (as root: one of each worker's own); refused at start, in one line,
    where the machine does not allow it. process: weaker, only by choice: the host's namespaces, with limits, a process group,
    a private folder, a user of each worker's own (as root), Landlock on its files where the kernel
    has it (else no file-system isolation) and a system-call filter that refuses sockets."""
    private_tests: bool = True
    """LiveCodeBench rows: also run `private_test_cases` (when the row has them), not only the
    tests the answer key points at."""
    python: str | None = None
    """Interpreter of the programs (null: this Python if the sandbox user can run it, else
    python3 on PATH). The start-up check runs it once inside the sandbox."""

    def __post_init__(self) -> None:
        if self.time_limit_s <= 0:
            raise ValueError(f"time_limit_s={self.time_limit_s!r}: expected > 0")
        if self.tests_budget_s is not None and self.tests_budget_s <= 0:
            raise ValueError(f"tests_budget_s={self.tests_budget_s!r}: expected > 0 or null")
        for name in ("memory_mb", "max_output_bytes", "max_processes", "max_file_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected >= 1")

    def budget_within(self, reward_timeout_s: float) -> float:
        """The tests' budget in a reward call bounded by `reward_timeout_s` (tests_budget_s)."""
        if self.tests_budget_s is not None:
            return self.tests_budget_s
        return reward_timeout_s - tests_margin_s(reward_timeout_s)

    def within(self, reward_timeout_s: float) -> CodeSandboxSettings:
        """These settings in a reward call bounded by `reward_timeout_s`: tests_budget_s set."""
        return dataclasses.replace(self, tests_budget_s=self.budget_within(reward_timeout_s))

    def misfit(self, reward_timeout_s: float, where: str = "rollout.reward_args") -> str | None:
        """Why the tests cannot keep within a reward call bounded by `reward_timeout_s`, as one
        line naming the fields (under `where`), or None."""
        room = reward_timeout_s - tests_margin_s(reward_timeout_s)
        if self.tests_budget_s is not None and self.tests_budget_s > room:
            return (f"{where}.tests_budget_s={self.tests_budget_s:g}: expected <= {room:g} s, "
                    f"rollout.reward_timeout_s={reward_timeout_s:g} less {tests_margin_s(reward_timeout_s):g} s "
                    "for the last run's kill (or raise rollout.reward_timeout_s)")
        budget = self.budget_within(reward_timeout_s)
        if self.time_limit_s + INTERPRETER_START_S > budget:
            return (f"{where}.time_limit_s={self.time_limit_s:g}: one test at its limit (+ "
                    f"{INTERPRETER_START_S:g} s for the interpreter) does not fit the {budget:g} s that one "
                    f"response's tests may take ({where}.tests_budget_s, by default "
                    f"rollout.reward_timeout_s={reward_timeout_s:g} less 10%, at least 2 s); lower it or raise "
                    "rollout.reward_timeout_s")
        return None


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

    def misfit(self, reward_timeout_s: float, where: str = "rollout.reward_args") -> str | None:
        """Why the attempts cannot fit in a reward call bounded by `reward_timeout_s`, or None."""
        worst = self.worst_case_s()
        if reward_timeout_s > worst:
            return None
        return (f"rollout.reward_timeout_s={reward_timeout_s:g}: expected > {worst:g} s for the reward "
                f"service's attempts to fit ({where}: timeout_s x (retries + 1) + backoffs), or fewer retries")

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s!r}: expected > 0")
        if self.retries < 0:
            raise ValueError(f"retries={self.retries!r}: expected >= 0")
        if self.backoff_s < 0:
            raise ValueError(f"backoff_s={self.backoff_s!r}: expected >= 0")

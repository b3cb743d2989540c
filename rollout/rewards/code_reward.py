"""`reward: code`: the response's program run against the row's tests, in the sandbox (sandbox/run.py).

    reward = CodeReward(CodeSandboxSettings())
    tests = reward.prepare(record)               # once per prompt: the row's tests, parsed
    reward.score(record, response_text, tests)   # fraction of tests passed (or all-or-nothing)

The program: the last fenced code block of the response (```python ... ``` or untagged ```...```;
a later block in another language does not hide an earlier Python one), Python only, found by a
linear scan of the response's first MAX_SCANNED_CHARS.

The tests, from the field the answer key points at (`rollout.answer_key`), in any of the layouts
users keep them in:
- APPS / TACO `input_output`, which is also verl's `reward_model.ground_truth`: a dict or its JSON
  text `{"inputs": [...], "outputs": [...], "fn_name": optional}`. Without fn_name each test is a
  stdin/stdout pair (an input or output given as a list of lines is joined); with it, each input is
  the argument list of a call to `fn_name` (a top-level function, or a method of `class Solution`)
  and the output its return value (APPS wraps it in a one-element list: both are accepted).
- LiveCodeBench: a list (or its JSON text) of `{"input", "output", "testtype": "stdin" |
  "functional"}`, from `public_test_cases`; the row's `private_test_cases` are added when
  `private_tests` (rollout.reward_args) is on (plain JSON, or LiveCodeBench's base64 + zlib + pickle of the
  JSON text, unpickled with nothing but strings allowed). Functional tests take the function name
  from the row's `metadata` (`{"func_name": ...}`) and one JSON value per input line.
A per-test time limit comes from the row (`time_limit`: seconds, or text such as "2 seconds", at
the top level or in the tests' dict), else from the settings' time_limit_s.

Comparison, exact wherever the expected value is exact (a tolerance on integers pays `a + b + 1`
on 1000000, and factorial(20) off by 1e12): stdout equal after trimming trailing whitespace per line
and trailing empty lines, else token by token: a token equal as text, or, where the expected token is
a real float (a decimal point or an exponent: `0.5`, `1e-9`), a number within 1e-6 of it (relative or
absolute). Return values: equal as JSON values; integers, strings and booleans exactly, a float
expected within the same tolerance; tuples as lists. (LiveCodeBench compares such tokens as
decimals, verl's APPS checks try a float tolerance first: this is the strict end.) Whatever the
program prints is an answer: an output that cannot be parsed or compared (an int past int()'s 4300
digits, JSON nested past MAX_RESULT_DEPTH, 10**400 against a float) fails the test; only the
sandbox's own failure to start a run raises (SandboxFailure: the machine's, scored as such and never
a reward error, scoring.py).

Time: each test has its limit, and the whole scoring of one response, from the call's start, has a
budget below the reward call's bound (tests_budget_s, by default rollout.reward_timeout_s
less a margin): the tests stop at the first that times out or when the budget is spent, and the
tests not run count as failed. A slow or looping program thus scores 0 (or what it passed) in
bounded time, never a reward error that would stop the run.
"""
from __future__ import annotations

import base64
import dataclasses
import io
import itertools
import json
import math
import operator
import pickle
import re
import time
import zlib
from typing import Any

from rollout.rewards.sandbox.run import Sandbox, SandboxFailure
from rollout.rewards.settings import DEFAULT_REWARD_TIMEOUT_S, CodeSandboxSettings

_TAG = re.compile(r"[A-Za-z0-9_+-]*")
PYTHON_TAGS = {"", "python", "py", "python3", "py3"}
FLOAT_TOLERANCE = 1e-6
MAX_SCANNED_CHARS = 1 << 20
"""A response's first characters searched for code blocks (a 32k-token response is ~130k)."""
RESULT_RATIO, RESULT_SLACK = 16, 4096
"""A call's result is parsed only up to RESULT_SLACK + RESULT_RATIO x the expected value's JSON in
characters: longer JSON cannot equal it (a float's repr is at most 24 characters, a character
escaped at most 12), and a result of max_output_bytes in small numbers parsed whole is a list of
a million objects in the worker."""
MAX_RESULT_DEPTH = 200
"""Deepest nesting of a call's JSON result that is parsed; deeper fails the test (a result of
"[" * 100000 would reach json's and the comparison's recursion)."""


def extract_program(text: str) -> str | None:
    """The last fenced Python (or untagged) code block of a response, or None: "```tag ...\n",
    the code, the next "```". A scan with str.find, linear in the text: a regular expression with a
    lazy body backtracks quadratically on a long run of backticks (100k: 12-21 s)."""
    text, pos, program = text[:MAX_SCANNED_CHARS], 0, None
    while True:
        start = text.find("```", pos)
        newline = text.find("\n", start + 3) if start >= 0 else -1
        end = text.find("```", newline + 1) if newline >= 0 else -1
        if end < 0:  # no later fence can close either
            return program
        tag = _TAG.match(text, start + 3, newline)  # matches, if only the empty string
        if tag is not None and tag.group(0).lower() in PYTHON_TAGS:
            program = text[newline + 1:end]
        pos = end + 3


@dataclasses.dataclass
class Case:
    input: Any
    """stdin text, or the argument list of a call."""
    output: Any
    """expected stdout text, or the expected return value."""


@dataclasses.dataclass
class TestSuite:
    cases: list[Case]
    fn_name: str | None = None
    """Call-based tests: the function (or Solution method) to call; None: stdin/stdout."""
    time_limit_s: float | None = None


class _StringsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name} from a test field")


def _decode_tests(value: Any, where: str) -> Any:
    """A test field as data: as it is, JSON text, or LiveCodeBench's base64(zlib(pickle(JSON)))."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text[:1] in "[{":
        return json.loads(text)
    try:
        raw = _StringsOnly(io.BytesIO(zlib.decompress(base64.b64decode(text)))).load()
    except Exception as e:  # noqa: BLE001 - named below with the field
        raise ValueError(f"{where}: expected tests as JSON ({{inputs, outputs[, fn_name]}} or a list of "
                         f"{{input, output, testtype}}) or LiveCodeBench's compressed form, got {text[:60]!r} "
                         f"({type(e).__name__}: {e})") from None
    return json.loads(raw) if isinstance(raw, (str, bytes)) else raw


def _lines(x: Any) -> str:
    return "\n".join(map(str, x)) + "\n" if isinstance(x, list) else str(x)


def _time_limit(*sources: Any) -> float | None:
    for src in sources:
        if isinstance(src, dict) and src.get("time_limit") is not None:
            value = src["time_limit"]
            m = re.match(r"\s*([0-9]*\.?[0-9]+)", str(value))
            if m:
                return float(m.group(1))
    return None


def load_tests(record: dict, private_tests: bool = True) -> TestSuite:
    """The row's tests (module docstring for the layouts); ValueError naming the field otherwise."""
    spec = _decode_tests(record["answer"], "answer")
    if isinstance(spec, dict) and "inputs" in spec and "outputs" in spec:
        inputs, outputs, fn_name = spec["inputs"], spec["outputs"], spec.get("fn_name")
        if len(inputs) != len(outputs):
            raise ValueError(f"answer: {len(inputs)} inputs but {len(outputs)} outputs")
        if fn_name:
            cases = [Case(list(i) if isinstance(i, (list, tuple)) else [i], o) for i, o in zip(inputs, outputs)]
        else:
            cases = [Case(_lines(i), _lines(o)) for i, o in zip(inputs, outputs)]
        return TestSuite(cases, fn_name or None, _time_limit(spec, record))
    if isinstance(spec, list) and all(isinstance(t, dict) and "input" in t and "output" in t for t in spec):
        tests = list(spec)
        if private_tests and record.get("private_test_cases"):
            private = _decode_tests(record["private_test_cases"], "private_test_cases")
            if not isinstance(private, list):
                raise ValueError(f"private_test_cases: expected a list of tests, got {type(private).__name__}")
            tests += private
        functional = [t for t in tests if t.get("testtype") == "functional"]
        fn_name = None
        if functional:
            meta = record.get("metadata")
            meta = json.loads(meta) if isinstance(meta, str) and meta.strip() else meta or {}
            fn_name = meta.get("func_name") if isinstance(meta, dict) else None
            if not fn_name:
                raise ValueError("functional tests need the function's name in the row's metadata "
                                 "({\"func_name\": ...})")
            cases = [Case([json.loads(line) for line in str(t["input"]).split("\n") if line.strip()],
                          json.loads(t["output"])) for t in tests]
        else:
            cases = [Case(str(t["input"]), str(t["output"])) for t in tests]
        return TestSuite(cases, fn_name, _time_limit(record))
    raise ValueError("answer: expected tests as {inputs, outputs[, fn_name]} (APPS/TACO, verl) or a list "
                     f"of {{input, output, testtype}} (LiveCodeBench), got {str(spec)[:80]!r}")


_REAL = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+|\d+(?:\.\d*)?[eE][+-]?\d+)")


def _tokens_equal(got: str, expected: str) -> bool:
    """Equal as text, or close to an expected real float (module docstring); an integer is exact."""
    if got == expected:
        return True
    if not _REAL.fullmatch(expected):
        return False
    try:
        x = float(got)
    except ValueError:
        return False
    return _close(x, float(expected))


def _close(got: float, expected: float) -> bool:
    return math.isclose(got, expected, rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE)


_BLANK = re.compile(r"\s*")
_TOKEN = re.compile(r"\S+")


def stdout_matches(got: str, expected: str) -> bool:
    """Module docstring: trimmed lines, else tokens, with a tolerance only on expected floats. Both
    compared as streams, a line or a token at a time: an output of max_output_bytes in small
    tokens, split whole, was 1.4 million strings (84 MiB more in the worker while compared)."""
    return _same_lines(got, expected) or _same_tokens(got, expected)


def _same_lines(got: str, expected: str) -> bool:
    """Equal after trimming trailing whitespace per line and trailing empty lines, the output's
    lines compared where they lie (no copy of them)."""
    g = e = 0
    while g <= len(got) and e <= len(expected):
        g_end, e_end = got.find("\n", g), expected.find("\n", e)
        g_end, e_end = len(got) if g_end < 0 else g_end, len(expected) if e_end < 0 else e_end
        want = expected[e:e_end].rstrip()  # ends in a character that is not whitespace, or is empty
        if not (got.startswith(want, g, g_end) and _BLANK.fullmatch(got, g + len(want), g_end)):
            return False
        g, e = g_end + 1, e_end + 1
    return bool(_BLANK.fullmatch(got, min(g, len(got))) and _BLANK.fullmatch(expected, min(e, len(expected))))


def _same_tokens(got: str, expected: str) -> bool:
    for a, b in itertools.zip_longest(_TOKEN.finditer(got), _TOKEN.finditer(expected)):
        if a is None or b is None:
            return False
        want = b.group()
        if a.end() - a.start() != len(want) and not _REAL.fullmatch(want):
            return False  # not equal as text, and no tolerance: not read out of the output at all
        if not _tokens_equal(a.group(), want):
            return False
    return True


def values_equal(got: Any, expected: Any) -> bool:
    """A call's return value against the expected one (module docstring)."""
    if isinstance(got, bool) or isinstance(expected, bool):
        return isinstance(got, bool) and isinstance(expected, bool) and got == expected
    if isinstance(expected, float) and isinstance(got, (int, float)):
        try:
            return _close(got, expected)
        except OverflowError:  # an int past the largest float (10**400)
            return False
    if isinstance(expected, int) and isinstance(got, (int, float)):
        return got == expected  # exact: 3.0 is 3, 3.0000001 is not
    if isinstance(got, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(got) == len(expected) and all(values_equal(x, y) for x, y in zip(got, expected))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(values_equal(got[k], expected[k]) for k in got)
    return got == expected


def call_result(out: str, max_chars: int | None = None) -> tuple[bool, Any]:
    """(found, value): the JSON after the harness's last marker line in a call's stdout. Bounded
    before parsing: the stdout is capped (max_output_bytes), a result longer than `max_chars` is
    not parsed (output_passes: what could equal the expected value), nesting past MAX_RESULT_DEPTH
    is refused, and int() refuses more than 4300 digits."""
    marker = CALL_MARKER.strip() + "\n"
    at = out.rfind(marker)
    if at < 0 or (max_chars is not None and len(out) - at - len(marker) > max_chars):
        return False, None
    text = out[at + len(marker):]
    if _nesting(text) > MAX_RESULT_DEPTH:
        return False, None
    try:
        return True, json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or an int of more digits than int() takes
        return False, None


_BRACKETS = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[{]}"))


def _nesting(text: str) -> int:
    """An upper bound on the nesting of a JSON text (brackets inside strings count too), in C loops."""
    if text.count("[") + text.count("{") <= MAX_RESULT_DEPTH:
        return MAX_RESULT_DEPTH
    steps = text.encode(errors="surrogatepass").translate(_BRACKETS, _NOT_BRACKETS)  # 2 open, 0 close
    return max(map(operator.sub, itertools.accumulate(steps), range(1, len(steps) + 1)), default=0)


def output_passes(got: str, expected: Any, call: bool) -> bool:
    """A run's output against the expected one: stdout text (stdout_matches) or a call's result
    (values_equal, APPS's one-element wrapping accepted). Whatever the program printed, this
    answers: an output that makes the parse or the comparison raise fails the test."""
    try:
        if not call:
            return stdout_matches(got, str(expected))
        found, value = call_result(got, RESULT_SLACK + RESULT_RATIO * len(json.dumps(expected)))
        return found and (values_equal(value, expected) or (isinstance(expected, list) and len(expected) == 1
                                                            and values_equal(value, expected[0])))
    except Exception:  # noqa: BLE001 - the program's output, never the sandbox's failure
        return False


CALL_MARKER = "\n@@gspo-call-result@@"

# Appended to a program for call-based tests: one call with the arguments read from stdin (JSON),
# the JSON of the return value printed after a marker line (the program may print too).
CALL_HARNESS = '''

def __gspo_call():
    import json as __json, sys as __sys
    __args = __json.loads(__sys.stdin.read())
    __fn = globals().get({name!r})
    if __fn is None and "Solution" in globals():
        __fn = getattr(globals()["Solution"](), {name!r})
    __result = __fn(*__args)
    if isinstance(__result, tuple):
        __result = list(__result)
    __sys.stdout.write({marker!r} + "\\n" + __json.dumps(__result) + "\\n")

__gspo_call()
'''


class CodeReward:
    """The `code` reward (module docstring). One sandbox per worker process."""

    def __init__(self, settings: CodeSandboxSettings) -> None:
        self.settings = settings
        self.sandbox = Sandbox(settings)
        # the reward workers always set tests_budget_s from their rollout.reward_timeout_s
        self.budget_s = settings.budget_within(DEFAULT_REWARD_TIMEOUT_S)

    def prepare(self, record: dict) -> TestSuite:
        suite = load_tests(record, self.settings.private_tests)
        if not suite.cases:
            raise ValueError("the row has no tests")
        return suite

    def score(self, record: dict, response_text: str, suite: TestSuite | None = None) -> float:
        deadline = time.monotonic() + self.budget_s  # the call's own time (extraction, parsing) counts
        suite = suite or self.prepare(record)
        program = extract_program(response_text)
        if program is None:
            return 0.0
        limit = suite.time_limit_s or self.settings.time_limit_s
        passed = 0
        with self.sandbox.session():  # gVisor: one sandbox for this response's tests, none shared with another's
            for case in suite.cases:
                if time.monotonic() >= deadline:
                    break  # the budget is spent: the tests not run count as failed
                status, ok = self._run_case(program, suite.fn_name, case, limit, deadline)
                passed += ok
                if status == "timeout":
                    break  # a program that timed out once would spend the rest of the budget the same way
                if not ok and self.settings.scoring == "all_pass":
                    return 0.0
        return passed / len(suite.cases) if self.settings.scoring == "fraction" else float(passed == len(suite.cases))

    def _run_case(self, program: str, fn_name: str | None, case: Case, limit: float,
                  deadline: float) -> tuple[str, bool]:
        """(the run's status, whether the test passed)."""
        if fn_name is None:
            source, stdin = program, str(case.input).encode()
        else:
            source = program + CALL_HARNESS.format(name=fn_name, marker=CALL_MARKER.strip())
            stdin = json.dumps(case.input).encode()
        result = self.sandbox.run(source, stdin, limit, deadline)
        self._check(result)
        ok = result.status == "ok" and output_passes(result.stdout.decode(errors="replace"), case.output,
                                                     fn_name is not None)
        return result.status, ok

    @staticmethod
    def _check(result: Any) -> None:
        if result.status == "sandbox_error":  # ours, not the program's: never the response's reward error
            raise SandboxFailure(f"the code sandbox failed to start a run (not the response's doing): "
                                 f"{result.stderr_tail.decode(errors='replace').strip()[-300:]}")

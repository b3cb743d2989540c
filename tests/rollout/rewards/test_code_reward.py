"""`reward: code` (rollout/rewards/code_reward.py): programs from responses, the tests as APPS/TACO,
verl and LiveCodeBench keep them, scores, and the sandbox's hostile cases scoring 0 (each test
fails) within the limit with nothing left on the host. The policy is optimised to get reward: a
tolerance it can exploit, a row it can make run past the reward timeout, a worker it can read or
kill, each has a test here."""
from __future__ import annotations

import base64
import json
import os
import pickle
import socket
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import psutil
import pytest

from rollout.rewards import RewardWorkerPool
from rollout.rewards.code_reward import CodeReward, extract_program, load_tests, stdout_matches, values_equal
from rollout.rewards.sandbox.run import SANDBOX_ENV
from rollout.rewards.settings import CodeSandboxSettings

ROOT = Path(__file__).resolve().parents[3]
ADD = {"inputs": ["1 2\n", "3 4\n", "10 -3\n"], "outputs": ["3\n", "7\n", "7\n"]}
RIGHT = "Read two numbers.\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
WRONG = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"
PARTLY = "```python\na, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n```"  # 2 of 3


def test_the_program_is_the_last_python_block():
    assert extract_program("```python\nx = 1\n```\ntext\n```py\nx = 2\n```") == "x = 2\n"
    assert extract_program("```\nprint(1)\n```") == "print(1)\n"
    assert extract_program("```python\nok = 1\n```\n```cpp\nint main(){}\n```") == "ok = 1\n"
    assert extract_program("no code") is None


def test_test_layouts():
    apps = load_tests({"answer": json.dumps(ADD)})
    assert apps.fn_name is None and [c.input for c in apps.cases] == ADD["inputs"]
    lines = load_tests({"answer": {"inputs": [["1", "2"]], "outputs": [["3"]]}})  # lists of lines
    assert (lines.cases[0].input, lines.cases[0].output) == ("1\n2\n", "3\n")
    call = load_tests({"answer": {"fn_name": "add", "inputs": [[1, 2]], "outputs": [[3]]}, "time_limit": "2 seconds"})
    assert call.fn_name == "add" and call.cases[0].input == [1, 2] and call.time_limit_s == 2.0
    public = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]
    private = [{"input": "5 5\n", "output": "10\n", "testtype": "stdin"}]
    packed = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(private)))).decode()
    lcb = load_tests({"answer": json.dumps(public), "private_test_cases": packed})
    assert [c.input for c in lcb.cases] == ["1 2\n", "5 5\n"]
    assert len(load_tests({"answer": public, "private_test_cases": packed}, private_tests=False).cases) == 1
    functional = load_tests({"answer": [{"input": "[1, 2]\n3", "output": "[1, 2, 3]", "testtype": "functional"}],
                             "metadata": json.dumps({"func_name": "push"})})
    assert functional.fn_name == "push" and functional.cases[0].input == [[1, 2], 3]
    evil = base64.b64encode(zlib.compress(pickle.dumps(ValueError("x")))).decode()
    with pytest.raises(ValueError, match="refusing to unpickle"):
        load_tests({"answer": public, "private_test_cases": evil})
    with pytest.raises(ValueError, match="expected tests as"):
        load_tests({"answer": "42"})


def test_output_comparison():
    assert stdout_matches("3 \n\n", "3\n")
    assert stdout_matches("0.3333333\n", "0.33333333\n")
    assert stdout_matches("1 0.3333333\n", "1 0.33333333\n")
    assert stdout_matches("2.5000001e-09\n", "2.5e-9\n") and stdout_matches("3\n", "3.0\n")
    assert not stdout_matches("3\n", "4\n")
    assert not stdout_matches("1 2", "1 2 3")


def test_integers_and_strings_compare_exactly():
    # a relative tolerance on integers pays a wrong answer: a + b + 1 on 1000000, factorial(20)
    # off by 1e12 (reward hacking through the comparison)
    assert not stdout_matches("1000001\n", "1000000\n")
    assert not stdout_matches("2432903008176640000\n", "2432902008176640000\n")
    assert not stdout_matches("3.0\n", "3\n") and not stdout_matches("1e6\n", "1000000\n")
    assert not stdout_matches("1000001 0.5\n", "1000000 0.5\n")
    assert values_equal(3, 3) and values_equal(3.0, 3) and values_equal([1, "a"], (1, "a"))
    assert not values_equal(1000001, 1000000) and not values_equal(2432903008176640000, 2432902008176640000)
    assert not values_equal(3.0000001, 3) and not values_equal(1, True) and not values_equal(True, 1)
    assert values_equal(0.33333333, 0.3333333) and values_equal([1.0000000001], [1.0])
    assert not values_equal({"a": 1000001}, {"a": 1000000})


@pytest.fixture(scope="module")
def code() -> CodeReward:
    reward = CodeReward(CodeSandboxSettings(time_limit_s=2.0, max_output_bytes=1 << 20))
    reward.sandbox.probe()  # as a reward worker does before its first call (warm)
    return reward


@pytest.mark.slow
def test_scores_right_wrong_and_partly_right(code):
    record = {"answer": json.dumps(ADD)}
    suite = code.prepare(record)
    assert code.score(record, RIGHT, suite) == 1.0
    assert code.score(record, WRONG, suite) == 0.0
    assert code.score(record, PARTLY, suite) == pytest.approx(2 / 3)
    assert code.score(record, "I cannot write code", suite) == 0.0
    all_pass = CodeReward(CodeSandboxSettings(scoring="all_pass"))
    assert all_pass.score(record, PARTLY) == 0.0 and all_pass.score(record, RIGHT) == 1.0
    calls = {"answer": {"fn_name": "add", "inputs": [[1, 2], [2, 2]], "outputs": [[3], [4]]}}
    assert code.score(calls, "```python\ndef add(a, b):\n    return a + b\n```") == 1.0
    leet = {"answer": [{"input": "[1, 2]\n3", "output": "[1, 2, 3]", "testtype": "functional"}],
            "metadata": {"func_name": "push"}}
    assert code.score(leet, "```python\nclass Solution:\n    def push(self, xs, x):\n"
                            "        return xs + [x]\n```") == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("isolation", ["auto", "namespaces", "process", "process without landlock"])
def test_an_honest_solution_scores_one_in_every_mode(isolation, monkeypatch):
    # what closes an attack must leave the honest path whole: the root of the interpreter's files,
    # the filter, the emptied cgroup
    if isolation == "process without landlock":
        from rollout.rewards.sandbox import run as sandbox_run
        monkeypatch.setattr(sandbox_run, "landlock_abi", lambda: 0)
    reward = CodeReward(CodeSandboxSettings(isolation=isolation.split()[0], time_limit_s=2.0))
    honest = ("```python\nimport collections, heapq, json, sys\nfrom fractions import Fraction\n"
              "a, b = map(int, sys.stdin.read().split())\nprint(int(Fraction(a) + Fraction(b)))\n```")
    assert reward.score({"answer": json.dumps(ADD)}, honest) == 1.0


@pytest.mark.slow
def test_hostile_programs_score_zero_within_the_limit_and_leave_nothing(code, tmp_path):
    record = {"answer": {"inputs": ["1 2\n"], "outputs": ["3\n"]}}
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    tmp_path.chmod(0o777)
    outside = tmp_path / "outside.txt"  # the host's, not the run's
    hostile = {
        "infinite loop": "while True: pass",
        "fork bomb": "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass",
        "1 GB print": "s = 'x' * 10**5\nfor _ in range(10**4): print(s)",
        "10 GB allocation": "a = bytearray(10 * 2**30)\nprint(3)",
        "socket to 127.0.0.1": f"import socket\nsocket.create_connection(('127.0.0.1', "
                               f"{listener.getsockname()[1]}), timeout=1)\nprint(3)",
        "write outside its folder": f"open({str(outside)!r}, 'w').write('x')\nprint(3)",
    }
    for name, program in hostile.items():
        t0 = time.monotonic()
        assert code.score(record, f"```python\n{program}\n```") == 0.0, name
        assert time.monotonic() - t0 < 2.0 + 2.5, name
    with pytest.raises(socket.timeout):
        listener.accept()
    assert not outside.exists()
    code.sandbox.close()  # gVisor's spare sandbox, started ahead for a next response, holds no program
    left = [p for p in psutil.process_iter() if _tagged(p, code.sandbox.tag)]
    assert left == []


def _tagged(p, tag: str) -> bool:
    try:
        return p.environ().get(SANDBOX_ENV) == tag
    except Exception:  # noqa: BLE001 - gone or not ours
        return False


@pytest.mark.slow
def test_code_reward_in_the_workers():
    with RewardWorkerPool("code", workers=2, timeout_s=30, args={"time_limit_s": 2.0}) as pool:
        record = {"answer": json.dumps(ADD)}
        scores = pool.submit([record] * 3, [RIGHT, WRONG, PARTLY]).result(timeout=60)
        assert [round(s.reward, 4) for s in scores] == [1.0, 0.0, 0.6667]
        [bad] = pool.submit([{"answer": "no tests here"}], [RIGHT]).result(timeout=60)
        assert not bad.ok and "expected tests as" in bad.error


@pytest.mark.slow
def test_eval_metrics_with_the_code_reward():
    """eval/accuracy counts a response correct when every test passes (reward 1.0), eval/pass@k a
    prompt with one such response; on the shipped example set, scored in the workers."""
    from gspo_megatron.driver.evaluation import eval_metrics
    from rollout.prompts.dataset import load_prompts
    from rollout.generation.sample import Sample
    rows = load_prompts(str(ROOT / "examples" / "data" / "code_eval.jsonl"), "prompt", "input_output")
    first, fifth = rows[0], rows[4]
    groups = [[Sample(0, i, first, [1], 4) for i in range(3)], [Sample(1, i, fifth, [1], 4) for i in range(2)]]
    texts = [[RIGHT, WRONG, PARTLY],
             ["```python\ndef count_vowels(s):\n    return sum(c in 'aeiou' for c in s)\n```", WRONG]]
    with RewardWorkerPool("code", workers=2, timeout_s=30) as pool:
        for group, responses in zip(groups, texts):
            for s, score in zip(group, pool.submit([s.prompt for s in group], responses).result(timeout=60)):
                s.reward, s.response_ids = score.reward, [1]
    assert [s.reward for s in groups[0]] == [1.0, 0.0, pytest.approx(2 / 3)]
    m = eval_metrics(groups)
    assert m["eval/accuracy"] == pytest.approx(2 / 5) and m["eval/pass@k"] == 1.0
    assert m["eval/accuracy/apps_style"] == pytest.approx(1 / 3) and m["eval/accuracy/apps_call"] == 0.5


@pytest.mark.slow
def test_a_near_integer_answer_scores_zero(code):
    off_by_one = "```python\na, b = map(int, input().split())\nprint(a + b + 1)\n```"
    assert code.score({"answer": {"inputs": ["999999 1\n"], "outputs": ["1000000\n"]}}, off_by_one) == 0.0
    calls = {"answer": {"fn_name": "fact", "inputs": [[20]], "outputs": [[2432902008176640000]]}}
    near = "```python\nimport math\ndef fact(n):\n    return math.factorial(n) + 10**12\n```"
    assert code.score(calls, near) == 0.0
    assert code.score(calls, "```python\nimport math\ndef fact(n):\n    return math.factorial(n)\n```") == 1.0


@pytest.mark.slow
def test_a_slow_program_on_many_tests_scores_in_bounded_time_without_a_reward_error():
    # one looping program on a row of 14 tests ran 14 limits past rollout.reward_timeout_s; its
    # worker was killed, and under max_reward_error_fraction 0 the run stopped
    row = {"answer": {"inputs": [f"{i} 1\n" for i in range(14)], "outputs": [f"{i + 1}\n" for i in range(14)]},
           "time_limit": 0.5}
    loop = "```python\nwhile True: pass\n```"
    slow = "```python\nimport time\ntime.sleep(0.3)\na, b = map(int, input().split())\nprint(a + b)\n```"
    with RewardWorkerPool("code", workers=1, timeout_s=4.0) as pool:  # 2 s for a response's tests
        pool.wait_ready(every=True)
        t0 = time.monotonic()
        looped, slowed = pool.submit([row, row], [loop, slow]).result(timeout=30)
        seconds = time.monotonic() - t0
    assert (looped.reward, looped.ok, looped.error) == (0.0, True, None)
    assert slowed.ok and 0 < slowed.reward < 1  # the tests run within the budget count
    assert seconds < 2 * 4.0 and pool.restarts == 0


def test_a_test_limit_that_cannot_fit_is_refused_at_start():
    from gspo_megatron.config import ConfigError, config_from_dict
    base = {"model": {"hf_path": "/m"}, "rollout": {"prompts": "p.jsonl", "reward": "code"}}
    with pytest.raises(ConfigError, match=r"^rollout.reward_args.time_limit_s=10: .*rollout.reward_timeout_s=8"):
        config_from_dict(base, ["rollout.reward_timeout_s=8", "rollout.reward_args.time_limit_s=10"])
    with pytest.raises(ConfigError, match=r"^rollout.reward_args.tests_budget_s=59: expected <= 54"):
        config_from_dict(base, ["rollout.reward_args.tests_budget_s=59"])
    with pytest.raises(ConfigError, match=r"^eval.reward_args.time_limit_s=10: .*rollout.reward_timeout_s=8"):
        config_from_dict(base, ["rollout.reward_timeout_s=8", "rollout.reward=math", "eval.reward=code",
                                "eval.reward_args.time_limit_s=10"])
    assert config_from_dict(base).rollout.reward_settings.budget_within(60.0) == 54.0
    assert CodeSandboxSettings(tests_budget_s=20).misfit(60.0) is None


@pytest.mark.slow
def test_reward_workers_hold_no_secrets(monkeypatch):
    secrets = {"HF_TOKEN": "hf_x", "WANDB_API_KEY": "w", "AWS_SECRET_ACCESS_KEY": "a", "GITHUB_TOKEN": "g",
               "DB_PASSWORD": "p", "MY_SERVICE_KEY": "k"}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    with RewardWorkerPool("code", workers=1, timeout_s=30) as pool:
        pool.wait_ready(every=True)
        env = psutil.Process(pool._pool[0].proc.pid).environ()
    assert not set(secrets) & set(env) and env.get("PATH") == os.environ["PATH"]


PEEK_AND_KILL = """
import os, signal
worker, seen = os.getppid(), []
for what in ("environ", "mem", "maps", "fd"):
    try:
        if what == "fd":
            os.listdir(f"/proc/{worker}/fd")
        else:
            open(f"/proc/{worker}/{what}", "rb").read(4096)
        seen.append(what)
    except OSError:
        pass
for sig in (0, signal.SIGKILL):
    try:
        os.kill(worker, sig)
        seen.append(f"signal {sig}")
    except OSError:
        pass
print(" ".join(seen) or "sealed")
"""


@pytest.mark.slow
@pytest.mark.parametrize("user", ["root", "the worker's"])
def test_process_mode_keeps_the_worker_unreadable_and_alive(user):
    """isolation: process: the program cannot read the worker's environment or memory (the
    expected outputs) through /proc, nor signal it. As root the program runs as nobody; as any
    other user (a cluster) it shares the worker's, so the worker is not dumpable and the filter
    refuses the signal."""
    if user == "root" and os.geteuid() != 0:
        pytest.skip("not root")
    script = textwrap.dedent(f"""
        import json, os, sys
        sys.path.insert(0, {str(ROOT)!r})
        os.environ["HF_TOKEN"] = "hf_secret"
        from rollout.rewards import RewardWorkerPool
        row = {{"answer": {{"inputs": [""], "outputs": ["sealed"]}}}}
        with RewardWorkerPool("code", workers=1, timeout_s=20,
                              args={{"isolation": "process"}}) as pool:
            [s] = pool.submit([row], ["```python\\n" + {PEEK_AND_KILL!r} + "\\n```"]).result(timeout=60)
        print(json.dumps([s.reward, s.status, s.error]))
    """)
    argv = [sys.executable, "-c", script]
    if user != "root" and os.geteuid() == 0:  # the same user for worker and program: nobody
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", script]
        reach = subprocess.run(argv[:5] + ["-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
                                           "import rollout.rewards.workers"], capture_output=True, cwd="/")
        if reach.returncode != 0:
            pytest.skip(f"nobody cannot import this checkout: {reach.stderr.decode()[-200:]}")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    reward, status, error = json.loads(out.stdout.strip().splitlines()[-1])
    assert (reward, status) == (1.0, "ok"), (status, error)


HOSTILE_OUTPUTS = {
    # each returns the right value on the first test and, on the second, an output the worker's own
    # parse or comparison raised on (ValueError, RecursionError, OverflowError): a reward error, which
    # under max_reward_error_fraction 0 stopped the run
    "a 5001-digit int": ("add", [3, 4], "import sys\nsys.set_int_max_str_digits(0)\n"
                         "def add(a, b):\n    return a + b if a == 1 else 10 ** 5000"),
    "JSON nested 100000 deep": ("add", [3, 4], "import atexit, sys\ndef add(a, b):\n    if a != 1:\n"
                                "        atexit.register(lambda: sys.stdout.write('@@gspo-call-result@@\\n'"
                                " + '[' * 100000 + ']' * 100000 + '\\n'))\n    return a + b"),
    "10**400 where a float is expected": ("ratio", [0.5, 0.25], "def ratio(a, b):\n"
                                          "    return a / b if b == 2 else 10 ** 400"),
}


@pytest.mark.slow
@pytest.mark.parametrize("output", sorted(HOSTILE_OUTPUTS))
def test_an_output_the_worker_cannot_parse_or_compare_fails_that_test_only(code, output):
    fn_name, outputs, program = HOSTILE_OUTPUTS[output]
    row = {"answer": {"fn_name": fn_name, "inputs": [[1, 2], [2, 4]], "outputs": outputs}}
    assert code.score(row, f"```python\n{program}\n```") == 0.5


@pytest.mark.slow
def test_a_lone_surrogate_in_the_program_fails_the_test(code):
    # a response decoded with a lone surrogate: its program could not be encoded for the sandbox
    # (UnicodeEncodeError, a reward error); now Python refuses its bytes, as any syntax error
    record = {"answer": {"inputs": ["1 2\n"], "outputs": ["3\n"]}}
    assert code.score(record, "```python\nprint(3)  # \udced\n```") == 0.0


def test_a_large_output_of_small_tokens_is_compared_in_bounded_memory():
    # 4 MiB of two-character tokens, split whole, were 1.4 million strings: 84 MiB more in the
    # worker while compared; a call's result of small numbers parsed whole, a million objects
    import tracemalloc
    from rollout.rewards.code_reward import output_passes
    tokens = "12 " * ((4 << 20) // 3)
    result = "@@gspo-call-result@@\n[" + "1000, " * ((4 << 20) // 6) + "1]\n"
    tracemalloc.start()
    try:
        assert not output_passes(tokens, "3\n", call=False)
        assert not output_passes(tokens, " ".join(["12"] * 100) + "\n", call=False)
        assert not output_passes(result, [1000, 1000], call=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert output_passes("12 " * 1000, ("12 " * 1000).strip(), call=False)
    assert output_passes("@@gspo-call-result@@\n" + str([1000] * 1000) + "\n", [1000] * 1000, call=True)


def test_a_long_run_of_backticks_is_scanned_in_linear_time():
    # the fence regular expression backtracked quadratically: 100k backticks took 12-21 s in a
    # worker, before the tests' budget started
    tail = "`" * 100_000
    t0 = time.monotonic()
    assert extract_program("```python\nprint(1)\n```\n" + tail) == "print(1)\n"
    assert extract_program(tail + "\n" + tail) == ""  # an empty block, as the expression found
    assert extract_program(("```python" * 50_000) + "\n") is None
    assert time.monotonic() - t0 < 1.0


@pytest.mark.slow
def test_the_tests_budget_counts_from_the_start_of_the_call(monkeypatch):
    # whatever the call spends before the first test (extraction, parsing) is inside the budget: a
    # budget started after a slow extraction let a slow program run the call past the reward timeout
    from rollout.rewards import code_reward
    slow = "import time\ntime.sleep(0.3)\nprint(int(input()) + 1)\n"
    monkeypatch.setattr(code_reward, "extract_program", lambda text: time.sleep(1.0) or slow)
    # 3 s left after the extraction: room for the first tests on a loaded machine (with 1 s left
    # no test finished next to a busy suite), not for all 20 (6 s)
    reward = CodeReward(CodeSandboxSettings(tests_budget_s=4.0))
    reward.sandbox.probe()
    row = {"answer": {"inputs": [f"{i}\n" for i in range(20)], "outputs": [f"{i + 1}\n" for i in range(20)]}}
    t0 = time.monotonic()
    assert 0 < reward.score(row, "a slow program") < 1
    assert time.monotonic() - t0 < 4.0 + 0.4

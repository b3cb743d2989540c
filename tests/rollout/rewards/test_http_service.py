"""`reward: http(s)://...` (rollout/rewards/http_service.py) against an HTTP service the test starts:
the documented request and answer, retries on 5xx, and one clear error for a service that is down
or answers nonsense; the first such error of a run is said in one line, the later ones counted."""
from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rollout.rewards import RewardWorkerPool, check_reward
from rollout.rewards.http_service import RewardServiceError


class Judge(BaseHTTPRequestHandler):
    """/score: 1.0 when the response contains the record's answer; /flaky: HTTP 503 twice, then
    /score; /nonsense: not JSON; /short: one score too few; /bad: HTTP 400."""
    calls: dict[str, int] = {}

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = Judge.calls[self.path] = Judge.calls.get(self.path, 0) + 1
        scores = [float(str(r["answer"]) in t) for r, t in zip(body["records"], body["responses"])]
        if self.path == "/flaky" and n <= 2:
            return self._send(503, b"busy")
        if self.path == "/nonsense":
            return self._send(200, b"<html>hello</html>")
        if self.path == "/short":
            return self._send(200, json.dumps({"scores": scores[:-1]}).encode())
        if self.path == "/bad":
            return self._send(400, b"missing field")
        assert self.headers.get("Authorization") == "Bearer t0ken"
        self._send(200, json.dumps({"scores": scores}).encode())

    def _send(self, code: int, data: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def judge():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _pool(url: str) -> RewardWorkerPool:
    args = {"timeout_s": 5, "retries": 3, "backoff_s": 0.05, "headers": {"Authorization": "Bearer t0ken"}}
    return RewardWorkerPool(url, workers=2, timeout_s=30, args=args)


@pytest.mark.slow
def test_a_reward_service_scores_groups(judge):
    assert check_reward(f"{judge}/score") is None  # reachable
    records = [{"prompt": "1+1?", "answer": 2}] * 3
    with _pool(f"{judge}/score") as pool:
        scores = pool.submit(records, ["it is 2", "3", "2!"]).result(timeout=30)
        assert [s.reward for s in scores] == [1.0, 0.0, 1.0] and pool.batched
    with _pool(f"{judge}/flaky") as pool:  # retried with backoff
        assert [s.reward for s in pool.submit(records, ["2", "2", "0"]).result(timeout=30)] == [1.0, 1.0, 0.0]
    assert Judge.calls["/flaky"] == 3


@pytest.mark.slow
def test_a_service_that_is_down_or_answers_nonsense_is_named(judge):
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    down = f"http://127.0.0.1:{port.getsockname()[1]}/score"
    port.close()
    with pytest.raises(RewardServiceError, match=f"rollout.reward='{down}': the reward service does not accept"):
        check_reward(down)
    cases = {down: f"reward service {down} failed 4 times; last: ConnectionError",
             f"{judge}/nonsense": "answered something that is not JSON: '<html>hello</html>'",
             f"{judge}/short": r'expected {"scores": [2 numbers]}',
             f"{judge}/bad": "answered HTTP 400: 'missing field'"}
    for url, message in cases.items():
        with _pool(url) as pool:
            scores = pool.submit([{"answer": 1}] * 2, ["1", "1"]).result(timeout=60)
        assert all(s.status == "error" and s.reward == 0.0 and message in s.error for s in scores), \
            (url, scores[0].error)


@pytest.mark.slow
def test_a_judge_that_goes_down_is_said_once_then_counted():
    """A judge that accepted the start-up check and died: its first error is one line naming the
    URL and the error (rollout/rewards/scoring.py, RewardErrorBudget), the later ones are counted
    (the progress line shows them: tests/run/test_metrics.py), never a silent reward of 0."""
    from rollout.rewards.scoring import RewardErrorBudget
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/score"
    check_reward(url)  # it accepts connections at start...
    listener.close()   # ...and is gone once the run scores
    said: list[str] = []
    budget = RewardErrorBudget(max_error_fraction=1.0, log=said.append)
    with _pool(url) as pool:
        for _ in range(2):  # two steps' groups
            for score in pool.submit([{"answer": 1}] * 4, ["1"] * 4).result(timeout=60):
                budget.record(score.ok, score.error)
    assert budget.errors == 8 and len(said) == 1, said
    assert said[0].startswith("reward error, the first of this run (scored 0 and counted): ")
    assert f"RewardServiceError: reward service {url} failed 4 times; last: ConnectionError" in said[0]

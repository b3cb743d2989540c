"""`reward: http(s)://host/path`: a reward service (a judge model, a remote verifier) over HTTP.

One POST per group of responses, from a reward worker (so rollout.reward_workers bounds how many
requests are in flight, and rollout.reward_timeout_s bounds each call, retries included):

    POST <url>   {"records": [<prompt row>, ...], "responses": ["<response text>", ...]}
    200          {"scores": [0.0, 1.0, ...]}     (or the bare list [0.0, 1.0, ...])

The records are the prompt rows as the reward functions see them ("prompt", "answer", and every
other field: data_source, extra_info, ...), one per response. A judge model behind it: the service
fills its prompt template from record["prompt"], record["answer"] and the response, asks e.g. an
SGLang server (/generate), and turns the verdict into a number. docs/rewards.md has an example.

Failures: a connection error, a timeout, HTTP 5xx or 429 is retried `retries` times with
exponential backoff; a 4xx, a body that is not JSON, or scores of the wrong length or type are not
(the service answered, wrongly). Either way the group's responses are reward errors, counted against
rollout.max_reward_error_fraction, and the error names the URL and what came back.
"""
from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from gspo_errors import GspoError
from rollout.rewards.settings import RewardServiceSettings

if TYPE_CHECKING:
    import requests


class RewardServiceError(GspoError, RuntimeError):
    pass


class RewardService:
    def __init__(self, url: str, settings: RewardServiceSettings) -> None:
        self.url, self.settings = url, settings
        self._session: requests.Session | None = None

    def _post(self, body: bytes) -> Any:
        import requests
        if self._session is None:
            self._session = requests.Session()
        headers = {"Content-Type": "application/json", **self.settings.headers}
        return self._session.post(self.url, data=body, headers=headers, timeout=self.settings.timeout_s)

    def score(self, records: list[dict], texts: list[str]) -> list[float]:
        import requests
        body = json.dumps({"records": records, "responses": texts}, default=str).encode()
        delay, last = self.settings.backoff_s, ""
        for attempt in range(self.settings.retries + 1):
            if attempt:
                time.sleep(delay)
                delay *= 2
            try:
                reply = self._post(body)
            except requests.RequestException as e:
                last = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
                continue
            if reply.status_code >= 500 or reply.status_code == 429:
                last = f"HTTP {reply.status_code}: {reply.text[:200]!r}"
                continue
            if reply.status_code != 200:
                raise RewardServiceError(f"reward service {self.url} answered HTTP {reply.status_code}: "
                                         f"{reply.text[:200]!r}")
            return self._scores(reply.text, len(texts))
        raise RewardServiceError(f"reward service {self.url} failed {self.settings.retries + 1} times; "
                                 f"last: {last}")

    def _scores(self, text: str, n: int) -> list[float]:
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            raise RewardServiceError(f"reward service {self.url} answered something that is not JSON: "
                                     f"{text[:200]!r}") from None
        scores = data.get("scores") if isinstance(data, dict) else data
        if not isinstance(scores, list) or len(scores) != n:
            raise RewardServiceError(f"reward service {self.url}: expected {{\"scores\": [{n} numbers]}}, "
                                     f"got {text[:200]!r}")
        return scores  # each checked as a finite number by the worker


def check_reachable(url: str, timeout_s: float = 5.0) -> None:
    """Start-up check: the service's host accepts connections (RewardServiceError otherwise)."""
    import socket
    from urllib.parse import urlsplit
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as e:
        raise RewardServiceError(f"rollout.reward={url!r}: the reward service does not accept connections "
                                 f"({type(e).__name__}: {e})") from None

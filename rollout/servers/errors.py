"""The errors of the SGLang HTTP client (rollout/servers/client.py), apart so that its parts import them."""
from __future__ import annotations

from gspo_errors import GspoError


class SGLangError(GspoError, RuntimeError):
    """A server answered, but not as expected (HTTP error status or malformed body)."""

    def __init__(self, url: str, message: str, status: int | None = None, body: str | None = None):
        self.url, self.status, self.body, self.message = url, status, body, message
        detail = f" (HTTP {status})" if status is not None else ""
        text = f"{url}{detail}: {message}"
        if body is not None:
            text += f"; body: {body[:2000]!r}"
        super().__init__(text)


class ServerUnavailable(SGLangError):
    """No connection to the server (refused, reset or timed out) after all retries."""


class TakenOut(ServerUnavailable):
    """The server was taken out of service while the call waited for it (by a health probe, or by
    another call that lost it): the pool knows it already, with its reason."""


class NoServerLeft(ServerUnavailable):
    """No server of a pool is in service (rollout/servers/pool.py): every one is out, rejoining or gone.
    The message names each server and what happened to it."""


class NoTeacherLeft(NoServerLeft):
    """No teacher server (on-policy distillation, rollout/generation/teacher.py) is in service: the run waits
    for one as it does for the policy's servers (gspo_megatron/run/recovery.py), then exits 75."""


class RequestAbandoned(SGLangError):
    """The caller stopped waiting for this request (rollout.abort_timeout_s after an abort, a
    stalled server): its answer, if one ever comes, is dropped. Not the server's fault: it stays
    in service (the health probes judge it)."""

"""HTTP client for SGLang's native API: one server (`SGLangClient`) or several (`ServerPool`).

    pool = ServerPool(group.server_urls, router_url=group.router_url)
    out = pool.generate([1, 2, 3], {"max_new_tokens": 16, "temperature": 1.0})
    out.output_ids, out.logprobs, out.finish_reason, out.weight_versions

Generation goes through sglang-router when one is given, else round robin over the live servers;
a server that refuses connections is marked dead and the request moves to the next one. Control
and weight-update calls go to every server. Every request has a timeout; connection errors are
retried with exponential backoff; a non-2xx answer or a malformed body raises SGLangError with
the URL, status and body.
"""
from __future__ import annotations

import base64
import dataclasses
import io
import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import requests


class SGLangError(RuntimeError):
    """A server answered, but not as expected (HTTP error status or malformed body)."""

    def __init__(self, url: str, message: str, status: int | None = None, body: str | None = None):
        self.url, self.status, self.body = url, status, body
        detail = f" (HTTP {status})" if status is not None else ""
        text = f"{url}{detail}: {message}"
        if body is not None:
            text += f"; body: {body[:2000]!r}"
        super().__init__(text)


class ServerUnavailable(SGLangError):
    """No connection to the server (refused, reset or timed out) after all retries."""


@dataclasses.dataclass
class GenerateOutput:
    """One completion from /generate, token-in/token-out."""

    output_ids: list[int]
    logprobs: list[float]
    """log pi_rollout(token) for each output id (after temperature: SGLang samples from that)."""
    finish_reason: str
    """"stop" (EOS or a stop token, included in output_ids), "length" or "abort"."""
    weight_versions: list[str]
    """The server's weight version for each output token."""
    prompt_tokens: int
    text: str = ""
    server_url: str = ""


def parse_generate_item(item: Any, url: str) -> GenerateOutput:
    """Check and convert one /generate result; anything unexpected raises SGLangError."""
    try:
        meta = item["meta_info"]
        ids = [int(t) for t in item["output_ids"]]
        lps = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
        lp_ids = [int(entry[1]) for entry in meta.get("output_token_logprobs") or []]
        finish = meta["finish_reason"]
        finish_type = finish["type"] if isinstance(finish, dict) else str(finish)
        spans = meta.get("weight_versions")
        if spans:
            versions = [""] * len(ids)
            for span in spans:
                for i in range(int(span["start"]), min(int(span["end"]), len(ids))):
                    versions[i] = str(span["version"])
        else:
            versions = [str(meta.get("weight_version", ""))] * len(ids)
        prompt_tokens = int(meta.get("prompt_tokens", 0))
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise SGLangError(url, f"malformed /generate result ({type(e).__name__}: {e})",
                          body=repr(item)) from None
    if lp_ids != ids:
        raise SGLangError(url, f"/generate returned {len(ids)} output ids but log-probs for "
                          f"{len(lp_ids)} tokens (or other ids); was return_logprob set?", body=repr(item))
    if "" in versions:
        raise SGLangError(url, "/generate weight_versions spans do not cover every token", body=repr(item))
    return GenerateOutput(ids, lps, finish_type, versions, prompt_tokens, str(item.get("text", "")), url)


def _is_connect_failure(exc: BaseException) -> bool:
    """True when the request never reached the server (safe to retry anything)."""
    if isinstance(exc, requests.ConnectTimeout):
        return True
    text = repr(exc)
    return isinstance(exc, requests.ConnectionError) and (
        "NewConnectionError" in text or "Connection refused" in text)


class SGLangClient:
    """One SGLang server. Thread-safe (one requests.Session per thread).

    timeout_s bounds every request (generate included; pass a larger one for long generations);
    connection errors are retried `retries` times with backoff `backoff_s * 2**attempt`.
    """

    def __init__(self, url: str, timeout_s: float = 600.0, retries: int = 3, backoff_s: float = 0.5):
        self.url = url.rstrip("/")
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self._local = threading.local()

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session

    def request(self, method: str, path: str, payload: Any = None, *, timeout_s: float | None = None,
                retry: str = "connection") -> requests.Response:
        """Send, retrying per `retry`: "connection" (any connection error: for idempotent calls),
        "connect" (only when the request never reached the server), or "never"."""
        url = self.url + path
        for attempt in itertools.count():
            try:
                resp = self._session().request(method, url, json=payload,
                                               timeout=timeout_s or self.timeout_s)
            except (requests.ConnectionError, requests.Timeout) as e:
                retryable = (retry == "connection" and isinstance(e, requests.ConnectionError)
                             and not isinstance(e, requests.ReadTimeout)) or \
                            (retry in ("connection", "connect") and _is_connect_failure(e))
                if not retryable or attempt >= self.retries:
                    raise ServerUnavailable(self.url, f"{method} {path} failed after {attempt + 1} "
                                            f"attempt(s): {type(e).__name__}: {e}") from e
                time.sleep(self.backoff_s * 2 ** attempt)
                continue
            if not 200 <= resp.status_code < 300:
                raise SGLangError(self.url, f"{method} {path} failed", resp.status_code, resp.text)
            return resp
        raise AssertionError("unreachable")

    def _json(self, method: str, path: str, payload: Any = None, **kw) -> Any:
        resp = self.request(method, path, payload, **kw)
        try:
            return resp.json()
        except ValueError:
            raise SGLangError(self.url, f"{method} {path}: reply is not JSON", resp.status_code,
                              resp.text) from None

    def _checked(self, path: str, payload: Any, **kw) -> dict:
        """POST to an endpoint answering {"success": bool, "message": str}; raise unless success."""
        reply = self._json("POST", path, payload, **kw)
        if not isinstance(reply, dict) or reply.get("success") is not True:
            raise SGLangError(self.url, f"POST {path} did not succeed", body=repr(reply))
        return reply

    # --- health and info -------------------------------------------------------------------
    def health(self, timeout_s: float = 5.0) -> bool:
        """True when /health answers 200 (never raises)."""
        try:
            return self._session().get(self.url + "/health", timeout=timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def model_info(self) -> dict:
        return self._json("GET", "/model_info", timeout_s=30)

    def weight_version(self) -> str:
        """The version string of the weights the server holds ("default" until the first update)."""
        return str(self.model_info()["weight_version"])

    # --- generation ------------------------------------------------------------------------
    def generate(self, input_ids: Sequence[int] | Sequence[Sequence[int]], sampling_params: dict,
                 *, rid: str | Sequence[str] | None = None, return_logprob: bool = True,
                 timeout_s: float | None = None, retry: str = "connection") -> list[GenerateOutput]:
        """POST /generate with token ids (one prompt or a batch); one GenerateOutput per prompt.

        `rid` names the request(s) for abort(). A batch of N prompts returns N outputs in order.
        """
        batch = len(input_ids) > 0 and not isinstance(input_ids[0], int)
        payload: dict[str, Any] = {"input_ids": [list(map(int, x)) for x in input_ids] if batch
                                   else list(map(int, input_ids)),
                                   "sampling_params": dict(sampling_params),
                                   "return_logprob": return_logprob}
        if rid is not None:
            payload["rid"] = list(rid) if batch else rid
        if return_logprob:
            payload["logprob_start_len"] = -1  # log-probs of the output only, not the prompt
        reply = self._json("POST", "/generate", payload, timeout_s=timeout_s, retry=retry)
        items = reply if batch or isinstance(reply, list) else [reply]
        n = len(input_ids) if batch else 1
        if not isinstance(items, list) or len(items) != n:
            raise SGLangError(self.url, f"/generate: expected {n} result(s)", body=repr(reply))
        return [parse_generate_item(it, self.url) for it in items]

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort one request by rid, or every request on the server. An aborted /generate returns
        what it produced so far with finish_reason "abort"."""
        self.request("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all}, timeout_s=30)

    def flush_cache(self) -> None:
        """Drop the radix (prefix) cache; the server refuses (400) while requests are running."""
        self.request("POST", "/flush_cache", timeout_s=60)

    def pause_generation(self, mode: str = "abort") -> None:
        """mode "abort": abort and return running requests; "retract": re-queue them (KV freed);
        "in_place": freeze them with their KV cache. Resume with continue_generation()."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")
        self.request("POST", "/pause_generation", {"mode": mode}, timeout_s=60)

    def continue_generation(self) -> None:
        self.request("POST", "/continue_generation", {}, timeout_s=60)

    def release_memory_occupation(self) -> None:
        """Colocated mode: free the KV cache / weights memory while the trainer runs."""
        self.request("POST", "/release_memory_occupation", {}, timeout_s=300)

    def resume_memory_occupation(self) -> None:
        self.request("POST", "/resume_memory_occupation", {}, timeout_s=300)

    # --- weight updates --------------------------------------------------------------------
    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None, *,
                                 flush_cache: bool = True, abort_all_requests: bool = False,
                                 load_format: str | None = None, timeout_s: float = 600.0) -> dict:
        """Reload all weights from an HF directory (safetensors + config) readable by the server.

        weight_version: the label generated tokens carry from now on (GenerateOutput.weight_versions).
        """
        payload = {"model_path": str(model_path), "flush_cache": flush_cache,
                   "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        if load_format is not None:
            payload["load_format"] = load_format
        return self._checked("/update_weights_from_disk", payload, timeout_s=timeout_s, retry="connect")

    def begin_weight_update(self) -> dict:
        """Open a weight-update session; required around update_weights_from_tensor/_distributed."""
        return self._checked("/begin_weight_update", {}, timeout_s=120, retry="connect")

    def end_weight_update(self) -> dict:
        return self._checked("/end_weight_update", {}, timeout_s=120, retry="connect")

    def update_weights_from_tensor(self, named_tensors: Sequence[tuple[str, Any]],
                                   weight_version: str | None = None, *, flush_cache: bool = True,
                                   tp_size: int = 1, load_format: str | None = None,
                                   timeout_s: float = 600.0) -> dict:
        """Send (HF name, CPU tensor) pairs by shared memory: the server must run on this machine.

        Call between begin_weight_update() and end_weight_update(). Tensors go through
        torch.multiprocessing's "file_system" sharing strategy (the default strategy crashes the
        server, ENVIRONMENT.md); keep them alive until this returns. `tp_size`: the server's TP size
        (each TP rank receives the same list). A partial list updates only those parameters.
        """
        payload = {"serialized_named_tensors": [serialize_named_tensors(named_tensors)] * tp_size,
                   "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        if load_format is not None:
            payload["load_format"] = load_format
        return self._checked("/update_weights_from_tensor", payload, timeout_s=timeout_s, retry="connect")

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl", timeout_s: float = 300.0) -> dict:
        """Make the server's ranks join a process group with the trainer (trainer = rank 0).

        BLOCKS until every rank has joined, so call it from a thread (ServerPool.submit) while the
        trainer builds its side: a PrefixStore named `group_name` over a TCPStore at
        master_address:master_port, world_size = 1 + sum of servers' TP sizes; this server's ranks
        start at rank_offset. backend "gloo" on CPU, "nccl" on GPU.
        """
        payload = {"master_address": master_address, "master_port": int(master_port),
                   "rank_offset": int(rank_offset), "world_size": int(world_size),
                   "group_name": group_name, "backend": backend}
        return self._checked("/init_weights_update_group", payload, timeout_s=timeout_s, retry="connect")

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]],
                                        group_name: str = "weight_update_group",
                                        weight_version: str | None = None, *, flush_cache: bool = True,
                                        timeout_s: float = 600.0) -> dict:
        """Receive tensors by broadcast from rank 0 of the weights-update group.

        BLOCKS until the trainer has broadcast every tensor, in this order, so call it from a
        thread. dtypes are torch names without "torch." ("float32", "bfloat16"). Must be inside
        begin/end_weight_update; check that begin succeeded BEFORE broadcasting, or the trainer
        hangs in broadcast until the collective's timeout.
        """
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}, {len(dtypes)}, {len(shapes)}")
        payload = {"names": list(names), "dtypes": [str(d).replace("torch.", "") for d in dtypes],
                   "shapes": [list(map(int, s)) for s in shapes], "group_name": group_name,
                   "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return self._checked("/update_weights_from_distributed", payload, timeout_s=timeout_s,
                             retry="connect")

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self._checked("/destroy_weights_update_group", {"group_name": group_name},
                             timeout_s=60, retry="connect")


def serialize_named_tensors(named_tensors: Sequence[tuple[str, Any]]) -> str:
    """Pickle (name, tensor) pairs the way SGLang's MultiprocessingSerializer does (ForkingPickler,
    so tensors travel by shared memory), base64-encoded for JSON."""
    import torch.multiprocessing as torch_mp
    from multiprocessing.reduction import ForkingPickler

    torch_mp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump([(str(n), t.detach().cpu().contiguous()) for n, t in named_tensors])
    return base64.b64encode(buf.getvalue()).decode("ascii")


class ServerPool:
    """Several SGLang servers behind one interface.

    generate(): through `router_url` when given, else round robin over the servers believed alive;
    a server whose connection fails is marked dead and the request is retried on the next one
    (the partial work on the dead server is lost and regenerated). When none is left,
    ServerUnavailable names every server. Everything else (abort, flush, pause, weight updates)
    goes to every server in `server_urls`, in parallel.
    """

    def __init__(self, server_urls: Sequence[str], router_url: str | None = None, *,
                 timeout_s: float = 600.0, retries: int = 3, backoff_s: float = 0.5):
        if not server_urls:
            raise ValueError("ServerPool needs at least one server URL")
        self.clients = [SGLangClient(u, timeout_s, retries, backoff_s) for u in server_urls]
        self.router = SGLangClient(router_url, timeout_s, retries, backoff_s) if router_url else None
        self._dead: set[str] = set()
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.clients)),
                                            thread_name_prefix="sglang-pool")

    @property
    def server_urls(self) -> list[str]:
        return [c.url for c in self.clients]

    def live_clients(self) -> list[SGLangClient]:
        with self._lock:
            return [c for c in self.clients if c.url not in self._dead]

    def mark_dead(self, url: str) -> None:
        with self._lock:
            self._dead.add(url)

    def _next_client(self) -> SGLangClient:
        live = self.live_clients()
        if not live:
            raise ServerUnavailable(", ".join(self.server_urls), "no live SGLang server left "
                                    f"(all of {len(self.clients)} failed)")
        return live[next(self._rr) % len(live)]

    def generate(self, input_ids: Sequence[int], sampling_params: dict, *, rid: str | None = None,
                 timeout_s: float | None = None) -> GenerateOutput:
        """One prompt -> one GenerateOutput (see SGLangClient.generate)."""
        if self.router is not None:
            return self.router.generate(input_ids, sampling_params, rid=rid, timeout_s=timeout_s)[0]
        errors = []
        while True:
            try:
                client = self._next_client()
            except ServerUnavailable as e:
                raise ServerUnavailable(e.url, f"{e}; errors: {'; '.join(errors)}") from None
            try:
                return client.generate(input_ids, sampling_params, rid=rid, timeout_s=timeout_s)[0]
            except ServerUnavailable as e:
                errors.append(str(e))
                self.mark_dead(client.url)

    def for_each(self, fn: Callable[[SGLangClient], Any], live_only: bool = True) -> list[Any]:
        """Call fn(client) on every (live) server in parallel; results in server order; the first
        error is raised after all calls have finished."""
        clients = self.live_clients() if live_only else self.clients
        futures = [self._executor.submit(fn, c) for c in clients]
        results, first_error = [], None
        for f in futures:
            try:
                results.append(f.result())
            except BaseException as e:  # noqa: BLE001 - re-raised below, after every call returned
                results.append(None)
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return results

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Run a blocking call (e.g. init_weights_update_group) in the pool's threads."""
        return self._executor.submit(fn, *args, **kwargs)

    def abort_all(self) -> None:
        """Abort every request on every live server (their /generate calls return "abort")."""
        self.for_each(lambda c: c.abort(abort_all=True))

    def flush_cache(self) -> None:
        self.for_each(lambda c: c.flush_cache())

    def pause_generation(self, mode: str = "abort") -> None:
        self.for_each(lambda c: c.pause_generation(mode))

    def continue_generation(self) -> None:
        self.for_each(lambda c: c.continue_generation())

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                 **kw: Any) -> list[dict]:
        """Every server reloads from `model_path` (see SGLangClient.update_weights_from_disk)."""
        return self.for_each(lambda c: c.update_weights_from_disk(model_path, weight_version, **kw))

    def weight_versions(self) -> list[str]:
        return self.for_each(lambda c: c.weight_version())

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

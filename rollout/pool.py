"""Several SGLang servers behind one interface (optionally through sglang-router).

    pool = ServerPool(group.server_urls, router_url=group.router_url)
    out = pool.generate([1, 2, 3], {"max_new_tokens": 16, "temperature": 1.0})
    pool.update_weights_from_disk("/ckpt/hf-step-10", weight_version="10")

Generation goes through the router when one is given, else round robin over the live servers; a
server whose connection fails is marked dead and the request moves to the next one. Control and
weight-update calls go to every server. Requests for routed experts (routing replay) never go
through the router: sglang-router 0.3.2 drops the request's "return_routed_experts" field.
"""
from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

from rollout.client import GenerateOutput, SGLangClient, ServerUnavailable


class ServerPool:
    """Several SGLang servers behind one interface.

    generate(): through `router_url` when given, else round robin over the servers believed alive;
    a server whose connection fails is marked dead and the request is retried on the next one
    (the partial work on the dead server is lost and regenerated). When none is left,
    ServerUnavailable names every server. Everything else (abort, flush, pause, weight updates)
    goes to every server in `server_urls`, in parallel.
    """

    def __init__(self, server_urls: Sequence[str], router_url: str | None = None, *,
                 timeout_s: float = 600.0, retries: int = 3, backoff_s: float = 0.5,
                 routed_experts_layout: tuple[int, int] | None = None):
        """routed_experts_layout: (num_hidden_layers, num_experts_per_tok) of the served model, to
        shape routed experts; None: read from a server's config.json when first needed."""
        if not server_urls:
            raise ValueError("ServerPool needs at least one server URL")
        self.clients = [SGLangClient(u, timeout_s, retries, backoff_s) for u in server_urls]
        self.router = SGLangClient(router_url, timeout_s, retries, backoff_s) if router_url else None
        self.routed_experts_layout = routed_experts_layout
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

    def _next_client(self) -> SGLangClient | None:
        live = self.live_clients()
        return live[next(self._rr) % len(live)] if live else None

    def _layout(self) -> tuple[int, int]:
        for client in [] if self.routed_experts_layout else self.live_clients():
            try:
                self.routed_experts_layout = client.routed_experts_layout()
                break
            except ServerUnavailable:
                self.mark_dead(client.url)
        if self.routed_experts_layout is None:
            raise ServerUnavailable(", ".join(self.server_urls), "no live SGLang server left")
        return self.routed_experts_layout

    def generate(self, input_ids: Sequence[int], sampling_params: dict, *, rid: str | None = None,
                 timeout_s: float | None = None, return_routed_experts: bool = False) -> GenerateOutput:
        """One prompt -> one GenerateOutput (see SGLangClient.generate); return_routed_experts:
        with GenerateOutput.routed_experts (directly from a server, never through the router)."""
        kw: dict[str, Any] = {"rid": rid, "timeout_s": timeout_s}
        if return_routed_experts:
            kw.update(return_routed_experts=True, routed_experts_layout=self._layout())
        elif self.router is not None:
            return self.router.generate(input_ids, sampling_params, **kw)[0]
        return self._on_a_live_server(lambda c: c.generate(input_ids, sampling_params, **kw)[0])

    def input_log_probs(self, input_ids: Sequence[int], start: int, timeout_s: float | None = None) -> list[float]:
        """Log-probs of input_ids[start:] from one prefill on a live server (SGLangClient.input_log_probs)."""
        return self._on_a_live_server(lambda c: c.input_log_probs(input_ids, start, timeout_s=timeout_s))

    def _on_a_live_server(self, call: Callable[[SGLangClient], Any]) -> Any:
        """call(client) on the next live server (round robin); a server whose connection fails is
        marked dead and the call moves on; none left: ServerUnavailable naming each server once."""
        errors: dict[str, str] = {}
        while True:
            client = self._next_client()
            if client is None:  # one line, each server's URL once
                what = "; ".join(f"{u}: {r}" for u, r in errors.items()) if len(errors) != 1 else \
                    next(iter(errors.values()))
                raise ServerUnavailable(", ".join(self.server_urls),
                                        f"no live SGLang server left ({what or 'none was reachable'})")
            try:
                return call(client)
            except ServerUnavailable as e:
                errors[client.url] = e.message
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

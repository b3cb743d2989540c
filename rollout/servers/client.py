"""HTTP client for one SGLang server's native API (several: rollout.servers.pool.ServerPool).

    client = SGLangClient("http://127.0.0.1:30000")
    out = client.generate([1, 2, 3], {"max_new_tokens": 16, "temperature": 1.0})[0]
    out.output_ids, out.logprobs, out.finish_reason, out.weight_versions
    out = client.generate(ids, params, return_routed_experts=True)[0]   # MoE + server flag
    out.routed_experts                                # int16 [prompt + output - 1, layers, top-k]

Every request has a timeout; connection errors are retried with exponential backoff; a non-2xx
answer or a malformed body raises SGLangError with the URL, status and body.
"""
from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import requests

from rollout.servers.errors import SGLangError, ServerUnavailable  # noqa: F401  (the client's API)
from rollout.servers.weight_updates import WeightUpdates
from rollout.servers.lora_adapters import LoraAdapters


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
    routed_experts: np.ndarray | None = None
    """Routing replay data (only when asked for): int16 [prompt_tokens + len(output_ids) - 1,
    num_hidden_layers, top-k]; row p = the experts the engine chose for the token at input
    position p (the last output token is never fed, so it has no row). None when not requested,
    or when an aborted request came back without it. What SGLang returns: rollout/generation/sample.py."""


def decode_routed_experts(raw: Any, rows: int, layout: tuple[int, int], url: str) -> np.ndarray:
    """meta_info["routed_experts"] (base64 int32, little-endian) -> int16 [rows, layers, top-k]."""
    (layers, topk), expected = layout, max(rows, 0) * layout[0] * layout[1] * 4
    try:
        data = base64.b64decode(raw, validate=True)
    except (TypeError, ValueError) as e:
        raise SGLangError(url, f"meta_info.routed_experts is not base64 ({e})") from None
    if rows < 0 or len(data) != expected:
        raise SGLangError(url, f"meta_info.routed_experts has {len(data)} bytes, expected {expected} "
                          f"= {rows} rows (prompt tokens + output tokens - 1) x {layers} layers x "
                          f"top-{topk} x 4 (int32): is routed_experts_layout {tuple(layout)} the "
                          f"served model's (num_hidden_layers, num_experts_per_tok)?")
    ids = np.frombuffer(data, dtype="<i4").reshape(rows, layers, topk)
    if ids.size and not -1 <= ids.min() <= ids.max() <= np.iinfo(np.int16).max:
        raise SGLangError(url, f"meta_info.routed_experts: expert ids in [{ids.min()}, {ids.max()}]")
    return ids.astype(np.int16)


def routed_experts_layout_of(hf_config: dict) -> tuple[int, int]:
    """(num_hidden_layers, num_experts_per_tok) of an HF config.json dict, as SGLang sizes its
    capture (the text config of multimodal models: text_config / llm_config / language_config)."""
    cfg = next((hf_config[k] for k in ("text_config", "llm_config", "language_config")
                if isinstance(hf_config.get(k), dict)), hf_config)
    if "num_experts_per_tok" not in cfg or "num_hidden_layers" not in cfg:
        raise ValueError("routed experts need a MoE model: config.json has no num_experts_per_tok "
                         "or num_hidden_layers")
    return int(cfg["num_hidden_layers"]), int(cfg["num_experts_per_tok"])


def parse_generate_item(item: Any, url: str,
                        routed_experts_layout: tuple[int, int] | None = None) -> GenerateOutput:
    """Check and convert one /generate result; anything unexpected raises SGLangError.
    routed_experts_layout (num_hidden_layers, top-k): routed experts were requested; decode them."""
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
    routed = None
    if routed_experts_layout is not None:
        raw = meta.get("routed_experts")
        if raw is not None:
            routed = decode_routed_experts(raw, prompt_tokens + len(ids) - 1, routed_experts_layout, url)
        elif finish_type != "abort":  # a request aborted before it ran has none, and is redone
            raise SGLangError(url, "routed experts were requested but the /generate result has no "
                              "meta_info.routed_experts: was the server started with --enable-return-"
                              "routed-experts? (sglang-router 0.3.2 also drops it)", body=repr(item))
    return GenerateOutput(ids, lps, finish_type, versions, prompt_tokens, str(item.get("text", "")),
                          url, routed)


def connection_failure_reason(exc: BaseException) -> str:
    """A short reason for a failed connection, without requests' repetition of host and port."""
    text = repr(exc)
    if "Connection refused" in text:
        return "connection refused"
    if isinstance(exc, requests.ReadTimeout):
        return "ReadTimeout (no reply in time)"
    if isinstance(exc, requests.ConnectTimeout):
        return "connection timed out"
    if any(k in text for k in ("RemoteDisconnected", "Connection aborted", "Connection reset")):
        return "the server closed the connection (did it die?)"
    if isinstance(exc, requests.exceptions.ChunkedEncodingError):
        return "the server's reply was cut off (did it die?)"
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def _is_connect_failure(exc: BaseException) -> bool:
    """True when the request never reached the server (safe to retry anything)."""
    if isinstance(exc, requests.ConnectTimeout):
        return True
    text = repr(exc)
    return isinstance(exc, requests.ConnectionError) and (
        "NewConnectionError" in text or "Connection refused" in text)


class SGLangClient(WeightUpdates, LoraAdapters):
    """One SGLang server. Thread-safe (one requests.Session per thread).

    timeout_s bounds every request (generate included; pass a larger one for long generations);
    connection errors are retried `retries` times with backoff `backoff_s * 2**attempt`.
    """

    def __init__(self, url: str, timeout_s: float = 600.0, retries: int = 3, backoff_s: float = 0.5):
        self.url = url.rstrip("/")
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self._local = threading.local()
        self._layout: tuple[int, int] | None = None

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
            except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as e:
                # ChunkedEncodingError: the reply's body was cut off (a server killed while it
                # answered); requests does not count it as a ConnectionError
                retryable = (retry == "connection" and isinstance(e, (requests.ConnectionError,
                                                                      requests.exceptions.ChunkedEncodingError))
                             and not isinstance(e, requests.ReadTimeout)) or \
                            (retry in ("connection", "connect") and _is_connect_failure(e))
                if not retryable or attempt >= self.retries:
                    reason = connection_failure_reason(e)
                    raise ServerUnavailable(self.url, f"{method} {path} failed after {attempt + 1} "
                                            f"attempt(s): {reason}") from e
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

    def routed_experts_layout(self) -> tuple[int, int]:
        """(num_hidden_layers, num_experts_per_tok) of the served model, read once from the
        config.json at the server's model_path (/model_info), which must be readable here (local
        servers, a shared file system); otherwise pass routed_experts_layout to generate()."""
        if self._layout is None:
            path = Path(str(self.model_info().get("model_path", ""))) / "config.json"
            try:
                self._layout = routed_experts_layout_of(json.loads(path.read_text()))
            except (OSError, ValueError) as e:
                raise SGLangError(self.url, f"cannot tell the routed-experts layout from {path} ({e}); "
                                  f"pass routed_experts_layout=(num_hidden_layers, "
                                  f"num_experts_per_tok)") from None
        return self._layout

    def served_dtype(self) -> str:
        """The dtype the server holds its weights in, as a torch name ("bfloat16", "float32"), or
        "auto" (the model's config decides). From /server_info's launch arguments."""
        return str(self._json("GET", "/server_info", timeout_s=30).get("dtype", "auto"))

    def weight_version(self) -> str:
        """The version string of the weights the server holds ("default" until the first update)."""
        return str(self.model_info()["weight_version"])

    # --- generation ------------------------------------------------------------------------
    def generate(self, input_ids: Sequence[int] | Sequence[Sequence[int]], sampling_params: dict,
                 *, rid: str | Sequence[str] | None = None, return_logprob: bool = True,
                 timeout_s: float | None = None, retry: str = "connection",
                 return_routed_experts: bool = False,
                 routed_experts_layout: tuple[int, int] | None = None) -> list[GenerateOutput]:
        """POST /generate with token ids (one prompt or a batch); one GenerateOutput per prompt.

        `rid` names the request(s) for abort(). A batch of N prompts returns N outputs in order.
        return_routed_experts: also get each token's routed experts (GenerateOutput.routed_experts;
        the server needs --enable-return-routed-experts); routed_experts_layout (num_hidden_layers,
        num_experts_per_tok) shapes them, by default read from the server's config.json.
        """
        layout: tuple[int, int] | None = None
        if return_routed_experts:
            layers, top_k = routed_experts_layout or self.routed_experts_layout()
            layout = (layers, top_k)
        batch = len(input_ids) > 0 and not isinstance(input_ids[0], int)
        ids: list[Any] = list(input_ids)
        payload: dict[str, Any] = {"input_ids": [[int(t) for t in x] for x in ids] if batch
                                   else [int(t) for t in ids],
                                   "sampling_params": dict(sampling_params),
                                   "return_logprob": return_logprob}
        if rid is not None:
            payload["rid"] = list(rid) if batch else rid
        if self.lora_name is not None:
            payload["lora_path"] = [self.lora_name] * len(input_ids) if batch else self.lora_name
        if return_logprob:
            payload["logprob_start_len"] = -1  # log-probs of the output only, not the prompt
        if return_routed_experts:
            payload["return_routed_experts"] = True
        reply = self._json("POST", "/generate", payload, timeout_s=timeout_s, retry=retry)
        items = reply if batch or isinstance(reply, list) else [reply]
        n = len(input_ids) if batch else 1
        if not isinstance(items, list) or len(items) != n:
            raise SGLangError(self.url, f"/generate: expected {n} result(s)", body=repr(reply))
        return [parse_generate_item(it, self.url, layout) for it in items]

    def input_log_probs(self, input_ids: Sequence[int], start: int,
                        timeout_s: float | None = None) -> list[float]:
        """log p(input_ids[t] | input_ids[:t]) for t = start .. len - 1, from one prefill (no token
        generated): what an on-policy distillation teacher says of a student's sample. At
        temperature 1 whatever the request says: SGLang 0.5.23 does not scale input log-probs by
        the sampling temperature (measured: 0.5 and 1.0 give the same values). Equal to
        transformers' within 5e-7 in fp32, also when the prefix comes from the radix cache
        (tests/algorithms/test_distill.py)."""
        if not 1 <= start < len(input_ids):
            raise ValueError(f"start={start}: expected a position in [1, {len(input_ids)})")
        # The first entry SGLang returns is None: its token's predecessor is not recomputed (it lies
        # in the prefix, possibly from the radix cache), so ask from one position earlier.
        payload = {"input_ids": list(map(int, input_ids)), "return_logprob": True,
                   "logprob_start_len": int(start) - 1,
                   "sampling_params": {"max_new_tokens": 0}}
        if self.lora_name is not None:
            payload["lora_path"] = self.lora_name
        reply = self._json("POST", "/generate", payload, timeout_s=timeout_s)
        item = reply[0] if isinstance(reply, list) and len(reply) == 1 else reply
        try:
            entries = item["meta_info"]["input_token_logprobs"][1:]
            lps, ids = [float(e[0]) for e in entries], [int(e[1]) for e in entries]
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise SGLangError(self.url, f"malformed input log-probs ({type(e).__name__}: {e})",
                              body=repr(reply)[:2000]) from None
        sent = list(input_ids[start:])
        # SGLang reports ids >= vocab_size - 1 as 0 (SchedulerLogprobResultProcessor.
        # _process_input_token_logprobs, "clip padded hash values of image tokens"): the
        # model's last real token comes back as 0, with its true log-prob
        if len(ids) != len(sent) or any(g != w and g != 0 for g, w in zip(ids, sent)):
            raise SGLangError(self.url, f"input log-probs for tokens {ids} from position {start}, "
                              f"expected the tokens there, {sent}", body=repr(reply)[:2000])
        return lps

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

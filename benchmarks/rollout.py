"""Rollout throughput: tokens/s through our client and rollout manager vs a bare HTTP request.

    .venv/bin/python benchmarks/rollout.py                         # starts a tiny qwen3 server (CPU)
    .venv/bin/python benchmarks/rollout.py --url http://host:port  # an already-running server
    .venv/bin/python benchmarks/rollout.py --batch-sizes 1 16 64 --max-new-tokens 128 --repeats 3

For each batch size B (B prompts x max_new_tokens, EOS ignored so every row is full length):
  direct HTTP     one POST /generate with B prompts through `requests` (the floor: no client code)
  SGLangClient    the same batched call through rollout.servers.client (parsing, checks, weight versions)
  RolloutManager  B/G groups of G samples: one request per sample from the manager's threads,
                  Sample records, rewards (a trivial one) and metrics
Prints the median tokens/s over --repeats runs after one warm-up.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout.servers.client import SGLangClient  # noqa: E402
from rollout.servers.pool import ServerPool  # noqa: E402
from rollout.generation.manager import ManagerConfig, RolloutManager  # noqa: E402
from rollout.servers.launch import ServerConfig, ServerGroup  # noqa: E402


def _prompts(b: int) -> list[list[int]]:
    return [[1, 2 + i % 400, 3, 4 + (7 * i) % 400, 5] for i in range(b)]


def direct_http(url: str, b: int, n: int) -> int:
    r = requests.post(url + "/generate", timeout=600, json={
        "input_ids": _prompts(b), "return_logprob": True, "logprob_start_len": -1,
        "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True}})
    r.raise_for_status()
    return sum(len(x["output_ids"]) for x in r.json())


def via_client(client: SGLangClient, b: int, n: int) -> int:
    outs = client.generate(_prompts(b), {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True})
    return sum(len(o.output_ids) for o in outs)


def via_manager(pool: ServerPool, b: int, n: int) -> int:
    g = min(b, 8)
    cfg = ManagerConfig(group_size=g, max_new_tokens=n, ignore_eos=True, max_in_flight_requests=max(b, 1))
    prompts = iter([{"prompt": "p", "answer": "0", "ids": p} for p in _prompts(b // g)])
    mgr = RolloutManager(pool, cfg, encode_prompt=lambda rec: rec["ids"], decode=lambda ids: "",
                         reward_fn=lambda rec, text: 0.0)
    try:
        result = mgr.generate_step(prompts, num_groups=b // g)
    finally:
        mgr.close()
    return sum(len(s.response_ids) for grp in result.groups for s in grp)


def measure(fn, repeats: int) -> float:
    fn()  # warm-up
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = fn()
        rates.append(tokens / (time.perf_counter() - t0))
    return statistics.median(rates)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an SGLang server to use instead of starting a tiny one")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.url:
        group = ServerGroup.attach([args.url])
    else:
        from tools.make_tiny_model import make_tiny_model
        model = make_tiny_model("qwen3", Path(tempfile.mkdtemp()) / "tiny-qwen3", seed=0)
        group = ServerGroup.launch(ServerConfig(model_path=str(model)))
    with group:
        url = group.server_urls[0]
        client, pool = SGLangClient(url), ServerPool([url])
        n = args.max_new_tokens
        print(f"server {url}, {n} new tokens per row, median of {args.repeats} runs, tokens/s")
        print(f"{'batch':>6} {'direct HTTP':>12} {'SGLangClient':>13} {'RolloutManager':>15} {'mgr/direct':>11}")
        for b in args.batch_sizes:
            d = measure(lambda: direct_http(url, b, n), args.repeats)
            c = measure(lambda: via_client(client, b, n), args.repeats)
            m = measure(lambda: via_manager(pool, b, n), args.repeats)
            print(f"{b:>6} {d:>12.0f} {c:>13.0f} {m:>15.0f} {m / d:>11.2f}")
        pool.close()


if __name__ == "__main__":
    main()

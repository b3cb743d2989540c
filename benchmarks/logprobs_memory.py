"""Peak memory and time of token log-probs, forward + backward: fused (chunked, recomputing) vs
straightforward (full logits, log_softmax, gather). Each measurement runs in a fresh process.

    .venv/bin/python benchmarks/logprobs_memory.py                        # the table, CPU fp32
    .venv/bin/python benchmarks/logprobs_memory.py --tokens 2048 --vocab 32768 --chunk-tokens 512
    python benchmarks/logprobs_memory.py --device cuda --dtype bf16       # on a GPU machine

Peak extra memory = peak during forward+backward minus the memory held once the inputs exist.
On CPU it is the process RSS: a sampling thread (every 1 ms) and getrusage's max RSS (counted only
if it rose past its value at the baseline) give two lower bounds; the larger is reported. On CUDA it
is max_memory_allocated. "work" subtracts the gradients themselves ([t, h] + [v, h]), which any
method must return: it is the part that should not grow with t for the fused path.
A straightforward run whose estimated need exceeds the free memory is skipped, not OOM-killed
(other processes share the machine).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
# Rough peak of the straightforward path in units of one fp32 [t, v] tensor (logits, shifted,
# exp, and their gradients); measured about 4-5 on CPU, 6 keeps the skip rule conservative.
STRAIGHTFORWARD_TV_TENSORS = 6


class RssSampler(threading.Thread):
    def __init__(self, interval: float = 1e-3):
        super().__init__(daemon=True)
        import psutil
        self.proc, self.interval, self.peak, self.stop = psutil.Process(), interval, 0, threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval)


def child(args) -> None:
    import gc

    import torch

    from gspo_megatron.actor.logprobs import fused_token_logprobs, vocab_parallel_token_logprobs

    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, DTYPES[args.dtype])
    t, v, h = args.tokens, args.vocab, args.hidden
    hidden = torch.randn(t, h, device=device, dtype=dtype).requires_grad_(True)
    weight = (torch.randn(v, h, device=device, dtype=dtype) * 0.02).requires_grad_(True)
    targets = torch.randint(0, v, (t,), device=device)

    def step():
        if args.path == "fused":
            log_probs, _ = fused_token_logprobs(hidden, weight, targets, chunk_tokens=args.chunk_tokens or None,
                                                chunk_memory_mb=args.chunk_memory_mb)
        else:
            log_probs, _ = vocab_parallel_token_logprobs(hidden @ weight.t(), targets)
        log_probs.sum().backward()

    cuda = device.type == "cuda"
    if cuda:  # warm-up (cuBLAS handles, kernels), then measure the second step
        step()
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
    gc.collect()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        import psutil
        base = psutil.Process().memory_info().rss
        ru_base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        sampler = RssSampler()
        sampler.start()
    start, cpu_start = time.perf_counter(), time.process_time()
    step()
    if cuda:
        torch.cuda.synchronize()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    else:
        sampler.stop.set()
        sampler.join()
        ru_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        peak = max(sampler.peak, ru_peak if ru_peak > ru_base else 0) - base
    if hidden.grad is None or weight.grad is None:
        raise RuntimeError("the backward pass left no gradient on hidden or weight")
    grads = (hidden.grad.numel() + weight.grad.numel()) * hidden.grad.element_size()
    print(json.dumps(dict(peak=peak, grads=grads, seconds=seconds, cpu_seconds=cpu_seconds)))


def measure(path: str, t: int, v: int, args) -> dict | str:
    """One fresh process per run; with --repeats, the fastest of them (peaks are their max)."""
    runs = [measure_once(path, t, v, args) for _ in range(args.repeats)]
    failed = [r for r in runs if not isinstance(r, dict)]
    if failed:
        return failed[0]
    ok = [r for r in runs if isinstance(r, dict)]
    return dict(peak=max(r["peak"] for r in ok), grads=ok[0]["grads"],
                seconds=min(r["seconds"] for r in ok), cpu_seconds=min(r["cpu_seconds"] for r in ok))


def measure_once(path: str, t: int, v: int, args) -> dict | str:
    need = STRAIGHTFORWARD_TV_TENSORS * t * v * 4
    if path == "straightforward" and not args.no_skip:
        free = available_memory(args.device)
        if need > 0.8 * free:
            return f"skipped (needs ~{need / 2**30:.0f} GiB)"
    cmd = [sys.executable, __file__, "--child", "--path", path, "--tokens", str(t), "--vocab", str(v),
           "--hidden", str(args.hidden), "--dtype", args.dtype, "--device", args.device,
           "--chunk-tokens", str(args.chunk_tokens), "--chunk-memory-mb", str(args.chunk_memory_mb)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])})
    if proc.returncode != 0:
        return f"failed (rc {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def available_memory(device: str) -> int:
    if device == "cuda":
        import torch
        free, _ = torch.cuda.mem_get_info()
        return free
    import psutil
    return psutil.virtual_memory().available


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--chunk-tokens", type=int, default=1024, help="0: from --chunk-memory-mb (the actor's default)")
    p.add_argument("--chunk-memory-mb", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=1, help="fresh processes per cell; the fastest counts")
    p.add_argument("--paths", nargs="+", default=["fused", "straightforward"])
    p.add_argument("--no-skip", action="store_true", help="run straightforward even if it may not fit")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.tokens, args.vocab = args.tokens[0], args.vocab[0]
        return child(args)

    gib = 2**30
    print(f"# device={args.device} dtype={args.dtype} hidden={args.hidden} chunk_tokens={args.chunk_tokens or 'from memory'} chunk_memory_mb={args.chunk_memory_mb} "
          f"repeats={args.repeats}; peak = extra memory over the inputs (GiB), work = peak minus the returned "
          "gradients; wall / cpu = seconds of forward+backward (cpu = process CPU time, robust to a "
          "shared machine); ratio = fused / straightforward")
    print(f"{'vocab':>7} {'tokens':>6} | {'fused: peak':>11} {'work':>6} {'wall':>7} {'cpu':>7} | "
          f"{'straight: peak':>14} {'work':>6} {'wall':>7} {'cpu':>7} | {'ratio wall':>10} {'cpu':>5}")
    for v in args.vocab:
        for t in args.tokens:
            res = {path: measure(path, t, v, args) for path in args.paths}
            cells = []
            for path, width in (("fused", 11), ("straightforward", 14)):
                r = res.get(path, "not run")
                if isinstance(r, dict):
                    cells.append(f"{r['peak'] / gib:>{width}.2f} {(r['peak'] - r['grads']) / gib:>6.2f} "
                                 f"{r['seconds']:>7.2f} {r['cpu_seconds']:>7.2f}")
                else:
                    cells.append(f"{r:>{width + 24}}")
            f, s = res.get("fused"), res.get("straightforward")
            ratio = (f"{f['seconds'] / s['seconds']:>10.2f} {f['cpu_seconds'] / s['cpu_seconds']:>5.2f}"
                     if isinstance(f, dict) and isinstance(s, dict) else f"{'-':>10} {'-':>5}")
            print(f"{v:>7} {t:>6} | {cells[0]} | {cells[1]} | {ratio}", flush=True)

if __name__ == "__main__":
    main()

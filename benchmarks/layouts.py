"""Per parallel layout: forward-only time, train-step time, max error vs one process, and the cost
of GSPO itself (GSPO train step / the same forward-backward with plain next-token cross-entropy).

    .venv/bin/python benchmarks/layouts.py                      # all layouts, tiny Qwen3-MoE, CPU
    .venv/bin/python benchmarks/layouts.py --layouts tp2,pp2 --rows 32 --seq 128 --reps 5 --logits

Every layout runs on real gloo process groups (one process per rank, spawned like the tests) from
the same initial weights as the one-process run. "logprob err" is the max |old log-prob - one
process| over real tokens; "param err" the max |parameter - one process| after one GSPO step
(Adam with eps=10 >> |g|, linear in the gradient, like tests/actor/test_actor_layouts.py). Times are
the best of --reps (timeit's rule: the work is deterministic, so the minimum is the run least
disturbed by other processes), wall clock on rank 0 between barriers; GSPO and CE steps alternate
so that machine noise hits both alike. On a 2-core CPU machine the 4- and 8-rank layouts are
oversubscribed: compare the ratio column across layouts, not the absolute times.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from distributed import gather_row_values, run_distributed  # noqa: E402  (the tests' gloo launcher)

LAYOUTS = {
    "1proc": (1, {}),
    "tp2": (2, dict(tensor=2)),
    "pp2": (2, dict(pipeline=2)),
    "ep2": (2, dict(expert=2)),
    "dp2": (2, {}),
    "tp2_pp2": (4, dict(tensor=2, pipeline=2)),
    "pp2_vpp2": (2, dict(pipeline=2, virtual_pipeline=2)),
    "tp2_pp2_ep2": (8, dict(tensor=2, pipeline=2, expert=2)),
}


def make_batch(rows: int, seq: int):
    from gspo_megatron.actor.batching.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(seq // 4, seq + 1, (rows,), generator=g)
    prompt = torch.randint(2, seq // 8 + 3, (rows,), generator=g)
    t = torch.arange(seq)[None]
    tokens = torch.where(t < lengths[:, None], torch.randint(0, 512, (rows, seq), generator=g), 0)
    mask = (t >= prompt[:, None]) & (t < lengths[:, None])
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=mask,
                      advantages=torch.randn(rows, generator=g),
                      rollout_log_probs=-6.0 + 0.1 * torch.randn(rows, seq, generator=g))


def _timed(fn):
    torch.distributed.barrier()
    start = time.perf_counter()
    out = fn()
    torch.distributed.barrier()
    return time.perf_counter() - start, out


def _bench(rank, world, layout_kwargs, args, init_state):
    from gspo_megatron.actor import Actor, LogProbSettings, LossSettings, OptimizerSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    from model_specs.hf.tiny import qwen3_moe as tiny_hf_config

    gspo, ce = LossSettings(name="gspo"), LossSettings(name="ce")
    actor = Actor(tiny_hf_config(), ParallelLayout(**layout_kwargs),
                  optimizer=OptimizerSettings(optimizer="adam", lr=1.0, adam_eps=10.0, clip_grad=0.0),
                  loss=gspo, logprob=LogProbSettings(fused=not args["logits"]),
                  micro_batch_size=args["micro_batch_size"], seed=1 + rank)
    if init_state is None:
        full = actor.full_state_dict()
        if full is None:
            raise RuntimeError("full_state_dict(to_all_ranks=True) gave this rank nothing")
        init_state = {k: v.numpy() for k, v in full.items()}
    else:
        actor.load_full_state_dict({k: torch.from_numpy(v) for k, v in init_state.items()})
    shard = actor.shard(make_batch(args["rows"], args["seq"]))
    shard.old_log_probs, _ = actor.compute_old_log_probs(shard)
    old = None
    if actor.is_last_stage:
        if shard.global_rows is None or shard.old_log_probs is None:
            raise RuntimeError("the last stage's shard has no global_rows or old_log_probs")
        old = (shard.global_rows.numpy(), shard.old_log_probs.numpy())
    actor.train_step(shard)
    state = actor.full_state_dict(to_all_ranks=False)
    times: dict[str, list[float]] = {"fwd": [], "gspo": [], "ce": []}
    for _ in range(args["reps"]):
        times["fwd"].append(_timed(lambda: actor.compute_old_log_probs(shard))[0])
        for name, loss in (("gspo", gspo), ("ce", ce)):
            actor.loss = loss
            times[name].append(_timed(lambda: actor.train_step(shard))[0])
    return dict(old=old, times={k: min(v) for k, v in times.items()},
                state={k: v.numpy() for k, v in state.items()} if state is not None else None,
                init=init_state if rank == 0 else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of " + ",".join(LAYOUTS))
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--logits", action="store_true", help="logits path instead of the fused one")
    opts = parser.parse_args()
    args = dict(rows=opts.rows, seq=opts.seq, micro_batch_size=opts.micro_batch_size, reps=opts.reps,
                logits=opts.logits)
    names = opts.layouts.split(",")
    unknown = set(names) - set(LAYOUTS)
    if unknown:
        parser.error(f"unknown layouts {sorted(unknown)}; known: {list(LAYOUTS)}")

    reference = run_distributed(_bench, 1, ({}, args, None), timeout=1800)[0]
    batch = make_batch(opts.rows, opts.seq)
    t = torch.arange(opts.seq)[None]
    real = (t >= 1) & (t < batch.lengths[:, None])
    want = gather_row_values([reference["old"]], opts.rows, opts.seq)
    print(f"tiny Qwen3-MoE (4 layers, hidden 64, 4 experts top-2), {opts.rows} rows x <= {opts.seq} "
          f"tokens, micro-batch {opts.micro_batch_size}, {'logits' if opts.logits else 'fused'} "
          f"log-probs, best of {opts.reps}")
    header = (f"{'layout':<13}{'ranks':>6}{'fwd-only s':>12}{'train s':>10}{'CE train s':>12}"
              f"{'GSPO/CE':>9}{'logprob err':>13}{'param err':>11}")
    print(header)
    print("-" * len(header))
    for name in names:
        world, layout = LAYOUTS[name]
        results = [reference] if name == "1proc" else run_distributed(
            _bench, world, (layout, args, reference["init"]), timeout=1800)
        got = gather_row_values([r["old"] for r in results], opts.rows, opts.seq)
        lp_err = float((got - want)[real].abs().max())
        state = results[0]["state"]
        p_err = max(float(abs(torch.from_numpy(state[k]) - torch.from_numpy(v)).max())
                    for k, v in reference["state"].items())
        tm = results[0]["times"]
        print(f"{name:<13}{world:>6}{tm['fwd']:>12.3f}{tm['gspo']:>10.3f}{tm['ce']:>12.3f}"
              f"{tm['gspo'] / tm['ce']:>9.3f}{lp_err:>13.2e}{p_err:>11.2e}", flush=True)


if __name__ == "__main__":
    main()

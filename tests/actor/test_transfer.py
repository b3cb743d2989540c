"""actor/batching/transfer.py: each rank receives only its own rows, packed, over real gloo
groups; what it builds from them is exactly TrainBatch.shard of the global batch."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from distributed import run_distributed

LAYERS, TOPK = 3, 2


def make_batch(rows: int = 13, token_advantages: bool = False):
    """Every field kind: bool mask, int64 tokens and versions (-1 padding), fp32 log-probs, per-row
    or per-token advantages, int16 routes [b, s, layers, k] (-1 padding), teacher log-probs."""
    from gspo_megatron.actor.batching.batch import TrainBatch
    g = torch.Generator().manual_seed(rows)
    lengths = torch.randint(3, 40, (rows,), generator=g)
    lengths[rows // 2] = 90  # a long row
    s = int(lengths.max())
    t = torch.arange(s)[None]
    real = t < lengths[:, None]
    prompt = torch.randint(1, 3, (rows,), generator=g)
    trained = (t >= prompt[:, None]) & real
    adv = torch.where(trained, torch.randn(rows, s, generator=g), 0.0) if token_advantages else torch.randn(rows, generator=g)
    routes = torch.where(real[..., None, None], torch.randint(0, 8, (rows, s, LAYERS, TOPK), generator=g), -1)
    return TrainBatch(tokens=torch.where(real, torch.randint(1, 500, (rows, s), generator=g), 0), lengths=lengths,
                      loss_mask=trained & (torch.rand(rows, s, generator=g) > 0.1), advantages=adv,
                      rollout_log_probs=torch.where(trained, -torch.rand(rows, s, generator=g), 0.0),
                      weight_versions=torch.where(trained, 3, -1),
                      routed_experts=routes.to(torch.int16),
                      teacher_log_probs=torch.where(trained, -torch.rand(rows, s, generator=g), 0.0))


def assert_same(a, b) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), (f.name, x.dtype, y.dtype, tuple(x.shape), tuple(y.shape), (x != y).sum() if x.shape == y.shape else None)
        else:
            assert x == y, f.name


def as_received(shard, layers=None):
    """What a rank keeps of its shard: packed, its stage's routing layers, one byte per expert id."""
    from gspo_megatron.actor.batching.batch import compact_routes
    out = shard.packed()
    routes = compact_routes(out.routed_experts)
    if layers is not None:
        routes = routes[:, torch.tensor(layers, dtype=torch.long)]
    return dataclasses.replace(out, routed_experts=routes, route_layers=layers)


def _work(lengths):
    return [float(n) * (1000 + 10 * n) for n in lengths]


@pytest.mark.parametrize("token_advantages", [False, True])
def test_packed_rows_unpack_to_the_shard_and_carry_no_padding(token_advantages):
    from gspo_megatron.actor.batching.balance import plan_shards
    from gspo_megatron.actor.batching.transfer import pack, unpack
    batch = make_batch(token_advantages=token_advantages)
    for dp in (1, 2, 3):
        plan = plan_shards(batch.num_rows, dp, 2, _work(batch.lengths.tolist()))
        for d in range(dp):
            want = batch.shard(d, dp, 2, work=_work(batch.lengths.tolist()))
            rows = [i for parts in plan for i in parts[d]]
            manifest, buffer = pack(batch, rows)
            got = unpack(manifest, buffer, [len(p[d]) for p in plan], want.dp_token_imbalance)
            assert_same(got, as_received(want))
            assert_same(got.padded(), want)  # the padded form gives back the shard exactly
            # Bytes: each field's own rows' real tokens (or rows) x its item size, each field
            # starting at a multiple of 8; nothing for padding.
            real, n = int(batch.lengths[rows].sum()), len(rows)
            sizes = [real * 8, n * 8, real * 1, (real if token_advantages else n) * 4, real * 4, real * 8,
                     n * 8, real * LAYERS * TOPK, real * 4]  # tokens, lengths, mask, advantages,
            # rollout log-probs, versions, global rows, routes (a byte per expert id), teacher log-probs
            assert buffer.numel() == sum(-(-b // 8) * 8 for b in sizes)


def _scatter(rank, world, groups, dp_of, case, layers_of=None, replicas=None, stages=None):
    from gspo_megatron.actor.batching.transfer import scatter_rows
    from gspo_errors import GspoError
    batch = make_batch(rows=17)  # every rank builds it, to compare; only rank 0's is sent

    def make():
        if case == "raises":
            raise ValueError("the reward service is down")
        if case == "runtime_stop":  # every rank exits with rank 0's code (75, not DriverError's own 3)
            from gspo_megatron.run.recovery import ServersLost
            raise ServersLost("no SGLang server in service")
        return None if case == "none" else (batch, {"metrics": {"reward": 0.5}})

    def mine(spec):  # this rank's group among those named, e.g. ((0, 1), (2, 3))
        return None if spec is None else groups[next(g for g in spec if rank in g)]
    from gspo_megatron.parallel.comm import strict_checks
    dp_size = max(dp_of) + 1
    try:
        with strict_checks():  # NCCL's rule on gloo: no host tensor reaches a collective
            got = scatter_rows(rank, make, dp_rank=dp_of[rank], dp_size=dp_size, num_mini_batches=4, work=_work,
                               route_layers=layers_of[rank] if layers_of else None,
                               replica_group=mine(replicas), stage_group=mine(stages))
    except (ValueError, GspoError) as e:  # DriverError on the ranks that are not rank 0
        return f"{type(e).__name__}: {e}" + (f" [exit {e.exit_code}]" if case == "runtime_stop" else "")
    if got is None:
        return None
    shard, extras, stats = got
    want = batch.shard(dp_of[rank], dp_size, 4, work=_work(batch.lengths.tolist()))
    assert_same(shard, as_received(want, layers_of[rank] if layers_of else None))
    return dict(extras=extras, stats=stats, rows=shard.global_rows.tolist(),
                real_tokens=int(shard.lengths.sum()), held=shard.nbytes(),
                layers=shard.routed_experts.shape[1], routes=_aligned(shard.routed_experts.nbytes),
                common=sum(_aligned(t.nbytes) for f in dataclasses.fields(shard)  # each field 8-aligned
                           if isinstance(t := getattr(shard, f.name), torch.Tensor) and f.name != "routed_experts"))


GROUPS = ((0, 1), (2, 3), (0, 2), (1, 3), (0,), (1,), (2,), (3,))


def _scatter_cases(rank, world, cases):
    """Every case in one set of processes (a spawn of 4 ranks costs ~10 s)."""
    import torch.distributed as dist
    groups = {g: dist.new_group(list(g)) for g in GROUPS}  # every rank creates every group
    return [_scatter(rank, world, groups, *case) for case in cases]


def _aligned(n):
    return -(-n // 8) * 8


@pytest.mark.slow
def test_every_rank_receives_its_shard_and_rank_0s_failures():
    """4 gloo ranks: DP4 (rank 0 sends each rank its rows); DP2 as two pipeline stages per replica
    (the same rows, relayed inside the replica by its leader; each stage only its own routing
    layers, 2 and 1 of 3, from rank 0); DP2 as TP2 (rows and routes relayed); DP2 given groups that
    do not hold the same rows (not used: rank 0 sends each rank its own); rank 0's None and rank 0's
    error reach every rank, with its exit code. What each rank holds is its rows' real tokens and its layers' routes."""
    dp2, stages = [0, 0, 1, 1], [[0, 1], [2], [0, 1], [2]]
    replicas, wrong, alone = ((0, 1), (2, 3)), ((0, 2), (1, 3)), ((0,), (1,), (2,), (3,))
    cases = [([0, 1, 2, 3], "ok"), (dp2, "ok", stages, replicas, alone), (dp2, "ok", None, replicas, replicas),
             (dp2, "ok", None, wrong, wrong), ([0, 1, 2, 3], "none"), ([0, 1, 2, 3], "raises"),
             ([0, 1, 2, 3], "runtime_stop")]
    per_rank = run_distributed(_scatter_cases, 4, (cases,), timeout=300)
    for k, case in enumerate(cases[:4]):
        dp_of, layers_of = case[0], (case[2] if len(case) > 2 else None)
        results = [mine[k] for mine in per_rank]
        assert all(r["extras"] == {"metrics": {"reward": 0.5}} for r in results)
        rows = {}
        for rank, r in enumerate(results):
            rows.setdefault(dp_of[rank], r["rows"])
            assert r["rows"] == rows[dp_of[rank]]  # the replica's ranks hold the same rows
        assert sorted(i for rs in rows.values() for i in rs) == list(range(17))
        most = max(r["stats"]["bytes_per_rank"] for r in results)
        for rank, r in enumerate(results):
            layers = len(layers_of[rank]) if layers_of else LAYERS
            assert r["layers"] == layers
            # tokens, mask, advantages-free per-token fields, versions, routes (a byte per id of
            # its own layers), teacher; plus per-row fields (lengths, advantages, global rows)
            per_token = 8 + 1 + 4 + 8 + layers * TOPK + 4
            assert r["held"] <= r["real_tokens"] * per_token + 24 * 17
        per_token = 8 + 1 + 4 + 8 + LAYERS * TOPK + 4
        assert most <= 1.2 * max(r["real_tokens"] for r in results) * per_token + 24 * 17
        # What rank 0 sent: relayed, each replica's rows once (and each stage's routes once);
        # else each other rank its own.
        r0 = results[0]["stats"]["rank0_sent_bytes"]
        common = {dp_of[rank]: r["common"] for rank, r in enumerate(results)}
        if k == 2:  # TP2-like: rows and routes relayed, one copy of each replica's buffers
            assert r0 == sum(common.values()) + sum(results[rank]["routes"] for rank in (0, 2))
        elif k == 1:  # PP2-like: the rows relayed; each stage's routes from rank 0
            assert r0 == sum(common.values()) + sum(r["routes"] for r in results[1:])
        else:  # DP4, or groups not used: each rank its own, rank 0's replica peer included
            assert r0 == sum(r["common"] + r["routes"] for r in results[1:])
    assert [mine[4] for mine in per_rank] == [None] * 4
    said = [mine[5] for mine in per_rank]
    assert said[0] == "ValueError: the reward service is down"
    assert said[1:] == ["DriverError: rank 0 failed: ValueError: the reward service is down"] * 3
    stopped = [mine[6] for mine in per_rank]
    assert stopped == ["ServersLost: no SGLang server in service [exit 75]"] + \
        ["DriverError: rank 0 failed: ServersLost: no SGLang server in service [exit 75]"] * 3


@pytest.mark.parametrize("layers", [None, [], [0], [1, 2], [2, 0]])
def test_a_stage_is_sent_its_layers_routes_only(layers):
    """pack_routes: the rows' real tokens at the stage's layers, one byte per expert id (a range
    of layers and any other list alike)."""
    from gspo_megatron.actor.batching.batch import compact_routes
    from gspo_megatron.actor.batching.transfer import _routes_view, pack_routes
    batch, rows = make_batch(rows=9).packed(), [3, 1, 7]
    manifest, buffer = pack_routes(batch, rows, layers)
    want = compact_routes(batch.select(rows).routed_experts)
    if layers is not None:
        want = want[:, torch.tensor(layers, dtype=torch.long)]
    assert torch.equal(_routes_view(manifest, buffer), want)
    assert buffer.numel() == -(-want.numel() // 8) * 8  # nothing but the ids

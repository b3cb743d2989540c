"""The delta path without a server: DeltaEncoder's payloads applied by the project's SGLang loader
(rollout/in_server/weight_loader.py) to a toy model whose load_weights places HF tensors the way SGLang's do
(two HF tensors stacked into one fused parameter, one transposed), bit for bit; a checksum catches
a weight changed behind the sender's back; the routing of the model's load_weights hands the
loader's payloads to it and everything else to the model untouched (the disk loader's iterator
unconsumed). The real servers' side: tests/sync/test_weight_sync_owners.py."""
from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from gspo_megatron.sync.delta import DeltaEncoder
from rollout.in_server.weight_loader import (PART, checksum, flatten, load, pack_bits, path_tensor,
                                  route_load_weights, unflatten, unpack_bits)

Q, K, W = "model.layers.0.q.weight", "model.layers.0.k.weight", "model.layers.0.w.weight"


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16), requires_grad=False)
        self.w = torch.nn.Parameter(torch.zeros(3, 5, dtype=torch.bfloat16), requires_grad=False)


class _Toy(torch.nn.Module):
    """q [2, 4] and k [4, 4] stacked into qkv; w [5, 3] stored transposed."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer()])
        self.seen: list = []

    def load_weights(self, weights):
        self.seen.append(weights)
        layer = self.layers[0]
        for name, t in weights:
            if name == Q:
                layer.qkv.data[:2].copy_(t)
            elif name == K:
                layer.qkv.data[2:].copy_(t)
            elif name == W:
                layer.w.data.copy_(t.t())
            else:
                raise KeyError(name)


def _served(model: _Toy) -> dict[str, torch.Tensor]:
    layer: Any = model.layers[0]  # a _Layer (torch types a ModuleList's item as a Module)
    return {Q: layer.qkv.data[:2].clone(), K: layer.qkv.data[2:].clone(), W: layer.w.data.t().clone()}


def _apply(model, payload, tmp_path, flat=False) -> dict:
    report = tmp_path / "report.json"
    payload = list(payload) + [(PART + "report", path_tensor(str(report)))]
    load(model, flatten(payload) if flat else payload)
    return json.loads(report.read_text())


def test_deltas_applied_bit_for_bit_and_a_changed_weight_caught(tmp_path):
    g = torch.Generator().manual_seed(0)
    weights = {Q: torch.randn(2, 4, generator=g), K: torch.randn(4, 4, generator=g),
               W: torch.randn(5, 3, generator=g)}
    model = _Toy()
    enc = DeltaEncoder(torch.bfloat16)
    full = enc.encode(list(weights.items()), delta=False, full=True)["full"]
    model.load_weights(full)
    for step in range(3):
        # a few elements move by more than bf16's resolution, the rest by far less
        weights = {n: t + 1e-6 for n, t in weights.items()}
        weights[Q][0, step] += 0.5
        weights[W][step + 1, 2] -= 0.25
        weights[K][3, 3] = -0.0 if step == 1 else weights[K][3, 3]
        payload = enc.encode(list(weights.items()), delta=True, full=False, check=[Q, K, W])["delta"]
        sent = {n.rpartition(PART)[0] or n for n, _ in payload}
        assert {Q, W} <= sent
        got = _apply(model, payload, tmp_path, flat=step % 2 == 1)  # as the tensor transport sends it
        assert got == {"mismatched": [], "checked": 3, "unchecked": 0, "error": None}, got
        served = _served(model)
        for n, t in weights.items():
            assert torch.equal(served[n].view(torch.int16), t.to(torch.bfloat16).view(torch.int16)), (step, n)
    # behind the sender's back: the next delta's checksum names the tensor
    model.layers[0].w.data[0, 0] += 1.0
    weights[Q][1, 1] += 0.5
    payload = enc.encode(list(weights.items()), delta=True, full=False, check=[Q, K, W])["delta"]
    got = _apply(model, payload, tmp_path)
    assert got["mismatched"] == [W] and got["error"] is None


def test_routing_hands_the_loaders_payloads_to_it_and_the_rest_untouched(tmp_path):
    model = _Toy()
    route_load_weights(model)
    route_load_weights(model)  # idempotent
    t = torch.ones(2, 4)
    stream = iter([(Q, t)])  # the disk loader's iterator: passed on as it is
    model.load_weights(stream)
    assert model.seen[-1] is stream
    model.load_weights([(Q, t)])
    assert model.seen[-1] == [(Q, t)]
    before = len(model.seen)
    report = tmp_path / "r.json"
    model.load_weights([(K, torch.full((4, 4), 2.0)), (PART + "report", path_tensor(str(report)))])
    # through the loader: the dense tensor reached the model's own load_weights, the report was written
    assert [n for n, _ in model.seen[before]] == [K]
    assert json.loads(report.read_text())["error"] is None
    assert torch.equal(model.layers[0].qkv.data[2:], torch.full((4, 4), 2.0, dtype=torch.bfloat16))


def test_flatten_round_trip():
    named = [("a", torch.arange(3, dtype=torch.int64)), ("b|bits", torch.tensor([5], dtype=torch.uint8)),
             ("c", torch.tensor([[1.5, -0.0]], dtype=torch.bfloat16)), ("d", torch.tensor(7, dtype=torch.int32)),
             ("e", torch.tensor([True, False]))]
    [(name, buf)] = flatten(named)
    back = unflatten([(name, buf), ("plain", torch.ones(1))])
    assert [n for n, _ in back] == ["a", "b|bits", "c", "d", "e", "plain"]
    for (_, t), (_, u) in zip(named, back):
        assert t.dtype == u.dtype and t.shape == u.shape
        assert torch.equal(t.reshape(-1).view(torch.uint8), u.reshape(-1).view(torch.uint8))


def test_bits_and_checksums():
    mask = torch.zeros(37, dtype=torch.bool)
    mask[[0, 7, 8, 36]] = True
    assert unpack_bits(pack_bits(mask), 37).tolist() == [0, 7, 8, 36]
    x = torch.tensor([0.0, 1.0, 2.0], dtype=torch.bfloat16)
    y = x.clone()
    y[0] = -0.0  # equal as numbers, not as bits
    assert checksum(x) != checksum(y)
    assert checksum(x[[0, 2, 1]]) != checksum(x)  # a swap


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_checksum_sees_every_element(dtype):
    """One changed bit anywhere (first, last, a row boundary, the tail past the last full row)
    changes the sum; the chunking (CPU or GPU sizes) and the values' layout (a view) do not."""
    from rollout.in_server.weight_loader import _ROW
    g = torch.Generator().manual_seed(0)
    n = 3 * _ROW * (2 if dtype == torch.int8 else 1) + 77
    t = (torch.randint(-100, 100, (n,), generator=g).to(dtype) if dtype == torch.int8
         else torch.randn(n, generator=g).to(dtype))
    base = checksum(t)
    assert base == checksum(t, rows_per_chunk=1) == checksum(t, rows_per_chunk=4096)
    assert base == checksum(t.reshape(-1, 1).t().contiguous())
    words = t.view(torch.int8 if dtype == torch.int8 else torch.int16)
    for i in (0, _ROW - 1, _ROW, words.numel() - 1):
        for bit in (0, 7):
            u = words.clone()
            u[i] ^= 1 << bit
            assert checksum(u.view(dtype)) != base, (i, bit)
    swapped = t.clone()
    swapped[[5, _ROW + 5]] = t[[_ROW + 5, 5]]
    if not torch.equal(swapped, t):
        assert checksum(swapped) != base
    assert checksum(torch.empty(0, dtype=dtype)) == 0

"""A weight sync between two processes on one GPU (row 5 of scripts/gpu_acceptance.sh): the tensor
transport's path with CUDA IPC (sync.transport_args: {cuda_ipc: true}), as colocated SGLang servers
take it.

    python tools/gpu_check_sync.py          # on a GPU: both processes on cuda:0
    python tools/gpu_check_sync.py --cpu    # CUDA hidden: host tensors by shared memory (the CPU test)

A trainer process with the tiny Qwen3-MoE streams its weights (sync/stream.py), encodes them for a
server in bf16 (sync/delta.py: whole tensors, then the changed elements), packs each request into
one buffer left on the GPU and serializes it as /update_weights_from_tensor carries it
(sync/tensor.py TensorSender with cuda_ipc: a CUDA IPC handle); a receiving process on the same GPU
deserializes the request as SGLang does and applies it with the project's loader
(rollout/in_server/weight_loader.load) to its own copy of the weights. Three passes: a full sync,
a delta after one GSPO step (every tensor checksummed on the receiver), then the control: one
element changed on the receiver behind the trainer's back, which the next delta's checksums must
name. After the delta the receiver's weights, read back by the loader, must equal the trainer's in
bf16 bit for bit. Prints a table (bytes, seconds, changed elements, checks) and the line
    sync on one device (<device>, <how>): full <MB> in <s> s, delta <MB> in <s> s;
    bit-identical yes|no; control caught yes|no
(one line) and exits 1 unless both are yes.

What stands in: SGLang itself (its CUDA kernels are too large to bring to the GPU machine): the
receiver answers the request bodies SGLang's /update_weights_from_tensor takes, without HTTP or a
scheduler, and applies them to a module holding one parameter per HF tensor (SGLang's fused
layouts are the placement probe's business, tested against a real CPU server in
tests/sync/test_weight_sync_owners.py). The serialization, the payload and the loader are the
project's own.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout.servers.weight_updates import WeightUpdates, deserialize_named_tensors  # noqa: E402

URL = "receiver"  # the one server's name in the pass plan
BUCKET_BYTES = 1 << 16


class ServedWeights:
    """The receiver's model: one parameter per HF name (the HF names are its parameters' names),
    in the served dtype on the receiver's device, NaN until loaded; `load_weights` places each HF
    tensor in its parameter, as an SGLang model's load_weights places HF tensors in its own."""

    def __new__(cls, shapes: dict[str, tuple[int, ...]], dtype: Any, device: str) -> Any:
        import torch

        class _Served(torch.nn.Module):
            def load_weights(self, weights: Any) -> None:
                params = dict(self.named_parameters())
                for name, tensor in weights:
                    params[name].data.copy_(tensor)

        model = _Served()
        for name, shape in shapes.items():
            *path, leaf = name.split(".")
            module = model
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, torch.nn.Parameter(
                torch.full(shape, float("nan"), dtype=dtype, device=device), requires_grad=False))
        return model


def receive(conn: Any, device: str, cpu: bool) -> None:
    """The receiving process: answers `(path, body)` requests as SGLang's endpoints would, and the
    control's ("change", name) by changing one element of that parameter."""
    if cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    from rollout.in_server.weight_loader import LOADER, load
    model: Any = None
    while True:
        path, body = conn.recv()
        try:
            if path == "shapes":
                model = ServedWeights(body, torch.bfloat16, device)
            elif path == "change":
                flat = dict(model.named_parameters())[body].data.view(-1)
                flat[0] = flat[0] + 1.0
            elif path == "/update_weights_from_tensor":  # sglang 0.5.23 WeightUpdater.update_weights_from_tensor
                named = deserialize_named_tensors(body["serialized_named_tensors"][0])
                named = [(n, t.to(device)) for n, t in named]
                if body.get("load_format") == LOADER:
                    load(model, named)
                elif named:
                    model.load_weights(named)
                del named  # the sender's memory is its own again
            elif path == "stop":
                conn.send({"success": True})
                return
            conn.send({"success": True})
        except Exception as e:  # noqa: BLE001 - the sender reports it
            conn.send({"success": False, "message": f"{type(e).__name__}: {e}"})


class PipeClient(WeightUpdates):
    """The SGLang client's weight-update calls (rollout/servers/weight_updates.py) with the receiver
    at the other end of a pipe instead of HTTP: the same request bodies."""

    url = URL
    REPLY_TIMEOUT_S = 600.0

    def __init__(self, conn: Any, receiver: Any) -> None:
        self.conn, self.receiver = conn, receiver

    def _checked(self, path: str, payload: Any, **kw: Any) -> dict:
        if path in ("/begin_weight_update", "/end_weight_update"):
            return {"success": True}
        self.conn.send((path, payload))
        # a receiver that died (a CUDA error, the OOM killer) never answers: said at once, and no
        # answer waited for past its bound (a GPU visit's minutes are few)
        deadline = time.monotonic() + self.REPLY_TIMEOUT_S
        try:
            while not self.conn.poll(1.0):
                if not self.receiver.is_alive():
                    raise EOFError
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the receiver gave no answer to {path} within {self.REPLY_TIMEOUT_S:.0f} s")
            reply = self.conn.recv()
        except EOFError:  # its end of the pipe closed: it exited
            self.receiver.join(timeout=5)
            raise RuntimeError(f"the receiver exited with {self.receiver.exitcode} before it answered {path}") from None
        if not reply.get("success"):
            raise RuntimeError(f"the receiver: {reply.get('message')}")
        return reply


def _receiver_state(client: PipeClient) -> Any:
    from gspo_megatron.sync.transport_base import SenderState

    class ReceiverState(SenderState):
        """The sender's state with the receiver as the one server of every pass."""

        def client(self, url: str) -> Any:
            return client
    return ReceiverState()


def _gspo_step(actor: Any) -> None:
    import torch

    from gspo_megatron.actor.batching.batch import TrainBatch
    g = torch.Generator().manual_seed(1)
    t = torch.arange(32)[None]
    batch = TrainBatch(tokens=torch.randint(3, 500, (4, 32), generator=g), lengths=torch.full((4,), 32),
                       loss_mask=(t >= 8).expand(4, 32), advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))
    batch.old_log_probs, _ = actor.compute_old_log_probs(batch)
    actor.train_step(batch)


def sync_on_one_device(cpu: bool) -> dict[str, Any]:
    """The three passes (module docstring); their outcomes, and the checks' verdicts."""
    import tempfile

    import torch
    import torch.multiprocessing as mp

    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.sync import build_plan
    from gspo_megatron.sync.sender_pass import PassPlan, run_pass
    from gspo_megatron.sync.stream import assign_senders, hf_state_dict
    from gspo_megatron.sync.tensor import TensorSender
    from model_specs.hf.tiny import qwen3_moe
    from model_specs.weights.maps import weight_map_for
    device = "cpu" if cpu else "cuda:0"
    parent, child = mp.get_context("spawn").Pipe()
    receiver = mp.get_context("spawn").Process(target=receive, args=(child, device, cpu), daemon=True)
    receiver.start()
    child.close()  # the receiver's end lives in the receiver alone
    client = PipeClient(parent, receiver)
    state = _receiver_state(client)
    try:
        actor = Actor(qwen3_moe(), ParallelLayout(), loss=LossSettings(name="gspo"), micro_batch_size=4,
                      optimizer=OptimizerSettings(optimizer="sgd", lr=0.5, clip_grad=0.0))
        wmap = weight_map_for(actor.spec.hf_config)
        plan = build_plan(actor.chunks, wmap)
        senders = assign_senders(plan)
        trained = hf_state_dict(actor.chunks, wmap)
        assert trained is not None  # one process: rank 0 holds every HF tensor
        client._checked("shapes", {n: tuple(t.shape) for n, t in trained.items()})
        sender = TensorSender(cuda_ipc=True)  # on the host too: the encoder's device branch, host tensors
        out: dict[str, Any] = {"device": str(torch.cuda.get_device_name(0)) if not cpu else "cpu",
                               "how": "host shared memory" if cpu else "CUDA IPC"}
        enc = None
        for name, mode in (("full", "full"), ("delta after a GSPO step", "delta"),
                           ("delta after a weight changed on the receiver (control)", "delta")):
            if name.startswith("delta after a GSPO"):
                _gspo_step(actor)
            if "control" in name:
                client._checked("change", next(iter(trained)))
            t0 = time.perf_counter()
            outcome, enc = run_pass(state, enc, actor.chunks, wmap, plan, senders, BUCKET_BYTES,
                                    PassPlan(name, {URL: mode}, check_all=True, dtype="bfloat16",
                                             keep_base=True, sender=sender))
            out[name] = dict(outcome=outcome, seconds=time.perf_counter() - t0)
            if outcome.error:
                raise RuntimeError(f"{name}: {outcome.error}")
            if name.startswith("delta after a GSPO"):
                trained = hf_state_dict(actor.chunks, wmap)
                assert trained is not None
                with tempfile.TemporaryDirectory() as tmp:
                    served = client.served_tensors({n: t.shape for n, t in trained.items()},
                                                   f"{tmp}/served.safetensors")
                out["bit_identical"] = sorted(served) == sorted(trained) and all(
                    torch.equal(served[n].view(torch.int16), t.to(torch.bfloat16).cpu().view(torch.int16))
                    for n, t in trained.items())
        first = next(iter(trained))
        out["control_caught"] = out["delta after a weight changed on the receiver (control)"][
            "outcome"].mismatched.get(URL) == [first]
        out["tensors"] = len(trained)
        actor.close()
        return out
    finally:
        try:
            client._checked("stop", {})
        except Exception:  # noqa: BLE001 - a receiver that died says so in its exit code
            pass
        receiver.join(timeout=30)


def table(out: dict[str, Any]) -> str:
    lines = ["| sync | tensors | bytes | changed elements | checked, mismatched | seconds (stream / encode / post) |",
             "|---|---|---|---|---|---|"]
    for name in ("full", "delta after a GSPO step", "delta after a weight changed on the receiver (control)"):
        o, s = out[name]["outcome"], out[name]["seconds"]
        changed = f"{o.changed / o.elements:.3f}" if name != "full" else "all"
        lines.append(f"| {name} | {out['tensors']} | {o.sent_bytes / 1e6:.3f} MB | {changed} | "
                     f"{o.checked}, {len(o.mismatched.get(URL, []))} | {s:.3f} ({o.stream_s:.3f} / "
                     f"{o.encode_s:.3f} / {o.post_s:.3f}) |")
    full, delta = out["full"], out["delta after a GSPO step"]
    lines.append(f"\nsync on one device ({out['device']}, {out['how']}): full "
                 f"{full['outcome'].sent_bytes / 1e6:.3f} MB in {full['seconds']:.3f} s, delta "
                 f"{delta['outcome'].sent_bytes / 1e6:.3f} MB in {delta['seconds']:.3f} s; "
                 f"bit-identical {'yes' if out['bit_identical'] else 'no'}; "
                 f"control caught {'yes' if out['control_caught'] else 'no'}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="CUDA hidden: host tensors by shared memory")
    args = p.parse_args()
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check_sync: no CUDA device (use --cpu for the same path on the host)", file=sys.stderr)
        return 2
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    out = sync_on_one_device(args.cpu)
    print(table(out))
    return 0 if out["bit_identical"] and out["control_caught"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Row 5 of the GPU acceptance (tools/gpu_check_sync.py) on CPU: the same path between two processes
with CUDA hidden, host tensors by shared memory where the GPU hands CUDA IPC handles. A full sync,
a delta after a GSPO step and the control are applied by the project's loader in the receiving
process, read back bit for bit; the control, a weight changed on the receiver, is named by the
checksums. And the pieces that decide where a request's bytes live, with the meta device standing
for a GPU (no CUDA here): what is on a device stays there."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_sync_between_two_processes_is_bit_identical_and_the_control_is_caught():
    proc = subprocess.run([sys.executable, "tools/gpu_check_sync.py", "--cpu"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"sync on one device \(cpu, host shared memory\): full ([\d.]+) MB in [\d.]+ s, delta "
                     r"([\d.]+) MB in [\d.]+ s; bit-identical yes; control caught yes", last)
    assert m and float(m.group(2)) < float(m.group(1)), last
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line}
    assert rows["full"][3] == "0, 0"  # whole tensors: SGLang's own load, no checksums
    assert rows["delta after a GSPO step"][3] == f"{rows['full'][0]}, 0"  # every tensor checked
    assert rows["delta after a weight changed on the receiver (control)"][3].endswith(", 1")


def test_a_request_stays_on_the_device_of_its_tensors():
    """flatten() packs a request on the device of its tensors (the host entries join it), and
    serialize_named_tensors() hands a tensor where it is: both moved everything to the host before,
    so a GPU's request crossed the host twice instead of travelling as a CUDA IPC handle."""
    from rollout.in_server.weight_loader import flatten, unflatten
    from rollout.servers.weight_updates import deserialize_named_tensors, serialize_named_tensors
    on_device = torch.empty(3, 5, device="meta")
    (name, buf), = flatten([("a", on_device), ("a|shape", torch.tensor([3, 5]))])
    assert buf.device.type == "meta" and [(n, t.device.type) for n, t in unflatten([(name, buf)])] == \
        [("a", "meta"), ("a|shape", "meta")]
    assert [(n, t.device.type) for n, t in deserialize_named_tensors(serialize_named_tensors([("m", on_device)]))] == \
        [("m", "meta")]
    host = [("h", torch.arange(6.0).reshape(2, 3).t()), ("i", torch.arange(3))]
    back = deserialize_named_tensors(serialize_named_tensors(host))
    assert [n for n, _ in back] == ["h", "i"] and all(torch.equal(t, u) for (_, t), (_, u) in zip(back, host))
    (_, buf), = flatten(host)
    assert buf.device.type == "cpu"


def test_the_tensor_transport_hands_gpu_memory_only_with_cuda_ipc_and_a_gpu():
    """sync.transport_args: {cuda_ipc: true} reaches the senders only where CUDA is (a CPU's tensors
    are on the host already)."""
    from gspo_megatron.sync.transport_base import make_transport
    from gspo_megatron.sync.transports import TRANSPORTS, TensorSettings
    from gspo_tables import row_settings
    assert TRANSPORTS["tensor"].settings is TensorSettings
    settings = row_settings(TRANSPORTS["tensor"], {"cuda_ipc": True}, "sync.transport_args")
    ipc = make_transport("tensor", None, hf_path="", sync_dir=Path, master_address="", settings=settings)
    plain = make_transport("tensor", None, hf_path="", sync_dir=Path, master_address="")
    assert ipc.cuda_ipc and not plain.cuda_ipc
    assert ipc.sender("1", {}).keeps_device() == torch.cuda.is_available()
    assert not plain.sender("1", {}).keeps_device()

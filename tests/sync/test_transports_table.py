"""TRANSPORTS is the only table of weight-sync transports: every row names a Transport whose Sender is
a Sender; the run config's `sync.transport` accepts exactly the table's rows (or a reference to one)
and names them when it refuses one. A row a plug-in adds (GSPO_PLUGINS, docs/extending.md) runs the
every-owner check: a real server, 2 ranks under EP2, with and without deltas."""
from __future__ import annotations

import pytest

from gspo_megatron.sync.transports import TRANSPORTS

SHIPPED = ("disk", "tensor", "distributed")


def test_every_row_names_its_transport_and_sender():
    from gspo_megatron.sync.transport_base import Sender, Transport, transport_class
    assert set(SHIPPED) <= set(TRANSPORTS)
    for name, row in TRANSPORTS.items():
        cls = transport_class(name)
        assert issubclass(cls, Transport) and row.name == name, (name, cls)
        assert issubclass(cls.sender_type, Sender) and (cls.sender_type is not Sender or name not in SHIPPED), name
    assert [n for n in SHIPPED if TRANSPORTS[n].deltas] == ["tensor", "distributed"]
    assert [n for n in SHIPPED if TRANSPORTS[n].folder_versions] == ["disk"]
    with pytest.raises(ValueError, match=r"sync.transport='nccl': expected one of disk, tensor, distributed"):
        transport_class("nccl")


def test_the_config_takes_the_tables_names_and_references():
    from gspo_megatron.config import ConfigError, SyncConfig
    from gspo_megatron.config.parsing import build
    for name in TRANSPORTS:
        assert build(SyncConfig, {"transport": name}, "sync.").transport == name
    ref = "gspo_megatron.sync.transports:TRANSPORTS"  # an object, but not a row
    with pytest.raises(ConfigError, match=f"sync.transport='{ref}': .* is not a weight-sync transport"):
        build(SyncConfig, {"transport": ref}, "sync.")
    with pytest.raises(ConfigError) as refused:
        build(SyncConfig, {"transport": "nccl"}, "sync.")
    assert str(refused.value) == ("sync.transport='nccl': expected one of " + ", ".join(TRANSPORTS)
                                  + ", or package.module:Name naming a TransportRow")


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in TRANSPORTS if n not in SHIPPED])
def test_a_plug_in_transport_passes_the_every_owner_check(name, tmp_path):
    from transport_check import check_every_owner
    print(check_every_owner(name, tmp_path))


def test_every_row_builds_for_a_run(tmp_path):
    """make_transport builds every row as a run does (for_run with the row's settings: a subclass
    of another row's class takes its own constructor's arguments, not its parent's settings)."""
    from gspo_megatron.sync.transport_base import make_transport
    from rollout.servers.pool import ServerPool
    pool = ServerPool(["http://127.0.0.1:9"])
    try:
        for name, row in TRANSPORTS.items():
            transport = make_transport(name, pool, hf_path=str(tmp_path), sync_dir=lambda: tmp_path / "sync",
                                       master_address="127.0.0.1")
            assert transport.row is row and transport.pool is pool, name
    finally:
        pool.close()

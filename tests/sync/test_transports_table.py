"""TRANSPORTS is the only table of weight-sync transports: every row names a Transport whose name
is the row's and whose Sender is a Sender; the run config's `sync.transport` accepts exactly the
table's names (its Literal is built from the table) and names them when it refuses one."""
from __future__ import annotations

import typing

import pytest


def test_every_row_names_its_transport_and_sender():
    from gspo_megatron.sync.transport_base import Sender, Transport, transport_class
    from gspo_megatron.sync.transports import TRANSPORTS
    assert set(TRANSPORTS) == {"disk", "tensor", "distributed"}
    for name, row in TRANSPORTS.items():
        cls = transport_class(name)
        assert issubclass(cls, Transport) and cls.name == name == row.name, (name, cls)
        assert issubclass(cls.sender_type, Sender) and cls.sender_type is not Sender, (name, cls.sender_type)
    assert [n for n, r in TRANSPORTS.items() if r.deltas] == ["tensor", "distributed"]
    assert [n for n, r in TRANSPORTS.items() if r.folder_versions] == ["disk"]
    with pytest.raises(ValueError, match=r"sync.transport='nccl': expected one of \['disk', 'distributed', 'tensor'\]"):
        transport_class("nccl")


def test_the_config_takes_the_tables_names():
    from gspo_megatron.config import ConfigError, SyncConfig
    from gspo_megatron.config.parsing import build
    from gspo_megatron.sync.transports import TRANSPORTS
    assert typing.get_args(typing.get_type_hints(SyncConfig)["transport"]) == tuple(TRANSPORTS)
    for name in TRANSPORTS:
        assert build(SyncConfig, {"transport": name}, "sync.").transport == name
    with pytest.raises(ConfigError) as refused:
        build(SyncConfig, {"transport": "nccl"}, "sync.")
    assert str(refused.value) == "sync.transport='nccl': expected " + " | ".join(repr(n) for n in TRANSPORTS)

"""The start-up check of the private torch APIs the plugin relies on."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

from elasticd.errors import ElasticdError
from elasticd.rendezvous import handler, torch_compat
from elasticd.rendezvous.torch_compat import TorchCompatError, check_torch_apis


def test_the_installed_torch_passes():
    check_torch_apis()


@pytest.mark.parametrize("name", ["_remove_participant_epilogue", "_RendezvousState", "_get_timeout",
                                  "_NodeDesc"])
def test_a_missing_function_is_named_with_the_torch_version(monkeypatch, name):
    monkeypatch.delattr(dyn, name)
    with pytest.raises(TorchCompatError) as info:
        check_torch_apis()
    message = str(info.value)
    assert f"dynamic_rendezvous.{name}" in message
    assert f"torch {torch.__version__}" in message
    assert torch_compat.SUPPORTED_RANGE in message
    assert isinstance(info.value, ElasticdError)


def test_a_missing_method_is_named(monkeypatch):
    monkeypatch.delattr(dyn.DynamicRendezvousHandler, "_keep_alive")
    with pytest.raises(TorchCompatError, match=r"DynamicRendezvousHandler\._keep_alive"):
        check_torch_apis()


def test_a_missing_state_field_is_named(monkeypatch):
    original = dyn._RendezvousState.__init__

    def without_closed(self):
        original(self)
        del self.closed

    monkeypatch.setattr(dyn._RendezvousState, "__init__", without_closed)
    with pytest.raises(TorchCompatError, match=r"_RendezvousState\(\)\.closed"):
        check_torch_apis()


def test_the_plugin_checks_at_start(monkeypatch):
    monkeypatch.delattr(dyn, "_remove_participant_epilogue")
    with pytest.raises(TorchCompatError, match="_remove_participant_epilogue"):
        handler.create_handler(RendezvousParameters("etcd3", "127.0.0.1:1", "job-1", 1, 2))

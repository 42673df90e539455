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


def _params(**conf):
    return RendezvousParameters("etcd3", "127.0.0.1:1", "job-1", 1, 2, **conf)


def test_cas_backoff_is_forwarded_where_torch_has_it(monkeypatch):
    def from_backend(cls, run_id, store, backend, min_nodes, max_nodes, local_addr=None,
                     timeout=None, keep_alive_interval=5, keep_alive_max_attempt=3,
                     cas_backoff_max_seconds=0.0):  # torch 2.15's signature
        raise AssertionError("not called")

    monkeypatch.setattr(dyn.DynamicRendezvousHandler, "from_backend", classmethod(from_backend))
    assert torch_compat.supports_cas_backoff()
    assert handler.cas_backoff_kwargs(_params(cas_backoff_max_seconds="0.5")) == {
        "cas_backoff_max_seconds": 0.5}
    assert handler.cas_backoff_kwargs(_params()) == {}


def test_cas_backoff_is_left_out_where_torch_lacks_it(monkeypatch):
    def from_backend(cls, run_id, store, backend, min_nodes, max_nodes, local_addr=None,
                     timeout=None, keep_alive_interval=5, keep_alive_max_attempt=3):  # <= 2.14
        raise AssertionError("not called")

    monkeypatch.setattr(dyn.DynamicRendezvousHandler, "from_backend", classmethod(from_backend))
    assert not torch_compat.supports_cas_backoff()
    assert handler.cas_backoff_kwargs(_params(cas_backoff_max_seconds="0.5")) == {}


@pytest.mark.parametrize("bad", ["-1", "soon", "nan", "inf"])
def test_a_bad_cas_backoff_names_the_key_and_an_example(bad):
    with pytest.raises(ElasticdError, match=r"cas_backoff_max_seconds=.* must be a number of "
                                            r"seconds >= 0; e\.g\. cas_backoff_max_seconds=0\.5"):
        handler.parse_params(_params(cas_backoff_max_seconds=bad))

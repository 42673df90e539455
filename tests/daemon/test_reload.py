"""SIGHUP reload against a real daemon: a file that clashes with the kept (not reloadable)
sections is rejected and the daemon keeps training on the running config; a valid file
is applied.

The clash: ``[rendezvous]`` is not reloadable, so the running ``last_call_timeout = 5``
is kept; the new file's ``drain_grace_s = 2`` is valid with its own
``last_call_timeout = 1`` but not with the kept 5 (the drain grace must exceed it).
Building that merged config used to raise out of ``reload`` and kill the daemon.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.daemon_nodes import DaemonNode, log_lines, stepping_at, stop_nodes, wait_for

RDZV_5 = "[rendezvous]\nlast_call_timeout = 5\n"


@pytest.fixture
def node(tmp_path, job_id, etcd_server):
    node = DaemonNode("a", etcd_server.endpoint, job_id, tmp_path,
                      {"max_nodes": 1, "sections": RDZV_5})
    yield node
    stop_nodes([node])


def _events(node: DaemonNode, text: str) -> list[dict]:
    return [e for e in log_lines(node) if e.get("event") == text]


def _edit(node: DaemonNode, *replacements: tuple[str, str]) -> None:
    text = node.config_path.read_text()
    for old, new in replacements:
        assert text.count(old) == 1, f"{old!r} not once in the config:\n{text}"
        text = text.replace(old, new)
    node.config_path.write_text(text)


def _no_traceback(node: DaemonNode) -> None:
    text = node.log_path.read_text(errors="replace")
    assert "Traceback" not in text, node.log_tail()
    assert not [e for e in log_lines(node) if "exception" in e], node.log_tail()


@pytest.mark.slow
def test_reload_that_clashes_with_kept_sections_is_rejected(node):
    node.start()
    wait_for(lambda: stepping_at([node], 1, 0), 120, "training", [node])
    assert "last_call_timeout = 5" in node.config_path.read_text()
    _edit(node, ("drain_grace_s = 30", "drain_grace_s = 2"),
          ("last_call_timeout = 5", "last_call_timeout = 1"))
    sent = time.time()
    node.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: _events(node, "config reload rejected; keeping the running config"), 20,
             "the reload to be rejected", [node])
    rejected = _events(node, "config reload rejected; keeping the running config")[-1]
    assert rejected["level"] == "error"
    assert "drain_grace_s" in rejected["reason"], rejected
    assert not _events(node, "config reloaded")
    # Alive, still training, still on the running config.
    wait_for(lambda: stepping_at([node], 1, sent + 2), 30, "steps after the rejected reload", [node])
    assert node.running(), node.log_tail()
    _no_traceback(node)

    # A valid file afterwards is applied (the rejected attempt left nothing stuck).
    _edit(node, ("drain_grace_s = 2", "drain_grace_s = 30"),
          ("last_call_timeout = 1", "last_call_timeout = 5"),
          ("every_steps = 20", "every_steps = 7"))
    node.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: _events(node, "config reloaded"), 20, "the valid reload", [node])
    line = _events(node, "config reloaded")[-1]
    assert line["applied"] == {"checkpoint.every_steps": [20, 7]}, line
    assert line["needs_restart"] == {}, line
    again = time.time()
    wait_for(lambda: stepping_at([node], 1, again + 1), 30, "steps after the valid reload", [node])
    assert node.running(), node.log_tail()
    _no_traceback(node)


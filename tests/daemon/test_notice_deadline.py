"""A cloud preemption notice cuts the drain to its deadline, and the shutdown's SIGTERM
that follows it (GCE and Azure send both at once) keeps the drain graceful.

Real daemon, real torchrun and trainer, a fake metadata service (elasticd/lab/fake_metadata.py):

* each provider announces a preemption 30 s away (GCE: its fixed 30 s window; AWS:
  ``instance-action`` ``time``; Azure: ``NotBefore``), ``drain_grace_s = 60``: the drain's
  grace is min(60, 30 - 5 s margin) = 25 s, in the daemon's sentence and the journal,
  and the node still stops cleanly (checkpoint, exit 0) well within it;
* a notice then one SIGTERM: still a graceful drain (checkpoint, exit 0);
* a notice then two SIGTERMs: a hard stop (exit 1) that leaves no process behind, even
  workers that ignore SIGTERM.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from elasticd import proctree
from elasticd.etcd_client import EtcdClient, EtcdSettings
from elasticd.journal import recent_events
from elasticd.lab.fake_metadata import FakeMetadata
from elasticd.observer import newest_committed_step
from elasticd.rendezvous.keys import JobKeys
from tests.daemon_nodes import DaemonNode, agent_events, log_lines, stepping_at, stop_nodes, wait_for

NOTICE_S = 30


class GraceNode(DaemonNode):
    """A daemon node whose config has ``drain_grace_s = 60`` (the harness writes 30)."""

    def prepare(self) -> None:
        super().prepare()
        text = self.config_path.read_text()
        assert text.count("drain_grace_s = 30") == 1, text
        self.config_path.write_text(text.replace("drain_grace_s = 30", "drain_grace_s = 60"))


@pytest.fixture
def meta():
    with FakeMetadata() as server:
        yield server


@pytest.fixture
def nodes():
    started: list[DaemonNode] = []
    yield started
    stop_nodes(started)


def _start(nodes, cls, etcd, job_id, root: Path, meta: FakeMetadata, provider: str) -> DaemonNode:
    section = f'[preemption]\n{provider} = true\nmetadata_url = "{meta.url}"\npoll_interval_s = 0.2\n'
    node = cls("a", etcd.endpoint, job_id, root, {"max_nodes": 1, "sections": section})
    nodes.append(node)
    node.start()
    wait_for(lambda: stepping_at([node], 1, 0), 120, "training", [node])
    return node


def _announce(meta: FakeMetadata, provider: str) -> None:
    if provider == "gce":
        meta.announce_gce()   # GCE's window is a fixed 30 s from the notice
    elif provider == "aws":
        meta.announce_aws("terminate", at=time.time() + NOTICE_S)
    else:
        meta.announce_azure("Preempt", not_before=time.time() + NOTICE_S)


def _draining(node: DaemonNode) -> list[dict]:
    return [e for e in log_lines(node) if e.get("event", "").startswith("draining because")]


def _events(node: DaemonNode, text: str) -> list[str]:
    return [e["event"] for e in log_lines(node) if text in e.get("event", "")]


def _assert_clean_stop(node: DaemonNode, root: Path) -> int:
    """The workers took the coordinated stop and rank 0 committed that step."""
    stopped = agent_events(node, "stopped")
    assert stopped, node.log_tail()
    step = stopped[-1]["step"]
    assert step > 0
    assert newest_committed_step(str(root / "ckpt")) == step
    assert not _events(node, "the drain grace is over"), node.log_tail()
    assert not _events(node, "second stop signal"), node.log_tail()
    assert "the agent stopped; leaving the job and exiting" in [e["event"] for e in log_lines(node)]
    text = node.log_path.read_text(errors="replace")
    assert "Traceback" not in text, node.log_tail()
    return step


@pytest.mark.slow
@pytest.mark.parametrize("provider", ["gce", "aws", "azure"])
def test_notice_deadline_cuts_the_drain_grace(etcd_server, job_id, tmp_path, meta, nodes, provider):
    # The job_id fixture cuts the test name to 40 characters: every provider would share it.
    job_id = f"{job_id}-{provider}"
    node = _start(nodes, GraceNode, etcd_server, job_id, tmp_path, meta, provider)
    announced = time.monotonic()
    _announce(meta, provider)
    wait_for(lambda: _draining(node), 20, "the drain to start", [node])
    line = _draining(node)[0]
    assert f"a {provider} preemption notice arrived" in line["event"], line
    # min(drain_grace_s 60, 30 s deadline - 5 s margin); the notice was read up to a poll late.
    # (A world of one: nobody to go on in place, so every rank, this one, stops.)
    assert line["event"].endswith(("(grace 25 s, by a coordinated stop)",
                                   "(grace 24 s, by a coordinated stop)")), line

    assert node.proc.wait(timeout=NOTICE_S) == 0, node.log_tail()
    assert time.monotonic() - announced < NOTICE_S - 5, "the drain outlived the notice's grace"
    assert not meta.rejections
    _assert_clean_stop(node, tmp_path)

    client = EtcdClient(EtcdSettings(endpoints=(etcd_server.endpoint,)))
    try:
        events = recent_events(client, JobKeys(job_id), limit=100)
    finally:
        client.close()
    draining = [e for e in events if e.get("kind") == "node-draining" and e.get("node") == "a"]
    assert len(draining) == 1, events
    assert 23.5 <= draining[0]["grace_s"] <= 25.0, draining
    assert f"a {provider} preemption notice arrived" in draining[0]["reason"]
    assert any(e.get("kind") == "node-left" for e in events), events


@pytest.mark.slow
def test_sigterm_after_a_notice_keeps_the_drain_graceful(etcd_server, job_id, tmp_path, meta, nodes):
    node = _start(nodes, DaemonNode, etcd_server, job_id, tmp_path, meta, "gce")
    meta.announce_gce()
    wait_for(lambda: _draining(node), 20, "the drain to start", [node])
    node.proc.send_signal(signal.SIGTERM)   # the shutdown that follows the notice
    assert node.proc.wait(timeout=NOTICE_S) == 0, node.log_tail()
    _assert_clean_stop(node, tmp_path)
    stopped = [e for e in log_lines(node) if e.get("event") == "daemon stopped"]
    assert stopped and stopped[-1]["hard"] is False, stopped


STUBBORN = """\
import os, pathlib, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)   # and never looks at the stop file
pathlib.Path(sys.argv[1]).write_text(str(os.getpid()))
while True:
    time.sleep(0.1)
"""


@pytest.mark.slow
def test_second_sigterm_after_a_notice_is_a_hard_stop(etcd_server, job_id, tmp_path, meta, nodes):
    # Workers that ignore the drain keep it going for its whole grace, so the second
    # SIGTERM surely lands in it (the real trainer's drain is over in about a second).
    script, ready = tmp_path / "stubborn.py", tmp_path / "worker.pid"
    script.write_text(STUBBORN)
    section = f'[preemption]\ngce = true\nmetadata_url = "{meta.url}"\npoll_interval_s = 0.2\n'
    node = DaemonNode("a", etcd_server.endpoint, job_id, tmp_path,
                      {"max_nodes": 1, "sections": section, "entrypoint": [str(script), str(ready)]})
    nodes.append(node)
    node.start()
    wait_for(ready.exists, 120, "the worker to start", [node])
    tree = node.tree()
    assert int(ready.read_text()) in [p.pid for p in tree], "the worker is not under the daemon"
    meta.announce_gce()
    wait_for(lambda: _draining(node), 20, "the drain to start", [node])
    node.proc.send_signal(signal.SIGTERM)   # the shutdown after the notice: the drain goes on
    # Python runs a signal's handler once for any number of deliveries before it gets to
    # run it: space the two signals.
    time.sleep(2)
    assert node.running(), node.log_tail()
    assert not _events(node, "second stop signal"), node.log_tail()
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(timeout=20) == 1, node.log_tail()
    assert _events(node, "a second stop signal arrived; stopping now without a checkpoint"), \
        node.log_tail()
    assert not _events(node, "the agent stopped; leaving the job and exiting"), node.log_tail()
    stopped = [e for e in log_lines(node) if e.get("event") == "daemon stopped"]
    assert stopped and stopped[-1]["hard"] is True, stopped
    proctree.reap_children()
    left = [p.pid for p in tree if proctree.pid_alive(p)]
    assert not left, f"the hard stop left processes: {left}"

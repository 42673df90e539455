"""The 3-member loopback etcd cluster (``EmbeddedEtcdCluster``): a leader, a new one after
the leader's SIGKILL, none while a quorum is lost, and the data back once it returns; a
local cluster on it gives its daemons every endpoint."""

from __future__ import annotations

import pytest

from elasticd import proctree
from elasticd.config import load_config
from elasticd.errors import EtcdUnavailable
from elasticd.etcd_client import EtcdClient, EtcdSettings, no_retry
from elasticd.lab.embedded_etcd import EmbeddedEtcdCluster
from elasticd.lab.local_cluster import local_cluster


def _client(endpoints: tuple[str, ...]) -> EtcdClient:
    return EtcdClient(EtcdSettings(endpoints=endpoints, timeout_s=1, retry_s=10))


@pytest.mark.process
@pytest.mark.timeout(120)
def test_leader_kill_quorum_loss_and_back(tmp_path):
    with EmbeddedEtcdCluster(tmp_path / "etcd") as cluster:
        assert len(cluster.endpoints) == 3 and cluster.endpoint == ",".join(cluster.endpoints)
        assert proctree.wait_for(lambda: cluster.leader() is not None, 10, 0.1)
        client = _client(cluster.endpoints)
        try:
            client.put("/k", b"1")
            old = cluster.leader()
            cluster.kill(old)
            # The two left elect another; a client with every endpoint writes on.
            assert proctree.wait_for(lambda: cluster.leader() not in (None, old), 15, 0.1)
            client.put("/k", b"2")
            cluster.start([old])
            assert cluster.healthy(old)
            # Two of three down: no leader, no write; the one left is not healthy.
            down = [m for m in cluster.members if m is not cluster.leader()][:2]
            for m in down:
                cluster.kill(m)
            (left,) = [m for m in cluster.members if m.running()]
            assert proctree.wait_for(lambda: cluster.leader() is None and not cluster.healthy(left), 10, 0.1)
            with no_retry(), pytest.raises(EtcdUnavailable):
                client.put("/k", b"3")
            cluster.start(down)
            assert all(cluster.healthy(m) for m in cluster.members) and cluster.leader() is not None
            assert client.get("/k").value == b"2"
        finally:
            client.close()
    assert not any(m.running() for m in cluster.members)


def test_a_cluster_of_its_own_removes_its_directory():
    cluster = EmbeddedEtcdCluster(size=1).start()
    root = cluster.root
    assert cluster.leader() is cluster.members[0]
    cluster.stop()
    assert not root.exists() and not cluster.processes()


def test_a_local_cluster_of_three_members_gives_every_daemon_every_endpoint(tmp_path):
    with local_cluster(tmp_path / "c", etcd_members=3) as cluster:
        assert isinstance(cluster.etcd, EmbeddedEtcdCluster) and cluster.etcd.leader() is not None
        node = cluster.daemon("a", "job", start=False)
        node.prepare()
        assert load_config(node.config_path, env={}).etcd.endpoints == cluster.etcd.endpoints
    assert not cluster.etcd.processes() and not cluster.leftover
    with pytest.raises(ValueError, match="etcd_members=2: 1 or 3"), \
            local_cluster(tmp_path / "d", etcd_members=2):
        pass

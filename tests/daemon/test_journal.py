"""The lifecycle journal against a real etcd: its lease is replaced, so events keep landing
after the first lease is gone; bad entries read back are skipped."""

from __future__ import annotations

import json
import time

import pytest

from elasticd.etcd_client import EtcdClient, EtcdSettings
from elasticd.journal import Journal, recent_events
from elasticd.rendezvous.keys import JobKeys


def kinds(client: EtcdClient, keys: JobKeys) -> list[str]:
    return [e["kind"] for e in recent_events(client, keys, 100)]


def test_a_revoked_lease_is_replaced_and_the_write_lands(client, job_id):
    """Revoked as an expired 7-day lease would be: the next write grants a new lease."""
    keys = JobKeys(job_id)
    journal = Journal(client, keys, "node-a")
    journal.record("node-joined")
    (entry,) = client.get_prefix(keys.events)
    assert entry.lease_id, "entries live on a lease"
    client.revoke_lease(entry.lease_id)   # what expiry does: the lease and its keys are gone
    assert client.get_prefix(keys.events) == []
    journal.record("worker-restart", cause="membership")
    (entry2,) = client.get_prefix(keys.events)
    assert entry2.lease_id and entry2.lease_id != entry.lease_id
    assert client.lease_ttl(entry2.lease_id) > 0
    assert kinds(client, keys) == ["worker-restart"]
    journal.record("node-left")      # and the new lease is reused, not granted per write
    assert {kv.lease_id for kv in client.get_prefix(keys.events)} == {entry2.lease_id}


@pytest.mark.process
def test_an_expired_lease_is_replaced(client, job_id):
    """A real expiry with a short TTL, on a clock that does not reach half the TTL (so the
    proactive renewal does not hide the failed write)."""
    keys = JobKeys(job_id)
    journal = Journal(client, keys, "node-a", ttl_s=2, clock=lambda: 0.0)
    journal.record("first")
    (first,) = client.get_prefix(keys.events)
    deadline = time.monotonic() + 10
    while client.lease_ttl(first.lease_id) >= 0 and time.monotonic() < deadline:  # -1: gone
        time.sleep(0.2)
    assert client.get_prefix(keys.events) == [], "the 2 s lease should have expired"
    journal.record("after-expiry")
    assert kinds(client, keys) == ["after-expiry"]


def test_an_old_lease_is_swapped_before_it_expires(client, job_id):
    keys = JobKeys(job_id)
    now = [0.0]
    journal = Journal(client, keys, "node-a", ttl_s=3600, clock=lambda: now[0])
    journal.record("a")
    now[0] = 1799.0
    journal.record("b")
    now[0] = 1800.0      # half the TTL: entries from here on get a fresh lease
    journal.record("c")
    leases = [kv.lease_id for kv in sorted(client.get_prefix(keys.events), key=lambda kv: kv.key)]
    assert leases[0] == leases[1] != leases[2]
    assert client.lease_ttl(leases[2]) > 3500


@pytest.mark.process
def test_unavailable_etcd_drops_the_entry_at_once(fresh_etcd, job_id):
    c = EtcdClient(EtcdSettings(endpoints=(fresh_etcd.endpoint,), retry_s=30, timeout_s=2))
    try:
        journal = Journal(c, JobKeys(job_id), "node-a")
        journal.record("before")
        fresh_etcd.stop()
        start = time.monotonic()
        journal.record("during-outage")   # never raises, never waits out retry_s
        assert time.monotonic() - start < 5
    finally:
        c.close()


def test_recent_events_skips_what_is_not_a_json_object(client, job_id):
    keys = JobKeys(job_id)
    Journal(client, keys, "node-a").record("good")
    for i, raw in enumerate([b"[]", b"not json", b'"text"', b"42", b"\xff\xfe", b"null"]):
        client.put(f"{keys.events}{i:020d}-mallory", raw)
    warnings: list[str] = []
    events = recent_events(client, keys, 100, warn=warnings.append)
    assert [e["kind"] for e in events] == ["good"]
    assert len(warnings) == 6 and all("mallory" in w and "not a JSON object" in w for w in warnings)


def test_fields_that_json_cannot_write_do_not_raise(client, job_id):
    keys = JobKeys(job_id)
    Journal(client, keys, "node-a").record("odd", path=object(), when={1, 2})
    (entry,) = recent_events(client, keys)
    assert entry["kind"] == "odd" and isinstance(entry["path"], str)
    assert json.dumps(entry)

"""Keep one etcd lease alive from a background thread.

Keys attached to the lease vanish ``ttl_s`` after the last refresh: that is how
a node's record disappears when the node dies or goes silent, and how the keys
of a finished run are cleaned up without anyone deleting them.

If the lease is found expired (the process was stopped for longer than the TTL,
or etcd lost it), a new one is granted and ``on_renewed(new_id)`` is called so
the owner can re-attach its keys. An etcd outage is logged once when it starts
and once when it ends, not on every failed refresh.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from elasticd.errors import EtcdError
from elasticd.etcd_client import EtcdClient, deadline

log = structlog.get_logger(__name__)

# A revoke only saves the lease's remaining TTL, so it never waits long for an etcd that
# is gone (measured in CI: eight agents of one process each waited 31 s at exit, in turn).
REVOKE_BUDGET_S = 3.0


class LeaseKeeper:
    def __init__(self, client: EtcdClient, ttl_s: int, *, interval_s: float | None = None,
                 on_renewed: Callable[[int], None] | None = None, name: str = "lease") -> None:
        if ttl_s < 2:
            raise ValueError(f"lease ttl_s={ttl_s} must be >= 2 seconds")
        self._client = client
        self.ttl_s = int(ttl_s)
        # Three refreshes per TTL: one lost refresh never expires the lease.
        self.interval_s = interval_s if interval_s is not None else self.ttl_s / 3
        self._on_renewed = on_renewed
        self._name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._etcd_down = False
        self.id: int = 0

    def start(self) -> LeaseKeeper:
        self.id = self._client.grant_lease(self.ttl_s)
        self._thread = threading.Thread(target=self._run, name=f"elasticd-{self._name}",
                                        daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.refresh_once()

    def refresh_once(self) -> None:
        """One keep-alive; grants a new lease if the old one expired."""
        try:
            remaining = self._client.refresh_lease(self.id)
            if remaining <= 0:
                old, self.id = self.id, self._client.grant_lease(self.ttl_s)
                log.warning("lease expired; granted a new one", lease=self._name,
                            old_lease=old, new_lease=self.id)
                if self._on_renewed is not None:
                    self._on_renewed(self.id)
            self._set_etcd_down(False)
        except EtcdError as exc:
            self._set_etcd_down(True, str(exc))

    def _set_etcd_down(self, down: bool, reason: str = "") -> None:
        if down == self._etcd_down:
            return
        self._etcd_down = down
        if down:
            log.warning("etcd unreachable; lease keep-alive retrying", lease=self._name,
                        reason=reason)
        else:
            log.info("etcd reachable again; lease kept alive", lease=self._name)

    def stop(self, revoke: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if revoke and self.id:
            try:
                with deadline(min(float(self.ttl_s), REVOKE_BUDGET_S)):
                    self._client.revoke_lease(self.id)
            except EtcdError as exc:
                log.warning("could not revoke lease; it expires by itself", lease=self._name,
                            reason=str(exc))

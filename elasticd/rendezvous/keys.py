"""The etcd key layout of one job: everything lives under ``<root>/<job>/``.

``/elasticd/<job>/nodes/<node-id>``     node records (daemon), on the node's lease
``/elasticd/<job>/rdzv/state``          torch dynamic-rendezvous state (this plugin)
``/elasticd/<job>/rdzv/store/<key>``    the agents' c10d store (this plugin); torch's layout
                                        keeps the rendezvous epoch there (``store_epoch``)
``/elasticd/<job>/rdzv/round``          keyed rounds: the newest closed round (small pointer)
``/elasticd/<job>/rdzv/world/<round>``  keyed rounds: one closed round's members
``/elasticd/<job>/rdzv/epoch``          keyed rounds: the job's rendezvous epoch (these three
                                        are on no lease: they live as long as the job)
``/elasticd/<job>/rdzv/join/<round>/<agent>``  keyed rounds: an agent's join, on its lease
``/elasticd/<job>/rdzv/alive/<agent>``  keyed rounds: an agent's liveness, on its lease
``/elasticd/<job>/rdzv/closed``         keyed rounds: the job's rendezvous is closed
``/elasticd/<job>/rdzv/recovery/<round>/<agent>``  plain torchrun with recovery=in-place: an
                                        agent's recovery companion (probe, store, world, done)
``/elasticd/<job>/checkpoint/latest``   newest committed checkpoint (hint)
``/elasticd/<job>/events/<ts>-<node>``  lifecycle journal
``/elasticd/<job>/drain/<node-id>``     a drain request from ``elasticd drain``
``/elasticd/<job>/doctor/<node-id>``    ``elasticd doctor``'s record (checkpoint dir id, clock)
``/elasticd/<job>/state``               ``{"state": "completed", "node", "time"}`` once the script
                                        finished (``Daemon._mark_completed``, the one writer);
                                        absent while the job runs (``elasticd status``
                                        then derives running, failed or stalled from the
                                        node records and the journal). A failed node says
                                        so in its own record and the journal, not here
``/elasticd/<job>/generation``          the agreed in-place generation (elasticd.contract.generation)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from elasticd.errors import ConfigError

# The rendezvous layouts: keyed rounds (rendezvous/keyed.py: per-agent keys, etcd writes
# linear in the nodes), or torch's dynamic rendezvous on one shared state (every agent
# compare-and-sets one pickled state: writes grow with the square of the nodes).
# ``--rdzv-conf rounds=`` and ``[rendezvous] rounds``.
KEYED_ROUNDS = "keyed"
ROUNDS = (KEYED_ROUNDS, "torch")
DEFAULT_ROUNDS = KEYED_ROUNDS

DEFAULT_ROOT = "/elasticd"
# torch's layout: the rendezvous epoch's key in the run's store (``handler.store_epoch``).
GENERATION_EPOCH_KEY = "elasticd.generation_epoch"
_JOB_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")


def check_job_id(job_id: str) -> str:
    if not _JOB_ID.match(job_id or ""):
        raise ConfigError(
            f"job id {job_id!r} is not valid: use 1-128 characters of a-z, 0-9, '.', '_' "
            "or '-', starting with a letter or digit (it becomes an etcd key prefix)"
        )
    return job_id


@dataclass(frozen=True)
class JobKeys:
    job_id: str
    root: str = DEFAULT_ROOT

    def __post_init__(self) -> None:
        check_job_id(self.job_id)
        if not self.root.startswith("/") or self.root.endswith("/"):
            raise ConfigError(
                f"key prefix {self.root!r} must start with '/' and not end with '/', e.g. /elasticd"
            )

    @property
    def prefix(self) -> str:
        return f"{self.root}/{self.job_id}/"

    @property
    def nodes(self) -> str:
        return f"{self.prefix}nodes/"

    def node(self, node_id: str) -> str:
        return f"{self.nodes}{node_id}"

    @property
    def rdzv_state(self) -> str:
        return f"{self.prefix}rdzv/state"

    @property
    def rdzv_round(self) -> str:
        """Keyed rounds (``rendezvous.keyed``): the newest closed round, a small pointer."""
        return f"{self.prefix}rdzv/round"

    @property
    def rdzv_worlds(self) -> str:
        return f"{self.prefix}rdzv/world/"

    def rdzv_world(self, round_: int) -> str:
        # Fixed width: the key of one round is never a prefix of another's.
        return f"{self.rdzv_worlds}{round_:012d}"

    @property
    def rdzv_epoch(self) -> str:
        """Keyed rounds: the job's rendezvous epoch, created once (``keyed.epoch``)."""
        return f"{self.prefix}rdzv/epoch"

    def world_round(self, key: str) -> int | None:
        """The round of a ``world/<round>`` key; None for a key this plugin did not name."""
        tail = key.removeprefix(self.rdzv_worlds)
        return int(tail) if tail != key and tail.isdigit() else None

    def rdzv_joins(self, round_: int) -> str:
        return f"{self.prefix}rdzv/join/{round_:012d}/"

    @property
    def rdzv_alive(self) -> str:
        return f"{self.prefix}rdzv/alive/"

    def rdzv_recovery(self, round_: int) -> str:
        """recovery=in-place (``rendezvous.companion``): the round's companions, one key each."""
        return f"{self.prefix}rdzv/recovery/{round_:012d}/"

    @property
    def rdzv_closed(self) -> str:
        return f"{self.prefix}rdzv/closed"

    @property
    def store(self) -> str:
        return f"{self.prefix}rdzv/store/"

    @property
    def store_epoch(self) -> str:
        """torch's layout: the rendezvous epoch, in the run's store (on the run's lease)."""
        return f"{self.store}{GENERATION_EPOCH_KEY}"

    @property
    def checkpoint_latest(self) -> str:
        return f"{self.prefix}checkpoint/latest"

    @property
    def events(self) -> str:
        return f"{self.prefix}events/"

    def drain(self, node_id: str) -> str:
        """A drain request for one node (``elasticd drain``); the node deletes it when gone."""
        return f"{self.prefix}drain/{node_id}"

    @property
    def state(self) -> str:
        return f"{self.prefix}state"

    @property
    def generation(self) -> str:
        """The agreed ``GenerationRecord`` of in-place re-forms (one compare-and-set each)."""
        return f"{self.prefix}generation"

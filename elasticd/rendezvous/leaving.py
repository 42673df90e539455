"""An agent that dies of a signal still leaves the rendezvous, at interpreter exit.

torch's ``launch_agent`` calls the handler's ``shutdown()`` in a ``finally`` on every exit
but a signal: on ``SignalException`` (SIGTERM, SIGINT: a graceful stop, a drain of plain
torchrun) it skips it, so the agent's liveness stayed in etcd until its lease or
keep-alive ran out, and the others waited for it (measured without the daemon: a
graceful SIGTERM cost the survivors 16.5 s). The interpreter still exits normally after
that exception, so an ``atexit`` hook can leave, never close: the job goes on without
this node. Both handlers (torch's rounds and keyed rounds) share this one rule.

A node drained in place leaves the same way, before a round: its daemon creates the
leave file (``ELASTICD_LEAVE_FILE``) before its workers stop, and torch's agent, which
restarts a group whose workers exited, would otherwise join the next round and make
every survivor restart its workers for it. ``_leave_if_asked`` leaves instead and ends
the agent's run (``RendezvousGracefulExitError``, which torch's agent catches).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time

import structlog
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousGracefulExitError

from elasticd.contract.settings import LEAVE_FILE_ENV
from elasticd.etcd_client import deadline

log = structlog.get_logger(__name__)

# What one agent's leave at exit may take: the lease's expiry evicts it anyway.
AT_EXIT_BUDGET_S = 5.0
# What all of one process's leaves at exit may take together: a process with many agents
# (a test session) leaves each in turn, and with etcd gone each took its whole budget
# (53 of them held CI's exit 3.5 min). Past it the others' leases expire by themselves.
AT_EXIT_TOTAL_S = 10.0
_exit_spent = {"s": 0.0}   # seconds this process's leaves at exit have taken so far


class LeavesOnExit:
    """Mixin: ``_arm_leave_on_exit()`` once the agent has joined; ``_leave(success)`` is
    the handler's one way out (``shutdown`` calls it too, so it runs at most once)."""

    _leave_armed = False
    _has_left = False
    _asked_to_leave: str | None = None   # the leave file that made this agent leave

    def _leave_if_asked(self) -> None:
        """At the start of ``next_rendezvous``: if this node's daemon drains it in place
        (the leave file exists), leave the rendezvous (never close it) and end the agent's
        run instead of joining a round."""
        path = os.environ.get(LEAVE_FILE_ENV)
        if not path or not os.path.exists(path):
            return
        self._asked_to_leave = path
        self._leave_once(success=False)
        raise RendezvousGracefulExitError(
            f"this node is drained ({LEAVE_FILE_ENV}={path} exists): its agent leaves the "
            "rendezvous instead of joining another round")

    def _arm_leave_on_exit(self) -> None:
        if not self._leave_armed:
            self._leave_armed = True
            atexit.register(self._leave_on_exit)

    def _leave_on_exit(self) -> None:
        if self._has_left:
            return
        left = AT_EXIT_TOTAL_S - _exit_spent["s"]
        if left <= 0:
            self._has_left = True   # the process's budget is spent: the lease expires
            return
        _say_at_exit("agent exiting without a rendezvous shutdown (a signal); leaving the "
                     "rendezvous open for the others")
        started = time.monotonic()
        try:
            # Bounded: a process with many agents leaves each in turn, and with etcd gone an
            # unbounded leave held the interpreter's exit for minutes.
            with deadline(min(AT_EXIT_BUDGET_S, left)):
                self._leave_once(success=False)
        except Exception as exc:  # noqa: BLE001 - at exit: the lease's expiry still evicts us
            _say_at_exit("could not leave the rendezvous at exit", reason=repr(exc)[:200])
        finally:
            _exit_spent["s"] += time.monotonic() - started

    def _leave_once(self, success: bool) -> bool:
        if self._has_left:
            return True
        self._has_left = True
        return self._leave(success)

    def _leave(self, success: bool) -> bool:
        raise NotImplementedError


def warn_giving_up(asked: str | None = None, **fields: str) -> None:
    """The line of an agent that leaves without success (both handlers' ``_leave``);
    ``asked``: the leave file that made it leave (a drain in place: no warning)."""
    if asked is not None:
        log.info("this node is drained in place; leaving the rendezvous instead of joining "
                 "another round", leave_file=asked, **fields)
        return
    exc = sys.exc_info()[1]
    if isinstance(exc, RendezvousClosedError):
        # Nothing is left open for anyone: the run is over. The error's own text (what
        # happened, and the fix) is torchrun's last line right after this one; cut to 200
        # characters here it would end before the fix.
        log.warning("the rendezvous is closed; this agent exits (why, and the fix: the "
                    "RendezvousClosedError that follows)", **fields)
        return
    log.warning("agent is giving up; leaving the rendezvous open for the others", **fields,
                reason=repr(exc or "a signal")[:200])


def _say_at_exit(event: str, **fields: str) -> None:
    """A warning that cannot fail: at interpreter exit the log stream may be closed
    already (a test process's captured stdout), and the leave matters more than the line."""
    with contextlib.suppress(ValueError, OSError):
        log.warning(event, **fields)

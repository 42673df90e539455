"""``no-stale-commit`` on made-up histories (no processes): it passes on what a correct
system does around a network fault, reports a ghost step, and bites on a split brain, the
failure a partition invites (a node cut off going on, and committing, in the world it was
cut from).
"""

from __future__ import annotations

from elasticd.lab.chaos import invariants as inv
from elasticd.lab.chaos.run import RUN, FaultRecord, RunResult
from elasticd.lab.chaos.scenario import FaultSpec, Scenario

T0 = 1_000_000.0
EPOCH = "e1"


def rec(step: int, rnd: int, seq: int, t: float, event: str = "step", rank: int = 0) -> dict:
    return {"event": event, "step": step, "rank": rank, "time": T0 + t, "world_size": 3,
            "generation": {"round": rnd, "seq": seq, "epoch": EPOCH}}


def steps(first: int, last: int, rnd: int, seq: int, t0: float, rank: int = 0) -> list[dict]:
    """One record a step, 0.1 s apart; every 20th a checkpoint."""
    return [rec(s, rnd, seq, t0 + (s - first) * 0.1, "checkpoint" if s % 20 == 0 else "step", rank)
            for s in range(first, last + 1)]


def result(progress: dict[str, list[dict]], t_fault: float = 3.0) -> RunResult:
    sc = Scenario(1, (FaultSpec("partition-peers", "c", 30),), nodes=3, final_step=60)
    fault = FaultRecord(0, "partition-peers", "step 30", "c", 30, T0 + t_fault, T0 + t_fault + 10,
                        T0 + 20)
    return RunResult(sc, None, RUN, [fault], T0 - 10, T0, T0 + 100, {}, progress, {}, [])


def in_place(after_cut: list[dict] | None = None) -> dict[str, list[dict]]:
    """a, b, c step 1..30 in 1.0; c is cut off; a and b re-form as 1.1 and go on to 60."""
    return {"a": steps(1, 30, 1, 0, 0) + steps(31, 60, 1, 1, 5),
            "b": steps(1, 30, 1, 0, 0, 1) + steps(31, 60, 1, 1, 5, 1),
            "c": steps(1, 30, 1, 0, 0, 2) + (after_cut or [])}


def test_an_in_place_re_form_without_the_cut_node_passes():
    assert inv.check_stale_commit(result(in_place())).passed


def test_a_late_record_of_a_step_the_old_world_had_completed_passes():
    # c was stopped between its step 30 and writing it: the record comes after 1.1's steps.
    assert inv.check_stale_commit(result(in_place([rec(30, 1, 0, 6.0, rank=2)]))).passed


def test_a_restart_that_redoes_steps_from_a_checkpoint_passes():
    progress = {"a": steps(1, 30, 1, 0, 0) + steps(21, 60, 2, 0, 8)}
    assert inv.check_stale_commit(result(progress)).passed


def test_a_ghost_step_is_reported_but_passes():
    """Seen (partition-oneway-in): the cut-off c completed step 31 in 1.0 after the heal,
    from the messages a and b had sent it before re-forming as 1.1; then its daemon
    killed it. No commit: reported, not failed."""
    check = inv.check_stale_commit(result(in_place([rec(31, 1, 0, 9.0, rank=2)])))
    assert check.passed, check
    assert ("1 ghost step(s) of a cut-off world, first: node c step 31 in generation 1.0 after "
            "generation 1.1 had completed step 31") in check.detail


def test_it_bites_on_a_cut_node_that_goes_on_and_commits_in_its_old_world():
    """The system weakened so that c's workers keep stepping in 1.0 on their own (as if
    the group's collectives did not need the lost peers) and start a checkpoint at step
    40: two worlds, and the old one commits."""
    check = inv.check_stale_commit(result(in_place(steps(31, 40, 1, 0, 7, rank=0))))
    assert not check.passed, check
    assert check.detail.startswith("1 stale checkpoint(s); first: node c checkpoint 40 in generation "
                                   "1.0 after generation 1.1 had completed step 31"), check.detail
    assert "9 ghost step(s)" in check.detail and check.fault == "#0 partition-peers"


def test_other_epochs_are_never_compared():
    later = [dict(r, generation={"round": 0, "seq": 0, "epoch": "e2"}) for r in steps(31, 40, 0, 0, 7)]
    assert inv.check_stale_commit(result(in_place(later))).passed

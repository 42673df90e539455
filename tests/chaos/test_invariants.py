"""The invariants on made-up histories and real checkpoints, without processes, and each
seen to bite: fed a tampered history or a system weakened on purpose, the check fails.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest

from checkpointing import CheckpointManager, reader
from elasticd.lab.chaos import invariants as inv
from elasticd.lab.chaos.faults import Target, corrupt_newest, newest_committed
from elasticd.lab.chaos.oracle import lineage, replay_run
from elasticd.lab.chaos.run import RUN, FaultRecord, RunResult
from elasticd.lab.chaos.scenario import FaultSpec, Scenario

FINAL = 60
T0 = 1_000_000.0


def _world(step: int) -> int:
    return 3 if step <= 30 else 2


def _lr(step: int) -> float:
    return RUN.lr * _world(step) / 3


def _records(final: int = FINAL, *, resume_at: tuple[int, int] | None = None) -> list[dict]:
    """Rank 0's progress records, one step each 0.1 s; ``resume_at`` (after, to): a
    restart after step ``after`` that resumed from ``to`` (and a 3 s pause)."""
    out, t = [], T0
    step = 1
    while step <= final:
        out.append({"event": "checkpoint" if step % 20 == 0 else "step", "step": step, "rank": 0,
                    "world_size": _world(step), "lr": _lr(step), "time": t})
        t += 0.1
        if resume_at and step == resume_at[0]:
            t += 3.0
            step = resume_at[1]
            out.append({"event": "resumed", "step": step, "rank": 0, "world_size": 2, "lr": _lr(step),
                        "time": t})
            resume_at = None
        step += 1
    return out


def _save_final(ckpt, records: list[dict], final: int = FINAL) -> None:
    """The checkpoint a faithful run of ``records`` ends with (the replay's own state);
    the records get the losses it logged (one step behind, as the loop logs them)."""
    hist = {s: (r["world_size"], r["lr"]) for s, r in lineage(records).items()}
    done = replay_run(RUN, hist)
    for r in records:
        if r["event"] != "resumed" and r["step"] > 1:
            r |= {"loss_step": r["step"] - 1, "loss": done.losses[r["step"] - 1]}
    with CheckpointManager(ckpt, keep_last=3, world_size=2) as mgr:
        mgr.save(final, {"model": done.params, "sampler": {"epoch": done.epoch, "cursor": done.cursor}})


def _result(tmp_path, records: list[dict], faults: list[FaultRecord] = (), corrupted=None,
            final: int = FINAL) -> RunResult:
    sc = Scenario(1, (FaultSpec("node-kill", "any", 10),), nodes=3, final_step=final)
    return RunResult(sc, tmp_path, RUN, list(faults), T0 - 10, T0, records[-1]["time"] + 1,
                     {"a": 0, "b": 0, "c": 0}, {"a": records}, corrupted or {}, [])


def _fault(index: int, kind: str, t: float, **detail) -> FaultRecord:
    return FaultRecord(index, kind, "step 1", "a", 1, t, t, t + 5, detail)


# -- recovery time and steps lost --------------------------------------------------------------

def test_recovery_is_the_first_step_after_the_interruption_and_steps_lost_what_was_redone():
    records = _records(resume_at=(45, 40))
    t_fault = records[44]["time"] + 0.05   # just after step 45
    assert inv.recovery_s(records, t_fault, float("inf")) == pytest.approx(3.05, abs=0.01)
    assert inv.steps_lost(records, t_fault, float("inf")) == 5
    assert inv.steps_lost(records, records[-1]["time"], float("inf")) == 0  # not in the window


def test_a_fault_the_job_never_noticed_costs_nothing_and_no_steps_at_all_is_none():
    records = _records()
    assert inv.recovery_s(records, records[10]["time"] + 0.01, float("inf")) == 0.0
    assert inv.recovery_s(records, records[-1]["time"] + 1, float("inf")) is None


def _paused(records: list[dict], after_step: int, pause_s: float) -> list[dict]:
    """``records`` with every step after ``after_step`` moved ``pause_s`` later."""
    return [r | {"time": r["time"] + pause_s} if r["step"] > after_step else r for r in records]


def test_a_pause_shorter_than_an_interruption_at_the_fault_is_its_recovery(tmp_path):
    """An in-place re-form stops the survivors for ~0.3 s: that is the recovery, not 0.0 s
    (the 1 s interruption threshold alone read it as "never stopped")."""
    records = _paused(_records(), 45, 0.3)       # steps every 0.1 s; step 46 0.4 s after 45
    t_fault = records[44]["time"] + 0.02          # just after step 45
    assert inv.recovery_s(records, t_fault, float("inf")) == pytest.approx(0.38, abs=0.005)
    (metrics,) = inv.fault_metrics(_result(tmp_path, records, [_fault(0, "node-kill", t_fault)]))
    assert metrics.recovery_s == 0.38
    assert "#0 node-kill 0.38 s/0 lost" in inv.check_recovery(
        _result(tmp_path, records, [_fault(0, "node-kill", t_fault)]), [metrics]).detail


def test_a_short_pause_seconds_after_the_fault_or_the_cadence_itself_is_not_a_recovery():
    records = _paused(_records(), 45, 0.3)        # the same 0.4 s gap, now 2 s after the fault
    t_fault = records[24]["time"] + 0.02
    assert inv.recovery_s(records, t_fault, float("inf")) == 0.0
    assert inv.recovery_s(_records(), records[10]["time"] + 0.01, float("inf")) == 0.0
    slow = [r | {"time": T0 + 0.5 * i} for i, r in enumerate(_records())]   # 0.5 s steps
    assert inv.recovery_s(slow, slow[10]["time"] + 0.01, float("inf")) == 0.0
    assert inv.short_pause_s([T0, T0 + 0.1, T0 + 0.2]) == pytest.approx(0.3)
    assert inv.short_pause_s([T0 + 0.01 * i for i in range(30)]) == inv.PAUSE_FLOOR_S
    assert inv.short_pause_s([T0]) == inv.STALL_S


def test_an_interruption_that_begins_long_after_the_fault_healed_is_not_its_recovery(tmp_path):
    records = _records(resume_at=(45, 40))        # a 3 s stop after step 45 (t = 4.4 s)
    t_fault = records[5]["time"]                  # a fault at step 6 that the job never noticed
    assert inv.recovery_s(records, t_fault, float("inf"), onset_by=t_fault + 2) == 0.0
    assert inv.recovery_s(records, t_fault, float("inf")) == pytest.approx(7.0, abs=0.01)
    fault = _fault(0, "etcd-quorum-loss", t_fault)   # healed 5 s later: the stop starts 3.9 s on
    (metrics,) = inv.fault_metrics(_result(tmp_path, records, [fault]))
    assert metrics.recovery_s == pytest.approx(7.0, abs=0.01)   # within ONSET_S of the heal
    later = _records(final=400, resume_at=(350, 345))   # the stop now starts 34.4 s after
    (metrics,) = inv.fault_metrics(_result(tmp_path, later, [_fault(0, "etcd-quorum-loss", t_fault)]))
    assert metrics.recovery_s == 0.0


def test_the_recovery_check_allows_no_lost_step_on_a_drain(tmp_path):
    records = _records(resume_at=(45, 40))
    t = records[44]["time"] + 0.05
    for kind, passes in (("node-kill", True), ("drain", False)):
        result = _result(tmp_path, records, [_fault(0, kind, t)])
        check = inv.check_recovery(result, inv.fault_metrics(result))
        assert check.passed is passes, check
        assert passes or check.fault == "#0 drain"


# -- the oracle and exactly-once: pass on a faithful run, fail on a tampered one ---------------

@pytest.mark.process
def test_the_oracle_passes_on_a_faithful_history(tmp_path):
    records = _records(resume_at=(45, 40))
    _save_final(tmp_path / "ckpt", records)
    checks, _ = inv.check_all(_result(tmp_path, records, [_fault(0, "node-kill", records[44]["time"])]))
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]


def test_a_ghost_step_of_a_cut_off_rank0_is_not_the_jobs_history(tmp_path):
    """A frozen rank 0 wakes and completes step 31 in its old world (3) after the
    survivors' new generation completed step 31 at 2: its record is later in time but
    not the job's; the oracle and exactly-once hold, no-stale-commit names the ghost
    (found on keyed rounds: the ghost made the replay use world 3 for its step)."""
    records = _records()
    for r in records:
        r["generation"] = {"round": 1, "seq": 0 if r["step"] <= 30 else 1, "epoch": "e"}
    _save_final(tmp_path / "ckpt", records)
    ghost = {**records[30], "world_size": 3, "lr": _lr(30), "time": records[30]["time"] + 0.05,
             "generation": {"round": 1, "seq": 0, "epoch": "e"}}
    records.insert(31, ghost)
    checks, _ = inv.check_all(_result(tmp_path, records, [_fault(0, "node-stop", records[29]["time"])]))
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    (stale,) = [c for c in checks if c.name == "no-stale-commit"]
    assert "1 ghost step(s)" in stale.detail and "step 31 in generation 1.0" in stale.detail


@pytest.mark.parametrize("tamper", ["world", "lr"])
def test_the_oracle_bites_on_a_history_the_run_did_not_follow(tmp_path, tamper):
    """One step logged with a world size it did not have (its samples: a third more, used
    again the next step) or an LR off by one part in a million: the replay no longer matches."""
    records = _records()
    _save_final(tmp_path / "ckpt", records)
    fault_t = records[39]["time"]
    if tamper == "world":
        records[44]["world_size"] = 3
    else:
        records[44]["lr"] *= 1.0 + 1e-6
    result = _result(tmp_path, records, [_fault(0, "node-kill", fault_t)])
    oracle, once = inv.check_oracle(result, lineage(inv.rank0_records(result.progress)))
    assert not oracle.passed and not once.passed, (oracle, once)
    assert "relative difference" in oracle.detail and oracle.fault == "#0 node-kill"
    if tamper == "world":  # the step's loss was over other samples: named at that step
        assert "the logged loss leaves the replay's at step 45" in oracle.detail, oracle


def test_the_sampler_check_bites_on_a_saved_cursor_the_replay_did_not_reach(tmp_path):
    records = _records()
    hist = {s: (r["world_size"], r["lr"]) for s, r in lineage(records).items()}
    done = replay_run(RUN, hist)
    with CheckpointManager(tmp_path / "ckpt", keep_last=3, world_size=2) as mgr:
        mgr.save(FINAL, {"model": done.params, "sampler": {"epoch": done.epoch, "cursor": done.cursor + 2}})
    oracle, once = inv.check_oracle(_result(tmp_path, records), lineage(records))
    assert oracle.passed and not once.passed


def test_a_missing_step_is_named_with_the_fault_before_it(tmp_path):
    records = [r for r in _records() if r["step"] != 33]
    result = _result(tmp_path, records, [_fault(0, "node-stop", records[20]["time"])])
    check = inv.check_contiguous(result, lineage(records))
    assert not check.passed and "first [33]" in check.detail and check.fault == "#0 node-stop"


# -- checkpoints: the corruption injector, verification, and the weakened reader --------------

def _three_checkpoints(ckpt) -> None:
    with CheckpointManager(ckpt, keep_last=3, world_size=1) as mgr:
        for step in (20, 40, 60):
            mgr.save(step, {"model": {"w": replay_run(RUN, {1: (1, 0.1)}).params["0.weight"] + step}})


def test_the_corruption_injector_damages_the_newest_committed_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    _three_checkpoints(ckpt)
    target = Target({}, None, ckpt)
    detail = corrupt_newest(target)
    assert detail["step"] == 60 and list(target.corrupted.values()) == [60]
    assert newest_committed(ckpt)[0] == 60          # the manifest still claims it
    assert CheckpointManager(ckpt, read_only=True).load_latest().step == 40  # verification skips it


def _resume_after_damage(tmp_path, monkeypatch, weakened: bool) -> RunResult:
    """The resume a restarted rank 0 makes after the injector damaged step 60, with the
    reader's verification on, or off (``weakened``: the system under test is broken)."""
    ckpt = tmp_path / "ckpt"
    _three_checkpoints(ckpt)
    target = Target({}, None, ckpt)
    t_damage = time.time()
    detail = corrupt_newest(target)
    if weakened:
        monkeypatch.setattr(reader, "verify_files", lambda *a, **k: None)
    loaded = CheckpointManager(ckpt, read_only=True).load_latest()
    records = [*_records(),
               {"event": "resumed", "step": loaded.step, "rank": 0, "world_size": 2, "lr": 0.1,
                "time": t_damage + 1}]
    fault = FaultRecord(0, "checkpoint-corrupt", "step 50", "a", 60, t_damage, t_damage, t_damage + 5,
                        detail)
    return _result(tmp_path, records, [fault], target.corrupted)


def test_no_corrupt_load_passes_when_the_reader_verifies(tmp_path, monkeypatch):
    check = inv.check_corrupt_loads(_resume_after_damage(tmp_path, monkeypatch, weakened=False))
    assert check.passed, check


def test_no_corrupt_load_bites_when_verification_is_switched_off(tmp_path, monkeypatch):
    check = inv.check_corrupt_loads(_resume_after_damage(tmp_path, monkeypatch, weakened=True))
    assert not check.passed and "resumed from damaged step 60" in check.detail, check
    assert check.fault == "#0 checkpoint-corrupt"


def test_intact_checkpoints_exempt_only_what_the_run_damaged_itself(tmp_path):
    ckpt = tmp_path / "ckpt"
    _three_checkpoints(ckpt)
    records = _records()
    own = Target({}, None, ckpt)
    corrupt_newest(own)
    assert inv.check_checkpoints(_result(tmp_path, records, corrupted=own.corrupted)).passed
    # The same damage, not made by the run: a checkpoint the system itself broke.
    check = inv.check_checkpoints(_result(tmp_path, records))
    assert not check.passed and "xxh3_128 mismatch" in check.detail


def test_a_leftover_process_and_a_failed_exit_fail_their_checks(tmp_path):
    records = _records()
    result = _result(tmp_path, records)
    result.leftover.append("123:python worker")
    result.exit_codes["b"] = 1
    assert not inv.check_processes(result).passed
    assert not inv.check_completed(result).passed


def test_intact_checkpoints_bite_on_a_commit_before_its_data_was_whole(tmp_path):
    """A writer weakened to commit (manifest) before its data is durable, killed mid-write:
    the committed checkpoint is truncated, and the check names it."""
    ckpt = tmp_path / "ckpt"
    _three_checkpoints(ckpt)
    step, data = newest_committed(ckpt)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    check = inv.check_checkpoints(_result(tmp_path, _records()))
    assert not check.passed and f"{step}: truncated" in check.detail, check


def test_the_loss_check_names_the_first_step_whose_logged_loss_is_not_the_replays():
    history = {s: {"loss_step": s - 1, "loss": 1.0 / s if s != 7 else 1.0 / 6} for s in range(2, 12)}
    replayed = {s: 1.0 / (s + 1) for s in range(1, 12)}
    assert inv.first_loss_divergence(history, replayed) == 6
    assert inv.first_loss_divergence({s: r for s, r in history.items() if s != 7}, replayed) is None


# -- etcd faults: no lost step, and the daemons' etcd outages bounded ----------------------------

@pytest.mark.parametrize("kind", ["etcd-leader-kill", "etcd-quorum-loss", "etcd-restart",
                                  "checkpoint-dir-full"])
def test_an_etcd_fault_or_a_full_disk_may_cost_no_step(tmp_path, kind):
    """Workers never wait on etcd, and a full checkpoint disk only skips saves: a restart
    after one (a system that stopped training for it, and resumed from the last checkpoint:
    seen for the full disk before the trainer's fix, 39 steps) fails the recovery check."""
    records = _records(resume_at=(45, 40))
    result = _result(tmp_path, records, [_fault(0, kind, records[44]["time"] + 0.05)])
    check = inv.check_recovery(result, inv.fault_metrics(result))
    assert not check.passed and check.fault == f"#0 {kind}" and "5 steps lost (at most 0)" in check.detail


def _etcd_log(*lines: tuple[str, float]) -> list[dict]:
    """A daemon's etcd log lines: (event, time)."""
    return [{"event": event, "timestamp": datetime.fromtimestamp(t, UTC).isoformat()} for event, t in lines]


DOWN = "etcd unreachable; membership frozen, training continues"
UP = "etcd reachable again; membership view re-listed"
FAILED = "etcd call failed; a later cycle retries"


@pytest.mark.parametrize(("kind", "lines", "passes"), [
    ("etcd-leader-kill", [(FAILED, 2.0)], True),          # one call failed over the election
    ("etcd-leader-kill", [(DOWN, 0.5), (UP, 2.0)], True),
    # Weakened: daemons given only the killed leader's endpoint are cut off until it is
    # restarted (the heal, 5 s on): the leader change is no longer a short pause.
    ("etcd-leader-kill", [(DOWN, 0.5), (FAILED, 3.0), (UP, 6.5)], False),
    ("etcd-quorum-loss", [(DOWN, 0.5), (UP, 12.0)], True),    # back 7 s after the heal (at 5 s)
    ("etcd-quorum-loss", [(DOWN, 0.5), (UP, 12.0), (FAILED, 25.0)], False),   # failing 20 s after it
    ("etcd-quorum-loss", [(DOWN, 0.5)], False),               # never back
    ("etcd-quorum-loss", [(DOWN, 0.5), ("etcd reachable again; lease kept alive", 6.0)], False),
])
def test_the_etcd_outage_check_bites_on_a_long_or_endless_outage(tmp_path, kind, lines, passes):
    records = _records(400)   # 40 s of steps: every line above falls inside the run
    t = records[10]["time"]
    fault = FaultRecord(0, kind, "step 10", None, 10, t, t + 5, t + 20, {})
    result = _result(tmp_path, records, [fault], final=400)
    result.daemon_events = {"a": _etcd_log(*((e, t + dt) for e, dt in lines)), "b": []}
    check = inv.check_etcd_outages(result)
    assert check.passed is passes, check
    assert passes or check.fault == f"#0 {kind}"
    never_back = lines[-1][0] != UP and lines[-1][0] != FAILED
    want = (result.t_end - t) if never_back else lines[-1][1]
    assert inv.fault_metrics(result)[0].etcd_outage_s == pytest.approx(want, abs=0.01)


def test_an_outage_before_the_fault_is_not_its_own(tmp_path):
    records = _records()
    t = records[30]["time"]
    result = _result(tmp_path, records, [_fault(0, "etcd-leader-kill", t)])
    result.daemon_events = {"a": _etcd_log((DOWN, t - 20), (UP, t - 1), (FAILED, t - 0.5))}
    assert inv.check_etcd_outages(result).passed
    assert inv.fault_metrics(result)[0].etcd_outage_s == 0.0


@pytest.mark.parametrize(("drained_s", "code", "passes"),
                         [(12.5, 0, True), (None, None, False), (9.0, 1, False)])
def test_a_preempted_node_must_drain_cleanly_within_its_deadline(tmp_path, drained_s, code, passes):
    """Weakened: a daemon that ignores the notice is taken at the deadline (drained_s None),
    one that stops hard exits 1: the recovery check names the fault."""
    records = _records()
    fault = _fault(0, "preemption-notice", records[20]["time"], deadline_s=30.0, drained_s=drained_s,
                   drain_exit_code=code)
    result = _result(tmp_path, records, [fault])
    check = inv.check_recovery(result, inv.fault_metrics(result))
    assert check.passed is passes, check
    assert passes or (check.fault == "#0 preemption-notice" and "deadline" in check.detail)


# -- liveness ---------------------------------------------------------------------------------

def _stalled(records: list[dict], after_step: int, stall_s: float) -> list[dict]:
    """``records`` with no step for ``stall_s`` after ``after_step`` (later ones shifted)."""
    return [r | {"time": r["time"] + stall_s} if r["step"] > after_step else r for r in records]


def test_liveness_passes_a_recovery_within_the_bound_and_names_the_longest_pause(tmp_path):
    records = _stalled(_records(), 30, 8.0)
    fault = FaultRecord(1, "node-kill", "step 30", "b", 30, T0 + 3.0, T0 + 13.0, T0 + 15.0)
    check = inv.check_liveness(_result(tmp_path, records, [fault]), lease_ttl_s=5)
    assert check.passed, check.detail
    assert "longest pause 8.1 s" in check.detail and "#1 node-kill" in check.detail


def test_liveness_bites_on_a_stall_while_two_nodes_stayed_in_the_job(tmp_path):
    records = _stalled(_records(), 30, 60.0)
    fault = FaultRecord(1, "node-freeze", "step 30", "b", 30, T0 + 3.0, T0 + 70.0, None)
    check = inv.check_liveness(_result(tmp_path, records, [fault]), lease_ttl_s=5)
    assert not check.passed and check.fault == "#1 node-freeze"
    assert "while a, c had been in the job for over 20 s" in check.detail


def test_liveness_owes_nothing_while_etcd_is_down(tmp_path):
    records = _stalled(_records(), 30, 60.0)
    outage = FaultRecord(1, "etcd-quorum-loss", "step 30", None, 30, T0 + 3.0, T0 + 50.0, None)
    assert inv.check_liveness(_result(tmp_path, records, [outage]), lease_ttl_s=5).passed


# -- overlapping faults: each judged over what it overlaps -------------------------------------

def test_an_etcd_outage_overlapped_by_another_fault_before_its_heal_still_ends(tmp_path):
    """Seed 43's overlap run: a worker-kill fired 2.4 s into an etcd restart, before its
    heal; the outage ended after the heal, but the window stopped at the worker-kill and
    every daemon's outage read as endless. Weakened (never back) it still fails."""
    records = _records(400)
    t = records[10]["time"]
    restart = FaultRecord(0, "etcd-restart", "step 10", None, 10, t, t + 3, t + 8, {})
    kill = FaultRecord(1, "worker-kill", "step 30", "b", 30, t + 2.4, t + 2.4, t + 8,
                       {"overlap": {"phase": "inject"}})
    result = _result(tmp_path, records, [restart, kill], final=400)
    result.daemon_events = {"a": _etcd_log((DOWN, t + 0.2), (UP, t + 4.0))}
    assert inv.check_etcd_outages(result).passed, inv.check_etcd_outages(result)
    assert inv.fault_metrics(result)[0].etcd_outage_s == pytest.approx(4.0, abs=0.01)
    result.daemon_events = {"a": _etcd_log((DOWN, t + 0.2))}
    check = inv.check_etcd_outages(result)
    assert not check.passed and "a's etcd outage never ended" in check.detail


@pytest.mark.parametrize(("overlaps", "passes"), [(True, True), (False, False)])
def test_a_fault_fired_inside_anothers_recovery_may_cost_what_the_first_may(tmp_path, overlaps, passes):
    """Seed 43: a checkpoint corruption killed a worker (a rollback of 20 steps is its
    right) and an etcd-leader-kill fired 0.4 s later, inside its recovery; the rollback
    landed in the leader kill's window. Overlapping, the burst's limit holds; the same
    loss after an etcd fault that overlaps nothing still fails."""
    records = _records(resume_at=(45, 40))
    t = records[44]["time"]
    corrupt = _fault(0, "checkpoint-corrupt", t - 0.4)
    leader = _fault(1, "etcd-leader-kill", t + 0.05, **({"overlap": {"phase": "inject"}} if overlaps else {}))
    result = _result(tmp_path, records, [corrupt, leader])
    assert inv.loss_limits(result) == {0: 40, 1: 40 if overlaps else 0}
    check = inv.check_recovery(result, inv.fault_metrics(result))
    assert check.passed is passes, check

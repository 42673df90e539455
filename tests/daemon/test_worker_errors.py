"""The workers' last error from the agent log, read as it grows (elasticd.worker_errors)."""

from __future__ import annotations

from elasticd.worker_errors import MAX_CHARS, LastError, exception_lines

# What agent.log holds when a worker cannot start (measured: torchrun 2.13, the NCCL
# backend on a CPU machine): the worker's traceback, then torchrun's own.
WORKER_FAILED = """\
/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py:1849: UserWarning: ...
Traceback (most recent call last):
  File "/job/bad.py", line 2, in <module>
    dist.init_process_group("nccl")
RuntimeError: Distributed package doesn't have NCCL built in
E1204 01:40:43.683000 6494 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1)
Traceback (most recent call last):
  File "/venv/bin/torchrun", line 8, in <module>
    sys.exit(main())
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
bad.py FAILED
"""


def test_the_workers_exception_is_the_cause_and_torchruns_wrappers_are_not():
    assert exception_lines(WORKER_FAILED) == ["RuntimeError: Distributed package doesn't have NCCL built in"]
    killed = ("Traceback (most recent call last):\n  File \"x\", line 1\n"
              "torch.distributed.elastic.multiprocessing.api.SignalException: Process 1 got signal: 15\n")
    assert exception_lines(killed) == []
    assert exception_lines("Traceback (most recent call last):\n  File \"x\"\nKeyError\n") == ["KeyError"]


def test_the_log_is_followed_as_it_grows_a_half_written_traceback_waits_and_forget_resets(tmp_path):
    log = tmp_path / "agent.log"
    errors = LastError(log)
    assert errors.update() is None                       # no file yet
    log.write_text("step 1\nTraceback (most recent call last):\n  File \"t.py\", line 3\n")
    assert errors.update() is None                       # its exception line is not written yet
    with log.open("a") as f:
        f.write("ValueError: checkpoint dir /ck cannot be creat")
    assert errors.update() is None                       # nor complete
    with log.open("a") as f:
        f.write("ed\nstep 2\n")
    assert errors.update() == "ValueError: checkpoint dir /ck cannot be created"
    errors.forget()
    assert errors.update() is None                       # nothing new since
    log.replace(tmp_path / "agent.log.1")                # rotated, as agent.rotate_log does
    log.write_text("Traceback (most recent call last):\n  File \"t\"\nOSError: " + "x" * 500 + "\n")
    got = errors.update()
    assert got.startswith("OSError: xxx") and len(got) == MAX_CHARS and got.endswith("...")

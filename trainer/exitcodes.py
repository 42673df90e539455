"""Worker exit codes, torch-free (``import trainer`` stays cheap).

The daemon neither imports this module nor sees the codes (they go to torchrun's agent):
it reads the event each worker writes to its progress file before it exits, and the
agent's own exit code (docs/trainer.md, "Exit codes").

* ``COMPLETE_EXIT_CODE`` (0): training complete (max steps / epochs reached, final
  checkpoint committed); the daemon records the job as completed.
* ``STOP_EXIT_CODE`` (75, EX_TEMPFAIL): coordinated stop (SIGTERM, SIGINT or the stop
  file) after rank 0 committed a checkpoint of the agreed step; resume later.
* ``FAILURE_EXIT_CODE`` (1): a peer or collective failed; restart from the newest
  checkpoint (rank 0 tries to commit the last completed step on the way out).
* ``DIVERGED_EXIT_CODE`` (65, EX_DATAERR): the agreed loss was non-finite
  ``nonfinite_loss_limit`` times in a row on every node at once (or on samples that
  already made another node's loss non-finite); nothing of the diverged state is committed
  and the daemon marks the node failed instead of restarting (a restart from the last
  checkpoint would diverge again).
* ``UNFIT_EXIT_CODE`` (78, EX_CONFIG): this node's workers cannot resume the job (its
  checkpoint directory lacks the job's newest commit: ``trainer.fitness``; or its loss
  went non-finite a step before every other node's: ``trainer.nonfinite``); the daemon
  leaves the job instead of restarting (the other nodes go on without it).
* ``ORPHAN_EXIT_CODE`` (70): the orphan watchdog ended a worker whose torchrun agent
  or daemon died.
"""

import contextlib
import os
import sys
from typing import NoReturn

COMPLETE_EXIT_CODE = 0
STOP_EXIT_CODE = 75
FAILURE_EXIT_CODE = 1
ORPHAN_EXIT_CODE = 70
DIVERGED_EXIT_CODE = 65
UNFIT_EXIT_CODE = 78


def exit_worker(code: int) -> NoReturn:
    """Flush stdout/stderr and end the process with ``code`` at once.

    Skips interpreter teardown on purpose: after a peer died, torch's process-group
    and DDP destructors can block forever while holding the GIL (measured with gloo),
    which would leave the worker alive with its exit code unsaid. Call it only after
    ``ElasticTrainer.run()`` returned: checkpoints are committed by then.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stream
            stream.flush()
    os._exit(code)

"""trainer/examples/mlp.py on a loaded machine: every worker started after the marker
``SLOW_START_MARKER`` exists sleeps ``SLOW_START_S`` seconds before anything else (an
import of torch and a group init that take this long under CI's load)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from trainer.examples.mlp import main

if __name__ == "__main__":
    if Path(os.environ["SLOW_START_MARKER"]).exists():
        time.sleep(float(os.environ.get("SLOW_START_S", "4")))
    raise SystemExit(main())

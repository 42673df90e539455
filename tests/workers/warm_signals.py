"""Worker for the warm-start signal tests: how it meets a SIGTERM.

``sleep``: idles 60 s without a handler (a SIGTERM must kill it, exit -15);
``spin``: burns CPU 60 s without a handler (the same);
``handler``: installs its own SIGTERM handler first thing, says ``installed``, idles;
the handler says ``got SIGTERM`` and exits 75.
"""

import os
import signal
import sys
import time


def _on_term(*_: object) -> None:
    # os.write: a print in the handler could re-enter a print that is still flushing.
    os.write(1, b"got SIGTERM\n")
    sys.exit(75)


def main() -> None:
    mode = sys.argv[1]
    if mode == "handler":
        signal.signal(signal.SIGTERM, _on_term)
        os.write(1, b"installed\n")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if mode == "spin":
            sum(range(10_000))
        else:
            time.sleep(1)
    sys.exit(3)  # no signal came: the test fails on this code


if __name__ == "__main__":
    main()

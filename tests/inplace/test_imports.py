"""The in-place protocol and the plugin load without the daemon's modules: the plugin runs
inside torchrun's agent, and the daemon's imports there caused two import-order bugs
(eb5f79f, 2c21aaa)."""

from __future__ import annotations

import subprocess
import sys

DAEMON_MODULES = ("elasticd.supervisor", "elasticd.daemon", "elasticd.agent", "elasticd.config")


def test_the_protocol_and_the_plugin_import_no_daemon_module():
    code = ("import sys, elasticd.inplace.loss, elasticd.inplace.agreement, "
            "elasticd.inplace.handover, elasticd.inplace.store, elasticd.contract.progress, "
            "elasticd.rendezvous.companion, elasticd.rendezvous.handler; "
            f"print([m for m in {DAEMON_MODULES!r} if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr

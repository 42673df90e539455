"""The etcd v3 rendezvous plugin for torchrun (``--rdzv-backend=etcd3``).

Registered on the ``torchrun.handlers`` entry-point group. torchrun loads the
entry point while it is still importing its own registry, so this module
imports nothing heavy: the handler module is loaded on first use.
"""

from collections.abc import Callable
from typing import Any

BACKEND_NAME = "etcd3"


def handler_factory() -> Callable[[Any], Any]:
    """Entry point: a zero-argument function returning the handler factory."""
    from elasticd.rendezvous.handler import create_handler

    return create_handler

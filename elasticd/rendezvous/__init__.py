"""The etcd v3 rendezvous plugin for torchrun (``--rdzv-backend=etcd3``).

Registered on the ``torchrun.handlers`` entry-point group. torchrun loads the
entry point while it is still importing its own registry, so this module
imports nothing heavy: the handler module is loaded on first use.
"""

from collections.abc import Callable
from typing import Any

BACKEND_NAME = "etcd3"


def handler_factory() -> Callable[[Any], Any]:
    """Entry point: a zero-argument function returning the handler factory.

    The handler module is imported when a handler is created, not here: importing it
    first imports torch's rendezvous registry, which calls this entry point while the
    handler module is half-initialised (an ImportError traceback in the log otherwise).
    """

    def create_handler(params: Any) -> Any:
        from elasticd.rendezvous import handler

        return handler.create_handler(params)

    return create_handler

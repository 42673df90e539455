"""Test-only fault points: the crash tests set `phase_hook` to pause or mark phases of a save.

In production `phase_hook` is None and `phase()` costs one global lookup.
"""

from __future__ import annotations

from collections.abc import Callable

phase_hook: Callable[[str, str], None] | None = None


def phase(name: str, path: str = "") -> None:
    """Report that a save reached phase `name` (acting on `path`) to the installed hook, if any."""
    hook = phase_hook
    if hook is not None:
        hook(name, path)

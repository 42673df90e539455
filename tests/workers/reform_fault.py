"""The MLP example with a fault injected into the in-place re-form: joining the next
generation's group always fails, by either mechanism (trainer.reform), so every re-form
takes the fallback (exit, restart)."""

from __future__ import annotations

from trainer import inplace, reform
from trainer.examples import mlp
from trainer.exitcodes import exit_worker


def _broken_join(*args, **kwargs) -> None:
    raise inplace.ReformError("fault injected: the new group will not form")


if __name__ == "__main__":
    reform.DestroyInit.join = _broken_join  # type: ignore[method-assign]
    reform.Reconfigure.join = _broken_join  # type: ignore[method-assign]
    exit_worker(mlp.main())

"""Where checkpoints live: a directory path, or a bucket URL (``s3://bucket/prefix``,
``gs://bucket/prefix``: ``checkpointing.object_storage``). One rule for the config, the
doctor, the daemon and the checkpoint manager; torch-free (``elasticd.config`` imports it)."""

from __future__ import annotations

import os


def is_url(location: str | os.PathLike[str]) -> bool:
    """A location with a scheme other than ``file`` (object storage), not a path."""
    text = os.fspath(location)
    return "://" in text and not text.startswith("file://")

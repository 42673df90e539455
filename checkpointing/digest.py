"""The checksums that verify a checkpoint's data files: which algorithms, and their form.

A manifest names each file's algorithm by the key its hex digest is stored under
(``{"bytes": N, "xxh3_128": "..."}``). The writer uses ``WRITE_ALGORITHM``; the reader
verifies any algorithm listed here, so checkpoints written by earlier versions (sha256)
stay loadable.

Why xxh3_128 and not sha256: the digest detects damage (a torn, truncated or bit-flipped
file), not tampering: the manifest is unkeyed, so whoever can rewrite a data file can
rewrite its manifest too, whichever hash it names. For that job a 128-bit
non-cryptographic hash is as good, and the background writer's hash is CPU taken from
training: sha256 ran at 1.34 GB/s here, xxh3_128 at 9.1 GB/s (one core of this 2-core
AMD EPYC, 256 MiB buffers; benchmarks/results/checkpoint_stall.md has what it does to
the stall). The manifest's own checksum stays sha256: it covers a few hundred bytes.
"""

from __future__ import annotations

import hashlib
import re
from typing import Protocol

import xxhash


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


_FORMS = {"xxh3_128": re.compile(r"[0-9a-f]{32}"), "sha256": re.compile(r"[0-9a-f]{64}")}
ALGORITHMS = tuple(_FORMS)
WRITE_ALGORITHM = "xxh3_128"


def new(algorithm: str = WRITE_ALGORITHM) -> Hasher:
    """A fresh hasher of ``algorithm`` (one of ``ALGORITHMS``)."""
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checkpoint digest {algorithm!r}; known: {', '.join(ALGORITHMS)}")


def is_well_formed(algorithm: str, hexdigest: object) -> bool:
    """True if ``hexdigest`` is a lower-case hex digest of ``algorithm``'s length."""
    form = _FORMS.get(algorithm)
    return form is not None and isinstance(hexdigest, str) and form.fullmatch(hexdigest) is not None

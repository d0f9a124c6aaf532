"""A core's private directory outlives no core: the next one to start removes those whose
owner died (here, a process that exits without removing its own), and no other."""

import os
import subprocess
import sys
import tempfile

from coordinator.run_dir import LOCK, RunDir, sweep


def test_a_sweep_removes_the_directories_of_dead_cores_only(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run(
        [sys.executable, "-c", "from coordinator.run_dir import RunDir; print(RunDir().path)"],
        env=dict(os.environ, TMPDIR=str(tmp_path)), capture_output=True, text=True, check=True)
    dead_dir = tmp_path / dead.stdout.strip()
    unlocked = tmp_path / "siding-not-a-run-dir"
    unlocked.mkdir()
    assert (dead_dir / LOCK).exists()
    live = RunDir()  # a core sweeps as it starts
    assert not dead_dir.exists() and unlocked.exists()
    sweep()
    assert (live.path / LOCK).exists()
    live.remove()
    assert not live.path.exists()

"""experiments/quality/run.py: the launcher's memory gate and out-of-memory retry (no GPU needed)."""

import pytest


@pytest.fixture(scope="module")
def launcher(repo_script):
    return repo_script("experiments/quality/run.py")


def test_a_job_starts_only_with_room_for_it_and_the_jobs_still_ramping_up(launcher, monkeypatch):
    monkeypatch.setattr(launcher, "gpu_free_gib", lambda: 50.0)
    assert launcher.room_for_one(24, young=0) and launcher.room_for_one(24, young=1)
    assert not launcher.room_for_one(24, young=2)  # 50 GiB free is not 3 x 24: two starts still ramping up
    assert launcher.room_for_one(0, young=9)  # the gate is off
    monkeypatch.setattr(launcher, "gpu_free_gib", lambda: None)
    assert launcher.room_for_one(24, young=5)  # no nvidia-smi: no gate


def test_out_of_memory_is_read_from_the_log_tail(launcher, tmp_path):
    log = tmp_path / "job.log"
    log.write_bytes(b"x" * 50_000 + b"\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.07 GiB\n")
    assert launcher.out_of_memory(log)
    log.write_bytes(b"torch.OutOfMemoryError: CUDA out of memory\n" + b"y" * 50_000)  # long before the end
    assert not launcher.out_of_memory(log)
    assert not launcher.out_of_memory(tmp_path / "missing.log")

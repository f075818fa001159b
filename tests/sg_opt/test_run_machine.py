"""A run resumed on another machine: refused in one sentence unless asked for, and then said in its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sg_opt import run_machine
from sg_opt.cli import app
from sg_opt.run_machine import HostInfo, Machine, MachineRecord
from targets.protocol import ConfigError
from tests.fixtures.quick_measurement import quick_measurement

ROOT = Path(__file__).resolve().parents[2]
AGENT_TARGET = "tests.fixtures.agent_target:target"


def optimize(*args: str, out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sg_opt.cli", "optimize", "--out", str(out), "--threads", "1", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def elsewhere(run_dir: Path, **host) -> None:
    """Make the run's record say it measured on a machine like this one but for ``host``'s fields."""
    record = run_machine.read(run_dir)
    record.started_on.host = record.started_on.host.model_copy(update=host)
    (run_dir / run_machine.MACHINE_FILE).write_text(record.model_dump_json())


def test_each_difference_is_named_and_the_same_machine_is_none():
    here = Machine(host=HostInfo(cpu_model="AMD EPYC", cpu_count=16), gpus=["NVIDIA H200"])
    assert run_machine.difference(here, here.model_copy()) is None
    assert "NVIDIA H200" in run_machine.difference(here, here.model_copy(update={"gpus": ["NVIDIA H100 80GB HBM3"]}))
    assert "16 CPUs" in run_machine.difference(here, here.model_copy(update={"host": HostInfo(cpu_model="AMD EPYC",
                                                                                              cpu_count=2)}))
    assert "Xeon" in run_machine.difference(here, here.model_copy(update={"host": HostInfo(cpu_model="Xeon",
                                                                                           cpu_count=16)}))


def test_gpu_models_are_read_from_nvidia_smi_in_the_visible_order(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0, NVIDIA H100 80GB HBM3\\n1, NVIDIA H200\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert run_machine.gpu_models() == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert run_machine.gpu_models() == ["NVIDIA H200"]
    assert run_machine.this_machine("cpu").gpus == []  # a CPU run does not depend on the GPUs beside it


def test_a_resume_elsewhere_raises_and_an_allowed_one_is_recorded(tmp_path):
    run_machine.record_start(tmp_path, "cpu")
    run_machine.check_resume(tmp_path, "cpu", 3, allow_move=False)  # the same machine: nothing to say
    assert run_machine.read(tmp_path).moves == [] and run_machine.move_notes(tmp_path) == []
    elsewhere(tmp_path, cpu_model="Some Other CPU")
    with pytest.raises(ConfigError, match="Some Other CPU.*--on-another-machine"):
        run_machine.check_resume(tmp_path, "cpu", 3, allow_move=False)
    assert run_machine.read(tmp_path).moves == []  # a refusal changes nothing
    run_machine.check_resume(tmp_path, "cpu", 3, allow_move=True)
    record = run_machine.read(tmp_path)
    assert [m.evaluated for m in record.moves] == [3] and record.latest() == run_machine.this_machine("cpu")
    run_machine.check_resume(tmp_path, "cpu", 5, allow_move=False)  # it now measures here: no second move
    (note,) = run_machine.move_notes(tmp_path)
    assert "after 3 candidates" in note and "Some Other CPU" in note


def test_a_run_from_before_the_record_gets_one_at_its_next_resume(tmp_path):
    run_machine.check_resume(tmp_path, "cpu", 0, allow_move=False)
    assert isinstance(run_machine.read(tmp_path), MachineRecord)


def test_a_run_from_before_the_record_is_known_by_its_baselines_gpu(tmp_path, monkeypatch):
    """An H200 run made before machine records, resumed on an H100: refused, or recorded as a move with
    --on-another-machine; on the same GPU model it gets a record as any other."""
    h100 = Machine(host=HostInfo(cpu_model="Xeon", cpu_count=16), gpus=["NVIDIA H100 80GB HBM3"])
    monkeypatch.setattr(run_machine, "this_machine", lambda device: h100)
    h200_baseline = {"device": "cuda", "device_name": "NVIDIA H200", "threads": 16}
    with pytest.raises(ConfigError, match="NVIDIA H200.*--on-another-machine"):
        run_machine.check_resume(tmp_path, "cuda", 35, False, h200_baseline)
    assert run_machine.read(tmp_path) is None  # a refusal writes nothing
    run_machine.check_resume(tmp_path, "cuda", 35, True, h200_baseline)
    record = run_machine.read(tmp_path)
    assert record.started_on == Machine(host=None, gpus=["NVIDIA H200"]) and record.latest() == h100
    (note,) = run_machine.move_notes(tmp_path)
    assert "after 35 candidates" in note and "NVIDIA H200 (its CPU not recorded)" in note
    same = tmp_path / "same"
    same.mkdir()
    run_machine.check_resume(same, "cuda", 35, False, {**h200_baseline, "device_name": "NVIDIA H100 80GB HBM3"})
    assert run_machine.read(same) == MachineRecord(started_on=h100)
    cpu = tmp_path / "cpu"
    cpu.mkdir()
    run_machine.check_resume(cpu, "cuda", 3, False, {"device": "cpu", "device_name": "cpu"})  # names no GPU
    assert run_machine.read(cpu).started_on == h100


@pytest.mark.slow
def test_optimize_refuses_a_resume_on_another_machine_and_reports_an_allowed_one(tmp_path):
    """The console command as a user runs it: a run paused at a checkpoint, its record altered to another CPU;
    the resume exits 2 in one sentence and leaves the run as it was; with --on-another-machine it goes on, and
    its report and summary say where each part was measured."""
    args = ("--target", AGENT_TARGET, "--size", "tiny", "--max-iters", "1", *quick_measurement())
    first = optimize(*args, "--pause-after", "0", out=tmp_path)
    assert first.returncode == 3, first.stderr
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    elsewhere(run_dir, cpu_model="Some Other CPU")
    before = sorted(p.name for p in run_dir.iterdir())

    refused = optimize("--resume", run_dir.name, out=tmp_path)
    assert refused.returncode == 2
    assert "another machine" in refused.stderr and "Traceback" not in refused.stderr
    assert refused.stderr.startswith("error:") and refused.stderr.count("error:") == 1  # one sentence, wrapped
    assert sorted(p.name for p in run_dir.iterdir()) == before

    moved = optimize("--resume", run_dir.name, "--on-another-machine", "--pause-after", "0", out=tmp_path)
    assert moved.returncode == 3, moved.stderr  # it went on here: one more node, then paused again
    report = subprocess.run([sys.executable, "-m", "sg_opt.cli", "report", str(run_dir), "--json"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    notes = json.loads(report.stdout)["notes"]
    assert any("resumed on another machine" in n and "Some Other CPU" in n for n in notes), notes
    assert "resumed on another machine" in (run_dir / "report.md").read_text()


def test_on_another_machine_without_resume_is_one_sentence(tmp_path):
    result = CliRunner().invoke(app, ["optimize", "--out", str(tmp_path), "--target", AGENT_TARGET, "--size", "tiny",
                                      "--on-another-machine"])
    assert result.exit_code == 2 and "--on-another-machine goes with --resume" in result.output
    assert not any(tmp_path.iterdir())


"""The machine a run measures on, and a resume on another one.

Every figure of a run is a ratio of two measurements made on one machine, but a run carries figures across
resumes: its baseline's step time, its noise floor, its incumbent's measured ratios. Resumed on another machine (a
killed job rescheduled onto an H100 after starting on an H200, a CI job on another runner), the later candidates
would be judged against a floor measured elsewhere and the report would quote one speedup over two machines. So
a run records its machine when it is made (``MACHINE_FILE``), and ``sg-opt optimize --resume`` on a machine that
differs (CPU model or count; the GPU models, where the run is on a GPU) is refused in one sentence, unless the user
says ``--on-another-machine``. The move is then kept in the same file and every report of the run says so.

The GPU models are read with ``nvidia-smi``, not torch: the command's own process never initialises CUDA (its
timing workers are forked from it).
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from sg_opt.run_store import write_atomically
from targets.protocol import ConfigError

MACHINE_FILE = "machine.json"
SMI_TIMEOUT_S = 20.0


class HostInfo(BaseModel):
    cpu_model: str
    cpu_count: int


class Machine(BaseModel):
    host: HostInfo | None = Field(description="None: not known (a run from before these records, known by the GPU "
                                              "its baseline reported)")
    gpus: list[str] = Field(default_factory=list, description="the visible GPUs' models (device cuda only)")

    def describe(self) -> str:
        if self.host is None:
            return f"{', '.join(self.gpus)} (its CPU not recorded)" if self.gpus else "a machine not recorded"
        cpus = f"{self.host.cpu_count} x {self.host.cpu_model or 'an unnamed CPU'}"
        return f"{', '.join(self.gpus)} on {cpus}" if self.gpus else cpus


class Move(BaseModel):
    to: Machine
    at: str = Field(description="when it was resumed there, ISO 8601 local time")
    evaluated: int = Field(description="candidates evaluated before the move")


class MachineRecord(BaseModel):
    started_on: Machine
    moves: list[Move] = Field(default_factory=list)

    def latest(self) -> Machine:
        return self.moves[-1].to if self.moves else self.started_on


def host_info() -> HostInfo:
    """The CPU this process runs on: its model name (from /proc/cpuinfo where there is one) and count."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    return HostInfo(cpu_model=model or platform.processor() or platform.machine(), cpu_count=os.cpu_count() or 1)


def gpu_models() -> list[str]:
    """The models of the GPUs this process may use, as ``nvidia-smi`` names them (``CUDA_VISIBLE_DEVICES`` by
    index respected); empty where there is no nvidia-smi or it fails."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=SMI_TIMEOUT_S, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    names = {index.strip(): name.strip() for index, _, name in
             (line.partition(",") for line in out.strip().splitlines() if "," in line)}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and all(part.strip().isdigit() for part in visible.split(",") if part.strip()):
        return [names[i.strip()] for i in visible.split(",") if i.strip() in names]
    return list(names.values())


def this_machine(device: str) -> Machine:
    return Machine(host=host_info(), gpus=gpu_models() if device.startswith("cuda") else [])


def difference(was: Machine, now: Machine) -> str | None:
    """What makes ``now`` another machine than ``was``, in a phrase; None if it is the same kind of machine (as far
    as ``was`` is known)."""
    if was.gpus != now.gpus:
        return f"its GPUs were {', '.join(was.gpus) or 'none'} and are {', '.join(now.gpus) or 'none'} here"
    if was.host is None or now.host is None:
        return None
    if was.host.cpu_model != now.host.cpu_model:
        return f"its CPU was {was.host.cpu_model!r} and is {now.host.cpu_model!r} here"
    if was.host.cpu_count != now.host.cpu_count:
        return f"it had {was.host.cpu_count} CPUs and has {now.host.cpu_count} here"
    return None


def from_baseline(environment: dict | None) -> Machine | None:
    """What a run made before these records says of its machine: the GPU its baseline ran on (a CPU run's
    environment names no CPU model). None where it names none."""
    environment = environment or {}
    if environment.get("device", "cpu") == "cpu" or not environment.get("device_name"):
        return None
    return Machine(host=None, gpus=[environment["device_name"]])


def read(run_dir: Path) -> MachineRecord | None:
    """The run's record; None for a run made before runs kept one, or a torn file."""
    try:
        return MachineRecord.model_validate_json((run_dir / MACHINE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValidationError, ValueError):
        return None


def _write(run_dir: Path, record: MachineRecord) -> None:
    write_atomically(run_dir / MACHINE_FILE, record.model_dump_json(indent=1))


def record_start(run_dir: Path, device: str) -> None:
    _write(run_dir, MachineRecord(started_on=this_machine(device)))


def check_resume(run_dir: Path, device: str, evaluated: int, allow_move: bool,
                 baseline_environment: dict | None = None) -> None:
    """Before a resume: ConfigError (one sentence) if this machine is not the one the run last measured on and
    ``allow_move`` is off; with it on, the move is recorded. A run without a record is known by the GPU its
    baseline ran on (``from_baseline``: an H200 run of 2026-12-04 resumed on an H100 before this, unrefused), and
    gets a record from here on."""
    now, record = this_machine(device), read(run_dir)
    if record is None:
        was = from_baseline(baseline_environment)
        if was is None or not now.gpus or set(was.gpus) <= set(now.gpus):
            _write(run_dir, MachineRecord(started_on=now))
            return
        record = MachineRecord(started_on=was)
    what = difference(record.latest(), now)
    if what is None:
        return
    if not allow_move:
        raise ConfigError(f"run {run_dir.name} measured on another machine ({what}): its baseline, noise floor and "
                          f"accepted ratios were measured there; resume it on that machine, or pass "
                          f"--on-another-machine to go on here (its report will say so)")
    record.moves.append(Move(to=now, at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), evaluated=evaluated))
    _write(run_dir, record)


def move_notes(run_dir: Path) -> list[str]:
    """One sentence per machine the run moved to, for its report."""
    record = read(run_dir)
    if record is None:
        return []
    notes, was = [], record.started_on
    for move in record.moves:
        notes.append(f"resumed on another machine ({difference(was, move.to) or 'the same kind'}) at {move.at}, "
                     f"after {move.evaluated} candidates: measurements before then were made on {was.describe()}, "
                     f"those after on {move.to.describe()}; each ratio compares two sides timed on one machine, "
                     f"but the baseline's step time and the noise floors calibrated before then come from the earlier one")
        was = move.to
    return notes

"""From the state to worker requests: what the baseline, the incumbent and a candidate run as.

A configuration is a knob patch over the target's defaults plus a set of replacement kernel
sources. Workers read kernels from a directory of ``<slot>.py`` files, so each distinct set is
materialised once under ``kernel_sets/<digest>/`` in the run directory; the digest also identifies a
configuration for duplicate detection.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from pathlib import Path
from typing import Any, Mapping

from state_machine.state import Candidate, RunState, loosest
from targets.protocol import KnobSpace
from targets.worker_protocol import Mode, WorkerRequest
from validators.kernel import spot_check_spec


def candidate_config(state: RunState, candidate: Candidate) -> dict[str, Any]:
    return {**state.incumbent.config, **candidate.patch}


def candidate_kernels(state: RunState, candidate: Candidate) -> dict[str, str]:
    return {**state.incumbent.kernels, **candidate.kernels}


def numerics_class(state: RunState, space: KnobSpace, resolved: Mapping[str, Any], kernels: Mapping[str, str]) -> str:
    """The promise a configuration is held to: the loosest among its changes from the baseline (a kernel
    replacement reorders math)."""
    base = space.resolve(state.baseline_config)
    classes = [space[name].numerics_of(value) for name, value in resolved.items() if base[name] != value]
    return loosest(classes + (["reorder"] if kernels else []))


def _source_hashes(kernels: Mapping[str, str]) -> dict[str, str]:
    return {slot: hashlib.sha256(Path(path).read_bytes()).hexdigest() for slot, path in sorted(kernels.items())}


def config_digest(resolved: Mapping[str, Any], kernels: Mapping[str, str]) -> str:
    """Identity of a configuration: the fully resolved knobs and the bytes of every replaced kernel."""
    identity = {"config": dict(sorted(resolved.items())), "kernels": _source_hashes(kernels)}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def kernel_dir(run_dir: str, kernels: Mapping[str, str]) -> str | None:
    """A directory holding exactly these kernel sources as ``<slot>.py`` (None when there are none)."""
    if not kernels:
        return None
    with _KERNEL_DIRS:  # lanes of --gpus ask for the same set (the incumbent's) at once
        return _kernel_dir(run_dir, kernels)


_KERNEL_DIRS = threading.Lock()


def _kernel_dir(run_dir: str, kernels: Mapping[str, str]) -> str:
    digest = hashlib.sha256(json.dumps(_source_hashes(kernels), sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(run_dir) / "kernel_sets" / digest
    if not folder.is_dir():
        staging = folder.with_name(digest + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for slot, path in kernels.items():
            shutil.copyfile(path, staging / f"{slot}.py")
        staging.rename(folder)  # atomic: a killed run never leaves a half-written set behind
    return str(folder)


def request(state: RunState, mode: Mode, config: Mapping[str, Any], kernels: Mapping[str, str],
            steps: int | None = None) -> WorkerRequest:
    steps = steps if steps is not None else (state.plan.numerics_steps if mode == "numerics" else 1)
    return WorkerRequest(target=state.target, size=state.size, mode=mode, config=dict(config),
                         kernels_dir=kernel_dir(state.run_dir, kernels), data=state.data, device=state.device,
                         seed=state.seed, steps=steps, warmup=state.plan.warmup, phase_steps=0,
                         threads=state.threads, ranks=state.ranks,
                         gpus=state.lane.gpus if state.lane else None, cpus=state.lane.cpus if state.lane else None,
                         # timed sides check their replaced kernels between blocks only (rate 0 inside blocks)
                         spot_check=spot_check_spec(0.0) if kernels and mode == "bench" else None)


def baseline_request(state: RunState, mode: Mode, steps: int | None = None) -> WorkerRequest:
    return request(state, mode, state.baseline_config, {}, steps)


def incumbent_request(state: RunState, mode: Mode, steps: int | None = None) -> WorkerRequest:
    return request(state, mode, state.incumbent.config, state.incumbent.kernels, steps)


def candidate_request(state: RunState, candidate: Candidate, mode: Mode, steps: int | None = None) -> WorkerRequest:
    return request(state, mode, candidate_config(state, candidate), candidate_kernels(state, candidate), steps)


def write_json(path: Path, record: Any) -> str:
    """Write a pydantic model (or plain data) as JSON, atomically; return the path as a string."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = record.model_dump_json(indent=1) if hasattr(record, "model_dump_json") else json.dumps(record, indent=1)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)
    return str(path)

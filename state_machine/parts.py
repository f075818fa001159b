"""The finished parts of a long node, kept in the run directory: a node killed half-way redoes only the parts it
had not finished. The baseline is minutes of workers (two numerics fingerprints, quality, a probe, the A/A noise
floor) written to its checkpoint only at the end; a kill at minute four redid all of it.

A part is the result of one worker request, saved once it succeeded and found again by that request's digest,
so a resumed node that asks for anything else (another config, plan or size) runs it afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

from targets.worker_protocol import WorkerRequest, WorkerResult

PARTS = "parts"  # <run>/<node>/parts/<name>.json


def _digest(request: WorkerRequest) -> str:
    return hashlib.sha256(request.model_dump_json().encode()).hexdigest()


def saved_part(folder: Path, name: str, request: WorkerRequest,
               run: Callable[[WorkerRequest], WorkerResult]) -> WorkerResult:
    """``run(request)``, or the result an earlier attempt of the node saved for the same request."""
    path = folder / PARTS / f"{name}.json"
    digest = _digest(request)
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        if saved.get("request") == digest:
            return WorkerResult.model_validate(saved["result"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # none, torn or from another request: run it
    result = run(request)
    if result.ok:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"request": digest, "result": result.model_dump(mode="json")}), encoding="utf-8")
        os.replace(tmp, path)
    return result


def saved_sequence(folder: Path, name: str, key: str) -> list[dict]:
    """The items an earlier attempt of the node saved under ``name`` for the same ``key``, in order (a calibration's
    finished A/A runs); none when they were made for anything else."""
    try:
        saved = json.loads((folder / PARTS / f"{name}.json").read_text(encoding="utf-8"))
        return list(saved["items"]) if saved.get("key") == key else []
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def save_sequence(folder: Path, name: str, key: str, items: list[dict]) -> None:
    """Keep ``items`` under ``name`` for ``key``, atomically: a kill leaves the old list or the new one."""
    path = folder / PARTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "items": items}), encoding="utf-8")
    os.replace(tmp, path)

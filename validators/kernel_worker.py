"""The kernel check's process boundary: the parent's launcher and the child's entry point.

``run_kernel_check`` (parent) writes the candidate's checked source and a request into a temporary
folder and starts ``python -m validators.kernel_worker --request R --result V`` (child) with the
scrubbed environment of ``targets.worker_client``, its own process group, that folder as working
directory and a time limit. The child imports the candidate, runs ``validators.kernel.check_kernel``
and writes the verdict. The candidate shares the child's process with the reference and the
measurement, never the caller's: a crash, hang or forged result becomes a failed verdict.

Two defences do not rely on the static check. The request file is deleted as soon as it is read,
and the verdict carries the request's nonce, so a candidate that forges a result file and exits
is caught by the parent. And torch's public namespaces, ``torch.Tensor``, the reference's module
and the global numerics switches are snapshotted before the candidate is imported and compared
after it is imported and after it has run: a candidate that patched ``torch.einsum`` (and so the
reference) or flipped TF32 fails with check ``global-state`` whatever its outputs were.

And the child is confined (``targets.confinement``): started as ``python -m targets.confinement
validators.kernel_worker ...``, a fresh interpreter that confines itself before torch starts its threads, it
sees a read-only file system outside its folder and no network; ``KernelResult.confinement`` says how, or why
not.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
from pydantic import BaseModel

from targets.confinement import Confinement, confine_worker, current
from targets.protocol import ConfigError, KernelSlot
from targets.registry import resolve_target
from targets.worker import answer_stack_requests, write_result
from targets.worker_client import scrubbed_env
from validators.kernel import KernelVerdict, Rejected, check_kernel, draw_seed, parse_dtype

WATCHED_MODULES = ("torch", "torch.functional", "torch.nn.functional", "torch.linalg", "torch.random", "torch.cuda")


class KernelRequest(BaseModel):
    """What the child process checks. ``nonce`` must come back with the verdict, so a candidate that
    writes a result file of its own and exits cannot pass for the validator."""

    target: str
    slot: str
    path: str
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    allow_tf32: bool = False
    max_flops: float | None = None
    nonce: str = ""


class KernelResult(BaseModel):
    nonce: str
    verdict: KernelVerdict
    confinement: Confinement | None = None


# ----------------------------------------------------------------------------- parent

def _process_failure(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def run_kernel_check(target_name: str, slot_name: str, source: str, device: str, dtype: str, timeout_s: float, *,
                     seed: int | None = None, allow_tf32: bool = False,
                     max_flops: float | None = None) -> KernelVerdict:
    """Run ``check_kernel`` on ``source`` in a fresh, scrubbed process. No static check: callers use
    ``validate_kernel_file``; this is exposed so tests can show what the dynamic check alone does."""
    seed = draw_seed() if seed is None else seed
    failed = KernelVerdict(ok=False, slot=slot_name, device=device, dtype=dtype, seed=seed)
    with tempfile.TemporaryDirectory(prefix="sg-opt-kernel-") as tmp:
        folder = Path(tmp)
        candidate = folder / f"{slot_name}.py"
        candidate.write_text(source, encoding="utf-8")  # the text that was checked, not a file that may change
        request = KernelRequest(target=target_name, slot=slot_name, path=str(candidate), device=device, dtype=dtype,
                                seed=seed, allow_tf32=allow_tf32, max_flops=max_flops, nonce=secrets.token_hex(16))
        request_file, result_file, stderr_file = folder / "request.json", folder / "result.json", folder / "stderr"
        request_file.write_text(request.model_dump_json())
        cmd = [sys.executable, "-m", "targets.confinement", "validators.kernel_worker", "--request",
               str(request_file), "--result", str(result_file)]
        with open(stderr_file, "wb") as err:
            proc = subprocess.Popen(cmd, cwd=tmp, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                    env=scrubbed_env(), start_new_session=True)
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return failed.model_copy(update={"check": "timeout", "reason": (
                    f"the kernel check did not finish within {timeout_s:g} s and was killed (a hang or a very "
                    f"slow kernel).")})
        failed.detail = stderr_file.read_bytes()[-4000:].decode(errors="replace")
        try:
            result = KernelResult.model_validate_json(result_file.read_text())
        except (OSError, ValueError):
            return failed.model_copy(update={"check": "crash", "reason": (
                f"the kernel check process {_process_failure(code)} without a readable result.")})
        if result.nonce != request.nonce:
            return failed.model_copy(update={"check": "crash", "reason": (
                "the kernel check's result does not carry this run's nonce, so the validator did not write it.")})
        result.verdict.confinement = result.confinement
        return result.verdict


# ----------------------------------------------------------------------------- child

def _switches() -> dict[str, Any]:
    """Process-wide settings that change what torch computes."""
    matmul = torch.backends.cuda.matmul
    return {
        "default dtype": torch.get_default_dtype(), "default device": str(torch.get_default_device()),
        "grad mode": torch.is_grad_enabled(), "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "float32 matmul precision": torch.get_float32_matmul_precision(),
        "torch.backends.cuda.matmul.allow_tf32": matmul.allow_tf32,
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction":
            matmul.allow_fp16_reduced_precision_reduction,
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction":
            matmul.allow_bf16_reduced_precision_reduction,
        "torch.backends.cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
    }


def _namespaces(slot: KernelSlot) -> dict[str, dict[str, Any]]:
    """Public callables and submodules of the namespaces the reference and the comparisons use."""
    spaces: dict[str, Any] = {name: vars(sys.modules[name]) for name in WATCHED_MODULES if name in sys.modules}
    spaces["torch.Tensor"] = dict(vars(torch.Tensor))
    spaces[slot.reference.__module__] = vars(sys.modules[slot.reference.__module__])
    return {space: {k: v for k, v in members.items() if (space == "torch.Tensor" or not k.startswith("_"))
                    and (callable(v) or isinstance(v, ModuleType))}
            for space, members in spaces.items()}


def snapshot(slot: KernelSlot) -> dict[str, dict[str, Any]]:
    return {**_namespaces(slot), "switches": _switches()}


def _same(old: Any, new: Any) -> bool:
    """The same object, or torch's own lazy decoration of it (torch._dynamo, when first imported,
    wraps torch.manual_seed with functools.wraps; setting __wrapped__ takes a dunder, which the static
    check forbids)."""
    return new is old or getattr(new, "__wrapped__", None) is old


def changed(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> list[str]:
    """What differs: a replaced or removed member, or a switch with another value."""
    found = [key for key, value in before["switches"].items() if after["switches"].get(key) != value]
    for space, members in before.items():
        if space != "switches":
            now = after.get(space, {})
            found += [f"{space}.{name}" for name, value in members.items() if not _same(value, now.get(name))]
    return found


def _check_unchanged(before: dict[str, dict[str, Any]], slot: KernelSlot, when: str) -> None:
    differences = changed(before, snapshot(slot))
    if differences:
        raise Rejected("global-state", f"{slot.name} changed torch's global state {when} "
                                       f"({', '.join(differences[:3])}), which could bend the reference.")


def load_candidate(path: str, slot: KernelSlot) -> Callable[..., Any]:
    """Import the candidate file and return its function named after the slot."""
    spec = importlib.util.spec_from_file_location(f"sg_opt_candidate_{slot.name}", path)
    if spec is None or spec.loader is None:
        raise Rejected("load", f"cannot import the kernel file {path}.")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the candidate's import failing is its failure
        message = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        raise Rejected("load", f"importing the kernel file raised {message}.", traceback.format_exc()[-4000:]) from None
    fn = getattr(module, slot.name, None)
    if not callable(fn):
        raise Rejected("load", f"the kernel file defines no function {slot.signature}.")
    return fn


def execute(req: KernelRequest) -> KernelVerdict:
    """Load and check the candidate; every failure, the candidate's or the set-up's, is a verdict."""
    verdict = KernelVerdict(ok=False, slot=req.slot, device=req.device, dtype=req.dtype, seed=req.seed)
    try:
        slot = resolve_target(req.target).slot(req.slot)
        dtype = parse_dtype(req.dtype)
        if req.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("device cuda was asked for but torch sees no CUDA device here")
        device = torch.device(req.device)
        try:  # imported before the snapshot, since a candidate may import it
            importlib.import_module("triton.language")
        except ImportError:
            pass
        before = snapshot(slot)
        fn = load_candidate(req.path, slot)
        _check_unchanged(before, slot, "when imported")
        verdict = check_kernel(slot, fn, device, dtype, req.seed, allow_tf32=req.allow_tf32, max_flops=req.max_flops)
        _check_unchanged(before, slot, "while running")
    except Rejected as rejection:
        verdict.ok = False
        verdict.check, verdict.reason, verdict.detail = rejection.check, rejection.message, rejection.detail
    except ConfigError as exc:
        verdict.check, verdict.reason = "config", str(exc)
    except Exception as exc:  # noqa: BLE001 - a failure of the set-up, not attributed to the candidate
        verdict.check = "internal"
        verdict.reason = f"the kernel check itself failed: {type(exc).__name__}: {exc}".splitlines()[0][:500]
        verdict.detail = traceback.format_exc()[-4000:]
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validators.kernel_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--request", required=True, help="JSON file holding a KernelRequest (deleted once read)")
    parser.add_argument("--result", required=True, help="where to write the KernelResult JSON")
    args = parser.parse_args(argv)
    if argv is None:  # started as a worker: confined before the candidate is imported
        confine_worker(reexec=True)
    answer_stack_requests()
    request_file = Path(args.request)
    req = KernelRequest.model_validate_json(request_file.read_text())
    request_file.unlink()
    write_result(args.result, KernelResult(nonce=req.nonce, verdict=execute(req), confinement=current()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

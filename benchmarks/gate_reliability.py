"""How often `sg-opt gate` gets it right: a planted 15% slowdown must fail, a no-op must pass, quiet or busy.

Copies of the committed tree (``git archive HEAD``; with ``--working-tree``, the working tree's files, tracked
and untracked but not ignored, to try a change before it is committed) are made in ``--work``: ``ref`` as it is,
and ``cand`` either as it is (the no-op) or with every training step of the bundled trainer busy-waiting
``--slowdown`` of its own measured time (the planted regression: more work per step, numerics untouched). Each trial runs
``sg-opt gate --size tiny --ref-tree ref`` from inside ``cand`` and records its exit code, ratio and interval;
``--busy`` runs a one-core busy loop beside every trial. Trials are appended to ``--out`` (JSON lines) and a
rerun skips the ones already there, so the benchmark resumes where it stopped.

    python benchmarks/gate_reliability.py --trials 10 --out gate_trials.jsonl
    python benchmarks/gate_reliability.py --trials 10 --out gate_trials.jsonl --summary
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLANT = '''

# Planted by benchmarks/gate_reliability.py: every step busy-waits SLOWDOWN of its own measured time.
import time as _planted_time
_PLANTED_SLOWDOWN = {slowdown!r}
_planted_plain_step = HasteRecSession.step


def _planted_slowed_step(self):
    start = _planted_time.perf_counter()
    loss = _planted_plain_step(self)
    loss.item()  # the step's work done, on any device
    until = _planted_time.perf_counter() + _PLANTED_SLOWDOWN * (_planted_time.perf_counter() - start)
    while _planted_time.perf_counter() < until:
        pass
    return loss


HasteRecSession.step = _planted_slowed_step
'''
CONDITIONS = ("noop-quiet", "slow-quiet", "noop-busy", "slow-busy")


def export_tree(dest: Path, working: bool = False) -> None:
    """The committed tree at HEAD, without its history (what a CI job's checkout holds); or, ``working``, the
    files of the working tree that git does not ignore, as they are now."""
    dest.mkdir(parents=True)
    if working:
        listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                check=True, capture_output=True).stdout.decode()
        for name in filter(None, listed.split("\0")):
            if (REPO / name).is_file():  # a tracked file deleted in the working tree is left out
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / name, dest / name)
        return
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def prepare(work: Path, slowdown: float, working: bool = False) -> dict[str, Path]:
    """``ref``, ``noop`` and ``slow`` trees under ``work`` (made once; kept for a resumed run)."""
    trees = {name: work / name for name in ("ref", "noop", "slow")}
    for name, tree in trees.items():
        if not tree.is_dir():
            export_tree(tree, working)
            if name == "slow":
                session = tree / "targets" / "haste_rec" / "session.py"
                session.write_text(session.read_text() + PLANT.format(slowdown=slowdown))
    return trees


def busy_loop() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def trial(tree: Path, ref: Path, gate_args: list[str], timeout_s: float) -> dict:
    """One gate run from inside ``tree``: its exit code, wall time and the figures of its summary JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(tree), "GITHUB_STEP_SUMMARY": str(Path(tmp) / "summary.md")}
        cmd = [sys.executable, "-m", "sg_opt.cli", "gate", "--size", "tiny", "--ref-tree", str(ref),
               "--json", *gate_args]
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
            code, out = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired:
            code, out = "timeout", ""
        record = {"exit": code, "wall_s": round(time.monotonic() - start, 1)}
        try:
            data = json.loads(out[out.index("{"):]) if "{" in out else {}
        except ValueError:
            data = {}
    step = data.get("step_time") or {}
    record.update({k: step.get(k) for k in ("ratio", "ci_low", "ci_high", "floor", "passed", "extensions")})
    record["message"] = (step.get("message") or "")[:300]
    return record


def summarise(path: Path) -> None:
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        counts[row["condition"]][str(row["exit"])] += 1
    for condition in CONDITIONS:
        if counts[condition]:
            n = sum(counts[condition].values())
            codes = ", ".join(f"exit {k}: {v}" for k, v in sorted(counts[condition].items()))
            print(f"{condition:12s} {n:3d} trials  {codes}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10, help="trials per condition")
    parser.add_argument("--slowdown", type=float, default=0.15)
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "sg-opt-gate-reliability"))
    parser.add_argument("--out", default="gate_trials.jsonl")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a gate run may take")
    parser.add_argument("--summary", action="store_true", help="print the counts of --out and stop")
    parser.add_argument("--fresh", action="store_true", help="rebuild the trees first")
    parser.add_argument("--working-tree", action="store_true", help="copy the working tree (its files git does not "
                                                                    "ignore), not HEAD; give it its own --work")
    args, gate_args = parser.parse_known_args()
    out = Path(args.out)
    if args.summary:
        summarise(out)
        return 0
    work = Path(args.work)
    if args.fresh and work.exists():
        shutil.rmtree(work)
    trees = prepare(work, args.slowdown, args.working_tree)
    done = collections.Counter(json.loads(line)["condition"] for line in out.read_text().splitlines()) \
        if out.exists() else collections.Counter()
    conditions = args.conditions.split(",")
    # round robin: a campaign cut short still has every condition at about the same count
    for i, condition in sorted(((i, c) for c in conditions for i in range(done[c], args.trials)),
                               key=lambda pair: pair[0]):
        planted, load = condition.split("-")
        loop = busy_loop() if load == "busy" else None
        try:
            record = trial(trees[planted], trees["ref"], gate_args, args.timeout)
        finally:
            if loop is not None:
                loop.kill()
                loop.wait()
        record.update(condition=condition, trial=i, date=time.strftime("%Y-%m-%d"))
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(condition, i, record, flush=True)
    summarise(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

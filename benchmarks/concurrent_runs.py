"""Two `sg-opt optimize` runs at once on one machine, each checked afterwards by a quiet `sg-opt bench --vs`.

A run that measured beside the other must either report a figure that a later quiet re-measurement of its best
configuration confirms (within ``--tolerance``, 10% by default) or say that it could not measure cleanly. Each
pair of runs starts together; when both have finished, the best configuration of each is re-measured alone
(``bench --vs``: baseline against best, interleaved). Results are appended to ``--out`` (JSON lines; a rerun adds
pairs until ``--pairs``).

    python benchmarks/concurrent_runs.py --pairs 1 --out concurrent.jsonl
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def optimize(out: Path, args: argparse.Namespace) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sg_opt.cli", "optimize", "--target", "haste-rec", "--size", args.size,
           "--device", "cpu", "--tier", "offline", "--max-minutes", str(args.minutes), "--out", str(out)]
    return subprocess.Popen(cmd, stdout=(out.parent / f"{out.name}.log").open("w"), stderr=subprocess.STDOUT)


def run_figure(runs: Path) -> dict:
    """The finished run's own final measurement: ratio, interval, clean, from its summary.json."""
    run = next(iter(sorted(p for p in runs.iterdir() if p.is_dir())), None)
    summary = json.loads((run / "summary.json").read_text()) if run and (run / "summary.json").is_file() else {}
    final = summary.get("final") or {}
    return {"run": str(run) if run else None, "ratio": final.get("ratio"), "ci_low": final.get("ci_low"),
            "ci_high": final.get("ci_high"), "clean": final.get("clean", True), "load": final.get("load"),
            "accepted": summary.get("accepted"), "best_config": str(run / "best_config.toml") if run else None}


def quiet_bench(figure: dict, args: argparse.Namespace) -> dict:
    """``bench --vs`` of the run's best configuration against the baseline, alone on the machine."""
    if not figure["best_config"] or not Path(figure["best_config"]).is_file() or figure["ratio"] is None:
        return {}
    cmd = [sys.executable, "-m", "sg_opt.cli", "bench", "--target", "haste-rec", "--size", args.size, "--device",
           "cpu", "--vs", figure["best_config"], "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    try:
        data = json.loads(proc.stdout[proc.stdout.index("{"):])
    except ValueError:
        return {"error": (proc.stdout + proc.stderr)[-500:]}
    return {key: data.get(key) for key in ("ratio", "ci_low", "ci_high", "verdict")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--out", default="concurrent.jsonl")
    args = parser.parse_args()
    out = Path(args.out)
    done = len(out.read_text().splitlines()) if out.exists() else 0
    for pair in range(done // 2, args.pairs):
        work = Path(tempfile.mkdtemp(prefix="sg-opt-concurrent-"))
        folders = [work / "one", work / "two"]
        procs = [optimize(folder, args) for folder in folders]
        codes = [proc.wait() for proc in procs]
        for name, folder, code in zip(("one", "two"), folders, codes):
            figure = run_figure(folder) if folder.is_dir() else {"ratio": None, "best_config": None}
            quiet = quiet_bench(figure, args)
            agrees = None
            if figure.get("ratio") and quiet.get("ratio"):
                agrees = abs(figure["ratio"] / quiet["ratio"] - 1) <= args.tolerance
            honest = bool(agrees) or figure.get("clean") is False
            record = {"pair": pair, "run": name, "exit": code, "figure": figure, "quiet": quiet, "agrees": agrees,
                      "honest": honest, "date": time.strftime("%Y-%m-%d")}
            with out.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

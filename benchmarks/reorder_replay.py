"""Re-judge the numerics a finished `sg-opt optimize` run recorded, with today's validator.

A run keeps the baseline's fingerprint (baseline/numerics.json), its reassociated twin
(baseline/reorder_calibration.json) and every validated candidate's fingerprint
(candidates/NNN/numerics.json). This recomputes the reorder calibration from the two baseline
records and compares each candidate again under its recorded numerics class, printing the verdict
then and now. Nothing is re-run: it shows what a change of the rules does to measured data.

Usage: python benchmarks/reorder_replay.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from targets.worker_protocol import NumericsData
from validators.numerics import calibrate_reorder, compare


def _numerics(path: Path) -> NumericsData:
    record = json.loads(path.read_text())
    return NumericsData(**(record.get("numerics") or record["result"]["numerics"]))


def replay(run_dir: Path) -> list[str]:
    """One line for the calibration, then one per validated candidate: verdict recorded -> verdict now."""
    base = _numerics(run_dir / "baseline" / "numerics.json")
    calibration = calibrate_reorder(base, _numerics(run_dir / "baseline" / "reorder_calibration.json"))
    lines = [f"{run_dir.name}: {calibration.detail}"]
    for path in sorted(run_dir.glob("candidates/*/numerics.json")):
        recorded = json.loads(path.read_text())["verdict"]
        now = compare(base, _numerics(path), recorded["numerics_class"], reorder=calibration)
        lines.append(f"  candidate {path.parent.name} ({recorded['numerics_class']}): "
                     f"{'ok' if recorded['ok'] else 'rejected'} -> {'ok' if now.ok else 'rejected'}: {now.detail}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    for run_dir in args.runs:
        if not (run_dir / "baseline" / "reorder_calibration.json").is_file():
            raise SystemExit(f"{run_dir} has no baseline/reorder_calibration.json: not a run directory of "
                             f"sg-opt optimize with a reorder calibration")
        print("\n".join(replay(run_dir)))


if __name__ == "__main__":
    main()

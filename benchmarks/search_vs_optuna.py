"""sg-opt's rule proposer against an oracle: Optuna's TPE over the same knob space, under the same protocol.

Both searches are `sg-opt optimize --tier offline` runs, one with ``--search rules`` and one with
``--search tpe``, so every TPE sample is checked, validated against the baseline's numerics and timed
side by side against the incumbent exactly as a rule's candidate is. TPE's best is the oracle. Writes
into --out: search_vs_optuna.json (per candidate: each method's best-so-far estimated speedup; final
side-by-side speedups; the oracle; sg-opt's share of it, final against final where both runs have a final
measurement, and estimate against estimate; candidates until each curve reached 90% of the oracle's estimate),
best_so_far.svg (both curves on one chart) and search_vs_optuna.md.

    python benchmarks/search_vs_optuna.py --target haste-rec --size tiny --device cpu --rules-iters 6 --tpe-iters 12
    python benchmarks/search_vs_optuna.py --rules-run runs/A --tpe-run runs/B --out cmp   # compare finished runs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sg_opt.plots import best_so_far as best_so_far_svg
from sg_opt.report import read_run
from sg_opt.summary import Summary
from targets.protocol import ConfigError

ROOT = Path(__file__).resolve().parents[1]  # the runs start here, so a module:attr target of the repo resolves

METHODS = {"rules": "sg-opt (rules)", "tpe": "Optuna TPE (oracle)"}
SHARE = 0.9  # "reached the oracle" means reached this share of its speedup
ESTIMATE_TOLERANCE = 1.25  # an estimate further than this factor from its run's final measurement is called out
FILES = ("search_vs_optuna.json", "best_so_far.svg", "search_vs_optuna.md")


def run_search(search: str, iters: int, args: argparse.Namespace, runs_dir: Path) -> tuple[Path, float]:
    """One `sg-opt optimize --tier offline --search SEARCH` run in a subprocess, as a user runs it;
    its directory and wall seconds."""
    cmd = [sys.executable, "-m", "sg_opt.cli", "optimize", "--target", args.target, "--size", args.size,
           "--device", args.device, "--tier", "offline", "--search", search, "--max-iters", str(iters),
           "--max-minutes", str(args.max_minutes), "--timeout", str(args.timeout), "--blocks", str(args.blocks),
           "--out", str(runs_dir), "--json"]
    cmd += [part for value in args.sets for part in ("--set", value)]
    cmd += ["--threads", str(args.threads)] if args.threads else []
    cmd += ["--block-steps", str(args.block_steps)] if args.block_steps else []
    cmd += ["--aa-blocks", str(args.aa_blocks), "--recalibrate-after", str(args.recalibrate_after)]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(f"sg-opt optimize --search {search} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return runs_dir / json.loads(done.stdout)["run_id"], wall


def reached(curve: list[float], level: float) -> int | None:
    """Candidates evaluated until the curve first reached ``level`` (None: never)."""
    return next((n for n, value in enumerate(curve) if value >= level - 1e-12), None)


def _method(summary: Summary, run_dir: Path, wall_s: float | None) -> dict[str, Any]:
    f = summary.final
    return {"run_dir": str(run_dir), "run_id": summary.run_id, "candidates": summary.evaluated,
            "accepted": summary.accepted, "best_est_speedup": summary.est_curve()[-1],
            "final_speedup": f.speedup if f else None,
            "final_speedup_ci": [1 / f.ci_high, 1 / f.ci_low] if f and f.ci_low and f.ci_high else None,
            "final_verdict": f.verdict if f else None, "stop_reason": summary.stop_reason,
            "run_wall_s": summary.wall_s, "subprocess_wall_s": wall_s, "best_config": summary.best_config}


def share_of(sg_opt: float, oracle: float) -> dict[str, float | None]:
    """sg-opt's speedup as a share of the oracle's, and its gain over the baseline as a share of the oracle's gain
    (None where the oracle found none)."""
    return {"speedup": sg_opt / oracle, "gain": (sg_opt - 1) / (oracle - 1) if oracle > 1 else None}


def compare(runs: dict[str, tuple[Path, Summary, float | None]]) -> dict[str, Any]:
    """The comparison record: best-so-far curves, the oracle (TPE's best) and sg-opt's share of it."""
    curves = {name: summary.est_curve() for name, (_, summary, _) in runs.items()}
    rules, tpe = runs["rules"][1], runs["tpe"][1]
    oracle = curves["tpe"][-1]
    sg_best = curves["rules"][-1]
    notes = []
    for key in ("target", "size", "device"):
        if getattr(rules, key) != getattr(tpe, key):
            notes.append(f"the runs differ in {key} ({getattr(rules, key)} vs {getattr(tpe, key)}): not like for like")
    finals = {name: summary.final.speedup for name, (_, summary, _) in runs.items() if summary.final}
    both_final = len(finals) == 2  # measured side by side beats a product of ratios
    sg_head, oracle_head = (finals["rules"], finals["tpe"]) if both_final else (sg_best, oracle)
    if sg_head > oracle_head:
        measured = "final" if both_final else "estimated"
        notes.append(f"sg-opt's best (x{sg_head:.3f}, {measured}) beats the oracle's (x{oracle_head:.3f}): TPE's "
                     f"{tpe.evaluated} candidates were too few for it to be an upper bound")
    for name, final in finals.items():
        off = curves[name][-1] / final
        if not 1 / ESTIMATE_TOLERANCE <= off <= ESTIMATE_TOLERANCE:
            notes.append(f"{METHODS[name]}'s estimate (x{curves[name][-1]:.3f}) is x{off:.2f} its final side-by-side "
                         f"speedup (x{final:.3f}): its accepted ratios compounded their measurement errors, so its "
                         f"curve is only a ranking of when wins came; the final figure is the measured one")
    for name, (_, summary, _) in runs.items():
        if summary.stop_reason is None:
            notes.append(f"{METHODS[name]} has not finished ({summary.evaluated} candidates so far): its curve and "
                         f"best are interim, and it has no final side-by-side measurement yet")
        elif summary.final is None:
            notes.append(f"{METHODS[name]} accepted nothing, so it has no final side-by-side measurement")
    longest = max(len(c) for c in curves.values())
    return {
        "target": rules.target, "size": rules.size, "device": rules.device,
        "methods": {name: _method(summary, run_dir, wall) for name, (run_dir, summary, wall) in runs.items()},
        "best_so_far": [{"candidates": n, **{name: (c[n] if n < len(c) else None) for name, c in curves.items()}}
                        for n in range(longest)],
        "oracle": {"method": "tpe", "est_speedup": oracle, "final_speedup": tpe.final.speedup if tpe.final else None},
        "sg_opt_share_of_oracle": share_of(sg_best, oracle),
        "sg_opt_share_of_oracle_final": share_of(sg_head, oracle_head) if both_final else None,
        "reached_share": SHARE,
        "candidates_to_reach_share_of_oracle": {name: reached(c, SHARE * oracle) for name, c in curves.items()},
        "notes": notes,
    }


def _speedup(value: float | None) -> str:
    return f"x{value:.3f}" if value is not None else "-"


def _share(share: dict[str, float | None]) -> str:
    gain = f"{100 * share['gain']:.0f}%" if share["gain"] is not None else "- (the oracle found no speedup)"
    return f"{100 * share['speedup']:.0f}% of the speedup, {gain} of the gain over the baseline"


def markdown(record: dict[str, Any]) -> str:
    """A short human summary of the record."""
    share, to_share = record["sg_opt_share_of_oracle"], record["candidates_to_reach_share_of_oracle"]
    lines = [f"# sg-opt vs an Optuna TPE oracle: {record['target']} @ {record['size']} on {record['device']}", "",
             "Both are `sg-opt optimize --tier offline` runs (`--search rules` and `--search tpe`): every candidate "
             "is checked, validated against the baseline's numerics and timed side by side against the incumbent. "
             "Speedups are over the baseline; *estimated* is the product of the accepted side-by-side speedups, "
             "*final* the baseline re-measured against the best at the end.", "",
             f"| method | candidates | accepted | best (estimated) | final (side by side) | candidates to "
             f"{100 * record['reached_share']:.0f}% of the oracle's estimate | stopped by |", "|---|---|---|---|---|---|---|"]
    for name, m in record["methods"].items():
        lines.append(f"| {METHODS[name]} | {m['candidates']} | {m['accepted']} | {_speedup(m['best_est_speedup'])} | "
                     f"{_speedup(m['final_speedup'])} | {to_share[name] if to_share[name] is not None else 'never'} | "
                     f"{m['stop_reason'] or 'not finished'} |")
    lines.append("")
    final_share = record["sg_opt_share_of_oracle_final"]
    if final_share is not None:
        lines += [f"Oracle (TPE's best, final side by side): {_speedup(record['oracle']['final_speedup'])}. sg-opt's "
                  f"share of it, final against final: {_share(final_share)}."]
    lines += [f"Oracle (TPE's best, estimated): {_speedup(record['oracle']['est_speedup'])}. sg-opt's share of "
              f"it, estimate against estimate: {_share(share)}.", "", "![best so far](best_so_far.svg)", ""]
    lines += [f"- note: {note}" for note in record["notes"]]
    return "\n".join(lines).rstrip() + "\n"


def write(runs: dict[str, tuple[Path, Summary, float | None]], out: Path) -> dict[str, Any]:
    """Write FILES into ``out``; return the comparison record."""
    record = compare(runs)
    out.mkdir(parents=True, exist_ok=True)
    svg = best_so_far_svg([(METHODS[name], summary) for name, (_, summary, _) in runs.items()])
    if svg is None:
        record["notes"].append("neither run evaluated a candidate: there is no curve to draw")
    else:
        (out / FILES[1]).write_text(svg)
    (out / FILES[0]).write_text(json.dumps(record, indent=1, default=str))
    (out / FILES[2]).write_text(markdown(record))
    return record


def load(run_dir: Path, wall_s: float | None = None) -> tuple[Path, Summary, float | None]:
    try:
        summary, _ = read_run(run_dir)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    return run_dir, summary, wall_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="haste-rec")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rules-iters", type=int, default=25, help="candidates for the rule proposer at most")
    parser.add_argument("--tpe-iters", type=int, default=100, help="candidates for TPE at most")
    parser.add_argument("--max-minutes", type=float, default=120.0, help="wall-time cap of each run")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds any one worker may run")
    parser.add_argument("--blocks", type=int, default=6, help="timed blocks per side in each A/B (even)")
    parser.add_argument("--aa-blocks", type=int, default=40, help="timed blocks per side in each A/A run that "
                        "sets the noise floor (even)")
    parser.add_argument("--block-steps", type=int, default=None, help="steps per block (default: sized by sg-opt)")
    parser.add_argument("--recalibrate-after", type=float, default=2.0, help="noise floor again on an incumbent "
                        "this many times faster (0: never)")
    parser.add_argument("--set", action="append", default=[], dest="sets", help="baseline knob=value, repeatable")
    parser.add_argument("--rules-run", type=Path, help="compare this finished --search rules run instead of running")
    parser.add_argument("--tpe-run", type=Path, help="compare this finished --search tpe run instead of running")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default search_vs_optuna-TARGET-"
                                                               "SIZE-DEVICE)")
    args = parser.parse_args(argv)
    if (args.rules_run is None) != (args.tpe_run is None):
        parser.error("give both --rules-run and --tpe-run, or neither")
    out = args.out or Path(f"search_vs_optuna-{args.target.replace(':', '-')}-{args.size}-{args.device}")
    if args.rules_run is not None:
        runs = {"rules": load(args.rules_run), "tpe": load(args.tpe_run)}
    else:
        runs = {}
        for name, iters in (("rules", args.rules_iters), ("tpe", args.tpe_iters)):
            print(f"running sg-opt optimize --search {name} --max-iters {iters} ...", file=sys.stderr, flush=True)
            runs[name] = load(*run_search(name, iters, args, out / "runs"))
    record = write(runs, out)
    print(markdown(record))
    print(f"written: {', '.join(str(out / name) for name in FILES)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

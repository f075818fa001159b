"""Regenerate the replay fixtures of the proposer tests from a recorded run.

    .venv/bin/python -m tests.state_machine.regen_replays RUN_DIR NAME [--after N ...] [--out DIR]

RUN_DIR is a run directory as ``sg-opt optimize`` leaves it (``runs/<run-id>/``: run.json, summary.json, profiles/).
docs/results keeps only a run's summary and report; its ``run.tgz`` in git history (docs/results/README.md says how
to restore one) unpacks to the whole directory, and ``sg-opt report RUN_DIR`` writes the summary of a run cut short.
Writes, under DIR (default tests/fixtures):

- ``replays/NAME.json``: the run's target, size, device and baseline config, and every decided knob candidate with
  its verdict (``tests.state_machine.replays.Replay``);
- ``NAME_after_N.json``: the run's profile of its incumbent after accepted candidate #N, for each ``--after N``
  (default: the last win that was profiled).

A candidate's patch is read back from its ``change`` in the summary with the target's own knob parser; kernel
candidates are left out, since their sources are not replayed. NAME is the fixtures' stem, by convention
``<device>_<size>_<run>`` (h200_large_cached_s22). The replay tests then read the new run with
``recorded(state, ctx, NAME, N)``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from sg_opt.run_store import REQUEST_FILE, RunRequest
from sg_opt.summary import SUMMARY_FILE
from targets.protocol import ConfigError, KnobSpace
from targets.registry import resolve_target
from tests.state_machine.replays import FIXTURES, Replay, Step

AFTER = re.compile(r"^after #(\d+)$")  # a profile's label in summary.json (sg_opt.summary.PhaseBreakdown)


def parse_change(space: KnobSpace, change: str) -> dict[str, Any]:
    """'knob=value, ...' (``Candidate.change``) back into a patch of typed values; ConfigError for a knob the target
    lacks or a value outside its domain (an LLM's, rejected at check)."""
    patch = {}
    for part in change.split(", "):
        name, _, text = part.partition("=")
        patch[name] = space[name].parse(text)
    return patch


def steps(summary: dict[str, Any], space: KnobSpace) -> list[Step]:
    """The summary's decided knob candidates, in order (one whose change does not parse is left out, and said)."""
    out = []
    for row in summary["candidates"]:
        if row["kind"] != "knob":
            continue
        try:
            patch = parse_change(space, row["change"])
        except ConfigError as exc:
            print(f"left out #{row['id']} ({row['change']}): {exc}", file=sys.stderr)
            continue
        out.append(Step(id=row["id"], patch=patch, accepted=row["accepted"], stage=row["stage"],
                        numerics_class=row.get("numerics_class"), ratio=row.get("ratio"), ci_low=row.get("ci_low"),
                        ci_high=row.get("ci_high"), proposer=row["proposer"], reason=row["reason"]))
    return out


def profiles_after(summary: dict[str, Any]) -> dict[int, str]:
    """Accepted candidate id -> its run's profile of the incumbent after it (a path under the run directory)."""
    return {int(match[1]): row["profile"] for row in summary.get("phases", []) if (match := AFTER.match(row["label"]))}


def check_profile(space: KnobSpace, replay: Replay, after: int, profile: Path) -> None:
    """Stop, in a sentence, unless the profile ran the baseline config with the wins up to #after."""
    config = dict(replay.base)
    for step in replay.history:
        if step.accepted and step.id <= after:
            config.update(step.patch)
    resolved, ran = space.resolve(config), json.loads(profile.read_text())["config"]
    differ = sorted(k for k in config if resolved[k] != ran.get(k))
    if differ:
        raise SystemExit(f"{profile} did not run the incumbent after #{after}: {', '.join(differ)} differ")


def write_replay(replay: Replay, path: Path) -> None:
    """The replay as JSON with one step a line, so a regenerated run diffs by candidate."""
    head = json.dumps(replay.model_dump(exclude={"history"}), indent=2)[:-2]
    rows = ",\n    ".join(json.dumps(step.model_dump(exclude_defaults=True)) for step in replay.history)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'{head},\n  "history": [\n    {rows}\n  ]\n}}\n', encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="runs/<run-id>/ of the recorded run")
    parser.add_argument("name", help="the fixtures' stem, e.g. h200_large_cached_s22")
    parser.add_argument("--after", type=int, action="append", help="copy the profile after this accepted candidate")
    parser.add_argument("--out", type=Path, default=FIXTURES, help="the fixtures folder (default: tests/fixtures)")
    args = parser.parse_args(argv)
    request = RunRequest.model_validate_json((args.run_dir / REQUEST_FILE).read_text())
    summary = json.loads((args.run_dir / SUMMARY_FILE).read_text())
    space = resolve_target(request.target).knob_space
    replay = Replay(run=summary["run_id"], source=f"tests/state_machine/regen_replays.py from {args.run_dir.name}",
                    target=request.target, size=request.size, device=request.device, base=request.config,
                    history=steps(summary, space))
    profiles = profiles_after(summary)
    wanted = args.after or ([max(profiles)] if profiles else [])
    missing = [n for n in wanted if n not in profiles]
    if missing:
        raise SystemExit(f"the run has no profile after #{missing[0]}; it has {sorted(profiles) or 'none'}")
    for after in wanted:
        check_profile(space, replay, after, args.run_dir / profiles[after])
    write_replay(replay, args.out / "replays" / f"{args.name}.json")
    for after in wanted:
        shutil.copyfile(args.run_dir / profiles[after], args.out / f"{args.name}_after_{after}.json")
    print(f"{args.name}: {len(replay.history)} candidates, profiles after {wanted or 'none'} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

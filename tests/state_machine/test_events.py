"""events.jsonl: typed records on the way in, the same JSON shape on disk, and readers that skip what they cannot type
instead of failing a report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

from state_machine import events
from state_machine.context import RunContext
from state_machine.events import parse_event, read_events

ROOT = Path(__file__).resolve().parents[2]


def test_a_line_holds_t_event_and_the_fields_and_reads_back_as_the_same_record(tmp_path):
    seen = []
    ctx = RunContext(target=None, on_event=seen.append)
    record = events.Decide(id=3, accepted=False, stage="measure", reason="no-difference", ratio=0.99)
    ctx.event(str(tmp_path), record)
    line = (tmp_path / "events.jsonl").read_text()
    assert list(json.loads(line)) == ["t", "event", "id", "accepted", "stage", "reason", "ratio"]
    assert json.loads(line)["event"] == "decide"
    assert parse_event(line) == record and seen == [record]


def test_every_kind_has_its_own_event_name():
    union, _ = get_args(events.Event)
    kinds = [member.model_fields["event"].default for member in get_args(union)]
    assert len(kinds) == len(set(kinds)) == 25 and "decide" in kinds


def test_lines_of_older_runs_and_lines_it_cannot_type_are_skipped_not_fatal(tmp_path):
    lines = ['{"t": 1.0, "event": "setup", "target": "haste-rec", "size": "tiny", "tier": "offline", "device": "cpu"}',
             '{"t": 2.0, "event": "validated", "id": 1, "numerics_class": "exact", "detail": "bitwise"}',  # older
             '{"t": 3.0, "event": "diagnose", "findings": ["data: slow"]}',  # before `distorted`
             '{"t": 4.0, "event": "from-a-newer-sg-opt", "x": 1}',  # unknown kind
             '{"t": 5.0, "event": "decide", "id": "not a number"}',  # fields that do not validate
             '{"t": 6.0, "event": "decide", "id": 1, "accepted": true, "stage": "measure", "reason": "faster", '
             '"ratio": 0.5, "added_later": 1}',
             '{"t": 7.0, "event": "report", "stop_re']  # torn by a kill
    (tmp_path / "events.jsonl").write_text("\n".join(lines))
    read = read_events(tmp_path)
    assert [type(e) for e in read] == [events.Setup, events.Validated, events.Diagnose, events.Decide]
    assert read[1].wall_s is None and read[2].distorted is None and read[3].ratio == 0.5
    assert read_events(tmp_path / "absent") == []


def test_every_line_of_the_committed_runs_is_typed():
    """The run logs docs/results keeps, written by earlier versions, all read back as typed events."""
    files = sorted((ROOT / "docs" / "results").rglob("*events*.jsonl"))
    assert files
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            assert parse_event(line) is not None, f"{path.relative_to(ROOT)}:{number}: {line[:120]}"

"""Drop the checkpoints a resume never reads, so that a run directory stays small enough to carry and keep.

LangGraph's SQLite saver keeps every node's checkpoint, each a whole ``RunState``, nearly all superseded: the
2-candidate `xl` oracle of 2026-12-03 held 15 of them in 250 KB, 45 KB once compacted to the 2 a resume reads, and
the directory of a 97-candidate oracle packed to 7.3 MB. A resume reads the last checkpoint and its pending writes, and
``graph._rewrite`` walks back from it through the updates that left the next node unchanged to the checkpoint
before them (whose task names the node that wrote it). Those are kept; every older one goes. The graph has no
delta channels, so no kept checkpoint needs an ancestor to be rebuilt. ``state.json`` is untouched, and is
what reports read.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from state_machine.graph import CHECKPOINT_FILE, open_checkpointer, thread


def needed_checkpoints(run_dir: str | Path, run_id: str) -> list[str]:
    """The ids of the checkpoints a resume or a rewrite of ``run_id`` can read, newest first ([]: none saved). Only
    those are loaded: a long run holds hundreds, each a whole state."""
    saver = open_checkpointer(run_dir)
    try:
        kept: list[str] = []
        current = saver.get_tuple(thread(run_id))  # the last one
        while current is not None:
            kept.append(current.config["configurable"]["checkpoint_id"])
            parent = saver.get_tuple(current.parent_config) if current.parent_config else None
            if current.metadata.get("source") != "update":
                if parent is not None:  # a node's own checkpoint: the one before it names that node as its task
                    kept.append(parent.config["configurable"]["checkpoint_id"])
                break
            current = parent
        return kept
    finally:
        saver.conn.close()


def compact(run_dir: str | Path, run_id: str) -> tuple[int, int]:
    """Delete every checkpoint of ``run_id`` but those ``needed_checkpoints`` names, with their writes, and shrink
    the file; (checkpoints before, after). One transaction: an error leaves the file as it was."""
    path = Path(run_dir) / CHECKPOINT_FILE
    if not path.is_file():
        return 0, 0
    kept = needed_checkpoints(run_dir, run_id)
    conn = sqlite3.connect(str(path))
    try:
        before = conn.execute("SELECT count(*) FROM checkpoints WHERE thread_id = ?", (run_id,)).fetchone()[0]
        if not kept or before == len(kept):
            return before, before
        marks = ",".join("?" * len(kept))
        with conn:
            for table in ("checkpoints", "writes"):
                conn.execute(f"DELETE FROM {table} WHERE thread_id = ? AND checkpoint_id NOT IN ({marks})",
                             (run_id, *kept))
        conn.execute("VACUUM")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the saver's WAL journal: the file shrinks now, not later
        return before, len(kept)
    finally:
        conn.close()

"""Compaction keeps what a resume reads and nothing else: a compacted run resumes, is rewritten and relocated as
the whole one is."""

from __future__ import annotations

import contextlib
import shutil
import sqlite3

from state_machine import compaction, graph
from state_machine.context import RunContext
from state_machine.state_file import rooted
from targets.registry import resolve_target
from tests.fixtures.old_run import OLD_RUN_ID


def checkpoints(run_dir) -> int:
    with contextlib.closing(sqlite3.connect(run_dir / graph.CHECKPOINT_FILE)) as conn:
        return conn.execute("SELECT count(*) FROM checkpoints").fetchone()[0]


def resumed(run_dir):
    """What a resume of the run finds, after the rewrites a resume makes (upgrade, relocate)."""
    ctx = RunContext(target=resolve_target("haste-rec"))
    graph.upgrade(ctx, run_dir, OLD_RUN_ID)
    graph.relocate(ctx, run_dir, OLD_RUN_ID)
    app = graph.compile_graph(ctx, run_dir)
    return app.get_state(graph.thread(OLD_RUN_ID)).next, graph.current_state(app, graph.thread(OLD_RUN_ID))


def test_a_compacted_run_resumes_where_the_whole_one_does(old_run, tmp_path):
    whole = tmp_path / "whole" / OLD_RUN_ID
    shutil.copytree(old_run, whole)
    size = (old_run / graph.CHECKPOINT_FILE).stat().st_size
    before = checkpoints(old_run)

    assert compaction.compact(old_run, OLD_RUN_ID) == (before, 2)  # the last node's checkpoint and its parent's
    assert before > 10 and checkpoints(old_run) == 2
    assert (old_run / graph.CHECKPOINT_FILE).stat().st_size < size / 3
    next_nodes, state = resumed(old_run)
    whole_next, whole_state = resumed(whole)
    assert next_nodes == whole_next == ("validate",) and state.current.candidate.id == 3
    assert rooted(state, tmp_path) == rooted(whole_state, tmp_path)


def test_rewrites_after_a_compaction_still_find_the_node_that_wrote_the_checkpoint(old_run, tmp_path):
    """A rewrite is an update as the node that wrote the last checkpoint, found by walking back past earlier
    rewrites: compacting between rewrites keeps that walk whole, so the node to run next never changes."""
    compaction.compact(old_run, OLD_RUN_ID)
    resumed(old_run)  # upgrade and relocate: two updates on top of the checkpoint
    kept = compaction.needed_checkpoints(old_run, OLD_RUN_ID)
    assert len(kept) == 4  # the two updates, the node's checkpoint, its parent
    compaction.compact(old_run, OLD_RUN_ID)
    moved = tmp_path / "elsewhere" / OLD_RUN_ID
    shutil.move(old_run, moved)
    next_nodes, state = resumed(moved)
    assert next_nodes == ("validate",) and state.run_dir == str(moved)
    assert compaction.compact(moved, OLD_RUN_ID)[1] == 5  # one more update kept: nothing a resume reads is lost


def test_a_run_without_checkpoints_is_left_alone(tmp_path):
    assert compaction.compact(tmp_path, "none") == (0, 0)
    assert not (tmp_path / graph.CHECKPOINT_FILE).exists()

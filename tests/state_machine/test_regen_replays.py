"""regen_replays.py on a run directory rebuilt from a real run's summary and profile: the fixtures it writes replay."""

from __future__ import annotations

import shutil

import pytest

from sg_opt.run_store import RunRequest
from state_machine.proposers.offline import propose_offline
from tests.state_machine import regen_replays
from tests.state_machine.replays import FIXTURES, LARGE_CACHED_BASE, Replay, history, replayed, sound


@pytest.fixture
def run_dir(tmp_path):
    """The 2026-12-03 x7.29 `large-cached` run as `sg-opt optimize` left it, as far as the script reads it."""
    run = tmp_path / "20261203-024530-haste-rec-large-cached-offline"
    (run / "profiles").mkdir(parents=True)
    shutil.copyfile(FIXTURES / "h200_large_cached_s22_summary.json", run / "summary.json")
    shutil.copyfile(FIXTURES / "h200_large_cached_s22_after_12.json", run / "profiles" / "04.json")  # after #12
    request = RunRequest(run_id=run.name, target="haste-rec", size="large-cached", device="cuda",
                         config=LARGE_CACHED_BASE)
    (run / "run.json").write_text(request.model_dump_json())
    return run


def test_a_regenerated_replay_holds_the_runs_candidates_and_replays(run_dir, tmp_path, state, ctx):
    out = tmp_path / "fixtures"
    assert regen_replays.main([str(run_dir), "s22", "--out", str(out)]) == 0
    replay = Replay.model_validate_json((out / "replays" / "s22.json").read_text())
    transcribed = history("h200_large_cached_s22")
    assert [(s.id, s.patch, s.accepted) for s in replay.history] == [(s.id, s.patch, s.accepted) for s in transcribed]
    assert [s.stage for s in replay.history if s.stage != "measure"] == ["validate", "validate"]  # bf16, TF32 matmuls
    assert all(s.ratio == pytest.approx(t.ratio, abs=1e-3) for s, t in zip(replay.history, transcribed) if t.ratio)
    assert replay.base == LARGE_CACHED_BASE and replay.run == run_dir.name
    assert (out / "s22_after_12.json").read_bytes() == (run_dir / "profiles" / "04.json").read_bytes()
    at = replayed(state, ctx, str(out / "s22_after_12.json"), replay.size, replay.base, replay.history)
    sound(at, ctx, propose_offline(at, ctx, limit=200))


def test_a_profile_the_run_did_not_take_is_refused_in_a_sentence(run_dir, tmp_path):
    with pytest.raises(SystemExit, match=r"no profile after #7; it has \[1, 2, 3, 12\]"):
        regen_replays.main([str(run_dir), "s22", "--after", "7", "--out", str(tmp_path / "fixtures")])
    assert not (tmp_path / "fixtures").exists()

"""The state and context the node and proposer tests start from: haste-rec at size tiny, no workers."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from state_machine.context import ProposerPolicy, RunContext
from state_machine.state import RunState
from targets.registry import resolve_target
from tests.fixtures.old_run import OLD_RUN, OLD_RUN_ID


@pytest.fixture
def ctx():
    return RunContext(target=resolve_target("haste-rec"), policy=ProposerPolicy(kinds=("knob", "kernel")))


@pytest.fixture
def state(tmp_path):
    return RunState(run_id="t", run_dir=str(tmp_path), target="haste-rec", size="tiny")


@pytest.fixture
def old_run(tmp_path) -> Path:
    with tarfile.open(OLD_RUN) as archive:
        archive.extractall(tmp_path, filter="data")
    return tmp_path / OLD_RUN_ID

"""Findings that name causes: read from the marks a cause leaves in the profile, each with the knob categories
that attack it, on hand-built profiles and on a real CPU profile of the DLRM-style example."""

from __future__ import annotations

from examples.dlrm.job import target as DLRM
from profilers.coarse import profile_session
from profilers.findings import findings
from profilers.records import HostWait, PhaseTime
from tests.profilers.test_findings import STEP_S, coarse

FOR_LOOP_ADAM = {"aten::mul_": 16.0, "aten::lerp_": 16.0, "aten::addcmul_": 16.0, "aten::sqrt": 16.0,
                 "aten::div": 16.0, "aten::addcdiv_": 16.0}


def by_category(profile, knobs=None, target=DLRM):
    return {f.category: f for f in findings(profile, None, {}, knobs or {}, target)}


def test_dense_table_gradients_and_an_unfused_optimizer_are_named():
    profile = coarse({"data": 0.1, "backward": 0.2, "optimizer": 0.6})
    profile.phase_ops = {"backward": {"aten::_embedding_bag_dense_backward": 8.0}, "optimizer": FOR_LOOP_ADAM}
    found = by_category(profile)
    dense, loop = found["dense-embedding-grads"], found["unfused-optimizer"]
    assert "aten::_embedding_bag_dense_backward x8" in dense.evidence and dense.share == 0.6 + 0.1
    assert "96 op calls a step, none fused or foreach" in loop.evidence and loop.share == 0.6
    assert dense.knob_categories == ["embedding"] and loop.knob_categories == ["kernel"]


def test_fused_or_sparse_leaves_no_such_cause():
    profile = coarse({"optimizer": 0.6})
    profile.phase_ops = {"backward": {"aten::_embedding_bag_sparse_backward": 8.0},
                         "optimizer": {"aten::_fused_adam_": 1.0, **FOR_LOOP_ADAM}}
    assert not {"dense-embedding-grads", "unfused-optimizer"} & set(by_category(profile))


def test_host_syncs_and_pageable_copies_on_a_gpu():
    profile = coarse({"data": 0.2, "forward": 0.3, "metrics": 0.05}, idle=0.3, launches=120)
    profile.host_waits = [HostWait(phase="metrics", op="aten::_local_scalar_dense", call="cudaStreamSynchronize",
                                   wait_s=0.2 * STEP_S, calls=1.0),
                          HostWait(phase="data", op="aten::copy_", call="cudaMemcpyAsync", wait_s=0.1 * STEP_S,
                                   calls=3.0)]
    profile.pageable_copy_s = 0.05 * STEP_S
    profile.phases["data"] = PhaseTime(host_s=0.2 * STEP_S, host_wait_s=0.1 * STEP_S, device_s=0.0, share=0.2)
    found = by_category(profile)
    sync, copies = found["host-sync"], found["unpinned-copies"]
    assert "aten::_local_scalar_dense in metrics x1" in sync.evidence and abs(sync.share - 0.2) < 1e-9
    assert abs(copies.share - 0.1) < 1e-9 and copies.knob_categories == ["data"]
    assert set(sync.knob_categories) == {"host", "compile"}


def test_a_real_cpu_profile_of_the_example_names_its_causes():
    session = DLRM.build(DLRM.knob_space.resolve({}), "tiny", {}, "cpu", 0)
    profile = profile_session(session, "cpu", warmup=2, steps=2)
    found = by_category(profile, DLRM.knob_space.resolve({}))
    assert {"dense-embedding-grads", "unfused-optimizer"} <= set(found)
    assert found["data-wait"].headroom == 3.5  # the adapter's own headroom: batches built in the step

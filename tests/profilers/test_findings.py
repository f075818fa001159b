"""Findings on hand-built profiles: the right categories, headrooms and Amdahl gains, ranked."""

import pytest

from profilers.findings import MIN_SHARE, amdahl, findings as generic_findings
from profilers.records import Ceilings, CoarseProfile, FineProfile, PhaseTime, SlotTiming
from targets.haste_rec.target import TARGET

STEP_S = 0.010


def findings(coarse, fine, counters, knobs):
    """The bundled trainer's findings: its own headroom model and fp32-products finding."""
    return generic_findings(coarse, fine, counters, knobs, TARGET)
DENSE = {"embedding_grad_mode": "dense", "data_workers": 0, "prefetch_to_device": False,
         "optimizer_impl": "default", "embedding_placement": "device"}
TUNED = {**DENSE, "embedding_grad_mode": "fused", "optimizer_impl": "fused"}


def coarse(shares: dict[str, float], idle: float | None = None, launches: float = 0.0) -> CoarseProfile:
    cuda = idle is not None
    phases = {name: PhaseTime(host_s=share * STEP_S, device_s=share * STEP_S if cuda else None, share=share)
              for name, share in shares.items()}
    return CoarseProfile(device="cuda:0" if cuda else "cpu", time_basis="device" if cuda else "cpu", warmup=2,
                         steps=10, step_s=STEP_S, unprofiled_step_s=STEP_S, profiler_overhead=1.0, phases=phases,
                         attributed_share=sum(shares.values()), top_ops=[], device_idle_fraction=idle,
                         kernel_launches_per_step=launches, ops_per_step=100.0, peak_memory_bytes=1,
                         peak_memory_kind="host-max-rss", memcpy_h2d_bytes_per_step=0.0,
                         memcpy_d2h_bytes_per_step=0.0, final_loss=1.0)


def test_amdahl():
    assert amdahl(0.4, 20.0) == pytest.approx(1 / (0.6 + 0.02))
    assert amdahl(0.0, 5.0) == 1.0 and amdahl(1.0, 4.0) == pytest.approx(4.0)


def test_optimizer_at_40_percent_ranks_first_with_its_amdahl_gain():
    profile = coarse({"data": 0.2, "embed": 0.05, "tail": 0.1, "loss": 0.05, "backward": 0.2, "optimizer": 0.4})
    ranked = findings(profile, None, {}, DENSE)
    first = ranked[0]
    assert (first.category, first.phase) == ("optimizer", "optimizer")
    assert first.share == pytest.approx(0.4) and first.headroom == 20.0
    assert first.amdahl_gain == pytest.approx(1 / (1 - 0.4 + 0.4 / 20))
    assert "40.0%" in first.evidence and "10.00 ms" in first.evidence
    gains = [f.amdahl_gain for f in ranked]
    assert gains == sorted(gains, reverse=True)
    assert {f.category for f in ranked} == {"optimizer", "data-wait", "tail-gather-bound", "embedding-bound", "loss",
                                            "backward"}


def test_backward_headroom_follows_the_tail_backend():
    profile = coarse({"backward": 0.6, "optimizer": 0.05})
    torch_tail = findings(profile, None, {}, {**TUNED, "tail_backend": "torch"})[0]
    assert (torch_tail.category, torch_tail.headroom) == ("backward", 3.0)
    assert torch_tail.amdahl_gain == pytest.approx(1 / (0.4 + 0.6 / 3))
    kernels = findings(profile, None, {}, {**TUNED, "tail_backend": "triton"})[0]
    assert kernels.headroom == 1.5 and kernels.amdahl_gain < torch_tail.amdahl_gain


@pytest.mark.parametrize("backend,tail,loss", [(None, 3.0, 2.0), ("torch", 3.0, 2.0), ("slots", 2.0, 2.0),
                                               ("triton", 1.3, 2.0), ("triton-fused-loss", 1.3, 1.2)])
def test_tail_and_loss_headroom_follow_the_tail_backend(backend, tail, loss):
    """A Triton tail leaves only its meta-parameters to tune, a fused loss leaves the loss little."""
    knobs = TUNED if backend is None else {**TUNED, "tail_backend": backend}
    found = {f.category: f for f in findings(coarse({"tail": 0.48, "loss": 0.03}), None, {}, knobs)}
    assert (found["tail-gather-bound"].headroom, found["loss"].headroom) == (tail, loss)
    assert found["tail-gather-bound"].amdahl_gain == pytest.approx(1 / (0.52 + 0.48 / tail))
    if backend in ("triton", "triton-fused-loss"):
        assert "meta-parameters" in found["tail-gather-bound"].headroom_basis
    if backend == "triton-fused-loss":
        assert "fused into the tail kernel" in found["loss"].headroom_basis


def test_knobs_set_the_headroom_and_so_the_ranking():
    profile = coarse({"data": 0.3, "optimizer": 0.4})
    tuned = findings(profile, None, {}, TUNED)
    assert [f.category for f in tuned] == ["data-wait", "optimizer"]
    assert tuned[0].amdahl_gain == pytest.approx(1 / (0.7 + 0.3 / 3.5))
    assert tuned[1].headroom == 1.3
    overlapped = findings(profile, None, {}, {**TUNED, "data_workers": 2, "prefetch_to_device": True})
    data = next(f for f in overlapped if f.category == "data-wait")
    assert data.headroom == 1.5 and data.amdahl_gain < tuned[0].amdahl_gain


def test_parts_under_the_threshold_and_unmapped_phases_are_not_reported():
    ranked = findings(coarse({"data": MIN_SHARE / 2, "encoder": 0.5, "backward": MIN_SHARE / 2}), None, {}, DENSE)
    assert ranked == []


def test_idle_device_is_launch_bound_only_on_cuda():
    many = findings(coarse({"encoder": 0.5}, idle=0.45, launches=900), None, {}, DENSE)
    assert [f.category for f in many] == ["launch/host-bound"]
    assert many[0].share == 0.45 and many[0].headroom == 3.0 and "900 kernel launches" in many[0].evidence
    few = findings(coarse({"encoder": 0.5}, idle=0.45, launches=20), None, {}, DENSE)
    assert few[0].headroom == 1.5
    assert findings(coarse({"encoder": 0.5}, idle=0.1, launches=900), None, {}, DENSE) == []
    computing = coarse({"encoder": 0.5}, idle=0.45, launches=10)  # 5 ms of host work over 10 launches
    assert computing.phases["encoder"].host_s / 10 > 250e-6
    assert findings(computing, None, {}, DENSE)[0].headroom == 1.5
    computing.kernel_launches_per_step = 200  # many launches, but 25 us of host work each: launch gaps
    assert findings(computing, None, {}, DENSE)[0].headroom == 3.0
    named = coarse({"data": 0.1, "embed": 0.1, "encoder": 0.1, "backward": 0.1}, idle=0.45, launches=120)
    for name, n in (("data", 55), ("embed", 54), ("encoder", 3), ("backward", 8)):
        named.phases[name].launches = n
    assert "most launches from data (55), embed (54), backward (8)." in findings(named, None, {}, DENSE)[0].evidence


def test_cache_misses_need_cached_placement():
    profile = coarse({"embed": 0.5})
    counters = {"miss_rate": 0.6, "misses": 600.0, "hits": 400.0}
    cached = findings(profile, None, counters, {**DENSE, "embedding_placement": "cached"})
    miss = next(f for f in cached if f.category == "cache-misses")
    assert miss.phase == "embed" and miss.headroom == pytest.approx(1 / 0.7)
    assert "60.0% of lookups (600 of 1000)" in miss.evidence
    assert [f.category for f in cached] == ["embedding-bound", "cache-misses"]  # host/cached placement: 3x
    assert all(f.category != "cache-misses" for f in findings(profile, None, counters, DENSE))


def _slot(name: str, median_s: float, fraction: float, bound: str) -> SlotTiming:
    return SlotTiming(slot=name, implementation="reference", phase="tail", shape={"B": 4}, dtype="float32", repeats=5,
                      median_s=median_s, p10_s=median_s, p90_s=median_s, flops=1e9, bytes=1e9,
                      achieved_flops_per_s=1e9 / median_s, achieved_bytes_per_s=1e9 / median_s, intensity=1.0,
                      attainable_flops_per_s=1e9 / median_s / fraction, roofline_fraction=fraction, bound=bound)


def test_kernel_findings_come_from_the_roofline():
    ceilings = Ceilings(device_key="k", device_name="d", torch="t", measured_at="now", quick=True,
                        matmul_flops_per_s={"float32": 1e12}, matmul_size={"float32": 512}, copy_bytes_per_s=1e11,
                        copy_bytes=1 << 20)
    fine = FineProfile(device="cpu", timing="perf_counter", flush_bytes=0, ceilings=ceilings, slots=[
        _slot("tail_forward", 0.003, 0.1, "memory"),      # 30% of the step at 10% of its roof
        _slot("tail_backward_input", 0.002, 0.02, "compute"),  # headroom capped at 10
        _slot("tail_backward_weight", 0.002, 0.9, "memory"),   # already at the roof: nothing to gain
    ])
    ranked = findings(coarse({"encoder": 0.5}), fine, {}, DENSE)
    assert [(f.category, f.subject) for f in ranked] == [("memory-bound kernel", "tail_forward"),
                                                         ("compute-bound kernel", "tail_backward_input")]
    assert ranked[0].headroom == pytest.approx(8.0) and ranked[0].share == pytest.approx(0.3)
    assert ranked[0].amdahl_gain == pytest.approx(1 / (0.7 + 0.3 / 8))
    assert ranked[1].headroom == 10.0 and ranked[1].phase == "tail"


def test_findings_are_deterministic():
    profile = coarse({"data": 0.2, "embed": 0.2, "tail": 0.2, "loss": 0.2})
    assert findings(profile, None, {}, DENSE) == findings(profile, None, {}, DENSE)
    tied = [f.category for f in findings(profile, None, {}, DENSE)]
    assert tied == ["data-wait", "tail-gather-bound", "embedding-bound", "loss"]


def test_the_wait_for_data_is_not_counted_as_launch_gaps():
    """The H200 large run after the fused tail: the device idle 54% of the step, a fifth of it while the host
    built the next batch. That wait is data-wait's finding; the launch finding keeps the rest."""
    profile = coarse({"data": 0.22, "tail": 0.4}, idle=0.54, launches=196)
    profile.phases["data"] = PhaseTime(host_s=0.22 * STEP_S, device_s=0.0002 * STEP_S, share=0.22)
    launch = next(f for f in findings(profile, None, {}, TUNED) if f.category == "launch/host-bound")
    assert launch.share == pytest.approx(0.54 - 0.2198)
    assert "of 54.0% idle, 22.0% is the wait for data" in launch.evidence
    profile.phases["data"] = PhaseTime(host_s=0.4 * STEP_S, device_s=0.0, share=0.4)  # all of the idle time
    assert "launch/host-bound" not in {f.category for f in findings(profile, None, {}, TUNED)}


def test_the_launch_finding_names_the_hosts_largest_work_outside_data():
    """large-cached after #7 (H200, 2026-12-02): 12.8 ms of the host's 21.5 ms in embed; the finding says on what."""
    from profilers.records import HostWork
    profile = coarse({"embed": 0.5, "tail": 0.3}, idle=0.53, launches=342)
    profile.host_work = [HostWork(phase="data", op="aten::copy_", self_s=2e-3, calls=55),
                         HostWork(phase="embed", op="aten::index_copy_", self_s=4e-3, calls=3),
                         HostWork(phase="embed", op="cudaLaunchKernel", self_s=1.5e-3, calls=281)]
    launch = next(f for f in findings(profile, None, {}, TUNED) if f.category == "launch/host-bound")
    assert launch.evidence.endswith("; the host's largest work: aten::index_copy_ in embed (4.00 ms), "
                                    "cudaLaunchKernel in embed (1.50 ms).")


def test_a_phase_finding_says_how_much_of_its_time_the_device_works():
    """The 2026-12-02 `embed` at large-cached: 12.07 ms on the host (waits included), 1.61 on the device; a faster
    kernel can shorten only that. A device-bound phase: all of it; off a GPU: unknown."""
    profile = coarse({"embed": 0.4, "tail": 0.3}, idle=0.3, launches=200)
    profile.phases["embed"] = PhaseTime(host_s=12.07e-3, device_s=1.61e-3, share=0.4)
    by_category = {f.category: f for f in findings(profile, None, {}, TUNED)}
    assert by_category["embedding-bound"].device_fraction == pytest.approx(1.61 / 12.07)
    assert by_category["tail-gather-bound"].device_fraction == 1.0
    assert all(f.device_fraction is None for f in findings(coarse({"embed": 0.4}), None, {}, TUNED))


def test_the_launch_finding_splits_the_hosts_work_by_phase_outside_data():
    """What a change that cuts one phase's launches can reach: each phase's share of the host's work, waits on the
    device apart, data left out (its wait is data-wait's)."""
    profile = coarse({"data": 0.1, "embed": 0.5, "tail": 0.3}, idle=0.53, launches=342)
    profile.phases["embed"] = PhaseTime(host_s=0.5 * STEP_S, host_wait_s=0.1 * STEP_S, share=0.5)
    launch = next(f for f in findings(profile, None, {}, TUNED) if f.category == "launch/host-bound")
    assert "data" not in launch.host_by_phase
    assert launch.host_by_phase["embed"] == pytest.approx(0.4 / 0.7)
    assert launch.host_by_phase["tail"] == pytest.approx(0.3 / 0.7)


@pytest.mark.parametrize("knobs,headroom", [
    ({"tail_backend": "triton-fused-loss"}, 2.5),
    ({"tail_backend": "triton"}, 2.5),
    ({"tail_backend": "torch"}, None),                      # cuBLAS multiplies torch's fp32 matmuls
    ({"tail_backend": "triton", "tail_fp32_dot": "tf32x3"}, 1.5),  # three TF32 passes where one may do
    ({"tail_backend": "triton", "tail_fp32_dot": "tf32"}, None),
    ({"tail_backend": "triton", "matmul_precision": "high"}, None),  # auto: TF32 as matmul_precision says
    ({"tail_backend": "triton", "matmul_precision": "high", "tail_fp32_dot": "tf32x3"}, 1.5),  # the tail's own
    ({"tail_backend": "triton", "matmul_precision": "high", "tail_fp32_dot": "ieee"}, 2.5),
    ({"tail_backend": "triton", "precision": "bf16-autocast"}, None),
])
def test_fp32_products_of_the_triton_tail_are_their_own_finding(knobs, headroom):
    """Its headroom (2.5, the H200's fused loss kernel in exact fp32 against 3xTF32; 1.5, 3xTF32 against one
    TF32 pass) is the precision rules' business; the tail-gather-bound finding keeps the Triton tail's 1.3
    so that tile sweeps stay low."""
    resolved = {"precision": "fp32", "matmul_precision": "highest", "tail_fp32_dot": "auto", **knobs}
    ranked = findings(coarse({"tail": 0.48, "data": 0.2}), None, {}, resolved)
    fp32 = [f for f in ranked if f.category == "fp32-products"]
    assert bool(fp32) == (headroom is not None)
    if fp32:
        assert (fp32[0].phase, fp32[0].share, fp32[0].headroom) == ("tail", 0.48, headroom)
        assert next(f for f in ranked if f.category == "tail-gather-bound").headroom == 1.3

"""The coarse profiler on the real tiny trainer (named phases cover the step, overhead measured,
a valid Chrome trace), and its device-side attribution on a synthetic CUDA timeline."""

import json
import math
import os
from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import Interval

from profilers import profiled_window
from profilers.coarse import PhaseIndex, _Window, device_kind, memcpy_bytes, profile_session, union_length
from profilers.profiled_window import PROFILE_TRIES, STEP_RANGE, least_distorted_window
from profilers.records import DISTORTED_OVERHEAD
from targets.haste_rec.knobs import KNOB_SPACE
from targets.haste_rec.session import PHASES
from targets.haste_rec.target import build

STEPS = 8


def _profile(device: str, trace_path=None):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        session = build(KNOB_SPACE.resolve({}), "tiny", {}, device, 0)
        return profile_session(session, device, warmup=2, steps=STEPS, trace_path=trace_path)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cpu_profile(tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace") / "trace.json"
    return _profile("cpu", str(trace)), trace


def test_named_phases_cover_the_step(cpu_profile):
    profile, _ = cpu_profile
    assert profile.attributed_share >= 0.9, profile.attributed_share
    assert profile.attributed_share <= 1.0 + 1e-6
    assert set(profile.phases) == set(PHASES)
    assert all(p.host_s > 0 and p.device_s is None and p.launches is None for p in profile.phases.values())
    assert all(p.ops >= 1 for p in profile.phases.values())  # every phase calls at least one operator
    assert sum(p.ops for p in profile.phases.values()) <= profile.ops_per_step  # direct calls only
    assert sum(p.host_s for p in profile.phases.values()) <= profile.step_s


def test_overhead_and_cpu_fields(cpu_profile):
    profile, _ = cpu_profile
    assert profile.step_s > 0 and profile.unprofiled_step_s > 0
    assert profile.profiler_overhead == pytest.approx(profile.step_s / profile.unprofiled_step_s)
    assert 0.5 < profile.profiler_overhead < 5
    assert profile.time_basis == "cpu" and profile.device_idle_fraction is None
    assert profile.kernel_launches_per_step == 0 and profile.memcpy_h2d_bytes_per_step == 0
    assert profile.peak_memory_kind == "host-max-rss" and profile.peak_memory_bytes > 10 << 20
    assert profile.session_bytes_h2d_per_step == 0  # device placement on the CPU moves nothing
    assert math.isfinite(profile.final_loss) and profile.ops_per_step > 50


def test_top_ops_are_ops_ranked_by_self_time(cpu_profile):
    profile, _ = cpu_profile
    names = [op.name for op in profile.top_ops]
    assert names and any(name.startswith("aten::") for name in names)
    assert not set(names) & {*PHASES, STEP_RANGE}
    times = [op.self_s for op in profile.top_ops]
    assert times == sorted(times, reverse=True) and times[0] > 0
    assert sum(op.share for op in profile.top_ops) < 1.0


def test_host_work_takes_each_phase_apart_by_op(cpu_profile):
    """Every named phase's host time is made of its ops' self times: the ranked list names phases and ops,
    never ranges, and no phase's listed work exceeds its host time."""
    profile, _ = cpu_profile
    work = profile.host_work
    assert work and {w.phase for w in work} <= set(PHASES)
    assert not {w.op for w in work} & {*PHASES, STEP_RANGE}
    times = [w.self_s for w in work]
    assert times == sorted(times, reverse=True) and times[0] > 0
    for phase, p in profile.phases.items():
        assert sum(w.self_s for w in work if w.phase == phase) <= p.host_s * 1.001


def test_chrome_trace_is_valid_json_with_phases(cpu_profile):
    profile, trace = cpu_profile
    assert profile.trace_path == str(trace)
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert set(PHASES) <= names and STEP_RANGE in names


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_profile_attributes_device_time_to_phases():
    profile = _profile("cuda")
    assert profile.time_basis == "device" and profile.kernel_launches_per_step > 0
    assert profile.device_attributed_share >= 0.9
    assert 0.0 <= profile.device_idle_fraction <= 1.0
    assert profile.phases["backward"].device_s > 0 and profile.phases["tail"].device_s > 0
    assert profile.memcpy_h2d_bytes_per_step > 0
    assert profile.peak_memory_kind == "device-max-allocated" and profile.peak_memory_bytes > 0


# ----------------------------------------------------------------------------- pure pieces

def test_union_length_merges_overlaps():
    assert union_length([]) == 0
    assert union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)


def test_phase_index_finds_the_innermost_range():
    index = PhaseIndex([(0, 10, "forward"), (2, 4, "tail"), (10, 20, "backward"), (30, 40, "optimizer")])
    assert index.locate(3) == "tail"
    assert index.locate(5) == "forward"
    assert index.locate(15) == "backward"
    assert index.locate(25) is None and index.locate(-1) is None


Kernel = namedtuple("Kernel", "name device duration")


def _event(name, start, end, device=DeviceType.CPU, kernels=(), annotation=False, activity=None, **extra):
    fields = {"self_cpu_time_total": end - start, "self_device_time_total": sum(k.duration for k in kernels), **extra}
    return SimpleNamespace(name=name, time_range=Interval(start, end), device_type=device, kernels=list(kernels),
                           is_user_annotation=annotation, activity_type=activity, **fields)


def test_window_attributes_kernels_by_launch_time_across_threads():
    cuda = DeviceType.CUDA
    events = [
        _event("tail", 0, 1, annotation=True),  # a warm-up step before the window: ignored
        _event(STEP_RANGE, 10, 60, annotation=True),
        _event("forward", 10, 30, annotation=True),
        _event("backward", 30, 55, annotation=True),
        _event("aten::mm", 12, 14, kernels=[Kernel("gemm", 0, 8)]),
        # launched from the autograd thread: not a child of "backward" in the tree, inside it in time
        _event("aten::mm_backward", 35, 36, kernels=[Kernel("gemm", 0, 10), Kernel("backward", 0, 30)]),
        _event("cudaLaunchKernel", 13, 13.5, activity="cuda_runtime"),
        _event("gemm", 14, 22, device=cuda, activity="kernel"),
        _event("backward", 32, 62, device=cuda, activity="gpu_user_annotation", annotation=True),
        _event("gemm", 40, 50, device=cuda, activity="kernel"),
        _event("Memcpy HtoD (Pinned -> Device)", 50, 52, device=cuda, activity="gpu_memcpy",
               event_metadata=SimpleNamespace(bytes=4096)),
    ]
    window = _Window(events, ("forward", "backward"))
    by_phase = window.device_us_by_phase(window.index())
    assert dict(by_phase) == {"forward": 8, "backward": 10}  # the annotation's fake "kernel" is not counted
    assert [kind for _, kind in window.device] == ["kernel", "kernel", "memcpy"]
    assert window.device_us() == 20
    assert union_length((e.time_range.start, e.time_range.end) for e, _ in window.device) == 20
    assert (window.start, window.end) == (10, 60)
    assert window.attributed_share() == pytest.approx(45 / 50)
    assert window.memcpy_bytes("HtoD") == 4096 and window.memcpy_bytes("DtoH") == 0
    assert [op.name for op in window.top_ops(True, steps=1, step_s=50e-6, limit=5)] == ["aten::mm_backward",
                                                                                        "aten::mm"]
    assert [e.name for e in window.ops] == ["aten::mm", "aten::mm_backward"]  # not the runtime call
    assert dict(window.ops_by_phase(window.index())) == {"forward": 1, "backward": 1}
    assert dict(window.launches_by_phase(window.index())) == {"forward": 1, "backward": 1}  # not the mirror


def test_device_kind_and_memcpy_bytes_without_new_profiler_fields():
    old = SimpleNamespace(name="Memcpy DtoH (Device -> Pageable)", device_type=DeviceType.CUDA,
                          is_user_annotation=False,
                          _metadata_json='"device": 0, "bytes": 1024, "memory bandwidth (GB/s)": 1.5')
    assert device_kind(old, set()) == "memcpy" and memcpy_bytes(old) == 1024
    kernel = SimpleNamespace(name="void gemm<...>", device_type=DeviceType.CUDA, is_user_annotation=False)
    assert device_kind(kernel, set()) == "kernel" and memcpy_bytes(kernel) == 0
    mirror = SimpleNamespace(name="backward", device_type=DeviceType.CUDA, is_user_annotation=False)
    assert device_kind(mirror, {"backward"}) is None
    assert device_kind(SimpleNamespace(name="aten::mm", device_type=DeviceType.CPU), set()) is None


def test_host_time_blocked_on_the_device_is_split_out_of_its_phase():
    """A pageable copy in `data` waits for the previous step's kernels: that wait is the device's
    time, not data work, and must not make `data` look like the bottleneck."""
    events = [
        _event(STEP_RANGE, 0, 100, annotation=True),
        _event("data", 0, 60, annotation=True),
        _event("cudaMemcpyAsync", 5, 55, activity="cuda_runtime"),      # blocked 50 us on the stream
        _event("backward", 60, 100, annotation=True),
        _event("cudaStreamSynchronize", 90, 95, activity="cuda_runtime"),
        _event("cudaLaunchKernel", 61, 62, activity="cuda_runtime"),   # not a wait
    ]
    window = _Window(events, ("data", "backward"))
    waits = window.host_wait_us(window.index())
    assert dict(waits) == {"data": 50, "backward": 5}
    assert window.host_us()["data"] - waits["data"] == 10  # the phase's own host work


def test_host_work_is_self_time_by_phase_and_op_without_the_waits():
    """A host-bound embed phase: a slow scatter and its launches are listed where they run; the op's wait on the
    device (a blocking copy under it) is a host wait, not work, and neither is a range."""
    events = [
        _event(STEP_RANGE, 0, 100, annotation=True),
        _event("embed", 0, 70, annotation=True),
        _event("aten::index_copy_", 2, 32, activity="cpu_op", self_cpu_time_total=24),  # 6 us in its launch
        _event("cudaLaunchKernel", 26, 32, activity="cuda_runtime"),
        _event("aten::copy_", 40, 60, activity="cpu_op", self_cpu_time_total=4),  # 16 us of it blocked
        _event("cudaMemcpyAsync", 42, 58, activity="cuda_runtime"),
        _event("tail", 70, 100, annotation=True),
        _event("aten::index_copy_", 71, 73, activity="cpu_op", self_cpu_time_total=2),
        _event("cudaLaunchKernel", 74, 76, activity="cuda_runtime"),
    ]
    window = _Window(events, ("embed", "tail"))
    work = window.host_work(window.index(), steps=2, limit=10)
    assert [(w.phase, w.op) for w in work] == [
        ("embed", "aten::index_copy_"), ("embed", "cudaLaunchKernel"), ("embed", "aten::copy_"),
        ("tail", "aten::index_copy_"), ("tail", "cudaLaunchKernel")]
    assert [w.self_s for w in work] == pytest.approx([12e-6, 3e-6, 2e-6, 1e-6, 1e-6])
    assert work[0].calls == 0.5
    assert len(window.host_work(window.index(), steps=2, limit=2)) == 2


def test_each_host_wait_is_named_by_the_op_that_made_it():
    """Which op blocked the host (an `.item()`, a unique whose size lives on the device), through any runtime
    or annotation layers in between; a call with no op above it is named by itself."""
    backward = _event("backward", 0, 100, annotation=True)
    unique = _event("aten::_unique2", 10, 40, activity="cpu_op", cpu_parent=None)
    record = _event("record_param_comms", 12, 38, annotation=True, cpu_parent=unique)
    item = _event("aten::item", 50, 70, activity="cpu_op", cpu_parent=None)
    events = [
        _event(STEP_RANGE, 0, 100, annotation=True), backward, unique, record, item,
        _event("cudaStreamSynchronize", 15, 35, activity="cuda_runtime", cpu_parent=record),
        _event("cudaMemcpyAsync", 55, 65, activity="cuda_runtime", cpu_parent=item),
        _event("cudaMemcpyAsync", 80, 84, activity="cuda_runtime", cpu_parent=None),
    ]
    window = _Window(events, ("backward",))
    waits = window.host_waits(window.index(), steps=2, limit=5)
    assert [(w.phase, w.op, w.call) for w in waits] == [
        ("backward", "aten::_unique2", "cudaStreamSynchronize"), ("backward", "aten::item", "cudaMemcpyAsync"),
        ("backward", "cudaMemcpyAsync", "cudaMemcpyAsync")]
    assert [w.wait_s for w in waits] == pytest.approx([10e-6, 5e-6, 2e-6]) and waits[0].calls == 0.5
    assert len(window.host_waits(window.index(), steps=2, limit=1)) == 1


class _SlowUnderProfiler:
    """A session whose steps take ``slow_s`` under the profiler in its first ``distorted`` profiled windows and
    ``fast_s`` otherwise: a profiler that distorts some windows and not others. Its steps advance a clock of their
    own, which ``on_its_clock`` makes the window's timer read: a wall clock on a loaded 2-core VM once measured an
    undistorted window x1.51 slower and failed CI."""

    phase_names = ("step",)

    def __init__(self, distorted: int, fast_s: float = 0.005, slow_s: float = 0.02):
        self.distorted, self.fast_s, self.slow_s = distorted, fast_s, slow_s
        self.windows, self._in_profiler, self.now = 0, False, 0.0

    def step(self) -> torch.Tensor:
        profiling = torch.autograd._profiler_enabled()
        if profiling and not self._in_profiler:
            self.windows += 1
        self._in_profiler = profiling
        self.now += self.slow_s if profiling and self.windows <= self.distorted else self.fast_s
        return torch.tensor(1.0)

    def counters(self) -> dict[str, float]:
        return {}

    def on_its_clock(self, patch=setattr) -> "_SlowUnderProfiler":
        """The profiled window times steps by this session's clock (``patch``: monkeypatch.setattr in a test)."""
        patch(profiled_window, "time", SimpleNamespace(perf_counter=lambda: self.now))
        return self


@pytest.mark.parametrize("distorted, tried", [(0, 1), (1, 2), (5, PROFILE_TRIES)])
def test_a_distorted_window_is_profiled_again_and_the_least_distorted_kept(distorted, tried, monkeypatch):
    session = _SlowUnderProfiler(distorted).on_its_clock(monkeypatch.setattr)
    kept, overheads = least_distorted_window(session, torch.device("cpu"), steps=3)
    assert len(overheads) == tried == session.windows
    assert kept.overhead == min(overheads)
    assert all(o > DISTORTED_OVERHEAD for o in overheads[:min(distorted, tried)])
    if distorted < tried:
        assert kept.overhead <= DISTORTED_OVERHEAD  # the undistorted window is the one kept
    else:
        assert kept.overhead > DISTORTED_OVERHEAD  # every window distorted: the least of them, and it says so


def test_a_distorted_profile_says_so_and_an_undistorted_one_does_not(cpu_profile):
    profile, _ = cpu_profile
    assert min(profile.overheads_tried) == pytest.approx(profile.profiler_overhead)
    clean = profile.model_copy(update={"profiler_overhead": 1.1, "overheads_tried": [1.1]})
    assert clean.distortion_note() is None
    bad = profile.model_copy(update={"profiler_overhead": 2.66, "overheads_tried": [2.9, 2.66, 3.1],
                                     "step_s": 0.06567, "unprofiled_step_s": 0.02466})
    assert bad.distortion_note() == ("the profiler made its steps x2.66 slower (65.67 against 24.66 ms without it; "
                                     "the least distorted of 3 windows), so its phase times overstate the step's")


def _rank_windows(rank: int, world: int, init: str, out: str) -> None:
    """One rank of a gloo job whose session is distorted in its first window on rank 0 only."""
    import datetime
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    session = _SlowUnderProfiler(distorted=1 if rank == 0 else 0).on_its_clock()
    _, overheads = least_distorted_window(session, torch.device("cpu"), steps=3)
    dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        f.write(str(len(overheads)))
    # No interpreter teardown: after a profiled gloo job it aborted now and then ("terminate called without an
    # active exception": 2 of 55 runs of this test alone on the 2-core VM, and once in `make test`; the run looked
    # at had written both files first). A real rank's caller reads the result it wrote, not its exit status
    # (targets.worker_client.run_child).
    os._exit(0)


@pytest.mark.slow
def test_ranks_agree_to_profile_another_window_when_one_of_them_is_distorted(tmp_path):
    """Rank 0's first window is distorted, rank 1's is not: both profile a second one (in a real ranked step a
    rank that stopped would leave the other waiting in a collective), and neither a third."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_windows, args=(2, f"file://{tmp_path / 'store'}", str(tmp_path / "windows")), nprocs=2)
    assert [(tmp_path / f"windows.{rank}").read_text() for rank in (0, 1)] == ["2", "2"]

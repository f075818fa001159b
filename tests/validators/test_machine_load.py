"""Outside load: its arithmetic on synthetic /proc readings, the snapshot of who is busy, the wait before the blocks
and the re-run of loaded block pairs (fake runners, no timing), and one real measurement beside a busy loop on its
CPU, whose pairs are flagged."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from targets.worker_protocol import WorkerRequest
from validators.ab_runner import Block
from validators.ab_stats import block_order
from validators.machine_load import (SAMPLE_ENV, TICK_S, LoadMeter, LoadPolicy, LoadRecord, MachineSnapshot,
                                     ProcessLoad, Reading, after_steady_load, busy_ticks, gpu_busy, gpu_users,
                                     outside_cpus, pooled_load, process_ticks, snapshot, wait_for_quiet)
from targets.machine_lease import LOCK_DIR_ENV, machine_lease, run_presence, runs_present
from targets.protocol import ConfigError
from validators.speedup import measure_ab, run_pairs


def write_proc(root: Path, cpus: dict[int, list[int]], processes: dict[int, tuple]) -> Path:
    """A /proc-like folder: ``stat`` with these per-CPU counters (user nice system idle iowait irq softirq steal)
    and, per pid, ``stat`` (name, utime, stime, cutime, cstime) and ``cmdline``; processes not named are removed."""
    root.mkdir(exist_ok=True)
    total = [sum(v[i] for v in cpus.values()) for i in range(8)]
    lines = [" ".join(["cpu", *map(str, total)])] + [" ".join([f"cpu{n}", *map(str, v)]) for n, v in cpus.items()]
    (root / "stat").write_text("\n".join(lines + ["intr 0", "ctxt 0"]) + "\n")
    for entry in root.iterdir():
        if entry.name.isdigit() and int(entry.name) not in processes:
            for f in entry.iterdir():
                f.unlink()
            entry.rmdir()
    for pid, (name, utime, stime, cutime, cstime, *command) in processes.items():
        (root / str(pid)).mkdir(exist_ok=True)
        (root / str(pid) / "stat").write_text(f"{pid} ({name}) S 1 {pid} {pid} 0 -1 0 0 0 0 0 {utime} {stime} "
                                              f"{cutime} {cstime} 20 0 1 0 0 0 0\n")
        (root / str(pid) / "cmdline").write_text("\0".join(command[0].split()) + "\0" if command else "")
    return root


def test_busy_ticks_count_the_pinned_cpus_busy_fields_only(tmp_path):
    proc = write_proc(tmp_path / "proc", {0: [100, 1, 20, 900, 50, 3, 4, 2], 1: [10, 0, 5, 500, 7, 0, 1, 0]}, {})
    assert busy_ticks([0], proc) == 100 + 1 + 20 + 3 + 4 + 2  # idle and iowait are not busy
    assert busy_ticks([1], proc) == 16 and busy_ticks(None, proc) == 146
    assert busy_ticks([0], tmp_path / "none") is None


def test_a_trees_ticks_count_its_reaped_children(tmp_path):
    proc = write_proc(tmp_path / "proc", {0: [0] * 8}, {10: ("w orker)", 5, 2, 30, 1), 11: ("loader", 7, 0, 0, 0)})
    assert process_ticks([10, 11, 12], proc) == 38 + 7  # a name with ") " in it; 12 is gone: 0


def test_outside_load_is_busy_time_less_ours_less_the_rounding_slack_over_the_wall():
    before = Reading(at=10.0, busy=1000, own={"a": 50, "b": 10})
    after = Reading(at=12.0, busy=1150, own={"a": 110, "b": 10})  # 150 ticks busy, 60 of them our side a's
    slack = 2 * 1 + 2  # a tick per CPU, two for our trees
    assert outside_cpus(before, after, cpus=2) == pytest.approx((150 - 60 - slack) * TICK_S / 2.0)
    assert outside_cpus(before, Reading(at=12.0, busy=1003, own={"a": 50, "b": 10}), cpus=2) == 0.0  # within slack
    assert outside_cpus(before, Reading(at=12.0, busy=None), cpus=2) is None
    assert outside_cpus(before, Reading(at=10.0, busy=1200), cpus=2) is None  # no time passed


def test_a_meter_splits_a_block_into_outside_load_and_the_idle_sides_use(tmp_path):
    proc = tmp_path / "proc"
    write_proc(proc, {3: [1000, 0, 0, 0, 0, 0, 0, 0]},
               {100: ("a", 500, 0, 0, 0), 101: ("a-loader", 40, 0, 0, 0), 200: ("b", 300, 0, 0, 0)})
    trees = {100: [100, 101], 200: [200]}
    times = iter([0.0, 0.5])
    meter = LoadMeter([3], {"a": 100, "b": 200}, proc=proc, trees=lambda root: trees[root], clock=lambda: next(times))
    start = meter.start()
    # during a's block: a used 30 ticks, its loader 5 then exited (its time went to a's reaped children), b 2,
    # and something else 20: 57 busy ticks on CPU 3
    trees[100] = [100]
    write_proc(proc, {3: [1057, 0, 0, 0, 0, 0, 0, 0]}, {100: ("a", 530, 0, 45, 0), 200: ("b", 302, 0, 0, 0)})
    load = meter.block(start, timed="a")
    assert load["outside"] == pytest.approx((57 - 35 - 2 - 3) * TICK_S / 0.5)
    assert load["other_side"] == pytest.approx(2 * TICK_S / 0.5)


def test_a_snapshot_names_the_busiest_others_and_other_sg_opt_processes(tmp_path):
    proc = tmp_path / "proc"
    cpus = {0: [0] * 8}
    processes = {1: ("init", 10, 0, 0, 0, "/sbin/init"), 300: ("burn", 100, 0, 0, 0, "burn --hot"),
                 400: ("python", 50, 0, 0, 0, "python -m sg_opt.cli optimize --target x"),
                 500: ("python", 0, 0, 0, 0, "python -m pytest")}
    write_proc(proc, cpus, processes)

    def a_second_passes(seconds: float) -> None:
        assert seconds == 1.0
        processes.update({300: ("burn", 150, 0, 0, 0, "burn --hot"), 500: ("python", 90, 0, 0, 0, "python -m pytest"),
                          400: ("python", 70, 0, 0, 0, "python -m sg_opt.cli optimize --target x")})
        write_proc(proc, cpus, processes)
    smi = lambda args: [["4321", "python"], ["500", "python"]] if "--query-compute-apps=pid,process_name" in args \
        else None
    shot = snapshot(["0"], interval_s=1.0, proc=proc, ours={500}, sleep=a_second_passes, smi=smi)
    assert [(p.pid, p.name, p.cpus) for p in shot.busiest] == [(300, "burn", pytest.approx(50 * TICK_S))]
    assert [(p.pid, p.cpus) for p in shot.sg_opt] == [(400, pytest.approx(20 * TICK_S))]
    assert shot.sg_opt[0].command == "python -m sg_opt.cli optimize --target x"
    assert [p.pid for p in shot.gpu_users] == [4321]  # ours (500) left out
    said = shot.sentence()
    assert "busiest others burn (300)" in said and "1 other sg-opt processes" in said and "python (4321)" in said


def test_gpu_figures_come_from_nvidia_smi_when_there_is_one():
    assert gpu_busy("0", smi=lambda args: [["37"]]) == pytest.approx(0.37)
    assert gpu_busy("0", smi=lambda args: None) is None and gpu_users("0", smi=lambda args: None) == []
    assert gpu_users("1", smi=lambda args: [["12", "python"], ["[N/A]", "?"]]) == [(12, "python")]


class ScriptedMeter:
    def __init__(self, samples):
        self.samples, self.asked = list(samples), 0

    def sample(self, seconds):
        self.asked += 1
        return self.samples.pop(0)


def test_before_the_blocks_it_waits_while_outside_load_or_the_gpu_is_busy():
    meter = ScriptedMeter([1.2, 0.9, 0.1])
    outside, gpu, _ = wait_for_quiet(meter, [], LoadPolicy(wait_s=60, sample_s=0.0))
    assert (outside, gpu, meter.asked) == (0.1, None, 3)
    meter = ScriptedMeter([1.2, 1.2])
    outside, _, waited = wait_for_quiet(meter, [], LoadPolicy(wait_s=0, sample_s=0.0))
    assert (outside, meter.asked) == (1.2, 1) and waited >= 0  # no wait allowed: measured anyway, and judged later
    busy = iter([0.8, 0.5, 0.0])
    meter = ScriptedMeter([0.0, 0.0, 0.0])
    _, gpu, _ = wait_for_quiet(meter, ["0"], LoadPolicy(wait_s=60, sample_s=0.0), gpu=lambda g: next(busy))
    assert (gpu, meter.asked) == (0.0, 3)
    assert wait_for_quiet(ScriptedMeter([None]), [], LoadPolicy(wait_s=60))[0] is None  # nothing counted: no wait


def scripted_runner(loads):
    """A runner's ``run`` whose blocks have the given outside loads, in turn; it records what it ran."""
    ran, queue = [], list(loads)

    def run(side, steps):
        ran.append(side)
        return Block(side=side, steps=steps, wall_s=0.01 * len(ran), worker_s=0.01 * len(ran),
                     load=None if (x := queue.pop(0)) is None else {"outside": x, "other_side": 0.0})
    return run, ran


def test_a_pair_with_a_loaded_block_runs_again_in_the_same_order():
    run, ran = scripted_runner([0.0, 0.0, 0.0, 0.9, 0.0, 0.1, None, 0.0, 0.0, 0.0])
    pairs = run_pairs(run, 4, {"a": 2, "b": 3}, LoadPolicy())
    assert ran == ["a", "b", "b", "a", "b", "a", "a", "b", "b", "a"]  # pair 1 (b first) twice
    assert (pairs.reruns, pairs.rerun_load, pairs.loaded) == (1, [0.9], 0)
    kept = [block.wall_s for side in "ab" for block in pairs.blocks[side]]
    assert pytest.approx(0.04) not in kept and pytest.approx(0.03) not in kept  # the loaded pair is not kept
    assert [b.steps for b in pairs.blocks["a"]] == [2] * 4 and [b.steps for b in pairs.blocks["b"]] == [3] * 4


def test_once_the_reruns_are_spent_loaded_pairs_are_kept_and_counted():
    run, ran = scripted_runner([1.0, 0.0] * 4)  # one block of each pair loaded, the other not: uneven
    pairs = run_pairs(run, 2, {"a": 1, "b": 1}, LoadPolicy(reruns=1))
    assert ran == ["a", "b", "a", "b", "b", "a"] and (pairs.reruns, pairs.loaded) == (1, 2)
    assert len(pairs.blocks["a"]) == len(pairs.blocks["b"]) == 2
    run, ran = scripted_runner([1.0, 0.0] * 10)
    assert run_pairs(run, 4, {"a": 1, "b": 1}, LoadPolicy()).reruns == 4  # by default as many as there are pairs
    run, ran = scripted_runner([0.0] * 8)
    stopped = run_pairs(run, 4, {"a": 1, "b": 1}, LoadPolicy(), stop=lambda kept: "enough" if len(kept["a"]) == 2
                        else None)
    assert stopped.note == "enough" and ran == block_order(4)[:4]


def test_a_steady_load_both_blocks_of_a_pair_saw_alike_is_recorded_not_rerun():
    run, ran = scripted_runner([1.0, 0.9] * 4)  # a neighbour that never stops: it slows both sides alike
    pairs = run_pairs(run, 4, {"a": 1, "b": 1}, LoadPolicy())
    assert ran == block_order(4) and (pairs.reruns, pairs.loaded) == (0, 0) and pairs.steady == pytest.approx(0.9)
    assert "a steady 0.90 CPUs of other work ran beside both sides alike" in LoadRecord(steady_cpus=0.9).sentence()


def test_a_records_sentence_and_pooling():
    quiet = LoadRecord()
    assert quiet.sentence() is None and quiet.clean
    before = MachineSnapshot(loadavg=[2.5, 1.0, 0.5], cpus=2, busiest=[ProcessLoad(pid=7, name="cc1plus", cpus=0.97)])
    loaded = LoadRecord(before=before, reruns=2, rerun_load=[0.9, 1.1], loaded_pairs=3, clean=False)
    said = loaded.sentence()
    assert said.startswith("3 block pairs ran with more than 0.30 CPUs of other work on its CPUs after 2 were run")
    assert "as it began: load average 2.50 on 2 CPUs; busiest others cc1plus (7) 0.97" in said
    rerun = LoadRecord(reruns=2, rerun_load=[0.9, 1.1])
    assert rerun.sentence() == "2 block pairs were run again for outside load (up to 1.10 CPUs)" and rerun.clean
    unlocked = LoadRecord(unlocked="the cpu measurement lock was still taken after 900 s", clean=False)
    both = pooled_load([quiet, unlocked])
    assert not both.clean and both.unlocked.startswith("the cpu measurement lock") and pooled_load([None]) is None
    assert pooled_load([quiet, quiet]).clean and pooled_load([quiet, None]).clean
    assert LoadRecord(limit_cpus=2.0).sentence() == ("its blocks were allowed 2.00 CPUs of other work "
                                                     "(SG_OPT_LOAD_LIMIT_CPUS; default 0.30)")
    beside = LoadRecord(beside_runs=2)  # clean for a candidate's verdict (the lock held), not for a quoted figure
    assert beside.clean and not beside.quotable and quiet.quotable
    assert beside.sentence() == "2 other sg-opt run(s) shared the machine"
    assert pooled_load([quiet, beside]).beside_runs == 2 and not pooled_load([quiet, beside]).quotable


@pytest.mark.slow
def test_a_measurement_beside_another_run_is_clean_but_not_quotable(tmp_path, monkeypatch):
    """Another run (a process that is none of ours, holding the presence lock every measuring command holds) alive
    as the blocks begin; a process of our own holding it (a command measuring in-process) does not count."""
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path))
    spec = WorkerRequest(target="tests.fixtures.faulty_target:target", size="tiny", mode="bench", warmup=1,
                         threads=1, config={"behaviour": "slow"})
    hold = "from targets.machine_lease import run_presence\nimport time\nwith run_presence(): time.sleep(300)"
    started = subprocess.run(["sh", "-c", f"{sys.executable} -c '{hold}' > /dev/null 2>&1 & echo $!"],
                             capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2])
    other = int(started.stdout.strip())  # its shell has exited: it is not below this process
    try:
        for _ in range(200):
            if any(run.startswith(f"{other} ") for run in runs_present()):
                break
            time.sleep(0.05)
        with run_presence():  # as the CLI holds it around an in-process measurement
            beside = measure_ab(spec, spec, blocks=2, steps_per_block=2, timeout_s=120, block_seconds=0.05,
                                load_policy=LoadPolicy(wait_s=0))
    finally:
        os.kill(other, 9)
    assert beside.failure is None and beside.load.beside_runs == 1 and beside.clean and not beside.quotable
    alone = measure_ab(spec, spec, blocks=2, steps_per_block=2, timeout_s=120, block_seconds=0.05,
                       load_policy=LoadPolicy(wait_s=0))
    assert alone.failure is None and alone.load.beside_runs == 0 and alone.quotable


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a CPU to pin the busy loop on besides ours")
def test_a_busy_loop_on_the_measured_cpu_flags_the_pairs():
    cpu = sorted(os.sched_getaffinity(0))[-1]
    spec = WorkerRequest(target="tests.fixtures.faulty_target:target", size="tiny", mode="bench", warmup=1,
                         threads=1, config={"behaviour": "slow"})
    with machine_lease("cpu", exclusive=True):  # the loop disturbs no one else's measurement: measure_ab's is this
        busy = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile 1: pass"])
        try:
            result = measure_ab(spec, spec, blocks=2, steps_per_block=2, timeout_s=120, cpus=[cpu], block_seconds=0.2,
                                load_policy=LoadPolicy(wait_s=0, reruns=1))
        finally:
            busy.kill()
            busy.wait()
    assert result.failure is None and result.cpus == [cpu]
    load = result.load
    assert load.outside_before > load.limit_cpus and load.before is not None
    assert max(b["outside"] for side in (result.a, result.b) for b in side.block_load) > load.limit_cpus
    # the loop never stops, so each pair's blocks share the CPU with it alike: recorded as steady load, or, where
    # the scheduler split it unevenly between a pair's blocks, as pairs run again
    assert load.steady_cpus > load.limit_cpus or load.reruns >= 1
    assert result.load_note()


def test_the_sample_before_the_blocks_is_half_a_second_unless_the_environment_says(monkeypatch):
    monkeypatch.delenv(SAMPLE_ENV, raising=False)
    assert LoadPolicy().sample_s == 0.5
    monkeypatch.setenv(SAMPLE_ENV, "0.1")
    assert LoadPolicy().sample_s == 0.1 and LoadPolicy(sample_s=0.3).sample_s == 0.3
    monkeypatch.setenv(SAMPLE_ENV, "soon")
    with pytest.raises(ConfigError, match="SG_OPT_LOAD_SAMPLE_S must be a number of seconds, not 'soon'"):
        LoadPolicy()
    monkeypatch.setenv(SAMPLE_ENV, "0")
    with pytest.raises(ConfigError, match="SG_OPT_LOAD_SAMPLE_S must be a positive number of seconds, not 0"):
        LoadPolicy()


def test_a_wait_outlasted_by_steady_load_drops_the_later_waits_and_keeps_the_limits():
    mine = LoadPolicy(limit_cpus=0.3, wait_s=20.0, sample_s=0.25, reruns=2)
    assert after_steady_load(mine, 0.2) is mine and after_steady_load(mine, None) is mine  # quiet, or not measured
    later = after_steady_load(mine, 0.9)
    assert later == LoadPolicy(limit_cpus=0.3, wait_s=0.0, sample_s=0.25, reruns=2)
    assert after_steady_load(None, 0.0) is None and after_steady_load(None, 8.0).wait_s == 0.0


"""The distributed reference trainer in real gloo processes (torchrun, 2 ranks, size tiny).

Sharded training from the same seed follows the single-process trajectory within the reorder
numerics class, tables sharded table-wise or row-wise: the global batch is the single-process batch
split in halves, each rank's loss is its share of the single-process loss, the dense gradients are
summed, and each row gets one Adagrad update with its gradient over the global batch (row-wise, from
the one rank that holds it, after the owners' partial pooled sums are added). With the tail sharded
by label groups, each rank trains its groups over the global batch and rewires them as the single
process does. A rank that dies, or
that stops answering, fails the job with a non-zero exit status well within a minute instead of
hanging it.
"""

import functools
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from targets.haste_rec.distributed.plan import ShardingPlan
from targets.haste_rec.knobs import KNOB_SPACE
from targets.haste_rec.target import build, training_data
from targets.worker_protocol import NumericsData
from validators.numerics import compare

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # each test runs torchrun jobs of three processes
STEPS = 12
FUSED = {"embedding_grad_mode": "fused"}
CACHED_FUSED = {"embedding_placement": "cached", "embedding_grad_mode": "fused"}
PREFETCHED = {**CACHED_FUSED, "embedding_cache_prefetch": True}
TABLES_OF_RANKS = {"table-wise": [[0, 2], [1]], "row-wise": [[0, 1, 2], [0, 1, 2]]}  # tiny's 3 tables on 2 ranks
LABEL_GROUPS = {"tail_sharding": "label-groups", "rewire_every": 4}  # rewired after steps 4, 8 and 12 of the run


def torchrun(*args: str, timeout: float = 300, ranks: int = 2) -> tuple[subprocess.CompletedProcess, float]:
    """The trainer under torchrun with `ranks` gloo ranks; (the finished launcher, its wall seconds). A job takes
    about 10 s alone and 20 s beside another (``two_at_a_time``); the limit leaves room for a busy machine."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               "-m", "targets.haste_rec.distributed.train", "--size", "tiny", "--device", "cpu", *args]
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - start


def once(compute: Callable) -> Callable:
    """`compute` run once per distinct JSON-able arguments (override dicts included), so that the
    tests of both schemes share the runs they have in common."""
    results: dict[str, Any] = {}

    @functools.wraps(compute)
    def cached(*args: Any, **kwargs: Any) -> Any:
        key = json.dumps([args, kwargs], sort_keys=True)
        if key not in results:
            results[key] = compute(*args, **kwargs)
        return results[key]
    return cached


@once
def single_process_numerics(overrides: dict, data: str | None = None) -> NumericsData:
    """What the worker's numerics mode records for the single-process trainer (one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        session = build(KNOB_SPACE.resolve(overrides), "tiny", {}, "cpu", 0, data=data)
        session.record_grad_norms = True
        losses, norms = [], []
        for _ in range(STEPS):
            losses.append(float(session.step()))
            norms.append(session.grad_norms())
        return NumericsData(losses=losses, grad_norms=norms, probe=session.probe(), digest=session.param_digest())
    finally:
        torch.set_num_threads(threads)


@once
def sharded_training(sharding: str, overrides: dict, ranks: int = 2, data: str | None = None) -> dict:
    """The JSON result of STEPS steps under torchrun with --numerics."""
    knobs = {"embedding_sharding": sharding, **overrides}
    sets = [arg for name, value in knobs.items() for arg in ("--set", f"{name}={value}")]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        done, _ = torchrun("--steps", str(STEPS), "--numerics", "--timeout-s", "60", "--out", str(out), *sets,
                           *(() if data is None else ("--data", data)), ranks=ranks)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(out.read_text())


def numerics_of(result: dict) -> NumericsData:
    return NumericsData(**{k: v for k, v in result["numerics"].items() if k != "counters"})


def assert_follows(baseline: NumericsData, result: dict) -> None:
    """The run's global loss is the sum of its ranks' shares, and it follows `baseline` within reorder."""
    for step, loss in enumerate(result["losses"]):
        assert loss == pytest.approx(sum(r["local_losses"][step] for r in result["ranks"]), rel=1e-6)
    assert all(len(r["step_s"]) == STEPS for r in result["ranks"])
    verdict = compare(baseline, numerics_of(result), "reorder")
    assert verdict.ok, verdict.detail


TRAJECTORIES = [("table-wise", {}), ("table-wise", FUSED), ("row-wise", {}), ("row-wise", FUSED),
                ("row-wise", CACHED_FUSED), ("table-wise", LABEL_GROUPS), ("table-wise", {**LABEL_GROUPS, **FUSED})]
PREFETCH_CASES = [("row-wise", PREFETCHED), ("table-wise", CACHED_FUSED), ("table-wise", PREFETCHED)]


@pytest.fixture(scope="module")
def two_at_a_time() -> None:
    """Every trajectory's torchrun job, two jobs at a time (``sharded_training`` keeps their results): each job
    spends most of its ten seconds importing torch in three processes, on one core and a bit, so two share a
    2-core machine in less time than they take one after the other. Only numerics are compared, never times."""
    def run(case: tuple[str, dict]) -> None:
        try:
            sharded_training(*case)
        except AssertionError:
            pass  # not kept: the case's own test runs it again and fails with its message

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(run, TRAJECTORIES + PREFETCH_CASES))


@pytest.mark.parametrize("sharding,overrides", TRAJECTORIES,
                         ids=["table-wise-dense-table-gradient", "table-wise-fused-row-update",
                              "row-wise-dense-table-gradient", "row-wise-fused-row-update", "row-wise-cached-fused",
                              "label-groups-dense-table-gradient", "label-groups-fused-row-update"])
def test_sharded_training_follows_the_single_process_trajectory(sharding, overrides, two_at_a_time):
    result = sharded_training(sharding, overrides)
    assert [(r["tables"], r["samples"]) for r in result["ranks"]] == [(t, 16) for t in TABLES_OF_RANKS[sharding]]
    if overrides.get("tail_sharding") == "label-groups":  # each rank really trained its half of the groups
        owned = [r["counters"]["tail_groups_owned"] for r in result["ranks"]]
        assert min(owned) > 0 and owned[0] - owned[1] in (0, 1)
    assert_follows(single_process_numerics(overrides), result)
    assert result["losses"][-1] < 0.1 * result["losses"][0]  # it trains


@pytest.mark.parametrize("sharding", ["row-wise", "table-wise"])
def test_the_cache_prefetch_on_ranks_trains_bit_for_bit_as_without_it(sharding, two_at_a_time):
    """Each step input-dists the next batch a step early and every owner prepares its lookup ahead (every step but
    the first takes a prepared one): the decisions differ, the numbers do not."""
    prefetched = sharded_training(sharding, PREFETCHED)
    assert [r["counters"]["cache_prefetched"] for r in prefetched["ranks"]] == [STEPS - 1] * 2
    verdict = compare(numerics_of(sharded_training(sharding, CACHED_FUSED)), numerics_of(prefetched), "exact")
    assert verdict.ok, verdict.detail


@pytest.mark.parametrize("overrides", [{}, FUSED], ids=["dense-table-gradient", "fused-row-update"])
def test_row_wise_and_table_wise_sharding_follow_one_trajectory(overrides, two_at_a_time):
    verdict = compare(numerics_of(sharded_training("table-wise", overrides)),
                      numerics_of(sharded_training("row-wise", overrides)), "reorder")
    assert verdict.ok, verdict.detail


def test_row_wise_training_on_uneven_blocks_and_samples_with_weights(tmp_path_factory):
    """3 ranks on a weighted file of 31 feature rows: row blocks 11, 11, 9, samples 11, 11, 10."""
    path = tmp_path_factory.mktemp("xc") / "train.txt"
    gen = torch.Generator().manual_seed(0)
    lines = ["400 31 40"]
    for _ in range(400):
        labels = sorted(set(torch.randint(0, 40, (2,), generator=gen).tolist()))
        features = sorted(set(torch.randint(0, 31, (4,), generator=gen).tolist()))
        lines.append(",".join(map(str, labels)) + " " + " ".join(f"{f}:{0.5 + f / 31:.3f}" for f in features))
    path.write_text("\n".join(lines) + "\n")
    _, size = training_data("tiny", 0, str(path))
    plan = ShardingPlan(3, size.num_tables, "row-wise")
    assert size.table_rows == (31,) and [plan.row_range(31, r) for r in range(3)] == [(0, 11), (11, 22), (22, 31)]

    result = sharded_training("row-wise", {}, ranks=3, data=str(path))
    assert [r["samples"] for r in result["ranks"]] == [11, 11, 10]
    assert_follows(single_process_numerics({}, str(path)), result)
    assert result["losses"][-1] < 0.5 * result["losses"][0]  # it trains (on noise: more slowly)


FAULTS = [("exit:1:3", "30"), ("hang:1:3", "5")]
REFUSED = [("embedding_sharding=column-wise", "error: knob embedding_sharding must be one of table-wise | row-wise, "
                                              "not 'column-wise'"),
           ("pack_batches=true", "error: pack_batches = True runs on one process only, not in a torch.distributed job")]


@once
def failed_job(fault: str, timeout_s: str) -> tuple[subprocess.CompletedProcess, float, bool]:
    """A job with the rank fault `fault`: (the finished launcher, its wall seconds, whether it wrote a result)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        done, seconds = torchrun("--steps", "20", "--fault", fault, "--timeout-s", timeout_s, "--out", str(out),
                                 timeout=60)
        return done, seconds, out.exists()


@once
def refused_job(setting: str) -> subprocess.CompletedProcess:
    return torchrun("--steps", "1", "--set", setting, timeout=60)[0]


@pytest.fixture(scope="module")
def failing_two_at_a_time() -> None:
    """The jobs that fail, two at a time as in ``two_at_a_time``: the hanging one waits out its collective timeout
    beside the others' imports. Each test reads its own job's result and is asserted alone."""
    def run(job: Callable[[], Any]) -> None:
        try:
            job()
        except subprocess.TimeoutExpired:
            pass  # not kept: the case's own test runs it again and fails with its message

    # the hanging job first: the other slot runs the three short ones meanwhile
    jobs = [functools.partial(failed_job, *fault) for fault in reversed(FAULTS)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(run, jobs + [functools.partial(refused_job, setting) for setting, _ in REFUSED]))


@pytest.mark.parametrize("fault,timeout_s", FAULTS, ids=["dies", "hangs"])
def test_a_failed_rank_fails_the_job_instead_of_hanging_it(fault, timeout_s, failing_two_at_a_time):
    """exit: torchrun sees the dead worker and stops the job; hang: the other rank's collective times
    out (--timeout-s), it fails, and torchrun stops the silent one."""
    done, seconds, wrote = failed_job(fault, timeout_s)
    assert done.returncode != 0
    assert seconds < 60
    assert "ChildFailedError" in done.stderr and "exitcode  : 1" in done.stderr
    if fault.startswith("hang"):
        assert "Timed out" in done.stderr  # the collective timeout, not torchrun, ended it
    assert not wrote


@pytest.mark.parametrize("setting,sentence", REFUSED)
def test_an_unknown_sharding_scheme_or_a_single_process_knob_is_one_sentence_and_exit_status_2(
        setting, sentence, failing_two_at_a_time):
    done = refused_job(setting)
    assert done.returncode != 0 and "exitcode  : 2" in done.stderr
    assert sentence in done.stderr

"""The offline proposer replayed on the real profiles and histories of H200 runs (tests/fixtures/h200_*.json): what
it proposes next at the points where those runs stood, and why."""

from __future__ import annotations

from state_machine.proposers.offline import propose_offline
from state_machine.state import Evaluated, Verdict
from tests.state_machine.records import candidate
from tests.state_machine.replays import LARGE_CACHED_BASE, S22_LARGE_CACHED_HISTORY, S24_LARGE_HISTORY, replayed


def test_the_h200_large_run_after_its_last_win_goes_to_3xtf32_and_packed_batches(state, ctx):
    """Replayed on the real profile of the 2026-11-30 `large` run after its last accepted change (#10), with
    that run's history up to #12: the proposer now offers 3xTF32, TF32 for the tail alone, the dense CUDA graphs
    and packed batches before any sweep, and sweeps no tail backend (that run's #13-15 were torch, slots and
    triton: x4.2, x1.6, x1.2 slower). The graphs come third: half the host's work there is in the phases they
    replay (the optimizer's and embed's are not), and they later measured 0.959 at `large` (no difference)."""
    at = replayed(state, ctx, "h200_large_after_10.json", "large", {}, [
        (1, {"embedding_grad_mode": "fused"}, True), (2, {"tail_backend": "triton-fused-loss"}, True),
        (3, {"data_workers": 2}, True), (4, {"compile_encoder": True}, False),
        (5, {"pin_memory": True, "prefetch_to_device": True}, True), (6, {"precision": "bf16-autocast"}, False),
        (7, {"matmul_precision": "high"}, False), (8, {"embedding_backend": "triton"}, False),
        (9, {"data_workers": 4}, False), (10, {"embedding_grad_mode": "sparse"}, True),
        (11, {"optimizer_impl": "fused"}, False), (12, {"optimizer_impl": "foreach"}, False)])
    proposals = propose_offline(at, ctx, limit=200)
    assert [p.proposer for p in proposals[:4]] == ["offline:tf32x3-tail", "offline:tf32-tail",
                                                   "offline:dense-cuda-graph", "offline:packed-batches"]
    assert not any("tail_backend" in p.patch for p in proposals)


def test_the_h200_large_cached_run_reaches_the_device_cache(state, ctx):
    """Replayed on the real profile of the first 2026-11-30 `large-cached` run after its one win (#2, the
    Triton tail) with its history to #3 (the fused update on host tables, 1.11: rejected): the device cache
    with the fused update, which that run never tried, is among the next three proposals."""
    at = replayed(state, ctx, "h200_large_cached_after_2.json", "large-cached", LARGE_CACHED_BASE, [
        (1, {"tail_backend": "triton-fused-loss"}, False), (2, {"tail_backend": "triton"}, True),
        (3, {"embedding_grad_mode": "fused"}, False)])
    proposals = propose_offline(at, ctx, limit=3)
    assert {"embedding_placement": "cached", "embedding_grad_mode": "fused"} in [p.patch for p in proposals]
    assert all(p.patch != {"embedding_grad_mode": "fused"} for p in propose_offline(at, ctx, limit=200))


def test_the_second_h200_large_cached_run_tries_loader_workers_before_blind_sweeps(state, ctx):
    """Replayed on the real profile of the second 2026-11-30 `large-cached` run after its one win (#1, the
    fused Triton tail) with its history to #8: that run swept the tail's tile sizes next (#9-#11) for its big
    optimizer finding, and never reached the loader workers its data phase (8% of the step) asked for. Now a
    sweep's plausibility is shared among its values. First come pinned row traffic (the optimizer phase waited
    26.8 ms of its 52 on the device, where row gradients come down), then TF32 for the tail alone, host pooling
    and the loader rules; the dense CUDA graphs and the Triton embeddings last: two thirds of the host's work is
    the host tables' update in the optimizer phase, which the graphs do not replay, and `embed` is on the device
    38% of its time, all that faster kernels could shorten."""
    at = replayed(state, ctx, "h200_large_cached_s8_after_1.json", "large-cached", LARGE_CACHED_BASE, [
        (1, {"tail_backend": "triton-fused-loss"}, True),
        (2, {"embedding_placement": "cached", "embedding_grad_mode": "fused"}, False),
        (3, {"optimizer_impl": "fused"}, False), (4, {"compile_encoder": True}, False),
        (5, {"optimizer_impl": "foreach"}, False), (6, {"tail_fp32_dot": "tf32x3"}, False),
        (7, {"precision": "bf16-autocast"}, False), (8, {"matmul_precision": "high"}, False)])
    proposals = propose_offline(at, ctx, limit=200)
    assert [p.proposer for p in proposals[:6]] == ["offline:pinned-row-traffic", "offline:tf32-tail",
                                                   "offline:host-pooling", "offline:loader-workers",
                                                   "offline:packed-batches", "offline:loader-ring"]
    first_sweep = next(i for i, p in enumerate(proposals) if p.proposer == "offline:sweep")
    assert first_sweep == 10  # the ten rules the findings still trigger go first
    assert [p.proposer for p in proposals[6:9]] == ["offline:loader-workers-4", "offline:dense-cuda-graph",
                                                    "offline:triton-embeddings"]


S9_LARGE_HISTORY = [  # the 2026-11-30 x12.42 `large` run (docs/results/2026-11-30-h200x2-large-drained/)
    (1, {"embedding_grad_mode": "fused"}, True), (2, {"tail_backend": "triton-fused-loss"}, True),
    (3, {"data_workers": 2}, True), (4, {"tail_fp32_dot": "tf32x3"}, True), (5, {"compile_encoder": True}, False),
    (6, {"pin_memory": True, "prefetch_to_device": True}, False), (7, {"pack_batches": True}, True),
    (8, {"tail_fp32_dot": "tf32"}, False), (9, {"precision": "bf16-autocast"}, False),
    (10, {"matmul_precision": "high"}, False), (11, {"embedding_backend": "triton"}, False)]


def test_the_host_bound_h200_large_step_goes_to_the_dense_cuda_graphs(state, ctx):
    """Replayed on the real profile of the x12.42 `large` run after its last win (#7: 11.4 ms of host work
    in a 13.1 ms step, 38% of it launch gaps) with its history to #11: the CUDA graphs of the dense part come
    first, and the rejected TF32 tail is not offered again in that run."""
    at = replayed(state, ctx, "h200_large_s9_after_7.json", "large", {}, S9_LARGE_HISTORY)
    proposals = propose_offline(at, ctx, limit=200)
    assert proposals[0].patch == {"dense_cuda_graph": True}
    assert all(p.patch != {"tail_fp32_dot": "tf32"} for p in proposals)
    # not from a tail the graphs cannot capture: with the autograd tail the knob would do nothing
    unfused = at.model_copy(update={"incumbent": at.incumbent.model_copy(update={"config": {
        **at.incumbent.config, "tail_backend": "triton"}})})
    assert all("dense_cuda_graph" not in p.patch for p in propose_offline(unfused, ctx, limit=200))


S10_LARGE_HISTORY = [  # the x10.63 `large` run (docs/results/2026-11-30-h200x2-large-graphs/), with its ratios
    (1, {"embedding_grad_mode": "fused"}, True, 0.693), (2, {"tail_backend": "triton-fused-loss"}, True, 0.312),
    (3, {"data_workers": 2}, True, 0.774), (4, {"tail_fp32_dot": "tf32x3"}, True, 0.749),
    (5, {"dense_cuda_graph": True}, False, 0.959), (6, {"compile_encoder": True}, False, 0.970),
    (7, {"pin_memory": True, "prefetch_to_device": True}, False, 0.919), (8, {"pack_batches": True}, True, 0.696)]


def test_a_change_that_leaned_faster_is_tried_once_more_after_the_incumbent_got_much_faster(state, ctx):
    """Replayed on the real profile of the x10.63 `large` run after its last win (#8, packed batches: the
    incumbent x1.44 faster than when #5-7 were timed): the dense CUDA graphs, no-difference at 0.959 against the
    14 ms incumbent, come first again, and say why; once tried again, they are not offered a third time."""
    at = replayed(state, ctx, "h200_large_s10_after_8.json", "large", {}, S10_LARGE_HISTORY)
    proposals = propose_offline(at, ctx, limit=200)
    assert proposals[0].patch == {"dense_cuda_graph": True}
    assert proposals[0].rationale.startswith("tried again: candidate #5 measured 0.959") and "x1.44 faster" in \
        proposals[0].rationale
    again = [p.patch for p in proposals if p.rationale.startswith("tried again")]
    assert {"compile_encoder": True} in again and {"pin_memory": True, "prefetch_to_device": True} in again
    # not before the incumbent got RETRY_AFTER faster: without #8, none of #5-7 comes back
    before = replayed(state, ctx, "h200_large_s10_after_8.json", "large", {}, S10_LARGE_HISTORY[:7]
                      + [(8, {"pack_batches": True}, False, 0.99)])
    before = before.model_copy(update={"incumbent": at.incumbent.model_copy(update={"est_speedup": 7.98})})
    assert not [p for p in propose_offline(before, ctx, limit=200) if p.rationale.startswith("tried again")]
    # tried twice: never again
    twice = at.model_copy(update={"history": at.history + [Evaluated(
        candidate=candidate(9, patch={"dense_cuda_graph": True}), incumbent_id=8,
        config={**at.incumbent.config, "dense_cuda_graph": True},
        verdict=Verdict(accepted=False, stage="measure", reason="no-difference", ratio=0.97))]})
    assert all(p.patch != {"dense_cuda_graph": True} for p in propose_offline(twice, ctx, limit=200))
    # nor one that measured slower
    slower = [(cid, patch, ok, 1.02 if cid == 5 else r) for cid, patch, ok, r in S10_LARGE_HISTORY]
    assert all(p.patch != {"dense_cuda_graph": True}
               for p in propose_offline(replayed(state, ctx, "h200_large_s10_after_8.json", "large", {}, slower),
                                        ctx, limit=200))


S13_LARGE_HISTORY = [  # the x13.88 `large` run (docs/results/2026-11-30-h200x2-large-pairs/), all 15 candidates
    (1, {"embedding_grad_mode": "fused"}, True, 0.618), (2, {"tail_backend": "triton-fused-loss"}, True, 0.201),
    (3, {"tail_fp32_dot": "tf32x3"}, False, 0.947), (4, {"data_workers": 2}, False, 0.917),
    (5, {"tail_fp32_dot": "tf32"}, False, 1.005), (6, {"pack_batches": True}, True, 0.816),
    (7, {"data_workers": 4}, False, 0.954), (8, {"precision": "bf16-autocast"}, False),
    (9, {"matmul_precision": "high"}, False), (10, {"data_workers": 2, "tail_fp32_dot": "tf32x3"}, True, 0.772),
    (11, {"dense_cuda_graph": True}, False, 1.159), (12, {"compile_encoder": True}, False, 1.079),
    (13, {"data_workers": 4, "tail_fp32_dot": "tf32x3"}, False, 0.903),
    (14, {"embedding_backend": "triton"}, False, 1.184),
    (15, {"embedding_grad_mode": "sparse"}, False, 1.104)]


def test_the_session_13_large_run_stopped_one_candidate_short_of_pinned_prefetch(state, ctx):
    """Replayed on the real profile of the x13.88 `large` run after its last win (#10, the host-and-device pair) with
    all 15 of its candidates: its 16 minutes ended where the pinned prefetch came next (accepted at 0.810 in the x13.36
    run of the same day), then the fused and foreach optimizers. Cheaper candidates reach them. Since 2026-12-04 the
    fused optimizer answers the step's launch/host-bound finding too (its optimizer launches), and comes just before the
    pinned prefetch (it was part of the winning bundle of the 2026-12-03 x18.99 `large` run)."""
    at = replayed(state, ctx, "h200_large_s13_after_10.json", "large", {}, S13_LARGE_HISTORY)
    proposals = propose_offline(at, ctx, limit=200)
    assert [p.proposer for p in proposals[:3]] == ["offline:fused-optimizer-launches", "offline:pinned-prefetch",
                                                   "offline:foreach-optimizer"]
    assert proposals[1].patch == {"pin_memory": True, "prefetch_to_device": True}


XL_HISTORY = [  # the first xl run on an H200 (2026-11-30), its 13 decided candidates
    (1, {"tail_backend": "triton-fused-loss"}, False, "reorder"), (2, {"tail_backend": "triton"}, False, "reorder"),
    (3, {"precision": "bf16-autocast"}, False, "precision"), (4, {"matmul_precision": "high"}, True, 0.9827),
    (5, {"tail_backend": "slots"}, True, 0.3992), (6, {"embedding_grad_mode": "fused"}, True, 0.6645),
    (7, {"data_workers": 2}, False, 1.022), (8, {"pack_batches": True}, True, 0.9604),
    (9, {"data_workers": 4}, False, 1.002), (10, {"embedding_grad_mode": "sparse"}, False, 1.136),
    (11, {"embedding_backend": "triton"}, False, 1.143), (12, {"precision": "bf16"}, False, "precision"),
    (13, {"optimizer_impl": "for-loop"}, False, 0.989)]


def test_the_xl_run_tries_the_fused_triton_tail_again_under_the_bands_it_is_now_held_to(state, ctx):
    """Replayed on the real profile of the first `xl` run after its last win (#8) with its 13 candidates: the fused
    Triton tail broke the reorder band as #1 (2.9e-5 against 1.7e-5); since #4 took TF32 matmuls every candidate
    is held to the precision bands (#5, #6 and #8 were), so it comes back, first, with the unfused Triton tail.
    The bf16 candidates broke the precision bands themselves and stay out."""
    at = replayed(state, ctx, "h200_xl_after_8.json", "xl", {}, XL_HISTORY)
    proposals = propose_offline(at, ctx, limit=200)
    patches = [p.patch for p in proposals]
    assert patches[0] == {"tail_backend": "triton-fused-loss"}
    assert proposals[0].rationale.startswith("tried again: candidate #1 was held to the reorder bands")
    assert {"tail_backend": "triton"} in patches
    assert {"precision": "bf16-autocast"} not in patches and {"precision": "bf16"} not in patches
    before_tf32 = replayed(state, ctx, "h200_xl_after_8.json", "xl", {}, XL_HISTORY[:3])
    assert {"tail_backend": "triton-fused-loss"} not in [p.patch for p in propose_offline(before_tf32, ctx, 200)]


XL15_HISTORY = [  # the second xl run (2026-11-30) up to its retries: both Triton tails broke the precision
    # bands under TF32 matmuls (loss 0.021 and 0.033 against 0.02), their tl.dot in TF32 too
    *XL_HISTORY[:4], (5, {"tail_backend": "triton-fused-loss"}, False, "precision"),
    (6, {"tail_backend": "triton"}, False, "precision")]


def test_after_the_fused_tail_broke_the_precision_band_under_tf32_it_comes_with_3xtf32_products(state, ctx):
    at = replayed(state, ctx, "h200_xl_after_8.json", "xl", {}, XL15_HISTORY)
    patches = [p.patch for p in propose_offline(at, ctx, limit=200)]
    assert patches[0] == {"tail_backend": "triton-fused-loss", "tail_fp32_dot": "tf32x3"}
    assert {"tail_backend": "triton-fused-loss"} not in patches  # tried under both classes now


def test_the_s20_large_cached_run_after_the_device_index_overlaps_the_cache_next(state, ctx):
    """Replayed on the real profile of the 2026-12-02 `large-cached` run after #3 (the caches' index on the device),
    whose embed phase waited 3.4 ms for the previous step and then spent its host time while the device idled:
    that run went on to pinned memory, loader workers, CUDA graphs and Triton embeddings, and ran out of time
    before TF32x3. The cache overlap comes first now, TF32x3 within five (the Triton embeddings, 1.376 slower
    there, could only shorten embed's 1.61 ms on the device); host pooling, which cached tables ignore, never."""
    at = replayed(state, ctx, "h200_large_cached_s20_after_3.json", "large-cached", LARGE_CACHED_BASE, [
        (1, {"tail_backend": "triton-fused-loss"}, True, 0.656),
        (2, {"embedding_placement": "cached", "embedding_grad_mode": "fused"}, True, 0.475),
        (3, {"embedding_cache_index": "device"}, True, 0.676)])
    proposals = propose_offline(at, ctx, limit=200)
    assert proposals[0].patch == {"embedding_cache_overlap": True}
    assert proposals[1].patch == {"embedding_cache_prefetch": True}  # the 2026-12-04 rule: embed's host work too
    assert {"tail_fp32_dot": "tf32x3"} in [p.patch for p in proposals[:6]]
    assert all("embedding_pool_on_host" not in p.patch for p in proposals)


def test_halving_the_host_threads_is_proposed_on_a_gpu_where_embed_works_the_host(state, ctx):
    """On the same replay, the trainer's CPU threads are halved once, after the cache overlap (whose evidence is
    that step's own wait) and never on a CPU, where the threads do the math; an incumbent that already set them
    gets no such proposal."""
    history = [(1, {"tail_backend": "triton-fused-loss"}, True, 0.656),
               (2, {"embedding_placement": "cached", "embedding_grad_mode": "fused"}, True, 0.475),
               (3, {"embedding_cache_index": "device"}, True, 0.676)]
    at = replayed(state, ctx, "h200_large_cached_s20_after_3.json", "large-cached", LARGE_CACHED_BASE, history)
    patches = [p.patch for p in propose_offline(at, ctx, limit=200)]
    assert patches.index({"host_threads": "half"}) > patches.index({"embedding_cache_overlap": True})
    assert [p for p in patches if "host_threads" in p and p != {"host_threads": "half"}] == [{"host_threads": "quarter"}]
    on_cpu = at.model_copy(update={"device": "cpu"})
    assert {"host_threads": "half"} not in [p.patch for p in propose_offline(on_cpu, ctx, limit=200)
                                            if p.proposer == "offline:fewer-host-threads"]
    halved = at.model_copy(update={"incumbent": at.incumbent.model_copy(
        update={"config": {**at.incumbent.config, "host_threads": "half"}})})
    assert not any(p.proposer == "offline:fewer-host-threads" for p in propose_offline(halved, ctx, limit=200))


def test_after_pinned_memory_the_loader_workers_that_measured_no_difference_before_it_come_again(state, ctx):
    """Replayed on the real profile of the 2026-12-03 x7.29 `large-cached` run after its last win (#12, pinned memory),
    with its history: two loader workers had measured 1.014 (interval 0.970-1.027) before pinning, and packed batches
    0.954; the 2026-12-02 run accepted the workers after pinning (0.837). Both come back first, for the data phase that
    profile blamed; the overlap (an embedding knob, untouched since) and 3xTF32 come back later, as changes to the other
    side of the step than pinning's, not to the same part of it."""
    at = replayed(state, ctx, "h200_large_cached_s22_after_12.json", "large-cached", LARGE_CACHED_BASE,
                  S22_LARGE_CACHED_HISTORY)
    workers = at.history[5]
    at.history[5] = workers.model_copy(update={"verdict": workers.verdict.model_copy(
        update={"ci_low": 0.970, "ci_high": 1.027})})
    proposals = propose_offline(at, ctx, limit=200)
    assert [p.patch for p in proposals[:2]] == [{"data_workers": 2}, {"pack_batches": True}]
    assert proposals[0].rationale.startswith("tried again: candidate #6 measured 1.014 (rejected: as in that run) "
                                             "before #12 (pin_memory=True) changed the same part of the step")
    patches = [p.patch for p in proposals]
    for patch in ({"embedding_cache_overlap": True}, {"tail_fp32_dot": "tf32x3"}):
        again = proposals[patches.index(patch)]
        assert patches.index(patch) > 4 and "shortened the other side of the step" in again.rationale
    at.history[5] = workers  # shown slower (no interval: the ratio, 1.014) it stays out
    assert {"data_workers": 2} not in [p.patch for p in propose_offline(at, ctx, limit=200)]


def test_a_device_change_hidden_by_the_host_comes_again_after_each_host_side_win(state, ctx):
    """The 2026-12-03 x9.72 `large` run: TF32 tail products (#4: 1.027, interval 0.945-1.059) and 3xTF32 ones (#3)
    measured no difference while the step waited on its data; two loader workers (#7) and the device prefetch (#8) were
    then accepted, and the run never tried the products again. On top of its best, with the host bundle TPE found, TF32
    products measured 0.505. Replayed on that run's profiles: after #7 both come again first, naming #7; once more after
    #8 if the try after #7 showed no difference again; not a fourth time; not on a CPU, where the host is the device;
    and not one that measured slower."""
    after_7 = replayed(state, ctx, "h200_large_s24_after_7.json", "large", {}, S24_LARGE_HISTORY[:7])
    proposals = propose_offline(after_7, ctx, limit=200)
    assert [p.patch for p in proposals[:2]] == [{"tail_fp32_dot": "tf32x3"}, {"tail_fp32_dot": "tf32"}]
    assert proposals[0].rationale.startswith(
        "tried again: candidate #3 measured 1.037 (rejected: as in that run) before #7 (data_workers=2) shortened "
        "the other side of the step")
    hidden_again = (8, {"tail_fp32_dot": "tf32x3"}, False, (0.99, 0.95, 1.03))
    after_8 = replayed(state, ctx, "h200_large_s24_after_8.json", "large", {},
                       S24_LARGE_HISTORY[:7] + [hidden_again, (9, S24_LARGE_HISTORY[7][1], True, 0.820)])
    again = {p.patch["tail_fp32_dot"]: p for p in propose_offline(after_8, ctx, limit=200)
             if p.rationale.startswith("tried again") and set(p.patch) == {"tail_fp32_dot"}}
    assert set(again) == {"tf32x3", "tf32"}
    assert "candidate #8 measured 0.990" in again["tf32x3"].rationale and "before #9" in again["tf32x3"].rationale

    def then(at, cid, patch, accepted, ratio, low):
        config = {**at.incumbent.config, **patch}
        incumbent = at.incumbent.model_copy(update={"config": config}) if accepted else at.incumbent
        return at.model_copy(update={"incumbent": incumbent, "history": at.history + [Evaluated(
            candidate=candidate(cid, patch=patch), incumbent_id=9, config=config,
            verdict=Verdict(accepted=accepted, stage="measure", reason="as in that run", ratio=ratio, ci_low=low))]})
    third = then(then(after_8, 10, {"tail_fp32_dot": "tf32x3"}, False, 0.98, 0.95), 11, {"data_workers": 4}, True, 0.9,
                 0.85)
    assert {"tail_fp32_dot": "tf32x3"} not in [p.patch for p in propose_offline(third, ctx, limit=200)]
    assert not any("shortened the other side" in p.rationale
                   for p in propose_offline(after_7.model_copy(update={"device": "cpu"}), ctx, limit=200))
    slower = replayed(state, ctx, "h200_large_s24_after_7.json", "large", {},
                      [*S24_LARGE_HISTORY[:3], (4, {"tail_fp32_dot": "tf32"}, False, (1.08, 1.04, 1.12)),
                       *S24_LARGE_HISTORY[4:7]])
    assert {"tail_fp32_dot": "tf32"} not in [p.patch for p in propose_offline(slower, ctx, limit=200)]

"""Packed batches from loader workers through shared slots made once: the same bytes in the same order as the
DataLoader path, slots never rewritten while the trainer may still read them, failures raised."""

from __future__ import annotations

import time

import pytest
import torch

import targets.haste_rec.data.shared_ring as shared_ring
from targets.haste_rec.data.loader import RING_SWITCH
from targets.haste_rec.data.shared_ring import HOLD, RingLoader
from targets.haste_rec.embeddings.row_ops import TableLayout
from targets.haste_rec.knobs import KNOB_SPACE
from targets.haste_rec.session import loader_first
from targets.haste_rec.target import training_data

CPU = torch.device("cpu")


def batches(monkeypatch, ring: bool, workers: int, count: int, size: str = "tiny") -> list[bytes]:
    monkeypatch.setenv(RING_SWITCH, "1" if ring else "0")
    source, preset = training_data(size, 0)
    config = KNOB_SPACE.resolve({"data_workers": workers, "pack_batches": True})
    stream = loader_first(source, preset, config, CPU)
    assert (stream.ring is not None) == ring
    out = [bytes(next(stream).buffer.numpy()) for _ in range(count)]
    if stream.ring is not None:
        stream.ring.close()
    return out


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_the_ring_gives_the_bytes_the_dataloader_gives_in_the_same_order(monkeypatch, workers):
    assert batches(monkeypatch, True, workers, 10) == batches(monkeypatch, False, workers, 10)


def test_slots_that_would_crowd_shared_memory_give_way_to_the_dataloader(monkeypatch, capsys):
    """Where /dev/shm is small (a container's default is 64 MB), the loader hands packed batches over as
    storages, the same bytes, and says why; the ring takes at most SHM_SHARE of what is free."""
    reference = batches(monkeypatch, False, 2, 6)
    monkeypatch.setattr(shared_ring, "shared_memory_free", lambda: 4096)  # one page
    monkeypatch.setenv(RING_SWITCH, "1")
    source, preset = training_data("tiny", 0)
    stream = loader_first(source, preset, KNOB_SPACE.resolve({"data_workers": 2, "pack_batches": True}), CPU)
    assert stream.ring is None
    assert [bytes(next(stream).buffer.numpy()) for _ in range(6)] == reference
    assert "of /dev/shm" in capsys.readouterr().err


def test_a_batch_is_not_rewritten_until_the_trainer_has_taken_hold_more():
    source, preset = training_data("tiny", 0)
    pack = TableLayout(preset.table_rows).pack
    ring = RingLoader(source, pack, workers=2, slots_per_worker=1)
    try:
        taken, copies = [], []
        for _ in range(12):
            taken.append(next(ring))
            copies.append(taken[-1].buffer.clone())  # the bytes as the trainer got them
        assert all(torch.equal(c, pack(source.train_batch(i)).buffer) for i, c in enumerate(copies))
        # the last HOLD batches' slots are still held, so their bytes are unchanged...
        assert all(torch.equal(b.buffer, c) for b, c in zip(taken[-HOLD:], copies[-HOLD:]))
        # ...while the first batches' slots have since been reused (2 workers x 3 slots for 12 batches)
        assert ring.per_worker == 1 + 2
        assert any(not torch.equal(b.buffer, c) for b, c in zip(taken[:4], copies[:4]))
    finally:
        ring.close()


def test_a_batch_larger_than_its_slot_crosses_as_its_own_storage(monkeypatch):
    monkeypatch.setattr(shared_ring, "SLOT_HEADROOM", 0.5)  # every slot too small
    source, preset = training_data("tiny", 0)
    pack = TableLayout(preset.table_rows).pack
    ring = RingLoader(source, pack, workers=2)
    try:
        got = [next(ring).buffer for _ in range(6)]
        assert all(torch.equal(g, pack(source.train_batch(i)).buffer) for i, g in enumerate(got))
        assert not ring.out  # no slot held: each went straight back
    finally:
        ring.close()


class _Failing:
    def train_batch(self, index: int):
        if index >= 3:
            raise ValueError(f"no batch {index}")
        return training_data("tiny", 0)[0].train_batch(index)


@pytest.mark.parametrize("exited", [False, True])
def test_a_failing_worker_is_raised_in_the_trainer(exited):
    """Its error, named, also when the worker has exited before the trainer gives its last slot back (as on an
    H200, where the trainer then raised a broken pipe)."""
    source, preset = training_data("tiny", 0)
    failing = _Failing()
    ring = RingLoader(failing, TableLayout(preset.table_rows).pack, workers=1)
    try:
        for _ in range(3):
            next(ring)
        if exited:
            ring.procs[0].join(timeout=30)
            assert not ring.procs[0].is_alive()
        with pytest.raises(RuntimeError, match="loader worker 0 failed: ValueError: no batch 3"):
            next(ring)
    finally:
        ring.close()


def test_closing_the_ring_ends_its_workers():
    source, preset = training_data("tiny", 0)
    ring = RingLoader(source, TableLayout(preset.table_rows).pack, workers=2)
    next(ring)
    procs = list(ring.procs)
    start = time.perf_counter()
    ring.close()
    assert [p.exitcode for p in procs] == [0, 0]  # each saw its pipe close and returned, none was killed
    assert time.perf_counter() - start < 2.0


def losses(config: dict, device: str, steps: int = 12) -> list[float]:
    """The losses of a fresh session, deterministic as a numerics run is (class exact compares them bitwise),
    leaving this process's thread count and algorithm settings as they were."""
    from targets.haste_rec.target import build
    from targets.worker import make_deterministic
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    make_deterministic(torch.device(device))
    try:
        session = build(KNOB_SPACE.resolve(config), "tiny", {}, device, 0)
        return [float(session.step()) for _ in range(steps)]
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


@pytest.mark.parametrize("placement", [{}, {"embedding_placement": "host", "embedding_grad_mode": "sparse"}])
def test_training_from_the_ring_is_bitwise_the_training_without_workers(placement):
    """The trainer reads the slots in place on the CPU (and host tables read their ids there on a GPU): a slot
    rewritten too early would change the losses."""
    packed = {"pack_batches": True, **placement}
    assert losses({**packed, "data_workers": 2}, "cpu") == losses(packed, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("data", [{"pin_memory": True}, {"pin_memory": True, "prefetch_to_device": True},
                                  {"prefetch_to_device": True}])
def test_on_a_gpu_pinned_and_prefetched_slots_train_bitwise_alike(data, workers):
    packed = {"pack_batches": True, "embedding_grad_mode": "fused"}
    assert losses({**packed, **data, "data_workers": workers}, "cuda") == losses(packed, "cuda")


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_timing_workers_with_four_ring_workers_get_ready_and_measure(device):
    """Through the real path: timing workers (forked from the fork server where it serves) each start a ring of
    four loader workers, pinned and prefetched on a GPU. On 2026-11-30 such a worker at `large` on an H200 never
    got ready (the TPE oracle's incumbent); two ring workers had measured normally at `xl`."""
    from targets.worker_protocol import WorkerRequest
    from validators.speedup import measure_ab
    config = {"data_workers": 4, "pack_batches": True, "pin_memory": True, "prefetch_to_device": True,
              "embedding_grad_mode": "fused", "optimizer_impl": "foreach"}
    if device == "cuda":  # the rest of that incumbent's config (#56): the fused Triton tail as it had it
        config.update(tail_backend="triton-fused-loss", tail_fp32_dot="tf32x3", tail_block_b=128, tail_num_warps=8,
                      tail_num_stages=1)
    spec = WorkerRequest(target="haste-rec", size="tiny", mode="bench", device=device, warmup=1, config=config)
    result = measure_ab(spec, spec, blocks=2, steps_per_block=2, timeout_s=120)
    assert result.verdict != "failed", (result.failure.message, result.failure.detail)


def test_a_worker_that_dies_is_raised_in_the_trainer():
    source, preset = training_data("tiny", 0)
    ring = RingLoader(source, TableLayout(preset.table_rows).pack, workers=2)
    try:
        next(ring)
        ring.procs[1].kill()
        with pytest.raises(RuntimeError, match=r"loader worker 1 exited \(code -9\)"):
            for _ in range(40):
                next(ring)
    finally:
        ring.close()


def test_the_ring_says_how_many_batches_its_workers_can_build_ahead():
    """``banked_steps`` runs that many steps untimed before a timed window, so none of them was built earlier."""
    source, preset = training_data("tiny", 0)
    ring = RingLoader(source, TableLayout(preset.table_rows).pack, workers=2, slots_per_worker=4)
    try:
        for _ in range(HOLD + 2):  # steady state: the last HOLD batches taken hold their slots
            next(ring)
        time.sleep(2.0)  # every free slot filled
        ready = sum(1 for conn in ring.filled for _ in iter(lambda c=conn: c.poll(0) and c.recv(), False))
        assert ring.ahead == 2 * (4 + 2) - HOLD == ready
    finally:
        ring.close()

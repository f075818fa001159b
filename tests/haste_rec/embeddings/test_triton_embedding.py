"""Triton embedding kernels against float64 references, the embedding slots, and the store and trainer
with embedding_backend triton against torch.

Without a GPU the kernels run on Triton's CPU interpreter (fp32 and fp16 only: it computes bf16
wrongly) at small shapes; with one they are compiled and run there in fp32, fp16 and bf16, at larger
ragged shapes too. Outputs are poisoned with NaN before each call, so an unwritten element fails.

GPU command: .venv/bin/python -m pytest tests/haste_rec/embeddings/test_triton_embedding.py -q
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():  # no GPU: Triton's CPU interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")

pytest.importorskip("triton")

from targets.haste_rec.embeddings import triton_embedding as te  # noqa: E402
from targets.haste_rec.embeddings.embedding_config import EmbeddingConfig  # noqa: E402
from targets.haste_rec.embeddings.embedding_slots import (EMBEDDING_SLOTS, TORCH_EMBEDDING_IMPLS,  # noqa: E402
                                                          fused_update_inputs, fused_update_reference,
                                                          pool_forward_inputs, pool_forward_reference, rows_read_bytes)
from targets.haste_rec.embeddings.embeddings import EmbeddingStore  # noqa: E402
from targets.haste_rec.knobs import KNOB_SPACE  # noqa: E402
from targets.protocol import ConfigError  # noqa: E402
from tests.haste_rec.embeddings import test_embeddings as store_tests  # noqa: E402
from tests.haste_rec.cache.test_cache import one_intra_op_thread  # noqa: E402,F401 (autouse)
from validators.kernel import check_kernel  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
ON_GPU = DEVICE.type == "cuda"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # max error / max |reference|
SHAPES = [
    {"T": 3, "B": 7, "P": 5, "R": 50, "D": 13, "Q": 11, "weighted": 1, "ragged": 1},   # repeats, empty bags
    # hot rows > chunk (32 too: B*P lookups over Q rows); interpreted at fewer bags (each a slow program there)
    {"T": 2, "B": 33, "P": 9, "R": 1000, "D": 70, "Q": 5, "weighted": 0, "ragged": 1} if ON_GPU else
    {"T": 2, "B": 12, "P": 9, "R": 1000, "D": 70, "Q": 3, "weighted": 0, "ragged": 1},
    {"T": 2, "B": 3, "P": 2, "R": 7, "D": 4100, "Q": 3, "weighted": 1, "ragged": 0},    # rows wider than a tile
    {"T": 1, "B": 1, "P": 1, "R": 1, "D": 1, "Q": 1, "weighted": 1, "ragged": 1},       # unit
] + ([
    {"T": 5, "B": 999, "P": 13, "R": 20011, "D": 129, "Q": 3001, "weighted": 1, "ragged": 1},
    {"T": 2, "B": 4001, "P": 20, "R": 100_003, "D": 64, "Q": 7, "weighted": 0, "ragged": 1},  # ~11k per row
    {"T": 26, "B": 1024, "P": 20, "R": 50_000, "D": 128, "Q": 18_000, "weighted": 0, "ragged": 0},
] if ON_GPU else [])
IDS = ["T{T}_B{B}_P{P}_R{R}_D{D}_Q{Q}_w{weighted}".format(**s) for s in SHAPES]


def _inputs(make, shape: dict, dtype: torch.dtype, seed: int = 0) -> tuple:
    return make(shape, dtype, DEVICE, torch.Generator(device=DEVICE).manual_seed(seed))


def _f64(inputs: tuple) -> tuple:
    return tuple(t.double() if torch.is_tensor(t) and t.is_floating_point() else t for t in inputs)


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape and got.device.type == DEVICE.type
    got, want = got.double().cpu(), want.cpu()
    assert not torch.isnan(got).any(), "unwritten (NaN-poisoned) output elements"
    err = (got - want).abs().max().item() if want.numel() else 0.0
    scale = max(want.abs().max().item() if want.numel() else 0.0, 1e-30)
    assert err / scale <= TOL[dtype], f"max error {err / scale:.3g} of max |reference| > {TOL[dtype]}"


def _nan(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


# ----------------------------------------------------------------------------- pooled forward

@pytest.mark.parametrize("block_n", [None, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_pool_forward(shape: dict, dtype: torch.dtype, block_n: int | None) -> None:
    ids, offsets, weights, rows = inputs = _inputs(pool_forward_inputs, shape, dtype)
    out = te.embedding_pool_forward(ids, offsets, weights, rows, out=_nan((offsets.numel(), rows.shape[1]), dtype),
                                    block_n=block_n)
    _check(out, pool_forward_reference(*_f64(inputs)), dtype)


def test_pool_forward_strided_rows_and_empty_batch() -> None:
    ids, offsets, weights, rows = _inputs(pool_forward_inputs, SHAPES[0], torch.float32)
    wide = torch.zeros(rows.shape[0], 3 * rows.shape[1], device=DEVICE)
    wide[:, 5:5 + rows.shape[1]] = rows  # row stride 3D, unit stride along D
    view = wide[:, 5:5 + rows.shape[1]]
    want = pool_forward_reference(*_f64((ids, offsets, weights, rows)))
    _check(te.embedding_pool_forward(ids, offsets, weights, view), want, torch.float32)
    empty = te.embedding_pool_forward(ids[:0], torch.zeros(4, dtype=torch.int64, device=DEVICE), None, rows,
                                      out=_nan((4, rows.shape[1]), torch.float32))
    assert torch.equal(empty, torch.zeros_like(empty))


# ----------------------------------------------------------------------------- fused update

@pytest.mark.parametrize("chunk", [32, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_fused_update(shape: dict, dtype: torch.dtype, chunk: int) -> None:
    """The slot form: new weights | state of the touched rows; the inputs are left as they were."""
    inputs = _inputs(fused_update_inputs, shape, dtype)
    before = [t.clone() if torch.is_tensor(t) else t for t in inputs]
    want = fused_update_reference(*_f64(inputs))
    if want.numel() and want.abs().max().item() > torch.finfo(dtype).max:
        pytest.skip(f"the hot rows' Adagrad state exceeds {dtype}'s range at this shape (inf is the right answer)")
    out = te.embedding_fused_update(*inputs, out=_nan(tuple(want.shape), dtype), chunk=chunk)
    _check(out, want, dtype)
    assert all(torch.equal(a, b) for a, b in zip(inputs, before) if torch.is_tensor(a))


@pytest.mark.parametrize("with_state_index", [False, True])
@pytest.mark.parametrize("shape", SHAPES[:2], ids=IDS[:2])
def test_fused_update_in_place(shape: dict, with_state_index: bool) -> None:
    """The trainer's form: touched rows and states updated in place (states through an index, as in the
    row cache), every other row and state bitwise unchanged, and each row's squared gradient norm returned."""
    ids, offsets, weights, grad, rows, state, lr, eps = inputs = _inputs(fused_update_inputs, shape, torch.float32)
    want = fused_update_reference(*_f64(inputs))
    touched = torch.unique(ids)
    index = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(1)).to(DEVICE)
    states = state.clone()
    if with_state_index:
        states[index] = state  # row r's state sits at index[r]
    new_rows = rows.clone()
    sq = te.embedding_fused_update_(ids, offsets, weights, grad, new_rows, states, lr, eps,
                                    state_index=index if with_state_index else None, chunk=4)
    new_state = states[index] if with_state_index else states
    _check(torch.cat([new_rows[touched], new_state[touched]], dim=1), want, torch.float32)
    untouched = torch.ones(rows.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[touched] = False
    assert torch.equal(new_rows[untouched], rows[untouched]) and torch.equal(new_state[untouched], state[untouched])
    from targets.haste_rec.embeddings.row_ops import make_lookup, row_gradients
    f64 = _f64(inputs)
    row_sq = row_gradients(f64[3], make_lookup(f64[0], f64[1], f64[2], DEVICE)).pow(2).sum(dim=1)
    _check(sq, row_sq, torch.float32)


def test_fused_update_is_deterministic() -> None:
    """No atomics: hot rows split into chunks still sum in one fixed order, run after run."""
    inputs = _inputs(fused_update_inputs, SHAPES[0], torch.float32, seed=3)
    first = te.embedding_fused_update(*inputs, chunk=2)
    assert all(torch.equal(first, te.embedding_fused_update(*inputs, chunk=2)) for _ in range(2))


def test_empty_batch_updates_nothing() -> None:
    ids, offsets, weights, grad, rows, state, lr, eps = _inputs(fused_update_inputs, SHAPES[0], torch.float32)
    kept_rows, kept_state = rows.clone(), state.clone()
    sq = te.embedding_fused_update_(ids[:0], offsets[:0], None, grad[:0], rows, state, lr, eps)
    assert sq.numel() == 0 and torch.equal(rows, kept_rows) and torch.equal(state, kept_state)


def test_shape_contract() -> None:
    ids, offsets, weights, grad, rows, state, lr, eps = _inputs(fused_update_inputs, SHAPES[0], torch.float32)
    bad_calls = [
        lambda: te.embedding_pool_forward(ids.int(), offsets, weights, rows),
        lambda: te.embedding_pool_forward(ids, offsets.int(), weights, rows),
        lambda: te.embedding_pool_forward(ids, offsets, weights[:-1], rows),
        lambda: te.embedding_pool_forward(ids, offsets, weights, rows.t().contiguous().t()),
        lambda: te.embedding_pool_forward(ids, offsets, weights, rows, out=torch.empty(3, 3, device=DEVICE)),
        lambda: te.embedding_fused_update(ids, offsets, weights, grad[:-1], rows, state, lr, eps),
        lambda: te.embedding_fused_update(ids, offsets, weights, grad, rows, state.expand(-1, 2), lr, eps),
        lambda: te.embedding_fused_update(ids, offsets, weights, grad, rows, state, lr, eps, chunk=0),
    ]
    for call in bad_calls:
        with pytest.raises((ValueError, TypeError)):
            call()


# ----------------------------------------------------------------------------- meta-parameters (EmbeddingKernelConfig)

KC = te.EmbeddingKernelConfig
SWEPT = KC(tile_elements=1024, num_warps=2)  # the H200 sweep's best at 26 x 1M x 128
OTHER_CONFIGS = [KC(tile_elements=4096, num_warps=4, num_stages=3),  # the launch before the knobs
                 KC(tile_elements=8192, num_warps=8, num_stages=2),
                 KC(tile_elements=64, num_stages=1)]  # 64: D=70 rows split over two column programs


def test_default_config_is_bitwise_the_swept_launch() -> None:
    """The default config launches the sweep's best (1024-element tile, 2 warps) where those are its rules: same bits."""
    for shape in SHAPES[:3]:
        ids, offsets, weights, rows = _inputs(pool_forward_inputs, shape, torch.float32)
        assert torch.equal(te.embedding_pool_forward(ids, offsets, weights, rows),
                           te.embedding_pool_forward(ids, offsets, weights, rows, config=SWEPT))
    for shape in SHAPES[:2]:  # D <= 128: the update's auto warps are 2 there
        inputs = _inputs(fused_update_inputs, shape, torch.float32)
        assert torch.equal(te.embedding_fused_update(*inputs, chunk=4),
                           te.embedding_fused_update(*inputs, chunk=4, config=SWEPT))


@pytest.mark.parametrize("config", OTHER_CONFIGS, ids=lambda c: f"tile{c.tile_elements}_w{c.num_warps}_s{c.num_stages}")
def test_other_configs_stay_in_the_reorder_band(config) -> None:
    """Pooled forward and fused update (hot rows chunked) at non-default tiles, warps and stages: within the
    fp32 tolerance of the float64 reference, every output element written."""
    for shape in SHAPES[:3] if config.tile >= 1024 else SHAPES[:2]:  # tile 64 at D=4100: 65 programs a bag
        ids, offsets, weights, rows = inputs = _inputs(pool_forward_inputs, shape, torch.float32)
        out = te.embedding_pool_forward(ids, offsets, weights, rows, config=config,
                                        out=_nan((offsets.numel(), rows.shape[1]), torch.float32))
        _check(out, pool_forward_reference(*_f64(inputs)), torch.float32)
        inputs = _inputs(fused_update_inputs, shape, torch.float32)
        want = fused_update_reference(*_f64(inputs))
        out = te.embedding_fused_update(*inputs, out=_nan(tuple(want.shape), torch.float32), chunk=4, config=config)
        _check(out, want, torch.float32)


def test_resolve_is_a_fixed_rule_of_the_shape() -> None:
    auto, wide, big = te.DEFAULT_EMBEDDING_CONFIG, KC(tile_elements=4096), KC(8192, 8, 2)
    Launch = te.Launch
    # gather-sum: (BLOCK_N, BLOCK_D, warps, stages); a whole row up to the tile, BLOCK_N = the segment's power of two
    assert auto.resolve_gather_sum(128, 20) == Launch(8, 128, 2, None)      # the H200 sweep's best at 26 x 1M x 128
    assert auto.resolve_gather_sum(13, 5) == Launch(8, 16, 2, None)
    assert auto.resolve_gather_sum(8192, 20) == Launch(1, 1024, 2, None)
    assert wide.resolve_gather_sum(128, 20) == Launch(32, 128, 4, None)     # what the kernels launched before knobs
    assert big.resolve_gather_sum(128, 100) == Launch(64, 128, 8, 2)
    # update: (BLOCK_R, BLOCK_D, warps, stages); whole rows, BLOCK_R = tile / BLOCK_D in [1, 16]; warps by tile size
    assert auto.resolve_update(128) == Launch(8, 128, 2, None)
    assert auto.resolve_update(256) == Launch(4, 256, 2, None)
    assert auto.resolve_update(4100) == Launch(1, 8192, 8, None)
    assert auto.resolve_update(128, block_r=2) == Launch(2, 128, 2, None)
    assert wide.resolve_update(128) == Launch(16, 128, 4, None)
    assert wide.resolve_update(512) == Launch(8, 512, 4, None)
    assert KC(tile_elements=8192).resolve_update(512) == Launch(16, 512, 8, None)
    assert big.resolve_update(70) == Launch(16, 128, 8, 2)
    assert Launch(8, 128, 4, None).options() == {"num_warps": 4}
    assert Launch(8, 128, 4, 2).options() == {"num_warps": 4, "num_stages": 2}
    assert auto == KC() == KC("auto", "auto", "auto") and auto.resolve_update(128) == KC().resolve_update(128)


@pytest.mark.parametrize("field,value,words", [
    ("tile_elements", 100, "a power of two from 16 to 16384"),
    ("tile_elements", 8, "a power of two"),
    ("tile_elements", 32768, "a power of two"),
    ("tile_elements", "1024", "a power of two"),
    ("num_warps", 3, "one of 1, 2, 4, 8, 16, 32"),
    ("num_warps", True, "one of"),
    ("num_stages", 0, "an integer from 1 to 8"),
    ("num_stages", "fast", "an integer"),
])
def test_bad_meta_parameters_are_value_errors(field: str, value, words: str) -> None:
    with pytest.raises(ValueError, match=f"EmbeddingKernelConfig.{field} must be 'auto' or {words}.*got {value!r}"):
        KC(**{field: value})


def test_kernel_knobs() -> None:
    names = [k.name for k in KNOB_SPACE]
    at = names.index("embedding_backend")
    assert names[at + 1:at + 4] == ["embedding_tile_elements", "embedding_num_warps", "embedding_num_stages"]
    for name, choices, numerics in (("embedding_tile_elements", ("auto", 1024, 2048, 4096, 8192), "reorder"),
                                    ("embedding_num_warps", ("auto", 2, 4, 8), "reorder"),
                                    ("embedding_num_stages", ("auto", 1, 2, 3, 4), "exact")):
        knob = KNOB_SPACE[name]
        assert (knob.default, knob.choices, knob.category, knob.numerics) == ("auto", choices, "kernel", numerics)
        assert knob.parse(str(choices[1])) == choices[1] and knob.why
        for value in choices[1:]:  # every value is a valid config
            KC(**{name.removeprefix("embedding_"): value})
        assert not knob.is_active(KNOB_SPACE.resolve({}))
        assert not knob.is_active(KNOB_SPACE.resolve({"embedding_backend": "triton"}))  # grad mode dense: torch
        assert knob.is_active(KNOB_SPACE.resolve({"embedding_backend": "triton", "embedding_grad_mode": "fused"}))
        assert knob.is_active(KNOB_SPACE.resolve({"embedding_backend": "triton", "embedding_grad_mode": "sparse"}))


def test_store_passes_the_config_to_both_kernels(monkeypatch) -> None:
    """EmbeddingConfig's triton_* fields reach the pooled forward and the fused update; bad ones fail at build."""
    cfg = replace(store_tests.BASE, grad_mode="fused", backend="triton", triton_tile_elements=1024,
                  triton_num_warps=2, triton_num_stages=2)
    configs = []
    real = te.embedding_pool_forward
    monkeypatch.setattr(te, "embedding_pool_forward", lambda *a, **kw: configs.append(kw["config"]) or real(*a, **kw))
    rows = EmbeddingStore(store_tests.TABLE_ROWS, store_tests.DIM, cfg, DEVICE, 0,
                          max_unique_per_batch=store_tests.MAX_UNIQUE)._rows
    assert rows.fused_kernel.keywords["config"] == KC(1024, 2, 2)
    ids, offsets, weights, table = _inputs(pool_forward_inputs, SHAPES[0], torch.float32)
    rows.pool(ids, table, offsets, weights)
    assert configs == [KC(1024, 2, 2)]
    with pytest.raises(ValueError, match="tile_elements"):
        EmbeddingStore(store_tests.TABLE_ROWS, store_tests.DIM, replace(cfg, triton_tile_elements=100), DEVICE, 0)


# ----------------------------------------------------------------------------- the slots

def test_slots_pass_the_kernel_validator() -> None:
    """validators.kernel on the Triton implementations: fresh inputs, ragged prime shapes, poisoned
    outputs, inputs compared bitwise after the call."""
    for slot in EMBEDDING_SLOTS:
        verdict = check_kernel(slot, te.TRITON_EMBEDDING_IMPLS[slot.name], DEVICE, torch.float32, seed=11,
                               max_flops=2e8 if ON_GPU else 1e5)  # GPU: all but the 13 GB benchmark shape
        assert verdict.ok, verdict.reason


@pytest.mark.parametrize("slot", EMBEDDING_SLOTS, ids=lambda s: s.name)
def test_slot_costs_count_the_inputs(slot) -> None:
    """N = T*B*P lookups and U = T*Q distinct rows exactly, so the byte model matches the real inputs."""
    for shape in SHAPES[:2]:
        inputs = slot.make_inputs(shape, torch.float32, "cpu", torch.Generator().manual_seed(2))
        ids, offsets, weights = inputs[:3]
        N, U, D = ids.numel(), torch.unique(ids).numel(), shape["D"]
        assert N == shape["T"] * shape["B"] * shape["P"] and U == shape["T"] * shape["Q"]
        assert offsets.numel() == shape["T"] * shape["B"] and (offsets.diff() >= 0).all()
        table_of_bag = torch.arange(offsets.numel()) // shape["B"]
        bag_of = torch.searchsorted(offsets, torch.arange(N), right=True) - 1
        assert torch.equal(ids // shape["R"], table_of_bag[bag_of])  # each bag draws from its own table
        index_bytes = 8 * (N + offsets.numel()) + (4 * N if weights is not None else 0)
        if slot.name == "embedding_pool_forward":
            expected = index_bytes + 4 * U * D + 4 * offsets.numel() * D
        else:
            expected = index_bytes + 4 * offsets.numel() * D + 2 * 4 * U * (D + 1)
        assert slot.cost(shape, torch.float32).bytes == expected
        assert rows_read_bytes(shape, torch.float32) == 4 * N * D


def test_slot_registry_and_inputs_are_fresh() -> None:
    assert set(TORCH_EMBEDDING_IMPLS) == set(te.TRITON_EMBEDDING_IMPLS) == {"embedding_pool_forward",
                                                                            "embedding_fused_update"}
    for slot in EMBEDDING_SLOTS:
        assert slot.signature.startswith(slot.name + "(") and len(slot.shapes) >= 2 and slot.why
        first, again, other = (slot.make_inputs(SHAPES[0], torch.float32, "cpu", torch.Generator().manual_seed(s))
                               for s in (1, 1, 2))
        floats = [(a, b, c) for a, b, c in zip(first, again, other) if torch.is_tensor(a) and a.is_floating_point()]
        assert floats and all(torch.equal(a, b) and not torch.equal(a, c) for a, b, c in floats)


def test_slot_references_match_independent_float64_math() -> None:
    ids, offsets, weights, grad, rows, state, lr, eps = fused_update_inputs(SHAPES[0], torch.float64, "cpu",
                                                                            torch.Generator().manual_seed(4))
    ends = offsets.tolist()[1:] + [ids.numel()]
    pooled = torch.stack([(rows[ids[a:b]] * weights[a:b, None]).sum(0) for a, b in zip(offsets.tolist(), ends)])
    torch.testing.assert_close(pool_forward_reference(ids, offsets, weights, rows), pooled)
    bag_of = torch.searchsorted(offsets, torch.arange(ids.numel()), right=True) - 1
    dense = torch.zeros_like(rows).index_add_(0, ids, grad[bag_of] * weights[:, None])
    touched = torch.unique(ids)
    g = dense[touched]
    new_state = state[touched] + (g * g).mean(dim=1, keepdim=True)
    new_rows = rows[touched] - lr * g / (new_state.sqrt() + eps)
    torch.testing.assert_close(fused_update_reference(ids, offsets, weights, grad, rows, state, lr, eps),
                               torch.cat([new_rows, new_state], dim=1))


# ----------------------------------------------------------------------------- the store and the trainer

RIDING = {"cache_fraction": 0.3, "opt_state_cache_fraction": 0.3}  # equal: the state rides in the weights' slots
STORE_CONFIGS = [("device", "fused", {}), ("device", "sparse", {}), ("cached", "fused", {}), ("host", "fused", {}),
                 ("cached", "fused", RIDING)]


@pytest.mark.parametrize("placement,grad_mode,caches", STORE_CONFIGS)
def test_store_backend_triton_follows_torch(placement: str, grad_mode: str, caches: dict, monkeypatch) -> None:
    """The store's ten-step trajectory (test_embeddings; its first five interpreted, where each lookup and
    update is slow, and the caches already hit, miss and write back) with backend triton: reorder-close to
    torch's, and the cache sees the same hits, misses and traffic (the riding state updated in its weights'
    slots)."""
    if not ON_GPU:
        monkeypatch.setattr(store_tests, "STEPS", 5)
    cfg = replace(store_tests.BASE, placement=placement, grad_mode=grad_mode, **caches)
    want = store_tests.train(cfg, DEVICE)
    got = store_tests.train(replace(cfg, backend="triton"), DEVICE)
    store_tests.assert_same(got, want, exact=False)
    # store_tests.reference(DEVICE, "fused"), not from its cache (which holds the ten-step trajectory)
    store_tests.assert_same(got, store_tests.train(replace(store_tests.BASE, grad_mode="fused"), DEVICE), exact=False)
    assert got.counters == want.counters


def test_triton_runs_where_documented() -> None:
    def rows(placement: str, grad_mode: str, **kw):
        cfg = replace(store_tests.BASE, placement=placement, grad_mode=grad_mode, backend="triton", **kw)
        return EmbeddingStore(store_tests.TABLE_ROWS, store_tests.DIM, cfg, DEVICE, 0,
                              max_unique_per_batch=store_tests.MAX_UNIQUE)._rows
    assert rows("device", "fused").pool is not None and rows("device", "fused").fused_kernel is not None
    assert rows("cached", "fused").fused_kernel is not None and rows("host", "fused").fused_kernel is None
    assert rows("device", "sparse").fused_kernel is None and not rows("device", "sparse").weight.requires_grad
    from targets.haste_rec.embeddings.row_ops import pool
    assert rows("device", "dense").pool is pool and rows("host", "sparse").pool is not pool


def test_backend_knob_and_config() -> None:
    knob = KNOB_SPACE["embedding_backend"]
    assert (knob.default, knob.choices, knob.category, knob.numerics) == ("torch", ("torch", "triton"), "kernel",
                                                                          "reorder")
    names = [k.name for k in KNOB_SPACE]
    assert names.index("embedding_backend") == names.index("embedding_grad_mode") + 1
    with pytest.raises(ConfigError, match="backend must be one of"):
        EmbeddingConfig(backend="cuda")


def test_triton_on_the_cpu_needs_the_interpreter(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = replace(store_tests.BASE, grad_mode="fused", backend="triton")
    with pytest.raises(ConfigError) as raised:
        EmbeddingStore(store_tests.TABLE_ROWS, store_tests.DIM, cfg, torch.device("cpu"), 0)
    assert str(raised.value) == "embedding_backend triton needs a CUDA device (or TRITON_INTERPRET=1 on the CPU)"


def _numerics(overrides: dict, steps: int):
    from targets.haste_rec.target import build
    from targets.worker_protocol import NumericsData
    session = build(KNOB_SPACE.resolve(overrides), "tiny", {}, DEVICE, 0)
    session.record_grad_norms = True
    losses, norms = [], []
    for _ in range(steps):
        losses.append(float(session.step()))
        norms.append(session.grad_norms())
    data = NumericsData(losses=losses, grad_norms=norms, probe=session.probe(), digest=session.param_digest())
    return data, session


def test_trainer_backend_triton_within_the_reorder_band() -> None:
    """size tiny, grad mode fused: triton vs torch by validators.numerics (30 steps on a GPU, 3 interpreted),
    with the kernels' default meta-parameters and with non-default embedding_* kernel knobs."""
    from validators.numerics import compare
    steps = 30 if ON_GPU else 3
    base, _ = _numerics({"embedding_grad_mode": "fused"}, steps)
    cand, session = _numerics({"embedding_grad_mode": "fused", "embedding_backend": "triton"}, steps)
    assert session.model.embeddings.cfg.backend == "triton", \
        "model.embedding_config must pass config['embedding_backend'] to EmbeddingConfig(backend=...)"
    verdict = compare(base, cand, "reorder")
    assert verdict.ok, verdict.detail
    knobs = {"embedding_tile_elements": 1024, "embedding_num_warps": 2, "embedding_num_stages": 2}
    tuned, session = _numerics({"embedding_grad_mode": "fused", "embedding_backend": "triton", **knobs}, steps)
    assert session.model.embeddings._rows.fused_kernel.keywords["config"] == KC(1024, 2, 2), \
        "model.embedding_config must pass the embedding_* kernel knobs to EmbeddingConfig(triton_...)"
    verdict = compare(base, tuned, "reorder")
    assert verdict.ok, verdict.detail

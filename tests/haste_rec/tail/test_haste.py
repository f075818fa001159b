"""HasteOutput: the group-shared tail equals a masked dense layer, every backend, rewiring, label maps."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # no GPU: Triton's CPU interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from targets.haste_rec.tail.haste import HasteOutput, zero_rewired_state  # noqa: E402
from targets.haste_rec.tail.tail_slots import tail_forward  # noqa: E402
from targets.protocol import ConfigError  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# The Triton backends run on CUDA, or on the CPU interpreter in fp32 (it computes bf16 wrongly).
TRITON_BACKENDS = ["triton", "triton-fused-loss"] if importlib.util.find_spec("triton") else []


def _skip_unsupported(backend: str, device: str, dtype: torch.dtype, autocast: bool = False) -> None:
    if backend not in TRITON_BACKENDS:
        return
    if dtype == torch.float64:
        pytest.skip("the Triton tail kernels take fp32, fp16 and bf16")
    if device == "cpu" and (torch.cuda.is_available() or autocast):
        pytest.skip("the Triton interpreter runs the CPU tests without a GPU, in fp32")


def _layer(seed: int, n_head: int, n_tail: int, G: int, H: int = 24, tail_dims: int = 19, F: int = 6,
           dtype: torch.dtype = torch.float32, device: str = "cpu", **kwargs) -> HasteOutput:
    """A layer over n_head + n_tail labels shuffled between head and tail, the tail in groups of G."""
    labels = torch.randperm(n_head + n_tail, generator=torch.Generator().manual_seed(seed))
    groups = torch.full((math.ceil(n_tail / G) * G,), -1)
    groups[:n_tail] = labels[n_head:]
    layer = HasteOutput(H, tail_dims, labels[:n_head], groups.reshape(-1, G), F, seed=seed, **kwargs)
    with torch.no_grad():  # non-zero tail biases, so they are checked too
        layer.tail_bias.normal_(generator=torch.Generator().manual_seed(seed + 1))
    return layer.to(device, dtype)


def _random_case(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    H = draw(8, 40)
    tail_dims = draw(2, H)
    G = draw(2, 9)
    return {"H": H, "tail_dims": tail_dims, "F": draw(1, tail_dims), "G": G, "n_tail": draw(1, 6) * G + draw(1, G - 1)}


# ----------------------------------------------------------------------------- dense equivalence

def _dense_forward(layer: HasteOutput, h: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    tail = h[:, :layer.tail_dims] @ dense.T + layer.tail_bias.reshape(-1)
    return tail if layer.head is None else torch.cat([layer.head(h), tail], dim=1)


@pytest.mark.parametrize("backend", ["torch", "slots"] + TRITON_BACKENDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-11), (torch.float32, 1e-5)])
@pytest.mark.parametrize("n_head", [0, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("device", DEVICES)
def test_tail_equals_masked_dense_layer(backend: str, dtype: torch.dtype, tol: float, n_head: int, seed: int,
                                        device: str) -> None:
    _skip_unsupported(backend, device, dtype)
    case = _random_case(seed)
    layer = _layer(seed, n_head, case["n_tail"], case["G"], case["H"], case["tail_dims"], case["F"],
                   dtype=dtype, device=device, backend=backend)
    assert case["n_tail"] % case["G"] and not layer.valid_mask.all(), "the case must have padding"
    g = torch.Generator().manual_seed(100 + seed)
    h = torch.randn(7, case["H"], dtype=dtype, generator=g).to(device).requires_grad_(True)
    coeff = torch.randn(7, layer.n_internal, dtype=dtype, generator=g).to(device) * layer.valid_mask

    logits = layer(h)
    (logits * coeff).sum().backward()
    grads = {"h": h.grad, "w": layer.tail_weight.grad, "b": layer.tail_bias.grad}
    h_sparse_grad, h.grad = h.grad, None
    layer.zero_grad()

    dense = layer.as_dense_weight().detach().requires_grad_(True)
    expected = _dense_forward(layer, h, dense)
    (expected * coeff).sum().backward()
    K, G, F = layer.tail_weight.shape
    dense_grad = dense.grad.reshape(K, G, -1).gather(2, layer.tail_index[:, None, :].expand(K, G, F))

    close = dict(rtol=tol, atol=tol)
    torch.testing.assert_close(logits, expected, **close)
    torch.testing.assert_close(h_sparse_grad, h.grad, **close)
    torch.testing.assert_close(grads["w"], dense_grad, **close)
    torch.testing.assert_close(grads["b"], layer.tail_bias.grad, **close)
    assert (grads["w"][~layer.valid_mask[n_head:].reshape(K, G)] == 0).all(), "padded rows get no gradient"


@pytest.mark.parametrize("backend", ["slots"] + TRITON_BACKENDS)
@pytest.mark.parametrize("n_head", [0, 4])
@pytest.mark.parametrize("device", DEVICES)
def test_backends_agree_exactly_in_float32(backend: str, n_head: int, device: str) -> None:
    _skip_unsupported(backend, device, torch.float32)
    results = []
    for backend in ("torch", backend):
        layer = _layer(3, n_head, 50, 8, device=device, backend=backend)
        h = torch.randn(6, 24, generator=torch.Generator().manual_seed(0)).to(device).requires_grad_(True)
        logits = layer(h)
        logits.square().sum().backward()
        results.append((logits.detach(), h.grad, layer.tail_weight.grad, layer.tail_bias.grad))
    for name, a, b in zip(("logits", "h.grad", "tail_weight.grad", "tail_bias.grad"), *results):
        # fp32 on both sides, summed in another order (tl.dot's IEEE fp32 FMAs vs the einsum's GEMM):
        # the "reorder" class, whose error scales with the magnitude of the summed terms, not with each
        # output. 1e-5 of the tensor's largest |value| (~80 fp32 ulps of it) absorbs that, while a
        # kernel error (a dropped or doubled group, slot or batch row: typically >= 1e-3 of it) still fails.
        atol = max(1e-5 * b.abs().max().item(), 1e-6)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", ["slots"] + TRITON_BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
def test_backends_agree_under_autocast(backend: str, device: str) -> None:
    _skip_unsupported(backend, device, torch.bfloat16, autocast=True)
    results = []
    for backend in ("torch", backend):
        layer = _layer(4, 3, 45, 8, device=device, backend=backend)
        h = torch.randn(6, 24, generator=torch.Generator().manual_seed(0)).to(device).requires_grad_(True)
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = layer(h)
        logits.float().square().sum().backward()
        results.append((logits, h.grad, layer.tail_weight.grad, layer.tail_bias.grad))
    assert results[0][0].dtype == results[1][0].dtype
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------- slot overrides

def _looped_tail_forward(h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """An independent tail_forward: one matmul per group."""
    out = torch.cat([h[:, idx[k]] @ w[k].T for k in range(w.shape[0])], dim=1)
    return out if bias is None else out + bias.reshape(-1)


def test_slot_overrides_are_used() -> None:
    calls = []

    def counted(*args):
        calls.append(args)
        return _looped_tail_forward(*args)

    layer = _layer(5, 2, 30, 7, backend="slots", kernels={"tail_forward": counted})
    reference = _layer(5, 2, 30, 7)
    h = torch.randn(4, 24, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(layer(h), reference(h))
    assert len(calls) == 1 and all(t.is_contiguous() for t in calls[0] if torch.is_tensor(t))


def test_slot_output_shapes_are_checked() -> None:
    layer = _layer(5, 2, 30, 7, backend="slots",
                   kernels={"tail_backward_weight": lambda dz, h, idx: torch.zeros(idx.shape)})
    h = torch.randn(4, 24)
    with pytest.raises(ValueError, match="tail_backward_weight"):
        layer(h).sum().backward()


@pytest.mark.parametrize("kwargs", [{"backend": "cuda"}, {"kernels": {"tail_forward": tail_forward}},
                                    {"backend": "slots", "kernels": {"nope": tail_forward}}])
def test_bad_backend_settings(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        _layer(0, 1, 10, 4, **kwargs)


@pytest.mark.parametrize("head,groups", [([0, 1], [[1, 2], [3, -1]]),   # label 1 twice
                                         ([0], [[1, 3], [4, -1]]),       # label 2 missing
                                         ([-1, 0], [[1, 2]])])           # padding in the head
def test_labels_must_be_a_permutation(head: list, groups: list) -> None:
    with pytest.raises(ConfigError):
        HasteOutput(8, 8, torch.tensor(head), torch.tensor(groups), 4)


def test_fan_in_must_fit_tail_dims() -> None:
    with pytest.raises(ConfigError):
        HasteOutput(8, 4, torch.tensor([0]), torch.tensor([[1, 2]]), 5)


# ----------------------------------------------------------------------------- layout and init

def test_label_maps() -> None:
    layer = _layer(6, 7, 23, 5)
    assert layer.n_internal == 7 + 5 * 5 and layer.n_head == 7
    assert torch.equal(layer.valid_mask, layer.internal_label >= 0)
    assert torch.equal(layer.internal_label[layer.internal_position], torch.arange(30))
    assert int((~layer.valid_mask).sum()) == 2


def test_init_is_seeded_and_well_formed() -> None:
    a, b, c = _layer(7, 3, 41, 6), _layer(7, 3, 41, 6), _layer(8, 3, 41, 6)
    assert torch.equal(a.tail_index, b.tail_index) and torch.equal(a.tail_weight, b.tail_weight)
    assert not torch.equal(a.tail_index, c.tail_index)
    idx = a.tail_index
    assert idx.shape == (7, 6) and int(idx.min()) >= 0 and int(idx.max()) < a.tail_dims
    assert (idx.diff(dim=1) > 0).all(), "fan-in dims distinct (sorted at init)"
    padded = ~a.valid_mask[3:].reshape(7, 6)
    assert (a.tail_weight[padded] == 0).all() and (a.tail_weight[~padded] != 0).all()
    assert [p.shape for p in a.head_parameters()] == [(3, 24), (3,)]
    assert a.tail_parameters() == [a.tail_weight, a.tail_bias]
    assert a.as_dense_weight().shape == (42, a.tail_dims)


# ----------------------------------------------------------------------------- rewiring

def _distinct_magnitudes(layer: HasteOutput) -> None:
    with torch.no_grad():  # strengths sum_g |W| all distinct, so the weakest slots are unambiguous
        K, G, F = layer.tail_weight.shape
        scale = torch.randperm(K * F, generator=torch.Generator().manual_seed(9)).reshape(K, 1, F) + 1.0
        layer.tail_weight.copy_(layer.tail_weight.sign() * scale.to(layer.tail_weight.device))


@pytest.mark.parametrize("fraction", [0.25, 0.5])
@pytest.mark.parametrize("device", DEVICES)
def test_rewire_prunes_weakest_and_regrows_fresh_dims(fraction: float, device: str) -> None:
    layer = _layer(10, 2, 60, 8, tail_dims=20, F=8, device=device)
    _distinct_magnitudes(layer)
    before_idx, before_w = layer.tail_index.clone(), layer.tail_weight.detach().clone()
    strength = before_w.abs().sum(dim=1)
    count = round(fraction * 8)

    mask = layer.rewire(fraction, torch.Generator().manual_seed(0))

    weakest = strength.argsort(dim=1)[:, :count]
    assert torch.equal(mask, torch.zeros_like(mask).scatter_(1, weakest, True))
    assert int(mask.sum()) == 8 * count
    idx = layer.tail_index
    assert torch.equal(idx[~mask], before_idx[~mask])
    assert (idx.sort(dim=1).values.diff(dim=1) > 0).all(), "dims distinct within each group"
    assert int(idx.min()) >= 0 and int(idx.max()) < 20
    for k in range(idx.shape[0]):
        assert not set(idx[k][mask[k]].tolist()) & set(before_idx[k].tolist()), "regrown dims are new"
    assert (layer.tail_weight[mask[:, None, :].expand_as(before_w)] == 0).all()
    assert torch.equal(layer.tail_weight[~mask[:, None, :].expand_as(before_w)],
                       before_w[~mask[:, None, :].expand_as(before_w)])


@pytest.mark.parametrize("device", DEVICES)
def test_rewire_changes_logits_only_by_the_pruned_contributions(device: str) -> None:
    layer = _layer(11, 3, 40, 6, device=device)
    h = torch.randn(5, 24, generator=torch.Generator().manual_seed(1)).to(device)
    idx_before = layer.tail_index.clone()
    with torch.no_grad():
        before, dense_before = layer(h), layer.as_dense_weight()
        mask = layer.rewire(0.5, torch.Generator().manual_seed(2))
        after, dense_after = layer(h), layer.as_dense_weight()
    K, G, F = layer.tail_weight.shape
    expected = dense_before.clone().reshape(K, G, -1)
    k, f = mask.nonzero(as_tuple=True)
    expected[k[:, None], torch.arange(G, device=device)[None, :], idx_before[k, f][:, None]] = 0.0
    expected = expected.reshape(K * G, -1)
    assert torch.equal(dense_after, expected), "only the pruned entries leave; regrown ones start at zero"
    removed = h[:, :layer.tail_dims] @ (dense_before - expected).T
    torch.testing.assert_close(after[:, 3:], before[:, 3:] - removed)
    torch.testing.assert_close(after[:, :3], before[:, :3], rtol=0, atol=0)


def test_rewire_leaves_groups_with_zero_weakest_slots_unchanged() -> None:
    layer = _layer(12, 0, 40, 5)
    with torch.no_grad():
        layer.tail_weight[:4, :, :2] = 0.0  # groups 0-3 already have two dead slots
    h = torch.randn(5, 24)
    with torch.no_grad():
        before = layer(h)
        mask = layer.rewire(2 / layer.fan_in, torch.Generator().manual_seed(0))
        after = layer(h)
    assert mask[:4, :2].all() and int(mask[:4].sum()) == 8
    torch.testing.assert_close(after[:, :20], before[:, :20], rtol=0, atol=0)
    assert not torch.allclose(after[:, 20:], before[:, 20:])


def test_rewire_nothing() -> None:
    layer = _layer(13, 0, 20, 4)
    idx = layer.tail_index.clone()
    assert not layer.rewire(0.0, torch.Generator()).any()
    assert torch.equal(idx, layer.tail_index)
    with pytest.raises(ConfigError):
        layer.rewire(1.5, torch.Generator())


@pytest.mark.parametrize("device", DEVICES)
def test_zero_rewired_state_clears_moments_at_rewired_slots(device: str) -> None:
    layer = _layer(14, 3, 40, 6, device=device)
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.1)
    layer(torch.randn(5, 24, device=device)).square().sum().backward()
    optimizer.step()
    state = {name: t.clone() for name, t in optimizer.state[layer.tail_weight].items()}
    head_state = {name: t.clone() for name, t in optimizer.state[layer.head.weight].items()}
    mask = layer.rewire(0.5, torch.Generator().manual_seed(0))

    assert zero_rewired_state(optimizer, mask) == 2  # exp_avg and exp_avg_sq
    slot_mask = mask[:, None, :].expand_as(layer.tail_weight)
    for name in ("exp_avg", "exp_avg_sq"):
        now = optimizer.state[layer.tail_weight][name]
        assert (now[slot_mask] == 0).all() and (state[name][slot_mask] != 0).any()
        assert torch.equal(now[~slot_mask], state[name][~slot_mask])
    for name, value in head_state.items():
        assert torch.equal(optimizer.state[layer.head.weight][name], value)
    assert zero_rewired_state(optimizer, mask, weight=layer.tail_bias) == 0

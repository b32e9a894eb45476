"""Token weights, Radial-Directional Averaging and the per-fragment merge."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco_geo.core import merge
from ddiloco_geo.core.merge import anchor, merge_fragment, rda, token_weight, weighted_mean

pytestmark = pytest.mark.unit  # no servers, no subprocesses


def _orthogonal(m, dim, radius, seed=0):
    q, _ = torch.linalg.qr(torch.randn(dim, m, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return [(radius * q[:, i]).float() for i in range(m)]


@pytest.mark.parametrize("m", [2, 4, 8, 16])
def test_rda_of_orthogonal_equal_norm_vectors_keeps_the_norm(m):
    radius = 3.0
    vs = _orthogonal(m, 64, radius)
    ws = [1.0] * m
    assert float(rda(vs, ws).norm()) == pytest.approx(radius, rel=1e-5)
    assert float(weighted_mean(vs, ws).norm()) == pytest.approx(radius / math.sqrt(m), rel=1e-5)


def test_rda_of_identical_vectors_is_that_vector():
    v = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    out = rda([v, v.clone(), v.clone()], [1.0, 2.0, 5.0])
    assert out.shape == v.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, v, rtol=1e-6, atol=1e-7)


def test_weights_matter_and_zero_weight_has_no_effect():
    a, b, c = _orthogonal(3, 16, 1.0)
    assert torch.equal(rda([a, b], [1.0, 0.0]), a)
    torch.testing.assert_close(rda([a, b, c], [1.0, 1.0, 0.0]), rda([a, b], [1.0, 1.0]))
    heavy = rda([a, b], [9.0, 1.0])
    assert torch.dot(heavy, a) > torch.dot(heavy, b)


def test_rda_radius_is_weighted_mean_of_norms():
    a, b = _orthogonal(2, 8, 1.0)
    out = rda([2.0 * a, 4.0 * b], [3.0, 1.0])
    assert float(out.norm()) == pytest.approx((3 * 2 + 1 * 4) / 4, rel=1e-6)


def test_degenerate_direction_falls_back_to_weighted_mean():
    v = torch.randn(10, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(rda([v, -v], [1.0, 1.0]), torch.zeros(10))
    # opposite directions, different norms: the direction cancels, the weighted mean does not
    out = rda([v, -3 * v], [1.0, 1.0])
    torch.testing.assert_close(out, -v, rtol=1e-6, atol=1e-7)


def test_zero_vectors_merge_to_zero():
    z = torch.zeros(4)
    assert torch.equal(rda([z, z], [1.0, 1.0]), z)
    a = torch.ones(4)
    # phi(0) = 0: a zero vector shrinks the radius but not the direction
    torch.testing.assert_close(rda([a, z], [1.0, 1.0]), a / 2)


def test_single_contributor_returns_its_pseudo_grad():
    pg = {"blocks.0.attn.c_attn.weight": torch.randn(6, 2), "wte.weight": torch.randn(4, 2)}
    out = merge_fragment([pg], [5.0], lambda n: "wte" in n)
    for n in pg:
        assert torch.equal(out[n], pg[n])


def test_embeddings_use_the_weighted_mean_others_rda():
    names = ["wte.weight", "blocks.0.mlp.c_fc.weight"]
    vs = _orthogonal(4, 12, 2.0)
    pgs = [{n: v.view(3, 4).clone() for n in names} for v in vs]
    ws = [1.0, 2.0, 3.0, 4.0]
    out = merge_fragment(pgs, ws, lambda n: n.startswith("wte"))
    torch.testing.assert_close(out["wte.weight"], weighted_mean([p["wte.weight"] for p in pgs], ws))
    torch.testing.assert_close(out["blocks.0.mlp.c_fc.weight"], rda([p["blocks.0.mlp.c_fc.weight"] for p in pgs], ws))
    assert float(out["blocks.0.mlp.c_fc.weight"].norm()) == pytest.approx(2.0, rel=1e-5)


def test_token_weight():
    assert token_weight(1024, 8) == 1024 * 128
    assert token_weight(3, 2) == 4.5
    assert token_weight(0, 5) == 0.0
    assert token_weight(100, 0) == 0.0
    with pytest.raises(ValueError):
        token_weight(-1, 2)


@pytest.mark.parametrize(
    "weights",
    [[1.0], [1.0, 2.0, 3.0], [0.0, 0.0], [1.0, -1.0], [1.0, float("nan")], [float("inf"), 1.0]],
)
def test_bad_weights_raise(weights):
    pgs = [{"w": torch.ones(2)}, {"w": torch.ones(2)}]
    with pytest.raises(ValueError):
        merge_fragment(pgs, weights, lambda n: False)


def test_mismatched_fragments_raise():
    with pytest.raises(ValueError, match="tensors"):
        merge_fragment([{"w": torch.ones(2)}, {"v": torch.ones(2)}], [1.0, 1.0], lambda n: False)
    with pytest.raises(ValueError, match="w: shape"):
        merge_fragment([{"w": torch.ones(2)}, {"w": torch.ones(3)}], [1.0, 1.0], lambda n: False)
    with pytest.raises(ValueError):
        merge_fragment([], [], lambda n: False)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(0.1, 10.0), min_size=2, max_size=6),
    st.integers(0, 2**16),
)
def test_rda_norm_bounded_by_max_and_radius_matches(weights, seed):
    g = torch.Generator().manual_seed(seed)
    vs = [torch.randn(32, generator=g) * (1 + i) for i in range(len(weights))]
    out = rda(vs, weights)
    expected_radius = sum(w * float(v.norm()) for w, v in zip(weights, vs)) / sum(weights)
    assert torch.isfinite(out).all()
    assert float(out.norm()) == pytest.approx(expected_radius, rel=1e-5)


def test_robust_modes_ignore_one_poisoned_learner():
    honest = [torch.full((6,), 1.0) + 0.01 * i for i in range(4)]
    poisoned = honest + [torch.full((6,), 1e6)]
    assert merge.robust_mean(poisoned, "median").max() < 1.1
    assert merge.robust_mean(poisoned, "trimmed_mean", 0.25).max() < 1.1
    assert merge.weighted_mean(poisoned, [1.0] * 5).max() > 1e5  # what the robust modes prevent
    merged = merge.merge_fragment([{"w": v} for v in poisoned], [1.0] * 5, lambda n: False, robust="median")
    assert merged["w"].max() < 1.1
    # too few contributors to trim: the median
    two = [torch.zeros(3), torch.ones(3)]
    assert torch.equal(merge.robust_mean(two, "trimmed_mean", 0.49), merge.robust_mean(two, "median"))
    with pytest.raises(ValueError):
        merge.robust_mean(two, "mode")


def _naive_rda64(vectors, weights, eps=1e-12):
    """The float64 reference of RDA (the module docstring's formula, one tensor)."""
    total = sum(weights)
    v64 = [v.double() for v in vectors]
    norms = [float(v.norm()) for v in v64]
    radius = sum(w * n for w, n in zip(weights, norms)) / total
    direction = sum(w / (total * n) * v for w, n, v in zip(weights, norms, v64) if n > eps)
    return direction * (radius / float(direction.norm()))


def _fragment(seed, shapes):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * (1 + i) for i, (n, s) in enumerate(shapes.items())}


SHAPES = {"wte.weight": (37, 8), "blocks.0.attn.c_attn.weight": (48, 64), "blocks.0.ln_1.weight": (7,),
          "blocks.0.mlp.c_fc.weight": (1024, 3), "blocks.0.mlp.c_fc.bias": (1,)}


def test_vectorised_merge_matches_the_float64_reference_per_tensor():
    """Tensors of every size (padding, a row exactly, several rows) merge as each would alone."""
    pgs = [_fragment(s, SHAPES) for s in range(4)]
    ws = [1.0, 0.5, 2.0, 0.0]
    out = merge_fragment(pgs, ws, lambda n: n.startswith("wte"))
    for n in SHAPES:
        vectors = [pg[n] for pg in pgs]
        alone = weighted_mean(vectors, ws) if n.startswith("wte") else rda(vectors, ws)
        assert torch.equal(out[n], alone), n
        if not n.startswith("wte"):
            ref = _naive_rda64(vectors[:3], ws[:3]).float()
            # float32 sums of M products: a few ulps of the tensor's scale from the float64 result
            torch.testing.assert_close(out[n], ref, rtol=2e-6, atol=1e-6 * float(ref.abs().max()))


def test_reused_buffer_gives_views_and_the_default_gives_owned_tensors():
    pgs = [_fragment(s, SHAPES) for s in range(3)]
    owned = merge_fragment(pgs, [1.0, 2.0, 3.0], lambda n: False)
    views = merge_fragment(pgs, [1.0, 2.0, 3.0], lambda n: False, reuse_buffer=True)
    for n in SHAPES:
        assert torch.equal(owned[n], views[n])
    merge_fragment([_fragment(9, SHAPES)] * 2, [1.0, 1.0], lambda n: False, reuse_buffer=True)
    assert not torch.equal(owned["blocks.0.attn.c_attn.weight"], views["blocks.0.attn.c_attn.weight"])
    again = merge_fragment(pgs, [1.0, 2.0, 3.0], lambda n: False)
    assert all(torch.equal(owned[n], again[n]) for n in SHAPES)  # owned results never move


def test_merge_does_not_mutate_its_inputs():
    pgs = [_fragment(s, SHAPES) for s in range(3)]
    before = [{n: t.clone() for n, t in pg.items()} for pg in pgs]
    merge_fragment(pgs, [1.0, 2.0, 3.0], lambda n: "wte" in n, reuse_buffer=True)
    for pg, b in zip(pgs, before):
        assert all(torch.equal(pg[n], b[n]) for n in SHAPES)


def test_merge_fragment_is_thread_count_invariant():
    shapes = {"a": (70_001,), "b": (3, 1000), "wte.weight": (513, 64), "c": (2_000_003,)}
    pgs = [_fragment(s, shapes) for s in range(3)]
    before = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            results.append(merge_fragment(pgs, [1.0, 2.5, 0.3], lambda name: "wte" in name))
    finally:
        torch.set_num_threads(before)
    for r in results[1:]:
        assert all(torch.equal(r[n], results[0][n]) for n in shapes)


def test_anchor_on_the_current_version_is_the_pseudo_grad_itself():
    current = {"w": torch.randn(5), "b": torch.randn(2)}
    pg = {"w": torch.randn(5), "b": torch.randn(2)}
    same = anchor(current, dict(current), pg)
    assert all(same[n] is pg[n] for n in pg)
    base = {n: t - 0.5 for n, t in current.items()}
    stale = anchor(current, base, pg)
    for n in pg:
        assert torch.equal(stale[n], (current[n] - base[n]) + pg[n])


def test_per_index_mean_averages_each_coordinate_over_its_senders():
    a = torch.tensor([1.0, 0.0, 2.0, 0.0, 5.0])
    b = torch.tensor([3.0, 0.0, 0.0, 0.0, -1.0])
    c = torch.tensor([0.0, 0.0, 0.0, -4.0, 0.0])
    out = merge.per_index_mean([a, b, c], [1.0, 3.0, 2.0])
    # (1*1 + 3*3) / 4; nobody; a alone; c alone; (1*5 + 3*-1) / 4
    assert torch.allclose(out, torch.tensor([2.5, 0.0, 2.0, -4.0, 0.5]))
    # the dense mean divides a value one learner sent by everyone's weight: what per_index avoids
    assert merge.weighted_mean([a, b, c], [1.0, 3.0, 2.0])[3] == pytest.approx(-4.0 * 2 / 6)
    # a contributor without weight neither adds values nor counts as a sender
    assert torch.equal(merge.per_index_mean([a, b * 100], [1.0, 0.0]), a)
    assert out.dtype == torch.float32 and not out.isnan().any()


def test_merge_fragment_per_index_applies_to_every_tensor_and_robust_takes_precedence():
    frags = [{"wte.weight": torch.tensor([2.0, 0.0]), "h.w": torch.tensor([0.0, 6.0])},
             {"wte.weight": torch.tensor([0.0, 4.0]), "h.w": torch.tensor([2.0, 0.0])}]
    emb = lambda n: n.startswith("wte")  # noqa: E731
    merged = merge_fragment(frags, [1.0, 1.0], emb, sparse="per_index")
    assert torch.equal(merged["wte.weight"], torch.tensor([2.0, 4.0]))
    assert torch.equal(merged["h.w"], torch.tensor([2.0, 6.0]))
    dense = merge_fragment(frags, [1.0, 1.0], emb)
    assert torch.equal(dense["wte.weight"], torch.tensor([1.0, 2.0]))  # the weighted mean, with zeros
    robust = merge_fragment(frags, [1.0, 1.0], emb, robust="median", sparse="per_index")
    assert torch.equal(robust["h.w"], merge.robust_mean([frags[0]["h.w"], frags[1]["h.w"]], "median"))
    with pytest.raises(ValueError, match="sparse mode"):
        merge_fragment(frags, [1.0, 1.0], emb, sparse="sum")

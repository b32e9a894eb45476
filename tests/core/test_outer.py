"""The outer optimizer is pinned to torch.optim.SGD fed the pseudo-gradient as the gradient."""

import pytest
import torch

from ddiloco_geo.core.outer import MOMENTUM_PREFIX, OuterOptimizer, merge_and_step

pytestmark = pytest.mark.unit  # no servers, no subprocesses

SHAPES = {"a.weight": (5, 3), "a.bias": (5,), "b": (7,)}


def _random(seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(s, generator=g) for n, s in SHAPES.items()}


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("foreach", [True, False])
def test_matches_torch_sgd_over_several_steps(nesterov, foreach):
    params0 = _random(0)
    pseudo_grads = [_random(10 + i, scale=0.1) for i in range(6)]
    ps = {n: torch.nn.Parameter(t.clone()) for n, t in params0.items()}
    ref = torch.optim.SGD(list(ps.values()), lr=0.7, momentum=0.9, nesterov=nesterov, dampening=0, foreach=foreach)
    outer = OuterOptimizer(lr=0.7, momentum=0.9, nesterov=nesterov)
    params = params0
    for pg in pseudo_grads:
        for n, p in ps.items():
            p.grad = pg[n].clone()
        ref.step()
        params = outer.step(params, pg)
        for n in SHAPES:
            assert torch.equal(params[n], ps[n].detach()), n  # bit for bit
    assert outer.num_steps == len(pseudo_grads)


def test_step_does_not_mutate_inputs():
    params, pg = _random(0), _random(1)
    before = {n: t.clone() for n, t in params.items()}, {n: t.clone() for n, t in pg.items()}
    OuterOptimizer().step(params, pg)
    for n in SHAPES:
        assert torch.equal(params[n], before[0][n]) and torch.equal(pg[n], before[1][n])


def test_positive_pseudo_grad_moves_global_toward_learner():
    base = {"w": torch.zeros(4)}
    local = {"w": torch.ones(4)}
    pseudo_grad = {"w": base["w"] - local["w"]}
    new = OuterOptimizer(lr=0.5, momentum=0.0).step(base, pseudo_grad)
    torch.testing.assert_close(new["w"], torch.full((4,), 0.5))


@pytest.mark.parametrize("warmup", [0, 5])
def test_state_round_trip_resumes_identically(warmup):
    # mid-warm-up too: the step count in the state carries the ramp across a restart
    pgs = [_random(20 + i, scale=0.1) for i in range(6)]
    straight = OuterOptimizer(warmup=warmup)
    params = _random(0)
    for pg in pgs:
        params = straight.step(params, pg)

    first = OuterOptimizer(warmup=warmup)
    resumed_params = _random(0)
    for pg in pgs[:3]:
        resumed_params = first.step(resumed_params, pg)
    second = OuterOptimizer(shapes=SHAPES, warmup=warmup)
    second.load_state_dict(first.state_dict())
    assert second.num_steps == 3
    for pg in pgs[3:]:
        resumed_params = second.step(resumed_params, pg)
    for n in SHAPES:
        assert torch.equal(params[n], resumed_params[n])
    assert second.state_dict()["num_steps"].item() == 6


def test_load_state_dict_validates_names_and_shapes():
    opt = OuterOptimizer(shapes=SHAPES)
    state = opt.state_dict()
    bad_shape = dict(state, **{"momentum.b": torch.zeros(8)})
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(bad_shape)
    missing = {k: v for k, v in state.items() if k != "momentum.b"}
    with pytest.raises(ValueError, match="tensors"):
        opt.load_state_dict(missing)
    with pytest.raises(ValueError, match="unknown"):
        opt.load_state_dict(dict(state, junk=torch.zeros(1)))
    with pytest.raises(ValueError, match="num_steps"):
        opt.load_state_dict({k: v for k, v in state.items() if k != "num_steps"})


def test_step_rejects_mismatched_fragments():
    opt = OuterOptimizer()
    opt.step(_random(0), _random(1))
    with pytest.raises(ValueError):
        opt.step({"other": torch.zeros(2)}, {"other": torch.zeros(2)})
    with pytest.raises(ValueError):
        opt.step(_random(0), {**_random(1), "b": torch.zeros(3)})


@pytest.mark.parametrize("kwargs", [{"lr": 0}, {"lr": float("nan")}, {"momentum": 1.0}, {"momentum": -0.1},
                                    {"warmup": -1}, {"warmup": 2.5}, {"warmup": True}, {"warmup": "8"}])
def test_bad_hyperparameters_rejected(kwargs):
    with pytest.raises(ValueError):
        OuterOptimizer(**kwargs)


@pytest.mark.parametrize("nesterov", [True, False])
def test_consuming_step_and_copy_match_the_plain_step(nesterov):
    params, pgs = _random(0), [_random(30 + i, scale=0.1) for i in range(3)]
    plain, consuming = OuterOptimizer(nesterov=nesterov), OuterOptimizer(nesterov=nesterov)
    p1 = p2 = params
    for pg in pgs:
        p1 = plain.step(p1, pg)
        snapshot = consuming.copy()
        p2 = consuming.step(p2, {n: t.clone() for n, t in pg.items()}, consume=True)
        for n in SHAPES:
            assert torch.equal(p1[n], p2[n])
        if snapshot.num_steps:  # the copy kept the state it had before the step
            assert snapshot.num_steps == consuming.num_steps - 1
            assert not torch.equal(snapshot.state_dict()["momentum.b"], consuming.state_dict()["momentum.b"])


def test_merge_and_step_leaves_the_optimizer_and_the_inputs_alone():
    outer = OuterOptimizer()
    params = _random(0)
    outer.step(params, _random(1))
    before = outer.state_dict()
    anchored = [_random(2 + i) for i in range(3)]
    kept = [{n: t.clone() for n, t in a.items()} for a in anchored]
    new, stepped = merge_and_step(params, outer, anchored, [1.0, 2.0, 3.0], lambda n: False,
                                  {"lr": 0.5, "momentum": 0.8, "nesterov": True})
    after = outer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(a[n], k[n]) for a, k in zip(anchored, kept) for n in SHAPES)
    assert (stepped.lr, stepped.momentum, stepped.num_steps) == (0.5, 0.8, 2)


def test_a_final_merge_first_leaves_a_state_that_loads_and_steps_on():
    # a fragment whose first merge is final (a learner's first send was its exit flush) has stepped
    # once with no momentum yet; a syncer that loads that state (a restart, or the other syncer after
    # a publish race) steps on from zero momentum: it raised "the optimizer state has []" before
    kwargs = {"lr": 0.5, "momentum": 0.8, "nesterov": True}
    params = _random(0)
    new, stepped = merge_and_step(params, OuterOptimizer(**kwargs), [_random(1)], [1.0], lambda n: False,
                                  kwargs, final=True)
    loaded = OuterOptimizer(**kwargs)
    loaded.load_state_dict(stepped.state_dict())
    assert loaded.num_steps == 1
    grad = _random(2)
    fresh = OuterOptimizer(**kwargs).step(new, grad)
    stepped_on = loaded.step(new, grad)
    assert all(torch.equal(fresh[n], stepped_on[n]) for n in SHAPES) and loaded.num_steps == 2


@pytest.mark.parametrize("share", [1.0, 0.25])
def test_a_final_merge_moves_its_share_of_the_way_to_the_mean_of_the_models(share):
    # final = share: params - share * (weighted mean of the anchored deltas), every tensor a mean
    # (no RDA), momentum untouched; 1 is the whole way (the models' mean), 1/4 a fourth learner
    # joining the mean of three
    kwargs = {"lr": 0.5, "momentum": 0.8, "nesterov": True}
    params, deltas = _random(0), [_random(1), _random(2)]
    new, stepped = merge_and_step(params, OuterOptimizer(**kwargs), deltas, [1.0, 3.0], lambda n: False,
                                  kwargs, final=share)
    for n in SHAPES:
        mean = (deltas[0][n] + 3.0 * deltas[1][n]) / 4.0
        torch.testing.assert_close(new[n], params[n] - share * mean, rtol=1e-6, atol=1e-6)
    assert not any(k.startswith(MOMENTUM_PREFIX) for k in stepped.state_dict()) and stepped.num_steps == 1


@pytest.mark.parametrize("nesterov", [True, False])
def test_warmup_moves_from_plain_averaging_to_the_configured_optimizer(nesterov):
    lr, mu, warmup = 0.4, 0.9, 4
    outer = OuterOptimizer(lr=lr, momentum=mu, nesterov=nesterov, warmup=warmup)
    expected = [(1.0, 0.0), (0.85, 0.225), (0.7, 0.45), (0.55, 0.675), (lr, mu), (lr, mu), (lr, mu)]
    params = _random(0)
    ref = {n: t.clone() for n, t in params.items()}
    bufs = {n: torch.zeros(s) for n, s in SHAPES.items()}
    for k, (lr_k, mu_k) in enumerate(expected):
        assert outer.effective() == pytest.approx((lr_k, mu_k)), k
        pg = _random(30 + k, scale=0.1)
        params = outer.step(params, pg)
        for n in SHAPES:  # SGD's rule with this step's lr and momentum
            bufs[n] = mu_k * bufs[n] + pg[n]
            ref[n] = ref[n] - lr_k * ((pg[n] + mu_k * bufs[n]) if nesterov else bufs[n])
            torch.testing.assert_close(params[n], ref[n], rtol=1e-6, atol=1e-6)
        if k == 0:  # the first step is the learners' mean, exactly: the global moves by the whole delta
            assert all(torch.equal(params[n], _random(0)[n] - pg[n]) for n in SHAPES)
    assert outer.copy().effective() == (lr, mu) and outer.copy(warmup=10).effective() == pytest.approx((0.4 + 0.6 * 0.3, 0.9 * 0.7))

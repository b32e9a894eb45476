"""The built-in GPT, the factory plug-in and name-addressed tensor access."""

import math
import textwrap

import pytest
import torch

from ddiloco_geo.core.config import ModelConfig
from ddiloco_geo.core.data import load_corpus
from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.core.model import (
    GPT,
    NOMINAL_PARAMS,
    SIZES,
    build_model,
    count_params,
    get_tensors,
    is_embedding,
    param_shapes,
    resolve_dims,
    set_tensors,
)


def _num_params(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.unit
@pytest.mark.parametrize("name", list(SIZES))
def test_named_sizes_near_nominal(name):
    dims = resolve_dims(ModelConfig(name=name))
    with torch.device("meta"):
        model = GPT(dims)
    assert _num_params(model) == count_params(dims)
    assert 0.7 <= count_params(dims) / NOMINAL_PARAMS[name] <= 1.3


@pytest.mark.unit
@pytest.mark.parametrize("name", ["nano", "tiny"])
def test_small_sizes_build_for_real(name):
    model = build_model(ModelConfig(name=name))
    assert _num_params(model) == count_params(resolve_dims(ModelConfig(name=name)))


@pytest.mark.unit
def test_every_parameter_has_one_name_and_head_is_untied():
    model = build_model(ModelConfig(name="nano"))
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" in names and "wte.weight" in names
    assert model.lm_head.weight.data_ptr() != model.wte.weight.data_ptr()
    assert len(names) == len(set(names)) == len(list(model.parameters()))


@pytest.mark.unit
def test_explicit_dims_override_named_size_and_custom_needs_all():
    dims = resolve_dims(ModelConfig(name="tiny", n_layer=2))
    assert (dims.n_layer, dims.n_head, dims.n_embd) == (2, 4, 128)
    dims = resolve_dims(ModelConfig(name="custom", n_layer=1, n_head=2, n_embd=32))
    assert (dims.n_layer, dims.n_head, dims.n_embd) == (1, 2, 32)
    with pytest.raises(ConfigError, match="custom"):
        resolve_dims(ModelConfig(name="custom", n_layer=1, n_head=2))
    with pytest.raises(ConfigError, match="divisible"):
        resolve_dims(ModelConfig(name="custom", n_layer=1, n_head=3, n_embd=32))
    with pytest.raises(ConfigError, match="unknown"):
        resolve_dims(ModelConfig(name="huge"))


@pytest.mark.unit
def test_init_is_deterministic_from_seed_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = build_model(ModelConfig(name="nano", seed=7)).state_dict()
    assert torch.equal(torch.rand(1), expected_next)
    b = build_model(ModelConfig(name="nano", seed=7)).state_dict()
    c = build_model(ModelConfig(name="nano", seed=8)).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["wte.weight"], c["wte.weight"])


@pytest.mark.unit
def test_initial_loss_is_near_uniform():
    model = build_model(ModelConfig(name="nano"))
    idx = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, loss = model(idx, idx)
    assert logits.shape == (4, 64, 256)
    assert float(loss) == pytest.approx(math.log(256), abs=0.1)
    assert model(idx)[1] is None


def test_a_few_adamw_steps_on_real_text_lower_the_loss():
    torch.manual_seed(0)
    text = torch.frombuffer(bytearray(load_corpus("shakespeare", max_bytes=200_000)), dtype=torch.uint8).long()
    model = build_model(ModelConfig(name="custom", n_layer=2, n_head=2, n_embd=64, block_size=64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(30):
        starts = torch.randint(0, len(text) - 65, (8,), generator=g)
        chunk = torch.stack([text[s : s + 65] for s in starts])
        _, loss = model(chunk[:, :-1], chunk[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5


@pytest.mark.unit
def test_is_embedding_matches_name_parts():
    patterns = ["wte", "wpe", "embed", "lm_head"]
    assert is_embedding("wte.weight", patterns)
    assert is_embedding("model.embed_tokens.weight", patterns)
    assert is_embedding("lm_head.weight", patterns)
    assert not is_embedding("blocks.0.attn.c_attn.weight", patterns)
    assert not is_embedding("wte.weight", [])


@pytest.mark.unit
def test_get_and_set_tensors_with_alpha():
    model = build_model(ModelConfig(name="nano"))
    names = ["wte.weight", "blocks.1.ln_2.bias"]
    shapes = param_shapes(model)
    snap = get_tensors(model, names)
    assert {n: tuple(t.shape) for n, t in snap.items()} == {n: shapes[n] for n in names}
    assert all(t.dtype == torch.float32 and not t.requires_grad for t in snap.values())
    snap["wte.weight"].add_(1.0)  # a clone: the model is untouched
    assert not torch.equal(model.wte.weight.detach(), snap["wte.weight"])

    before = get_tensors(model, names)
    target = {n: torch.full(shapes[n], 2.0) for n in names}
    set_tensors(model, target, alpha=0.25)
    after = get_tensors(model, names)
    for n in names:
        torch.testing.assert_close(after[n], 0.25 * before[n] + 0.75 * target[n])
    set_tensors(model, target)
    assert all(torch.equal(t, target[n]) for n, t in get_tensors(model, names).items())
    assert model.wte.weight.requires_grad

    with pytest.raises(KeyError):
        get_tensors(model, ["nope"])
    with pytest.raises(ValueError, match="shape"):
        set_tensors(model, {"wte.weight": torch.zeros(3)})


FACTORY_SOURCE = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F

    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(256, 256)

        def forward(self, idx, targets=None):
            logits = self.embed(idx)
            loss = None if targets is None else F.cross_entropy(logits.view(-1, 256), targets.reshape(-1))
            return logits, loss

    def with_cfg(cfg):
        assert cfg.block_size > 0
        return Bigram()

    def no_args():
        return Bigram()

    def not_a_module(cfg):
        return 42

    class NoLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(2, 2)

        def forward(self, idx, targets=None):
            return idx

    def bad_forward():
        return NoLoss()
    """
)


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    (tmp_path / "ddiloco_toy_factory.py").write_text(FACTORY_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "ddiloco_toy_factory"


@pytest.mark.unit
@pytest.mark.parametrize("func", ["with_cfg", "no_args"])
def test_factory_plug_in(factory_module, func):
    cfg = ModelConfig(factory=f"{factory_module}:{func}", seed=3)
    a, b = build_model(cfg), build_model(cfg)
    assert list(param_shapes(a)) == ["embed.weight"]
    assert torch.equal(a.embed.weight, b.embed.weight)


@pytest.mark.unit
@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_colon_here", "package.module:function"),
        ("ddiloco_toy_factory:", "package.module:function"),
        ("surely_not_a_module_xyz:f", "cannot import"),
        ("ddiloco_toy_factory:missing", "no callable"),
        ("ddiloco_toy_factory:not_a_module", "not a torch.nn.Module"),
        ("ddiloco_toy_factory:bad_forward", "logits"),
    ],
)
def test_bad_factory_errors(factory_module, spec, message):
    with pytest.raises(ConfigError, match=message):
        build_model(ModelConfig(factory=spec))


def test_a_syncer_start_does_not_import_torch_dynamo():
    """torch._dynamo costs seconds of CPU at every start (more on a loaded machine): the syncer's
    imports, its model and its embedding rule must not pull it in (torch.distributed.tensor does)."""
    import subprocess
    import sys

    code = textwrap.dedent("""
        import sys
        from ddiloco_geo.cli import syncer
        from ddiloco_geo.core import config, model
        from ddiloco_geo import protocol
        settings, _ = config.load(cli={"model": {"name": "nano"}})
        net = model.build_model(settings.model)
        protocol.build_spec(settings, net)
        rule = model.embedding_rule(settings.model, net)
        assert rule("wte.weight")
        model.full_tensor(net.wte.weight)
        loaded = sorted(m for m in ("torch._dynamo", "torch.distributed.tensor") if m in sys.modules)
        print(",".join(loaded) or "none")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "none"

"""Hugging Face causal LMs as learner models: built from a config with nothing downloaded, the
learner's (logits, loss) contract, embeddings found from module types, and the built-in GPT's
exact mapping onto GPT-2 for ``export --format hf``."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from ddiloco_geo.core.config import ModelConfig
from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.core.fragments import plan_fragments
from ddiloco_geo.core.model import build_model, embedding_names, embedding_rule, generate, get_tensors, param_shapes
from ddiloco_geo.ops.export_hf import byte_tokenizer_json, gpt2_config, gpt2_state_dict
from ddiloco_geo.ops.report.charts import tokens_all_learners


LLAMA = dict(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def llama_cfg(**kw) -> ModelConfig:
    return ModelConfig(hf_class="LlamaConfig", hf_kwargs={**LLAMA, **kw}, block_size=32, seed=3)


@pytest.mark.unit
def test_hf_model_from_a_config_class_is_deterministic_and_keeps_the_contract():
    a, b = build_model(llama_cfg()), build_model(llama_cfg())
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    idx = torch.randint(0, 384, (2, 16))
    logits, loss = a(idx, idx)
    assert logits.shape == (2, 16, 384) and loss.dim() == 0
    assert abs(float(loss.detach()) - torch.log(torch.tensor(384.0)).item()) < 0.5  # near uniform at init
    plan = plan_fragments(param_shapes(a), 4)
    assert sorted(n for f in plan.fragments for n in f) == sorted(n for n, _ in a.named_parameters())


@pytest.mark.unit
def test_hf_model_from_a_local_config_directory(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(**LLAMA).save_pretrained(tmp_path)
    m = build_model(ModelConfig(hf_config=str(tmp_path), hf_kwargs={"num_hidden_layers": 1}, block_size=32))
    assert m.config.num_hidden_layers == 1 and m.config.hidden_size == 32
    with pytest.raises(ConfigError, match="no config.json"):
        build_model(ModelConfig(hf_config=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="exceeds the architecture's context"):
        build_model(llama_cfg(max_position_embeddings=16))
    with pytest.raises(ConfigError, match="not a transformers config class"):
        build_model(ModelConfig(hf_class="NoSuchConfig"))


@pytest.mark.unit
def test_embeddings_are_found_from_module_types_tied_or_not():
    untied = build_model(llama_cfg())
    assert embedding_names(untied) == {"lm.model.embed_tokens.weight", "lm.lm_head.weight"}
    tied = build_model(llama_cfg(tie_word_embeddings=True))
    assert embedding_names(tied) == {"lm.model.embed_tokens.weight"}  # the head shares it
    rule = embedding_rule(ModelConfig(hf_class="LlamaConfig", hf_kwargs=LLAMA, block_size=32, embedding_patterns=[]))
    assert rule("lm.lm_head.weight") and rule("lm.model.embed_tokens.weight") and not rule("lm.model.norm.weight")

    class Odd(nn.Module):  # names no pattern would catch
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(50, 8)
            self.body = nn.Linear(8, 8)
            self.out = nn.Linear(8, 50, bias=False)

    assert embedding_names(Odd()) == {"tok.weight", "out.weight"}
    gpt = build_model(ModelConfig(name="nano"))
    assert embedding_names(gpt) == {"wte.weight", "wpe.weight", "lm_head.weight"}


@pytest.mark.unit
def test_builtin_gpt_maps_exactly_onto_gpt2():
    from transformers import GPT2LMHeadModel

    cfg = ModelConfig(name="custom", n_layer=2, n_head=2, n_embd=32, block_size=32, seed=1)
    ours = build_model(cfg).eval()
    with torch.no_grad():  # make every weight non-trivial (biases and norms are zero/one at init)
        for p in ours.parameters():
            p.add_(0.02 * torch.randn_like(p))
    gpt2 = GPT2LMHeadModel(gpt2_config(ours.dims)).eval()
    names = [n for n, _ in ours.named_parameters()]
    missing, unexpected = gpt2.load_state_dict(gpt2_state_dict(get_tensors(ours, names)), strict=False)
    assert not missing and not unexpected
    idx = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        assert torch.allclose(ours(idx)[0], gpt2(input_ids=idx).logits, atol=1e-5)


@pytest.mark.unit
def test_byte_tokenizer_ids_are_byte_values():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(byte_tokenizer_json())
    text = "O Romeo, héllo\n"
    assert tok.encode(text).ids == list(text.encode()) and tok.decode(list(text.encode())) == text


def test_generate_is_greedy_with_top_k_1_and_reproducible():
    m = build_model(ModelConfig(name="nano", block_size=32))
    prompt = list(b"ROMEO:")
    greedy = generate(m, prompt, 40, block_size=32, top_k=1)
    with torch.no_grad():
        first = int(m(torch.tensor([prompt]))[0][0, -1].argmax())
    assert greedy[0] == first and len(greedy) == 40
    assert generate(m, prompt, 20, block_size=32, top_k=8, seed=5) == generate(m, prompt, 20, block_size=32, top_k=8, seed=5)


@pytest.mark.unit
def test_local_chart_puts_learner_curves_on_the_all_learner_token_axis():
    hist = {"a": [{"time": 10.0, "tokens": 100}, {"time": 20.0, "tokens": 200}],
            "b": [{"time": 15.0, "tokens": 50}, {"time": 25.0, "tokens": 100}]}
    assert tokens_all_learners(hist, 20.0) == pytest.approx(200 + 75)
    assert tokens_all_learners(hist, 30.0) == pytest.approx(300)  # both finished
    assert tokens_all_learners(hist, 10.0) == pytest.approx(100 + 25)  # b extrapolated back at its rate
    assert json.dumps(hist)  # the summary stays JSON

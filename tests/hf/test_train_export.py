"""The issue's done-when test: a small ``transformers`` causal LM built from a config, trained by
2 learners and a syncer on a local store from token shards that ``data prepare`` wrote, exported
with ``export --format hf``; ``from_pretrained`` loads it and gives the global model's eval loss,
and a restarted learner continues at its data cursor."""

from __future__ import annotations

import json

import pytest
import torch

from ddiloco_geo.cli.main import main
from ddiloco_geo.core import config
from ddiloco_geo.core.data import evaluate
from ddiloco_geo.core.hf import HFCausalLM
from ddiloco_geo.core.model import build_model, set_tensors
from ddiloco_geo.learner import Learner
from ddiloco_geo.learner.data import eval_batches_for
from ddiloco_geo.ops.report.evaluate import PastEvaluator
from ddiloco_geo.storage import open_store
from ddiloco_geo.tools.evaluate import Evaluator
from ddiloco_geo.tools.inprocess import InProcessRun, LearnerSpeed
from ddiloco_geo.tools.sample import sample_global

LLAMA = dict(vocab_size=384, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


@pytest.mark.slow
def test_hf_model_trains_on_token_shards_and_exports_for_from_pretrained(tmp_path, shard_dir, tokenizer_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store_url = f"file://{tmp_path / 'run'}"
    corpus = f"tokens:{shard_dir}"
    settings, _ = config.load(cli={
        "run_id": "hf-run",
        "model": {"hf_class": "LlamaConfig", "hf_kwargs": LLAMA, "block_size": 32, "seed": 1},
        "data": {"corpus": corpus, "chunk_tokens": 2048, "eval_batches": 4},
        "fragments": {"num_fragments": 4, "sync_every": 4, "overlap": 1},
        "learner": {"batch_size": 8, "max_steps": 24, "warmup_steps": 2, "lr": 3e-3, "log_every": 4,
                    "schedule": "own"},  # each learner takes exactly max_steps (the data cursor below)
        "run": {"codec": "bf16"},
    }, environ={})
    batches = eval_batches_for(settings.data, block_size=32, batch_size=8)
    initial = evaluate(build_model(settings.model), batches)

    run = InProcessRun(settings, [LearnerSpeed(1.0), LearnerSpeed(1.3)], store_url=store_url)
    try:
        run.run()
        global_model = build_model(settings.model)
        set_tensors(global_model, run.global_params())
        global_loss = evaluate(global_model, batches)
        assert global_loss < initial - 0.3, (initial, global_loss)
        # local's and report's evaluators read the same held-out token batches
        assert Evaluator.from_settings(run.settings).global_loss(run.store, run.spec)[0] == pytest.approx(global_loss, abs=1e-5)
        assert PastEvaluator(run.settings, run.spec).loss(run.global_params()) == pytest.approx(global_loss, abs=1e-5)
        cursor = run.learners[0].reader.state_dict()
        assert cursor["tokens_seen"] == 24 * 8 * 32

        # a restarted learner-0 resumes from its exit checkpoint, at its data cursor
        s0 = settings.model_copy(update={"learner": settings.learner.model_copy(update={"id": "learner-0"}),
                                         "data": settings.data.model_copy(update={"shard": "0/2"}),
                                         "storage": run.settings.storage})
        again = Learner.from_settings(s0, open_store(s0.storage), inline_io=True)
        again.join()
        assert again.resumed_from is not None and again.reader.state_dict() == cursor
        again.store.close()

        sample = sample_global(run.store, run.settings, prompt="ROMEO:", num_tokens=30)
        assert sample.startswith("ROMEO:") and len(sample) > 30
    finally:
        run.close()

    out = tmp_path / "export"
    assert main(["export", "--format", "hf", "--store", store_url, "--out", str(out), "--set", f"data.corpus={corpus}"]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "ddiloco_export.json"} <= {p.name for p in out.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert evaluate(HFCausalLM(loaded), batches) == pytest.approx(global_loss, abs=1e-5)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok("ROMEO: what").input_ids) == "ROMEO: what"
    assert json.loads((out / "ddiloco_export.json").read_text())["run_id"] == "hf-run"


@pytest.mark.slow
def test_builtin_gpt_export_loads_as_gpt2_with_the_same_loss(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store_url = f"file://{tmp_path / 'run'}"
    settings, _ = config.load(cli={
        "model": {"name": "custom", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
        "data": {"max_bytes": 100_000, "eval_batches": 2},
        "fragments": {"num_fragments": 4, "sync_every": 4, "overlap": 1},
        "learner": {"batch_size": 4, "max_steps": 8, "log_every": 4},
    }, environ={})
    run = InProcessRun(settings, [LearnerSpeed(1.0), LearnerSpeed(1.0)], store_url=store_url)
    try:
        run.run()
        params = run.global_params()
    finally:
        run.close()
    out = tmp_path / "gpt2"
    assert main(["export", "--format", "hf", "--store", store_url, "--out", str(out)]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded).__name__ == "GPT2LMHeadModel"
    ours = build_model(settings.model).eval()
    set_tensors(ours, params)
    idx = torch.tensor([list(b"ROMEO: what light through yonder")])
    with torch.no_grad():
        assert torch.allclose(ours(idx)[0], loaded(input_ids=idx).logits, atol=1e-5)
    assert AutoTokenizer.from_pretrained(out)("hi!").input_ids == list(b"hi!")
    assert main(["export", "--format", "hf", "--store", store_url, "--out", str(out)]) == 2  # never overwrites

"""``export --format hf``: the global model as a directory ``transformers`` loads with ``from_pretrained``.

What is written (``config.json``, ``model.safetensors``, ``generation_config.json``, tokenizer files,
``ddiloco_export.json`` with run id, versions and snapshot):

* **Hugging Face runs** (``model.hf_config``/``model.hf_class``): the run's own architecture, built
  from its config, loaded with the global parameters (the ``lm.`` wrapper prefix stripped, tied
  weights re-tied by ``save_pretrained``).
* **The built-in GPT**: mapped exactly onto GPT-2 (``GPT2LMHeadModel``). The architectures are the
  same (pre-LayerNorm blocks, learned positions, a 4x GELU MLP, biases everywhere but the head),
  so the export is lossless, and every tool that reads GPT-2 reads it. The differences are settings
  or layouts: GPT-2's ``Conv1D`` stores ``(in, out)`` where our ``nn.Linear`` stores ``(out, in)``
  (transposed here), our head is untied (``tie_word_embeddings=False``), our GELU is exact
  (``activation_function="gelu"``, not GPT-2's tanh ``gelu_new``), no dropout, vocabulary 256
  (bytes), ``n_positions = model.block_size``. A byte tokenizer (id = byte value) goes with it.
* ``model.factory`` models cannot be mapped: use the default safetensors export.

Tokenizer: for a ``tokens:`` corpus, the dataset's ``tokenizer.json`` (the caller passes it), saved
as a ``PreTrainedTokenizerFast``. The directory is written next to ``out`` and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import torch

from ddiloco_geo import protocol
from ddiloco_geo.core import hf
from ddiloco_geo.core import model as modelmod
from ddiloco_geo.core.config import ModelConfig
from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.ops.snapshot import export_params
from ddiloco_geo.storage import Store

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def gpt2_config(dims: modelmod.GPTDims) -> Any:
    from transformers import GPT2Config

    return GPT2Config(vocab_size=modelmod.VOCAB_SIZE, n_positions=dims.block_size, n_embd=dims.n_embd,
                      n_layer=dims.n_layer, n_head=dims.n_head, n_inner=4 * dims.n_embd, activation_function="gelu",
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                      architectures=["GPT2LMHeadModel"])


def gpt2_state_dict(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our GPT's parameter names and layouts -> GPT2LMHeadModel's."""
    out = {}
    for name, t in params.items():
        if name == "lm_head.weight":
            out[name] = t
            continue
        new = name.replace("blocks.", "h.", 1) if name.startswith("blocks.") else name
        out["transformer." + new] = t.t().contiguous() if name.endswith(CONV1D) else t
    return out


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel pre-tokenizers use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_json() -> str:
    """A tokenizer.json whose ids are byte values (0..255): the built-in GPT's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def _hf_model(cfg: ModelConfig, params: dict[str, torch.Tensor]) -> Any:
    if cfg.factory:
        raise ConfigError(f"model.factory={cfg.factory!r} has no Hugging Face architecture to map to; "
                          "export it with the default format (one safetensors file)")
    if hf.is_hf(cfg):
        wrapped = modelmod.build_model(cfg)
        modelmod.set_tensors(wrapped, params)
        return wrapped.lm
    from transformers import GPT2LMHeadModel

    lm = GPT2LMHeadModel(gpt2_config(modelmod.resolve_dims(cfg))).float()
    missing, unexpected = lm.load_state_dict(gpt2_state_dict(params), strict=False)
    if missing or unexpected:
        raise ConfigError(f"GPT-2 mapping is incomplete: missing {missing}, unexpected {unexpected}")
    return lm


def export_hf(store: Store, out: str, manifest: dict[str, Any] | None = None, *,
              tokenizer_json: str | None = None, verifier=None, require_signatures: bool = False) -> dict[str, Any]:
    """Write the global model to the directory ``out`` (must not exist, or be empty); with
    ``verifier`` only syncer-signed globals (:func:`~ddiloco_geo.ops.snapshot.export_params`)."""
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer

    spec = protocol.load_spec(store)
    cfg = ModelConfig.model_validate(spec.model)
    params, versions, skipped = export_params(store, spec, manifest, verifier, require_signatures)
    lm = _hf_model(cfg, params)
    if tokenizer_json is None and not hf.is_hf(cfg):
        tokenizer_json = byte_tokenizer_json()
    out = os.path.abspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError(f"--out {out} exists and is not an empty directory: choose a new one")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-hf-", dir=parent)
    try:
        lm.save_pretrained(tmp)
        if tokenizer_json is not None:
            PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json)).save_pretrained(tmp)
        info = {"format": "ddiloco-geo-export-hf-1", "run_id": spec.run_id, "model": spec.model,
                "versions": {str(p): v for p, v in sorted(versions.items())},
                "snapshot": manifest["snapshot"] if manifest else None, "architecture": type(lm).__name__}
        with open(os.path.join(tmp, "ddiloco_export.json"), "w") as f:
            json.dump(info, f, indent=1, sort_keys=True)
        if os.path.isdir(out):
            os.rmdir(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": out, "run_id": spec.run_id, "architecture": type(lm).__name__, "versions": info["versions"],
            "parameters": int(sum(t.numel() for t in params.values())), "tokenizer": tokenizer_json is not None,
            "snapshot": info["snapshot"], "skipped_unverified": skipped.as_dict()}

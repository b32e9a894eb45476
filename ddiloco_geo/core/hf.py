"""Hugging Face causal LMs as learner models (the optional ``[hf]`` extra: transformers, tokenizers).

A run trains any ``transformers`` causal LM built from a config, never from downloaded weights:

* ``model.hf_config``: a local directory holding ``config.json`` (or the file itself), read with
  ``AutoConfig.from_pretrained(..., local_files_only=True)``; ``model.hf_kwargs`` override its values;
* ``model.hf_class``: a config class (``"LlamaConfig"``, looked up in ``transformers``, or
  ``"package.module:Class"``) called with ``model.hf_kwargs``.

The model is ``AutoModelForCausalLM.from_config(config)`` in fp32, wrapped by :class:`HFCausalLM`
to the contract every learner model has: ``forward(idx, targets=None) -> (logits, loss)`` where
``targets`` are the already shifted next tokens (the HF ``labels`` argument shifts again, so the
loss is computed here). The wrapper holds the HF model as ``lm``, so every parameter name is the
HF name prefixed with :data:`PREFIX` (``lm.model.layers.0.self_attn.q_proj.weight``); tied
weights appear once, under their first name, as ``named_parameters`` gives them. The export
(:mod:`ddiloco_geo.ops.export_hf`) strips the prefix.

``transformers`` is imported only when a Hugging Face model is built (it takes seconds).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddiloco_geo.core.config import ModelConfig
from ddiloco_geo.core.errors import ConfigError

PREFIX = "lm."
EXTRA_HINT = "install the Hugging Face extra: pip install 'ddiloco-geo[hf]'"


def is_hf(cfg: ModelConfig) -> bool:
    return bool(cfg.hf_config or cfg.hf_class)


def _transformers() -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError as exc:
        raise ConfigError(f"model.hf_config/model.hf_class need transformers ({exc}); {EXTRA_HINT}") from None


def hf_config(cfg: ModelConfig) -> Any:
    """The ``transformers`` config named by the model settings (nothing is downloaded)."""
    tf = _transformers()
    if cfg.hf_config and cfg.hf_class:
        raise ConfigError("set model.hf_config or model.hf_class, not both")
    if cfg.hf_config:
        path = Path(cfg.hf_config).expanduser()
        if path.is_file():
            path = path.parent
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.hf_config={cfg.hf_config!r}: no config.json there; give a local directory "
                              "with a transformers config.json (nothing is downloaded)")
        return tf.AutoConfig.from_pretrained(str(path), local_files_only=True, **cfg.hf_kwargs)
    cls = _config_class(tf, cfg.hf_class or "")
    try:
        return cls(**cfg.hf_kwargs)
    except TypeError as exc:
        raise ConfigError(f"model.hf_class={cfg.hf_class!r} with model.hf_kwargs={cfg.hf_kwargs}: {exc}") from None


def _config_class(tf: Any, spec: str) -> type:
    module_name, sep, name = spec.rpartition(":")
    module = tf
    if sep:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(f"model.hf_class={spec!r}: cannot import {module_name!r}: {exc}") from None
    cls = getattr(module, name, None)
    if not isinstance(cls, type) or not issubclass(cls, tf.PretrainedConfig):
        raise ConfigError(f"model.hf_class={spec!r} is not a transformers config class (e.g. 'LlamaConfig', "
                          "'GPT2Config' or 'package.module:MyConfig')")
    return cls


def context_limit(config: Any) -> int | None:
    """The longest sequence the architecture accepts, if its config says."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM with the learner's ``forward(idx, targets) -> (logits, loss)``."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    @property
    def config(self) -> Any:
        return self.lm.config

    def get_input_embeddings(self) -> nn.Module:
        return self.lm.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module | None:
        return self.lm.get_output_embeddings()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.lm(input_ids=idx, use_cache=False).logits
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def build_hf(cfg: ModelConfig) -> HFCausalLM:
    """The wrapped model for ``cfg`` in fp32 (the caller seeds the RNG: weights follow ``cfg.seed``)."""
    tf = _transformers()
    config = hf_config(cfg)
    limit = context_limit(config)
    if limit is not None and cfg.block_size > limit:
        raise ConfigError(f"model.block_size={cfg.block_size} exceeds the architecture's context of {limit} "
                          "(max_position_embeddings); lower model.block_size or raise it in the config")
    try:
        lm = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError as exc:  # a config class with no registered causal-LM head
        raise ConfigError(f"{type(config).__name__} has no causal-LM model in transformers: {exc}") from None
    return HFCausalLM(lm.float())


def hf_state_dict(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The wrapper's parameter names -> the HF model's own names."""
    return {n[len(PREFIX):] if n.startswith(PREFIX) else n: t for n, t in params.items()}

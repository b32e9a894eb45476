"""The model every learner trains, and name-addressed access to its tensors.

A nanoGPT-style decoder over a byte vocabulary (256 symbols): ``wte``, ``wpe``, ``blocks.{i}``
(``ln_1``, ``attn`` with ``F.scaled_dot_product_attention(is_causal=True)``, ``ln_2``, ``mlp`` with
GELU), ``ln_f`` and an untied ``lm_head``, so that every parameter has exactly one name and the
fragment plan can address it. ``forward(idx, targets=None) -> (logits, loss)``.

Named sizes (parameter counts with the default ``block_size=128``; ``wpe`` adds
``block_size * n_embd`` more for longer contexts):

=======  =======  ======  ======  ===============  =========
name     n_layer  n_head  n_embd  parameters       nominal
=======  =======  ======  ======  ===============  =========
nano     4        4       96      508,992          0.5M
tiny     4        4       128     875,264          1M
small    6        6       384     10,893,312       10M
base     10       8       512     31,852,544       30M
large    14       12      768     99,723,264       100M
xl       28       16      1024    353,351,680      350M
=======  =======  ======  ======  ===============  =========

``name="custom"`` takes ``n_layer``/``n_head``/``n_embd`` (all required). With a named size, any of
the three given explicitly overrides that size's value. ``factory="package.module:function"``
replaces the built-in GPT altogether, and so does a Hugging Face causal LM built from a config
(``hf_config`` or ``hf_class``, :mod:`ddiloco_geo.core.hf`).

Embeddings for the merge (:func:`embedding_rule`): the parameters of every ``nn.Embedding`` and of
the output layer (the model's ``get_output_embeddings()``, else the last ``nn.Linear`` whose weight
has the shape of an embedding's), found from module types on any model, plus any name matching
``embedding_patterns``. :func:`generate` samples from any model with the ``(logits, loss)`` contract.

Initialisation is deterministic: weights depend only on ``ModelConfig.seed`` (the global RNG is
forked and restored), so every learner and the syncer build the same starting point.
"""

from __future__ import annotations

import importlib
import inspect
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddiloco_geo.core import hf
from ddiloco_geo.core.config import ModelConfig
from ddiloco_geo.core.errors import ConfigError

VOCAB_SIZE = 256

SIZES: dict[str, tuple[int, int, int]] = {
    # name: (n_layer, n_head, n_embd)
    "nano": (4, 4, 96),
    "tiny": (4, 4, 128),
    "small": (6, 6, 384),
    "base": (10, 8, 512),
    "large": (14, 12, 768),
    "xl": (28, 16, 1024),
}

NOMINAL_PARAMS: dict[str, int] = {
    "nano": 500_000,
    "tiny": 1_000_000,
    "small": 10_000_000,
    "base": 30_000_000,
    "large": 100_000_000,
    "xl": 350_000_000,
}


@dataclass(frozen=True)
class GPTDims:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int


def resolve_dims(cfg: ModelConfig) -> GPTDims:
    """The built-in GPT's dimensions for ``cfg``, or ConfigError saying what to change."""
    given = (cfg.n_layer, cfg.n_head, cfg.n_embd)
    if cfg.name == "custom":
        if any(v is None for v in given):
            raise ConfigError(
                "model.name='custom' needs model.n_layer, model.n_head and model.n_embd; "
                f"got n_layer={cfg.n_layer}, n_head={cfg.n_head}, n_embd={cfg.n_embd}"
            )
        n_layer, n_head, n_embd = given  # type: ignore[misc]
    elif cfg.name in SIZES:
        n_layer, n_head, n_embd = (v if v is not None else d for v, d in zip(given, SIZES[cfg.name]))
    else:
        raise ConfigError(f"model.name={cfg.name!r} is unknown; use one of {', '.join(SIZES)} or 'custom'")
    if n_embd % n_head:
        raise ConfigError(f"model.n_embd={n_embd} must be divisible by model.n_head={n_head}")
    return GPTDims(n_layer, n_head, n_embd, cfg.block_size)


def count_params(dims: GPTDims) -> int:
    """Exact parameter count of the built-in GPT (closed form, no allocation)."""
    d = dims.n_embd
    per_block = 12 * d * d + 13 * d  # ln_1, qkv, proj, ln_2, fc, proj (weights + biases)
    return dims.n_layer * per_block + 2 * VOCAB_SIZE * d + dims.block_size * d + 2 * d


class CausalSelfAttention(nn.Module):
    def __init__(self, dims: GPTDims) -> None:
        super().__init__()
        self.n_head = dims.n_head
        self.c_attn = nn.Linear(dims.n_embd, 3 * dims.n_embd)
        self.c_proj = nn.Linear(dims.n_embd, dims.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, dims: GPTDims) -> None:
        super().__init__()
        self.c_fc = nn.Linear(dims.n_embd, 4 * dims.n_embd)
        self.c_proj = nn.Linear(4 * dims.n_embd, dims.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, dims: GPTDims) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dims.n_embd)
        self.attn = CausalSelfAttention(dims)
        self.ln_2 = nn.LayerNorm(dims.n_embd)
        self.mlp = MLP(dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, dims: GPTDims) -> None:
        super().__init__()
        self.dims = dims
        self.wte = nn.Embedding(VOCAB_SIZE, dims.n_embd)
        self.wpe = nn.Embedding(dims.block_size, dims.n_embd)
        self.blocks = nn.ModuleList(Block(dims) for _ in range(dims.n_layer))
        self.ln_f = nn.LayerNorm(dims.n_embd)
        self.lm_head = nn.Linear(dims.n_embd, VOCAB_SIZE, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer) so the
        # residual stream's variance does not grow with depth.
        residual_std = 0.02 / math.sqrt(2 * self.dims.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln_" in name or name.startswith("ln_"):
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, 0.0, residual_std if name.endswith("c_proj.weight") else 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx.shape[1]
        if t > self.dims.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.dims.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model for ``cfg``, initialised from ``cfg.seed`` alone (identical in every process)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        if cfg.factory:
            return _from_factory(cfg)
        if hf.is_hf(cfg):
            return hf.build_hf(cfg)
        return GPT(resolve_dims(cfg))


def _from_factory(cfg: ModelConfig) -> nn.Module:
    spec = cfg.factory or ""
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name.isidentifier():
        raise ConfigError(f"model.factory={spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raises at import
        raise ConfigError(f"model.factory={spec!r}: cannot import {module_name!r}: {exc}") from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(f"model.factory={spec!r}: {module_name!r} has no callable {func_name!r}")
    model = func(cfg) if _takes_argument(func) else func()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.factory={spec!r} returned {type(model).__name__}, not a torch.nn.Module")
    _check_forward(model, cfg.block_size, spec)
    return model


def _takes_argument(func: object) -> bool:
    try:
        params = inspect.signature(func).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)


def _check_forward(model: nn.Module, block_size: int, spec: str) -> None:
    """One tiny forward pass, so a wrong contract fails at build time and not mid-run."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    idx = torch.zeros(1, min(8, block_size), dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(idx, idx)
    except Exception as exc:
        raise ConfigError(f"model.factory={spec!r}: forward(idx, targets) failed: {exc}") from exc
    finally:
        model.train(was_training)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor) and out[1].dim() == 0):
        raise ConfigError(f"model.factory={spec!r}: forward(idx, targets) must return (logits, scalar loss)")


def is_embedding(name: str, patterns: Iterable[str]) -> bool:
    """True if any pattern is a substring of one dot-separated part of ``name``."""
    parts = name.split(".")
    return any(pattern in part for pattern in patterns for part in parts)


def embedding_names(model: nn.Module) -> set[str]:
    """Parameter names of the model's embeddings, from module types: every ``nn.Embedding`` and the
    output layer (``get_output_embeddings()`` where the model has it, else the last ``nn.Linear``
    whose weight has an embedding's shape). Tied weights give their one (first) name."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    modules = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is None:
        shapes = {tuple(m.weight.shape) for m in modules}
        linears = [m for m in model.modules() if isinstance(m, nn.Linear) and tuple(m.weight.shape) in shapes]
        head = linears[-1] if linears else None
    if isinstance(head, nn.Module):
        modules.append(head)
    return {name_of[id(p)] for m in modules for p in m.parameters(recurse=False) if id(p) in name_of}


def embedding_rule(cfg: ModelConfig, model: nn.Module | None = None) -> Callable[[str], bool]:
    """Which tensors are merged by weighted mean instead of RDA: :func:`embedding_names` of the
    model (built on the meta device when not given: no memory, no weights) or a name matching
    ``cfg.embedding_patterns``."""
    if model is None:
        if cfg.factory:  # a user factory may not build on the meta device
            model = build_model(cfg)
        else:
            with torch.device("meta"):
                model = build_model(cfg)
    names = embedding_names(model)
    patterns = list(cfg.embedding_patterns)
    return lambda name: name in names or is_embedding(name, patterns)


def vocab_size(model: nn.Module) -> int | None:
    """Rows of the model's input embedding (its vocabulary), if it has one."""
    getter = getattr(model, "get_input_embeddings", None)
    emb = getter() if callable(getter) else next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return emb.num_embeddings if isinstance(emb, nn.Embedding) else None


def generate(model: nn.Module, prompt: list[int], num_tokens: int, *, block_size: int, top_k: int = 1,
             temperature: float = 1.0, seed: int = 0) -> list[int]:
    """``num_tokens`` new token ids after ``prompt``: greedy with ``top_k=1``, else sampled from the
    ``top_k`` most likely (seeded, so a run's sample is reproducible). Context is cropped to
    ``block_size``; the training mode is restored."""
    if not prompt:
        raise ValueError("generate needs a non-empty prompt")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(num_tokens):
                idx = torch.tensor([ids[-block_size:]], dtype=torch.long, device=device)
                logits = model(idx)[0][0, -1].float().cpu()
                if top_k <= 1:
                    ids.append(int(logits.argmax()))
                    continue
                top = torch.topk(logits / max(temperature, 1e-6), min(top_k, logits.numel()))
                choice = torch.multinomial(torch.softmax(top.values, dim=-1), 1, generator=gen)
                ids.append(int(top.indices[choice]))
    finally:
        model.train(was_training)
    return ids[len(prompt):]


def param_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def get_tensors(model: nn.Module, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Detached fp32 CPU copies of the named parameters (a host snapshot of one fragment)."""
    params = dict(model.named_parameters())
    out = {}
    for name in names:
        if name not in params:
            raise KeyError(f"model has no parameter {name!r}")
        out[name] = full_tensor(params[name].detach()).to(device="cpu", dtype=torch.float32, copy=True)
    return out


def _is_dtensor(t: torch.Tensor) -> bool:
    """An FSDP2-sharded ``DTensor``. ``torch.distributed.tensor`` is not imported here: it pulls in
    ``torch._dynamo`` (seconds of CPU at every start of a process that never shards, such as a
    syncer coming back after a restart); FSDP imports it before any DTensor exists, so while it is
    not loaded no tensor can be one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: for an FSDP2-sharded ``DTensor`` an all-gather (a collective: every rank of
    the learner calls it, in the same order); any other tensor as it is."""
    return t.full_tensor() if _is_dtensor(t) else t


def like_param(t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``t`` (a whole tensor, the same on every rank) on ``param``'s device and dtype, and for a
    sharded ``DTensor`` parameter cut to this rank's shard locally (no communication)."""
    t = t.to(device=param.device, dtype=param.dtype)
    if _is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(t, param.device_mesh, param.placements, src_data_rank=None)
    return t


def set_tensors(model: nn.Module, tensors: dict[str, torch.Tensor], alpha: float = 0.0) -> None:
    """In place: ``p = alpha * p + (1 - alpha) * t``; ``alpha=0`` overwrites.

    Optimizer state is left alone (the paper keeps inner AdamW state across adoptions).
    All names and shapes are checked before any parameter changes.
    """
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"alpha={alpha} must be in [0, 1)")
    params = dict(model.named_parameters())
    for name, t in tensors.items():
        if name not in params:
            raise KeyError(f"model has no parameter {name!r}")
        if tuple(t.shape) != tuple(params[name].shape):
            raise ValueError(f"{name}: shape {tuple(t.shape)} != parameter shape {tuple(params[name].shape)}")
    with torch.no_grad():
        for name, t in tensors.items():
            p = params[name]
            src = like_param(t, p)
            if alpha == 0.0:
                p.copy_(src)
            else:
                p.mul_(alpha).add_(src, alpha=1.0 - alpha)

"""A short text sample from a run's global model (what ``ddiloco-geo local`` prints at the end).

The global model is the newest published version of every fragment. A byte-level model reads and
writes bytes (the prompt's UTF-8, decoded with replacement); a ``tokens:`` corpus brings its
tokenizer. Sampling is top-k from a fixed seed (:func:`ddiloco_geo.core.model.generate`), so the
same run gives the same sample.
"""

from __future__ import annotations

from ddiloco_geo import protocol
from ddiloco_geo.core import model as modelmod
from ddiloco_geo.core.config import Settings
from ddiloco_geo.learner.data import tokenizer_json
from ddiloco_geo.storage import Store

DEFAULT_PROMPT = "ROMEO:\n"


def sample_global(store: Store, settings: Settings, *, prompt: str = DEFAULT_PROMPT, num_tokens: int = 200,
                  top_k: int = 8, seed: int = 0) -> str:
    """``prompt`` followed by ``num_tokens`` sampled tokens (bytes for a byte-level model)."""
    spec = protocol.load_spec(store)
    params, _ = protocol.read_global_params(store, spec)
    model = modelmod.build_model(settings.model)
    modelmod.set_tensors(model, params)
    tok_text = tokenizer_json(settings.data)
    if tok_text is None:
        ids = modelmod.generate(model, list(prompt.encode()), num_tokens, block_size=settings.model.block_size,
                                top_k=top_k, seed=seed)
        return prompt + bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_text)
    ids = modelmod.generate(model, tok.encode(prompt, add_special_tokens=False).ids, num_tokens,
                            block_size=settings.model.block_size, top_k=top_k, seed=seed)
    return prompt + tok.decode(ids)

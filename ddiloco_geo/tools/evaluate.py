"""Evaluation of the global model, as ``local`` and ``chaos`` report it.

The global model is the syncer's outer parameters (every fragment's newest published version), not
any learner's local copy, as Streaming DiLoCo's Table 3 advises. It is evaluated on the held-out
split of the run's corpus (a byte corpus or ``tokens:`` shards; ``data.eval_ratio``, ``data.eval_batches`` batches of
``learner.batch_size`` windows of ``model.block_size`` tokens), the same batches every time, so
losses of one run, or of a chaos run and its fault-free baseline, compare directly. In a signed run
only globals the syncer signed are evaluated (:func:`ddiloco_geo.protocol.global_model`: a forged
newer version is skipped and counted in :attr:`Evaluator.last_skipped`).
"""

from __future__ import annotations

from ddiloco_geo import protocol
from ddiloco_geo.core import data as datamod
from ddiloco_geo.core import model as modelmod
from ddiloco_geo.core.config import DataConfig, ModelConfig, Settings
from ddiloco_geo.core.signing import tool_keys
from ddiloco_geo.learner.data import eval_batches_for
from ddiloco_geo.protocol import RunSpec
from ddiloco_geo.storage import Store


class Evaluator:
    """Loss of the initial model and of the run's current global model on fixed eval batches."""

    def __init__(self, *, model: ModelConfig, data: DataConfig, batch_size: int, verifier=None,
                 require_signatures: bool = False) -> None:
        self.verifier, self.require_signatures = verifier, require_signatures
        self.last_skipped: dict = {}
        self.batches = eval_batches_for(data, block_size=model.block_size, batch_size=batch_size)
        self.model = modelmod.build_model(model)

    @classmethod
    def from_settings(cls, settings: Settings) -> Evaluator:
        verifier, required = tool_keys(settings.security)
        return cls(model=settings.model, data=settings.data, batch_size=settings.learner.batch_size,
                   verifier=verifier, require_signatures=required)

    def initial(self) -> float:
        """Loss of the freshly built model (call before :meth:`global_loss` loads a global)."""
        return datamod.evaluate(self.model, self.batches)

    def global_loss(self, store: Store, spec: RunSpec, quick: bool = False) -> tuple[float, dict[int, int]]:
        """(loss, {fragment: version}) of the newest globals; ``quick`` uses a quarter of the batches."""
        found = protocol.global_model(store, spec, self.verifier, self.require_signatures)
        self.last_skipped = found.skipped.as_dict()
        params, versions = found.params, found.versions
        modelmod.set_tensors(self.model, params)
        batches = self.batches[: max(1, len(self.batches) // 4)] if quick else self.batches
        return datamod.evaluate(self.model, batches), versions

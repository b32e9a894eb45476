"""The syncer role: merges learners' fragment deltas and publishes new global fragment versions.

- :mod:`~ddiloco_geo.syncer.service`: the service loop, publishing, status, shutdown;
- :mod:`~ddiloco_geo.syncer.intake`: listing, fetch, validation, rejection and quarantine;
- :mod:`~ddiloco_geo.syncer.rounds`: quorum, adaptive grace, merge spacing and the merge itself;
- :mod:`~ddiloco_geo.syncer.state`: what is held per fragment and how it is loaded from the bucket.
"""

from ddiloco_geo.syncer.service import SYNCER_ACTOR, Syncer
from ddiloco_geo.syncer.state import Ema, FragmentState, PendingDelta

__all__ = ["SYNCER_ACTOR", "Syncer", "Ema", "FragmentState", "PendingDelta"]

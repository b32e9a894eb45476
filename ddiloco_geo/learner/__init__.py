"""The learner role: an inner AdamW loop that never waits on the network.

- :mod:`~ddiloco_geo.learner.loop`: the step, adoption, sends, shutdown (:class:`Learner`);
- :mod:`~ddiloco_geo.learner.uploader`: the bounded background uploader of deltas;
- :mod:`~ddiloco_geo.learner.poller`: the background poller of new global versions;
- :mod:`~ddiloco_geo.learner.checkpoint`: the preemption checkpoint's format, write and read;
- :mod:`~ddiloco_geo.learner.ranks`: the collectives among a torchrun learner's own ranks;
- :mod:`~ddiloco_geo.learner.schedule`: the inner learning-rate schedule;
- :mod:`~ddiloco_geo.learner.preemption`: spot/preemption notices (SIGTERM, AWS, GCE).
"""

from ddiloco_geo.learner.loop import Learner
from ddiloco_geo.learner.presence import default_learner_id
from ddiloco_geo.learner.poller import GlobalPoller
from ddiloco_geo.learner.schedule import lr_schedule
from ddiloco_geo.learner.uploader import Outgoing, Uploader

__all__ = ["Learner", "default_learner_id", "GlobalPoller", "lr_schedule", "Outgoing", "Uploader"]

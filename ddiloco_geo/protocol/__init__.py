"""What every actor shares about a run in the bucket: the run spec, the index and reads of global
versions, the one publish path, and the delta ledger.

The learner, the syncer, ``local`` and the operator tools all go through these modules, so every
reader interprets the bucket the same way:

- :mod:`~ddiloco_geo.protocol.spec`: ``run.json`` (created once; later processes must agree);
- :mod:`~ddiloco_geo.protocol.index`: the ``globals/HEAD`` index and reads of published versions;
- :mod:`~ddiloco_geo.protocol.publish`: the commit of a version (state, global, update, tape, index)
  and the formats of the syncer's state and update objects;
- :mod:`~ddiloco_geo.protocol.ledger`: which deltas were merged, superseded, rejected, unaccounted;
- :mod:`~ddiloco_geo.protocol.verified`: the one verified read path (globals, records) every tool uses.
"""

from ddiloco_geo.protocol.spec import RunSpec, build_spec, create_or_load_spec, load_spec, spec_from, wait_for_spec
from ddiloco_geo.protocol.index import (
    advance_index, latest_version, list_versions, read_global, read_global_params, read_header, read_index,
)
from ddiloco_geo.protocol.ledger import (
    ledger, learner_ids, merge_records, newest_delta, next_delta_seq, quarantine_records, quarantined_learners,
)
from ddiloco_geo.protocol.verified import (
    GlobalModel, Skipped, exit_record, global_model, heartbeat, newest_global, read_record, syncer_status,
    verified_header,
)

__all__ = [
    "RunSpec", "build_spec", "spec_from", "create_or_load_spec", "load_spec", "wait_for_spec", "advance_index", "latest_version",
    "list_versions", "read_global", "read_global_params", "read_header", "read_index", "ledger", "learner_ids", "merge_records", "newest_delta", "next_delta_seq",
    "quarantined_learners", "quarantine_records", "GlobalModel", "Skipped", "exit_record", "global_model", "heartbeat",
    "newest_global", "read_record", "syncer_status", "verified_header",
]

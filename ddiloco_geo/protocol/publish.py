"""The one publish path, and the formats of the syncer's state and update objects.

:func:`commit_version` is the commit of a fragment version, shared by the syncer and
``restore --rollback``: the state object (create-only, a random token in its key), then the global
(create-only: **the commit point**; its header names the state key), then the update object, the
tape entry and the index. Two different objects for one version cannot exist; the loser of a create
race learns that the version is taken and adopts the winner.

:func:`compress_update` defines a published global as previous + dequantized change (error
feedback carries what quantization dropped into the next update), so a learner holding the
previous version rebuilds the new one bit for bit.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import torch

from ddiloco_geo import codec
from ddiloco_geo.core import layout
from ddiloco_geo.core.clocks import VectorClock
from ddiloco_geo.core.errors import CodecError
from ddiloco_geo.core.outer import NUM_STEPS_KEY, OuterOptimizer
from ddiloco_geo.core.signing import sign_record
from ddiloco_geo.protocol import index
from ddiloco_geo.protocol.verified import SYNCER_SIGNER, verified_header
from ddiloco_geo.storage import Store

RESIDUAL = "residual."  # state-object prefix of the update codec's error-feedback tensors  # in-memory globals kept for anchoring; older bases are read from the bucket


def compress_update(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], residual: dict[str, torch.Tensor],
                    header: codec.Header, codec_name: str, block_size: int, signer: Any = None, topk: int = 0
                    ) -> tuple[bytes, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Quantize a version's change for learners, with error feedback.

    The published global is defined as old + dequantize(quantize(change + residual)), so a learner
    holding the previous version rebuilds it bit for bit (checked against the global's checksum);
    what quantization dropped is carried into the next update. Returns (wire bytes, published
    params, new residual).

    What is sent is ``codec.roundtrip`` of the change: bit for bit what a learner decodes, without
    serializing; the object is then encoded once, with ``global_checksum`` (of the published
    params) in its header. Element-wise work runs as ``torch._foreach_*`` ops over the fragment's
    tensors, and the change's buffers become the new residual in place.
    """
    names = list(new)
    change = torch._foreach_sub([new[n] for n in names], [old[n] for n in names])
    carried = [i for i, n in enumerate(names) if n in residual]
    if carried:
        torch._foreach_add_([change[i] for i in carried], [residual[names[i]] for i in carried])
    change_by_name = dict(zip(names, change))
    sent_by_name = codec.roundtrip(change_by_name, codec_name, block_size=block_size, topk=topk)
    sent = [sent_by_name[n] for n in names]
    published = dict(zip(names, torch._foreach_add([old[n] for n in names], sent)))
    header.extra = {**header.extra, "global_checksum": codec.checksum_of(published)}
    wire = codec.encode(change_by_name, header, codec=codec_name, block_size=block_size, topk=topk, signer=signer)
    torch._foreach_sub_(change, sent)  # what was not sent: the next update's residual
    return wire, published, change_by_name


def commit_version(store: Store, *, run_id: str, fragment: int, version: int, params: dict[str, torch.Tensor],
                   state_tensors: dict[str, torch.Tensor], state_extra: dict[str, Any], record: dict[str, Any],
                   clock: VectorClock, signer: Any = None, after_commit: dict[str, bytes] | None = None,
                   advance_index: bool = True, verifier: Any = None) -> str | None:
    """The publish protocol, shared by the syncer and ``restore --rollback``.

    Writes the state object (create-only, a random token in its key), then the global (create-only:
    the commit point, its header naming the state key), then ``after_commit`` objects (the update),
    the tape entry (signed like the global) and, if asked, the index. Returns the state key, or None
    when another writer committed this version first (our state object, never referenced, is
    deleted). An existing global is ours only if it names our state key and, with ``verifier``, the
    syncer signed it: a forged object that copies our state key (it is listable) is not a win.
    """
    state_key = layout.syncer_state_key(fragment, version, secrets.token_hex(6))
    gkey = layout.global_key(fragment, version)
    state_header = codec.Header(kind="state", run_id=run_id, fragment=fragment, version=version, clock=clock,
                                extra={**state_extra, "global": gkey})
    store.put_if_absent(state_key, codec.encode(state_tensors, state_header, codec="fp32", signer=signer))
    record = {**record, "state_key": state_key, "published_at": time.time()}
    header = codec.Header(kind="global", run_id=run_id, fragment=fragment, version=version, clock=clock, extra=record)
    if not store.put_if_absent(gkey, codec.encode(params, header, codec="fp32", signer=signer)):
        try:
            ours = verified_header(store, gkey, verifier, SYNCER_SIGNER).extra.get("state_key") == state_key
        except CodecError:
            ours = False
        if not ours:
            store.delete(state_key)
            return None
    for key, data in (after_commit or {}).items():
        store.put_if_absent(key, data)
    entry = json.loads(json.dumps({"fragment": fragment, "version": version, "clock": json.loads(clock.to_json()),
                                   **record}, default=str))  # signed as it will read back
    store.put_if_absent(layout.tape_key(fragment, version), json.dumps(sign_record(entry, signer)).encode())
    if advance_index:
        index.advance_index(store, {fragment: version}, signer=signer, verifier=verifier)
    return state_key


def outer_state_to_wire(outer: OuterOptimizer) -> tuple[dict[str, torch.Tensor], int]:
    """Momentum buffers as fp32 tensors; the integer step count travels in the header."""
    state = outer.state_dict()
    steps = int(state.pop(NUM_STEPS_KEY))
    return state, steps


def outer_state_from_wire(tensors: dict[str, torch.Tensor], header: codec.Header) -> dict[str, torch.Tensor]:
    return {**tensors, NUM_STEPS_KEY: torch.tensor(int(header.extra.get("outer_num_steps", 0)), dtype=torch.int64)}

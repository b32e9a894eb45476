"""Replay: recompute every published global version from the bucket and check it bit for bit.

``ddiloco-geo replay --store URL [--fragment P] [--threads N] [--json]``

For every fragment p and every published version v (ascending), replay takes the objects the
syncer itself had in hand when it published v and runs the syncer's own pure functions
(:func:`ddiloco_geo.core.merge.anchor`, :func:`~ddiloco_geo.core.outer.merge_and_step`,
:func:`~ddiloco_geo.protocol.publish.compress_update`) on them:

* ``merge`` versions: global v−1 (params) and the state object it names (outer momentum, step
  count, the update codec's error-feedback residual); v's merge record (delta keys, base
  versions, counters, weights); every merged delta (fetched and decoded like the syncer does);
  every base version's params. The recomputed params must equal global v's tensors
  (``torch.equal``), the recomputed momentum/step count/residual must equal v's state object, the
  recorded weights must equal ``merge.token_weight`` of the deltas' counters (a resend merged by its
  share, ``syncer.resends``: of its counters beyond the merged delta's, which v−1's state object
  holds and the entry's ``resent`` must name), and when an update
  object ``u`` exists its decoded tensors must equal the recomputed quantized change. The update
  object's header names the codec and block size; without one (``update_codec = "none"``, or a
  syncer that crashed between writing the global and its update object) replay tries "none", then
  ``syncer.update_codec`` from the settings, each compared bit for bit.
* ``init`` versions (v = 0): the model's initial weights (built from ``run.json``'s model
  settings), zero momentum, no residual.
* ``rollback`` versions (``ddiloco-geo restore --rollback``): params and outer state equal to the
  version they roll back to.
* A fragment whose oldest version is not 0 (a run started by ``restore --to``) is *rooted* at that
  version: the root is taken as given (reported under ``roots``), everything after it is checked.

Each version is checked from the *stored* version before it, so one pass verifies the whole chain:
if every step is reproduced bit for bit, the newest global is exactly what the recorded deltas and
hyperparameters produce from the initial weights.

Inputs that are not in the bucket: the outer optimizer's hyperparameters (``syncer.outer_lr``,
``syncer.outer_momentum``, ``syncer.nesterov``, ``syncer.outer_warmup``) come from the settings
(``--set``/``--config``), unless a merge record carries them under ``"outer"`` (every record the syncer
writes does; one written before ``outer_warmup`` existed had no warm-up). The embedding rule comes from the model
settings in ``run.json`` (module types and name patterns, as the syncer decides it).

Determinism: merging runs with a fixed contributor order (the record's; float64 for norms and sums, see :mod:`ddiloco_geo.core.merge`), quantization is
blockwise absmax (exact), and the outer step is elementwise fp32. Measured on torch 2.13 (CPU): the
results do not depend on the intra-op thread count (1-16 threads, tensors up to 16M values, see
``tests/ops/test_replay.py``); they do depend on the torch build and the CPU's vector ISA level
(``torch.backends.cpu.get_cpu_capability()``, settable with ``ATEN_CPU_CAPABILITY``), which pick
the vectorized kernels (a run built at AVX2 replayed at DEFAULT differs from version 0 on). So
replay is bit-exact when it runs with the syncer's torch version and ISA level. Replay never uses a tolerance: the output's
``"bitwise"`` is always true, and a mismatch is reported as a divergence together with the torch
version, ISA level and thread count replay ran with.

Exit status: 0 if everything matches, 1 on the first divergence (per fragment; other fragments are
still checked), 2 on a configuration error. The command line is :mod:`ddiloco_geo.cli.replay`.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ddiloco_geo import codec, protocol
from ddiloco_geo.core import layout, merge
from ddiloco_geo.core.config import ModelConfig
from ddiloco_geo.core.errors import CodecError, DdilocoError, NotFoundError
from ddiloco_geo.core.merge import anchor
from ddiloco_geo.core.model import build_model, embedding_rule
from ddiloco_geo.core.outer import MOMENTUM_PREFIX, OuterOptimizer, merge_and_step
from ddiloco_geo.protocol.publish import RESIDUAL, compress_update, outer_state_from_wire
from ddiloco_geo.storage import Store
from ddiloco_geo.syncer.rounds import STALE_DAMPING_MODES, resend_share, stale_damping
from ddiloco_geo.syncer.state import merged_bookkeeping

log = logging.getLogger(__name__)

BASE_CACHE = 16  # params of recent versions kept for anchoring stale deltas


class Divergence(Exception):
    """The first thing that does not match in one fragment."""

    def __init__(self, fragment: int, version: int, what: str, detail: str, tensor: str | None = None,
                 max_abs_diff: float | None = None) -> None:
        super().__init__(detail)
        self.info = {"fragment": fragment, "version": version, "what": what, "tensor": tensor,
                     "max_abs_diff": max_abs_diff, "detail": detail}


@dataclass
class StoredState:
    key: str
    header: codec.Header
    momentum: dict[str, torch.Tensor]  # wire names ("momentum.<tensor>")
    residual: dict[str, torch.Tensor]  # tensor names

    @property
    def num_steps(self) -> int:
        return int(self.header.extra.get("outer_num_steps", 0))


def read_state(store: Store, spec: protocol.RunSpec, key: str, verifier=None, require: bool = False) -> StoredState:
    header, tensors = codec.decode(store.get(key), kind="state", run_id=spec.run_id, verify=verifier,
                                   require_signature=require, expected_signer="syncer" if verifier is not None else None)
    residual = {k[len(RESIDUAL):]: v for k, v in tensors.items() if k.startswith(RESIDUAL)}
    momentum = {k: v for k, v in tensors.items() if not k.startswith(RESIDUAL)}
    return StoredState(key, header, momentum, residual)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float | None:
    if a.shape != b.shape:
        return None
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def compare_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, fragment: int, version: int,
                    what: str) -> None:
    """Raise Divergence unless ``got`` and ``want`` hold the same names and bit-identical tensors."""
    if set(got) != set(want):
        raise Divergence(fragment, version, what, f"{what}: stored names {sorted(got)} != recomputed {sorted(want)}")
    for name in sorted(want):
        a, b = got[name], want[name]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            diff = max_abs_diff(a, b)
            raise Divergence(fragment, version, what,
                             f"{what} {name!r}: stored differs from recomputed (max |diff| {diff})", name, diff)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(a[n].shape == b[n].shape and torch.equal(a[n], b[n]) for n in a)


class Replayer:
    def __init__(self, store: Store, spec: protocol.RunSpec, *, outer_kwargs: dict[str, Any],
                 is_embedding: Callable[[str], bool], initial_params: dict[str, torch.Tensor] | None,
                 update_codec: str | None = None,
                 progress: Callable[[int, int, int, int], None] | None = None, verifier=None,
                 require_signatures: bool = False) -> None:
        self.store = store
        self.verifier, self.require_signatures = verifier, require_signatures
        self.spec = spec
        self.outer_kwargs = dict(outer_kwargs)
        self.is_embedding = is_embedding
        self.initial_params = initial_params
        self.update_codec = update_codec
        self.progress = progress
        self.versions_checked = 0
        self.roots: dict[int, int] = {}

    # --- reads -----------------------------------------------------------------------------------

    def _read(self, fragment: int, version: int, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (CodecError, NotFoundError) as exc:
            raise Divergence(fragment, version, "unreadable", f"{what}: {exc}") from None

    def _global(self, p: int, v: int) -> tuple[codec.Header, dict[str, torch.Tensor]]:
        return self._read(p, v, f"global {layout.global_key(p, v)}",
                          lambda: protocol.read_global(self.store, self.spec, p, v, verify=self.verifier,
                                                       require_signature=self.require_signatures))

    def _state(self, p: int, v: int, header: codec.Header) -> StoredState:
        key = header.extra.get("state_key")
        if not key:
            raise Divergence(p, v, "record", f"global {p}/{v} names no state object")
        state = self._read(p, v, f"state {key}", lambda: read_state(self.store, self.spec, key, self.verifier,
                                                                             self.require_signatures))
        if state.header.fragment != p or state.header.version != v:
            raise Divergence(p, v, "record", f"state {key} claims {state.header.fragment}/{state.header.version}")
        return state

    # --- one fragment ----------------------------------------------------------------------------

    def replay_fragment(self, p: int, versions: list[int], done_before: int, total: int,
                        set_aside: frozenset[int] = frozenset()) -> None:
        """Check ``versions`` in order, each from the one before it; a number in ``set_aside`` (a
        forged global the syncer recorded and published above) is not a gap."""
        if not versions:
            raise Divergence(p, -1, "missing", f"fragment {p} has no published version")
        root = versions[0]
        chain = sorted(set(versions) | {v for v in set_aside if root < v < versions[-1]})
        if chain != list(range(root, root + len(chain))):
            missing = next(root + i for i, v in enumerate(chain) if v != root + i)
            raise Divergence(p, missing, "missing", f"fragment {p} has no version {missing} but has later ones")
        header, params = self._global(p, root)
        state = self._state(p, root, header)
        if root == 0:
            self._check_init(p, header, params, state)
            self.versions_checked += 1
        else:
            self.roots[p] = root
        cache: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict({root: params})
        for i, v in enumerate(versions[1:], start=1):
            new_header, new_params = self._global(p, v)
            kind = new_header.extra.get("kind")
            if kind == "merge":
                options = self._recompute_merge(p, v, params, state, new_header, cache)
                want_params, want_state = next((o for o in options if _same(new_params, o[0])), options[0])
            elif kind == "rollback":
                want_params, want_state = self._recompute_rollback(p, v, new_header)
            else:
                raise Divergence(p, v, "record", f"unknown merge record kind {kind!r}")
            compare_tensors(new_params, want_params, fragment=p, version=v, what="params")
            if want_state.get("update") is not None:  # the update object learners rebuild v from
                stored, sent = want_state["update"]
                compare_tensors(stored, sent, fragment=p, version=v, what="update")
            new_state = self._state(p, v, new_header)
            self._compare_state(p, v, new_state, want_state, state)
            params, state = new_params, new_state
            cache[v] = new_params
            while len(cache) > BASE_CACHE:
                cache.popitem(last=False)
            self.versions_checked += 1
            if self.progress:
                self.progress(p, v, done_before + i + 1, total)

    def _check_init(self, p: int, header: codec.Header, params: dict[str, torch.Tensor], state: StoredState) -> None:
        kind = header.extra.get("kind")
        if kind != "init":
            raise Divergence(p, 0, "record", f"version 0 has kind {kind!r}, expected 'init'")
        if self.initial_params is not None:
            want = {n: self.initial_params[n].detach().to(torch.float32) for n in self.spec.plan.fragments[p]}
            compare_tensors(params, want, fragment=p, version=0, what="params")
        if state.momentum or state.residual or state.num_steps != 0:
            raise Divergence(p, 0, "momentum", "version 0's state is not a fresh outer optimizer")

    def _params_at(self, p: int, v: int, base: int, cache: OrderedDict) -> dict[str, torch.Tensor]:
        if base in cache:
            return cache[base]
        _, params = self._read(p, v, f"base version {base}", lambda: protocol.read_global(
            self.store, self.spec, p, base, verify=self.verifier, require_signature=self.require_signatures))
        return params

    def _recompute_merge(self, p: int, v: int, params: dict[str, torch.Tensor], state: StoredState,
                         header: codec.Header, cache: OrderedDict
                         ) -> list[tuple[dict[str, torch.Tensor], dict[str, Any]]]:
        """The published params and outer state the syncer computes for v, one option per possible
        update codec (exactly one unless the update object is missing)."""
        rec = header.extra
        entries = rec.get("merged") or []
        if not entries:
            raise Divergence(p, v, "record", "merge record lists no merged delta")
        expect = self.spec.plan.expect(p)
        anchored, weights = [], []
        merged_base, merged_counts = merged_bookkeeping(state.header.extra)
        damping = rec.get("stale_damping", "none")  # none before stop 48
        if damping not in STALE_DAMPING_MODES:
            raise Divergence(p, v, "record", f"merge record has stale_damping={damping!r}: expected one of {STALE_DAMPING_MODES}")
        for e in entries:
            key = e.get("key", "")
            d_header, pg = self._read(p, v, f"delta {key}", lambda: codec.decode(
                self.store.get(key), kind="delta", run_id=self.spec.run_id, expect=expect))
            for field_ in ("base_version", "num_steps", "num_tokens"):
                if getattr(d_header, field_) != e.get(field_):
                    raise Divergence(p, v, "record", f"delta {key}: header {field_}={getattr(d_header, field_)} "
                                                     f"but the merge record says {e.get(field_)}")
            if d_header.fragment != p:
                raise Divergence(p, v, "record", f"delta {key} is for fragment {d_header.fragment}")
            steps, tokens, resent = d_header.num_steps, d_header.num_tokens, None
            if "resent" in e:  # syncer.resends = "share": the part beyond the learner's merged delta on that base
                learner = e.get("learner") if isinstance(e.get("learner"), str) else ""
                resent = resend_share(merged_base, merged_counts, learner, d_header)
                if resent is None or e["resent"] != list(merged_counts[learner]) or e.get("share") != resent[0]:
                    raise Divergence(p, v, "record", f"delta {key}: recorded resent={e['resent']!r} share={e.get('share')!r}, "
                                                     f"but version {v - 1}'s state gives {resent!r}")
                steps, tokens = resent[1:]
            w = merge.token_weight(tokens, steps)
            if w != e.get("weight"):
                raise Divergence(p, v, "weight", f"delta {key}: recorded weight {e.get('weight')!r}, recomputed {w!r}")
            base = self._params_at(p, v, d_header.base_version, cache)
            if isinstance(e.get("clip"), float):  # the merge guard scaled this contributor down
                pg = {n: t * e["clip"] for n, t in pg.items()}
            if resent is not None:  # then its share (the syncer's order: the same bits)
                pg = {n: t * resent[0] for n, t in pg.items()}
            how = e.get("anchor", rec.get("anchoring"))  # an entry names its own when it differs from the run's
            x = pg if how == "base" else anchor(params, base, pg)
            on = state.header.version  # the version merged onto: v - 1, or below it across a set-aside forged global
            damp = 1.0 if rec.get("final") is True else stale_damping(damping, on - d_header.base_version)
            if e.get("damp", 1.0) != damp:
                raise Divergence(p, v, "record", f"delta {key}: recorded damp={e.get('damp')!r}, but its base "
                                                 f"{d_header.base_version} and stale_damping={damping!r} give {damp!r}")
            anchored.append(x if damp == 1.0 else {n: t * damp for n, t in x.items()})
            weights.append(w)
        robust, sparse = rec.get("robust", "none"), rec.get("sparse_average", "dense")
        if robust not in merge.ROBUST_MODES or sparse not in merge.SPARSE_MODES:
            raise Divergence(p, v, "record", f"merge record has robust={robust!r}, sparse_average={sparse!r}: "
                             f"not a merge this build knows (robust: {merge.ROBUST_MODES}, "
                             f"sparse_average: {merge.SPARSE_MODES}); replay it with the release that wrote it")
        # a record names the optimizer it stepped with; one written before syncer.outer_warmup had none
        okw = {**self.outer_kwargs, **({"warmup": 0, **rec["outer"]} if isinstance(rec.get("outer"), dict) else {})}
        try:
            outer = OuterOptimizer(**okw)
        except (TypeError, ValueError) as exc:
            raise Divergence(p, v, "record", f"merge record has outer={rec.get('outer')!r} ({exc}): not an outer "
                             "optimizer this build knows; replay it with the release that wrote it") from None
        outer.load_state_dict(outer_state_from_wire(state.momentum, state.header))
        share = rec.get("final_share", 1.0) if rec.get("final") is True else 0.0  # none before stop 31: in full
        if rec.get("final") is True and not (type(share) in (int, float) and 0 < share <= 1):
            raise Divergence(p, v, "record", f"merge record has final_share={share!r}: expected a number in (0, 1] "
                             "(an altered record, or one this build cannot read: replay it with the release that wrote it)")
        new_params, stepped = merge_and_step(params, outer, anchored, weights, self.is_embedding, okw,
                                             robust, rec.get("trim_ratio", 0.25), sparse, float(share))

        momentum = {k: t for k, t in stepped.state_dict().items() if k.startswith(MOMENTUM_PREFIX)}
        common = {"momentum": momentum, "num_steps": stepped.num_steps,
                  "merged_seqs": [(e["learner"], e["seq"]) for e in entries]}

        update_key = layout.global_update_key(p, v)
        try:
            stored_update = self.store.get(update_key)
        except NotFoundError:
            stored_update = None
        if stored_update is not None:  # the update object says which codec made the published params
            upd_header, upd_tensors = self._read(p, v, f"update {update_key}", lambda: codec.decode(
                stored_update, kind="update", run_id=self.spec.run_id, expect=expect))
            candidates = [(upd_header.codec, {"block_size": upd_header.block_size, "topk": upd_header.topk})]
        elif rec.get("update_codec"):
            upd_tensors, candidates = None, [(rec["update_codec"], self.spec.codec_args(rec["update_codec"]))]
        else:
            # no update object: either the syncer ran with update_codec 'none', or it crashed between
            # writing the global and the update; try 'none', then the configured codec (each bitwise)
            upd_tensors, candidates = None, [("none", {})]
            if self.update_codec not in (None, "none"):
                candidates.append((self.update_codec, self.spec.codec_args(self.update_codec)))
        options = []
        for codec_name, codec_args in candidates:
            if codec_name == "none":
                options.append((new_params, {**common, "residual": state.residual, "update": None}))
                continue
            uh = codec.Header(kind="update", run_id=self.spec.run_id, fragment=p, version=v, base_version=v - 1,
                              clock=header.clock)
            wire, published, residual = compress_update(params, new_params, state.residual, uh, codec_name, **codec_args)
            pair = None
            if upd_tensors is not None:
                pair = (upd_tensors, codec.decode(wire, kind="update", run_id=self.spec.run_id)[1])
            options.append((published, {**common, "residual": residual, "update": pair}))
        return options

    def _recompute_rollback(self, p: int, v: int, header: codec.Header) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        from_v = header.extra.get("from_version")
        if not isinstance(from_v, int) or not 0 <= from_v < v:
            raise Divergence(p, v, "record", f"rollback record has from_version={from_v!r}")
        src_header, src_params = self._global(p, from_v)
        src_state = self._state(p, from_v, src_header)
        return src_params, {"momentum": src_state.momentum, "residual": src_state.residual,
                            "num_steps": src_state.num_steps, "merged_seqs": []}

    def _compare_state(self, p: int, v: int, got: StoredState, want: dict[str, Any], prev: StoredState) -> None:
        compare_tensors(got.momentum, want["momentum"], fragment=p, version=v, what="momentum")
        compare_tensors(got.residual, want["residual"], fragment=p, version=v, what="residual")
        if got.num_steps != want["num_steps"]:
            raise Divergence(p, v, "momentum", f"outer step count {got.num_steps}, recomputed {want['num_steps']}")
        consumed = {str(k): int(x) for k, x in got.header.extra.get("consumed", {}).items()}
        before = {str(k): int(x) for k, x in prev.header.extra.get("consumed", {}).items()}
        for learner, seq in before.items():
            if consumed.get(learner, -1) < seq:
                raise Divergence(p, v, "consumed", f"high-water mark of {learner!r} went back from {seq} "
                                                   f"to {consumed.get(learner)}")
        for learner, seq in want["merged_seqs"]:
            if consumed.get(learner, -1) < seq:
                raise Divergence(p, v, "consumed", f"merged delta {learner}/{seq} is above the state's "
                                                   f"high-water mark {consumed.get(learner)}")


def environment() -> dict[str, Any]:
    """What decides floating-point summation order on this machine (reported with every result)."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - older torch
        capability = "unknown"
    return {"torch_version": torch.__version__, "cpu_capability": capability, "torch_threads": torch.get_num_threads()}


def replay(store: Store, spec: protocol.RunSpec, *, outer_kwargs: dict[str, Any], fragments: list[int] | None = None,
           initial_params: dict[str, torch.Tensor] | None = None, update_codec: str | None = "int4",
           progress: Callable | None = None, verifier=None, require_signatures: bool = False) -> dict[str, Any]:
    """Check every published version of ``fragments`` (default: all); returns the JSON result. With
    ``verifier`` only syncer-signed versions are replayed: a forged one is left out and counted
    (``skipped_unverified``). A forged version the syncer set aside (its signed record under
    ``syncer/forged/``; the syncer published the same merge at the next number) is not a gap; any
    other missing version is reported as a divergence."""
    if initial_params is None:
        initial_params = initial_weights(spec)
    todo = list(range(spec.plan.num_fragments)) if fragments is None else list(fragments)
    for p in todo:
        if not 0 <= p < spec.plan.num_fragments:
            raise DdilocoError(f"fragment {p} is not in the run's plan (0..{spec.plan.num_fragments - 1})")
    skipped = protocol.Skipped()
    versions = {p: _verified_versions(store, p, verifier, skipped) for p in todo}
    set_aside = {p: _set_aside(store, p, verifier) for p in todo}
    total = sum(len(v) for v in versions.values())
    r = Replayer(store, spec, outer_kwargs=outer_kwargs, is_embedding=embedding_rule(ModelConfig.model_validate(spec.model)),
                 initial_params=initial_params, update_codec=update_codec, progress=progress,
                 verifier=verifier, require_signatures=require_signatures)
    divergences = []
    done = 0
    for p in todo:
        try:
            r.replay_fragment(p, versions[p], done, total, set_aside[p])
        except Divergence as d:
            divergences.append(d.info)
            log.warning("replay_divergence %s", json.dumps(d.info))
        done += len(versions[p])
    return {
        "ok": not divergences,
        "bitwise": True,
        "versions_checked": r.versions_checked,
        "versions_total": total,
        "fragments": len(todo),
        "first_divergence": divergences[0] if divergences else None,
        "divergences": divergences,
        "roots": {str(p): v for p, v in r.roots.items()},
        "outer": outer_kwargs,
        "skipped_unverified": skipped.as_dict(),
        **environment(),
    }


def _verified_versions(store: Store, p: int, verifier, skipped) -> list[int]:
    if verifier is None:
        return protocol.list_versions(store, p)
    out = []
    for v in protocol.list_versions(store, p):
        try:
            protocol.verified_header(store, layout.global_key(p, v), verifier, "syncer")
            out.append(v)
        except (CodecError, NotFoundError) as exc:
            skipped.add("global", layout.global_key(p, v), getattr(exc, "reason", str(exc)))
    return out


def _set_aside(store: Store, p: int, verifier) -> frozenset[int]:
    """Versions of ``p`` the syncer recorded as forged and set aside (signed records only, with
    ``verifier``; a record naming another version than its key is ignored)."""
    out = set()
    for key in store.list(layout.forged_key(p, 0).rsplit("/", 1)[0] + "/"):
        rec = protocol.read_record(store, key, verifier, "syncer" if verifier is not None else None)
        v = rec.get("version") if rec is not None else None
        if type(v) is int and v >= 0 and rec.get("fragment") == p and layout.forged_key(p, v) == key:
            out.add(v)
    return frozenset(out)


def initial_weights(spec: protocol.RunSpec) -> dict[str, torch.Tensor]:
    """The model's initial fp32 weights, from run.json's model settings (as the syncer built them)."""
    net = build_model(ModelConfig(**spec.model))
    return {n: t.detach().to(torch.float32) for n, t in net.named_parameters()}

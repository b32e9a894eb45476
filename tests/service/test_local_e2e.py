"""End to end with real OS processes: `ddiloco-geo local` (a syncer and learners as processes) on
the moto S3 server and on a local directory, plus a learner run under torchrun with 2 ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cli_args_for, deadline

pytestmark = pytest.mark.slow

# a small run: nano GPT, 8 fragments re-synced every 8 steps, 200 kB of Shakespeare
SMALL = [
    "--model", "nano", "--set", "data.max_bytes=400000", "--set", "fragments.num_fragments=8",
    "--set", "fragments.sync_every=8", "--set", "data.eval_batches=4", "--set", "learner.log_every=5",
]


def ddiloco(*argv: str, cwd: Path, timeout: float = 420, env: dict | None = None) -> subprocess.CompletedProcess:
    timeout = deadline(timeout)
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "ddiloco_geo", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def check_summary(summary: dict, learners: int) -> None:
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5, summary
    assert set(summary["versions_published"]) == {str(p) for p in range(summary["num_fragments"])}
    assert all(v >= 2 for v in summary["versions_published"].values()), summary["versions_published"]
    assert summary["deltas_written"] > 0
    assert summary["deltas_written"] == summary["deltas_merged"] + summary["deltas_rejected"]
    assert summary["deltas_unaccounted"] == 0
    assert summary["processes_failed"] == 0
    assert len(summary["learners"]) == learners
    assert all(l["tokens"] > 0 for l in summary["learners"].values())
    assert summary["bytes_up"] > 0 and summary["bytes_down"] > 0
    assert summary["dp_allreduce_bytes"] > 0
    assert summary["discarded_fragment_steps_ratio"] == 0  # keep_progress (the default) discards nothing
    assert 0 < summary["out_of_step_fragment_steps_ratio"] < 1  # merges arrive after sends: some steps are past one


def test_three_learners_and_a_syncer_on_the_moto_server(make_storage_config, tmp_path):
    cfg = make_storage_config("moto")
    out = tmp_path / "out"
    proc = ddiloco("local", "--learners", "3", "--steps", "48", "--out", str(out), "--json", *SMALL,
                   *cli_args_for(cfg), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
    check_summary(summary, learners=3)
    assert summary["store"].startswith("s3://")
    assert (out / "training.png").stat().st_size > 10_000
    assert json.loads((out / "summary.json").read_text())["final_eval_loss"] == summary["final_eval_loss"]


def test_local_directory_default_and_status_with_signed_objects(tmp_path):
    out = tmp_path / "out"
    secret = "correct horse battery staple"
    proc = ddiloco("local", "--learners", "2", "--steps", "40", "--out", str(out), "--json", *SMALL, cwd=tmp_path,
                   env={"DDILOCO_SECURITY__RUN_SECRET": secret})
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
    check_summary(summary, learners=2)
    assert summary["deltas_rejected"] == 0  # every delta was signed and verified
    # the secret is in no file and no log
    for path in [*out.rglob("*"), *(tmp_path / "ddiloco-run").rglob("*.json")]:
        if path.is_file():
            assert secret not in path.read_text(errors="ignore"), path
    assert secret not in proc.stderr
    from ddiloco_geo import codec
    from ddiloco_geo.core import layout as keymod
    from ddiloco_geo.storage import open_store
    from ddiloco_geo.core import config

    st = open_store(config.load(cli={"storage": {"url": f"file://{tmp_path / 'ddiloco-run'}"}}, environ={})[0].storage)
    delta = st.list(keymod.deltas_dir("learner-0"))[0]
    assert codec.read_header(st.get(delta)).signer == "learner:learner-0"
    assert codec.read_header(st.get(keymod.global_key(0, 1))).signer == "syncer"
    assert (tmp_path / "ddiloco-run" / "run.json").exists()  # the embedded default store
    status = ddiloco("status", "file://./ddiloco-run", "--json", cwd=tmp_path, timeout=120,
                     env={"DDILOCO_SECURITY__RUN_SECRET": secret})
    assert status.returncode == 0, status.stderr
    snap = json.loads(status.stdout)
    assert {l["learner"] for l in snap["learners"]} == {"learner-0", "learner-1"}
    assert all(l["state"] == "exited" for l in snap["learners"])
    assert all(l["signed"] is True for l in snap["learners"])  # heartbeats verify against their learner
    for l in snap["learners"]:  # the aligned send lead and how the merges judged the sends
        t = l["send_timing"]
        assert t["lead"] >= 2 and t["on_time"] + t["late"] > 0, l
        assert t == summary["learners"][l["learner"]]["send_timing"]
    assert snap["syncers"][0]["counters"]["deltas_merged"] > 0
    assert snap["totals"]["tokens"] == summary["tokens_total"]
    assert snap["totals"]["learner_bytes"] > 0 and snap["totals"]["estimated_egress_usd"] > 0


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_learner_under_torchrun_with_two_ranks(tmp_path, parallel):
    """Inside a learner, an ordinary data-parallel job: 2 gloo ranks, rank 0 alone talks to storage;
    the model replicated (DDP) or sharded (FSDP2). Restarted, it resumes from its exit checkpoint
    (parameters and AdamW moments gathered whole, then re-sharded)."""
    store = f"file://{tmp_path / 'store'}"
    settings = tmp_path / "settings.toml"
    settings.write_text(
        '[model]\nname = "nano"\n[data]\nmax_bytes = 400000\n[fragments]\nnum_fragments = 8\nsync_every = 8\n'
        '[learner]\nmax_steps = 24\nlog_every = 4\n'
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    common = ["--config", str(settings), "--store", store, "--set", f"learner.parallel={parallel}"]
    syncer = subprocess.Popen([sys.executable, "-m", "ddiloco_geo", "syncer", *common], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    def run_learner(*extra: str) -> dict:
        learner = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             "-m", "ddiloco_geo", "learner", "--id", "ddp-learner", "--json", *common, *extra],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=deadline(300),
        )
        assert learner.returncode == 0, learner.stderr[-4000:]
        lines = [l for l in learner.stdout.splitlines() if l.startswith("{")]
        assert len(lines) == 1, learner.stdout  # only rank 0 reports
        return json.loads(lines[0])

    try:
        result = run_learner()
        assert result["world_size"] == 2 and result["parallel"] == parallel
        assert result["step"] == 24
        assert result["tokens"] == 24 * 2 * 8 * 128  # steps x ranks x batch x block
        assert result["uploads"]["deltas_sent"] >= 8
        assert result["checkpoint"]
        again = run_learner("--set", "learner.max_steps=32")
        assert again["resumed_from"] == result["checkpoint"] and again["step"] == 32, again
        assert again["uploads"]["deltas_sent"] >= 1
    finally:
        syncer.terminate()
        out, _ = syncer.communicate(timeout=deadline(120))
    assert syncer.returncode == 0, out[-3000:]
    from ddiloco_geo.core import config
    from ddiloco_geo import protocol
    from ddiloco_geo.storage import open_store

    st = open_store(config.load(cli={"storage": {"url": store}}, environ={})[0].storage)
    ledger = protocol.ledger(st)
    assert ledger["deltas_unaccounted"] == 0 and ledger["deltas_merged"] >= 8
    # the delta headers carry the counters of both ranks
    header = protocol.read_header(st, st.list("learners/ddp-learner/deltas/")[0])
    assert header.num_tokens == header.num_steps * 2 * 8 * 128

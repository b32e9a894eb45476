"""``ddiloco-geo learner``: one learner (run it under ``torchrun --nproc_per_node N`` for data
parallelism inside it). Shutdown order: the learner flushes and checkpoints (``Learner.finish``),
then the preemption watcher and the metrics server stop, then the store closes, then the process
group."""

from __future__ import annotations

import argparse
import contextlib
import json

from ddiloco_geo.cli.settings import settings_from
from ddiloco_geo.learner import Learner, ranks
from ddiloco_geo.learner.preemption import PreemptionWatcher
from ddiloco_geo.metrics import export_store_stats, serve_from_config
from ddiloco_geo.storage import open_store


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--id", help="learner id (default: hostname-pid)")
    p.add_argument("--region", help="region label for status views")
    p.add_argument("--shard", help="data shard 'i/N'")
    p.add_argument("--max-steps", type=int, help="inner steps before exiting")


def run(args: argparse.Namespace) -> int:
    settings, _ = settings_from(args, {
        "learner.id": args.id, "learner.region": args.region, "data.shard": args.shard,
        "learner.max_steps": args.max_steps,
    })
    rank, world, device = ranks.init_from_env(settings.learner.device)
    settings = settings.model_copy(update={"learner": settings.learner.model_copy(update={"device": device})})
    with contextlib.ExitStack() as stack:  # closed in reverse order of registration
        stack.push(lambda exc_type, *_: ranks.shutdown(world, clean=exc_type is None))
        store = open_store(settings.storage) if rank == 0 else None
        if store is not None:
            stack.callback(store.close)
        learner = Learner.from_settings(settings, store, rank=rank, world=world)
        agent = settings.agent
        watcher = PreemptionWatcher(provider=agent.provider if rank == 0 else "none", metadata_url=agent.metadata_url,
                                    poll_s=agent.poll_s, act_on_rebalance=agent.act_on_rebalance,
                                    on_notice=lambda notice: learner.request_stop(notice.source))
        watcher.install_signal_handlers(sigint=True)
        watcher.start()
        stack.callback(watcher.stop)
        if rank == 0:
            server = serve_from_config(settings.metrics, learner.registry, learner.health)
            if server is not None:
                stack.callback(server.stop)
                stack.callback(lambda: export_store_stats(learner.registry, "learner", store.stats.snapshot()))
        learner.join()
        summary = learner.run()
        if args.json and rank == 0:
            print(json.dumps({k: v for k, v in summary.items() if k != "history"}, default=str))
    return 0

"""TEMPORARY SHIM: ``ddiloco-geo replay`` until its argparse code moves here."""

from ddiloco_geo.ops.replay import add_replay_arguments as add_arguments, run_replay as run  # noqa: F401

"""TEMPORARY SHIM: ``ddiloco-geo snapshot`` until its argparse code moves here."""

from ddiloco_geo.ops.snapshot import add_snapshot_arguments as add_arguments, run_snapshot as run  # noqa: F401

"""TEMPORARY SHIM: ``ddiloco-geo restore`` until its argparse code moves here."""

from ddiloco_geo.ops.snapshot import add_restore_arguments as add_arguments, run_restore as run  # noqa: F401

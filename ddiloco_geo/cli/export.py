"""TEMPORARY SHIM: ``ddiloco-geo export`` until its argparse code moves here."""

from ddiloco_geo.ops.snapshot import add_export_arguments as add_arguments, run_export as run  # noqa: F401

"""TEMPORARY SHIM: ``ddiloco-geo report`` until its argparse code moves here."""

from ddiloco_geo.ops.report import add_arguments as add_arguments, run as run  # noqa: F401

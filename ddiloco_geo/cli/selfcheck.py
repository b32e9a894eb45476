"""TEMPORARY SHIM: ``ddiloco-geo selfcheck`` until its argparse code moves here."""

from ddiloco_geo.ops.selfcheck import add_arguments as add_arguments, run as run  # noqa: F401

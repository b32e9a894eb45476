"""TEMPORARY SHIM: ``ddiloco-geo local`` until its argparse code moves here."""

from ddiloco_geo.tools.local import add_arguments as add_arguments, run as run  # noqa: F401

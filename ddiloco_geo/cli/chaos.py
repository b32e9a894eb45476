"""TEMPORARY SHIM: ``ddiloco-geo chaos`` until its argparse code moves here."""

from ddiloco_geo.tools.chaos import add_arguments as add_arguments, run as run  # noqa: F401

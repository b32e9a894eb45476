"""TEMPORARY SHIM: ``ddiloco-geo bench`` until its argparse code moves here."""

from ddiloco_geo.tools.bench import add_arguments as add_arguments, run as run  # noqa: F401

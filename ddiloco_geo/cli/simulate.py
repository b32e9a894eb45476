"""TEMPORARY SHIM: ``ddiloco-geo simulate`` until its argparse code moves here."""

from ddiloco_geo.tools.sim import add_arguments as add_arguments, run as run  # noqa: F401

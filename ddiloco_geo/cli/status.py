"""TEMPORARY SHIM: ``ddiloco-geo status`` until its argparse code moves here."""

from ddiloco_geo.ops.status import add_arguments as add_arguments, run as run  # noqa: F401

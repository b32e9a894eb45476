"""TEMPORARY SHIM: ``ddiloco-geo syncer`` until its argparse code moves here."""

from ddiloco_geo.syncer import add_arguments as add_arguments, run as run  # noqa: F401

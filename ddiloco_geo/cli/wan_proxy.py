"""TEMPORARY SHIM: ``ddiloco-geo wan-proxy`` until its argparse code moves here."""

from ddiloco_geo.tools.wanproxy import add_arguments as add_arguments, run as run  # noqa: F401

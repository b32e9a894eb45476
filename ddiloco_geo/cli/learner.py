"""TEMPORARY SHIM: ``ddiloco-geo learner`` until its argparse code moves here."""

from ddiloco_geo.learner import add_arguments as add_arguments, run as run  # noqa: F401

"""Settings for a command: ``--set`` pairs, ``--store`` and a command's own flags, layered over the
environment, the TOML file and the defaults by :func:`ddiloco_geo.core.config.load`."""

from __future__ import annotations

import argparse
from typing import Any

from ddiloco_geo.core import config


def cli_overrides(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Nested dict of settings given on the command line: --set pairs, --store, and ``extra``
    (a flat {"section.field": value} map a subcommand built from its own flags)."""
    flat = {"storage.url": getattr(args, "store", None), **(extra or {})}
    return config.overrides_tree(getattr(args, "overrides", None), flat)


def settings_from(args: argparse.Namespace, extra: dict[str, Any] | None = None):
    """Resolve the settings tree for a subcommand (CLI > env > file > defaults)."""
    return config.load(cli=cli_overrides(args, extra), config_file=getattr(args, "config", None))

"""Settings for a command: ``--set`` pairs, ``--store`` and a command's own flags, layered over the
environment, the TOML file and the defaults by :func:`ddiloco_geo.core.config.load`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ddiloco_geo.core import config
from ddiloco_geo.core.errors import ConfigError


def cli_overrides(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Nested dict of settings given on the command line: --set pairs, --store, and ``extra``
    (a flat {"section.field": value} map a subcommand built from its own flags)."""
    flat: dict[str, Any] = {}
    for item in getattr(args, "overrides", []) or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set syncer.quorum=2")
        key, value = item.split("=", 1)
        flat[key.strip()] = _parse_value(value)
    if getattr(args, "store", None):
        flat["storage.url"] = args.store
    flat.update({k: v for k, v in (extra or {}).items() if v is not None})
    tree: dict[str, Any] = {}
    for dotted, value in flat.items():
        node = tree
        parts = dotted.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return tree


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def settings_from(args: argparse.Namespace, extra: dict[str, Any] | None = None):
    """Resolve the settings tree for a subcommand (CLI > env > file > defaults)."""
    return config.load(cli=cli_overrides(args, extra), config_file=getattr(args, "config", None))

"""Generate the layout.json files that the Terraform IAM modules read, from layout.role_prefixes().

    .venv/bin/python tests/deploy/layout_json.py           # check: exit 1 if a committed file differs
    .venv/bin/python tests/deploy/layout_json.py --write   # regenerate after a layout change

test_iam_layout.py runs the check, so a layout change that the policies miss fails CI.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ddiloco_geo.core import layout

ROOT = Path(__file__).resolve().parents[2]
TARGETS = [
    ROOT / "terraform/aws/modules/run-iam/layout.json",
    ROOT / "terraform/gcp/modules/run-iam/layout.json",
]
# role_prefixes() formats the learner id into its prefixes; the modules replace this placeholder
# with "<fleet>-*" (IAM) or "<fleet>-" (GCS conditions).
PLACEHOLDER = "{learner}"


def render() -> str:
    doc = {
        "generated_by": "tests/deploy/layout_json.py from ddiloco_geo.core.layout.role_prefixes()",
        "layout_version": layout.LAYOUT_VERSION,
        "learner_placeholder": PLACEHOLDER,
        "roles": {
            "learner": layout.role_prefixes("learner", PLACEHOLDER),
            "syncer": layout.role_prefixes("syncer"),
        },
    }
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def stale_targets() -> list[Path]:
    text = render()
    return [p for p in TARGETS if not p.exists() or p.read_text() != text]


def main(argv: list[str]) -> int:
    if "--write" in argv:
        for path in TARGETS:
            path.write_text(render())
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    stale = stale_targets()
    for path in stale:
        print(f"stale: {path.relative_to(ROOT)} (run: python tests/deploy/layout_json.py --write)")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

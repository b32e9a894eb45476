"""checkov, offline, over every Terraform root: no failed check except those listed (each with a
reason) in terraform/checkov-skips.yaml, and no stale entry in that list. CI and users run
``checkov -d terraform --skip-download --skip-check $(ids from the list)``."""

from __future__ import annotations

import json
import subprocess

import yaml

from conftest import deadline
from deploykit import TERRAFORM_DIR, checkov_bin  # noqa: F401 (fixture)

SKIPS_FILE = TERRAFORM_DIR / "checkov-skips.yaml"


def _skips() -> list[dict]:
    return yaml.safe_load(SKIPS_FILE.read_text())["skips"]


def test_every_skip_has_an_id_a_resource_and_a_reason():
    for entry in _skips():
        assert str(entry.get("id", "")).startswith("CKV"), entry
        assert str(entry.get("resource", "")).strip(), f"{entry['id']}: say which resource it is about"
        assert len(str(entry.get("why", "")).split()) >= 10, f"{entry['id']}: the reason is missing or too short"


def test_checkov_passes_offline_with_only_the_listed_skips(checkov_bin, tmp_path):
    ids = [entry["id"] for entry in _skips()]
    proc = subprocess.run(
        [
            str(checkov_bin), "-d", str(TERRAFORM_DIR), "--framework", "terraform",
            "--skip-download", "--compact", "--quiet", "-o", "json",
        ],
        capture_output=True, text=True, timeout=deadline(300), cwd=tmp_path,
    )
    assert proc.stdout.strip(), f"checkov printed nothing:\n{proc.stderr[-3000:]}"
    reports = json.loads(proc.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    # Run without --skip-check and compare: CLI-skipped checks vanish from the report, so a stale
    # entry could not be told from a needed one.
    findings = [c for r in reports for c in r.get("results", {}).get("failed_checks", [])]
    failed = [c for c in findings if c["check_id"] not in ids]
    skipped = {c["check_id"] for c in findings if c["check_id"] in ids}
    passed = sum(r.get("summary", {}).get("passed", 0) for r in reports)
    errors = sum(r.get("summary", {}).get("parsing_errors", 0) for r in reports)
    assert errors == 0, f"checkov could not parse {errors} file(s)"
    assert passed > 50, "checkov passed suspiciously few checks: did it see the modules?"
    assert not failed, "checkov findings (fix them or add a justified skip):\n" + "\n".join(
        f"{c['check_id']} {c['resource']} {c['file_path']}: {c['check_name']}" for c in failed
    )
    stale = set(ids) - skipped
    assert not stale, f"skip list entries that no longer skip anything (remove them): {sorted(stale)}"

"""The IAM policies grant exactly what the bucket layout (ddiloco_geo.core.layout.role_prefixes) says.

* layout.json, which the Terraform modules read, is regenerated from role_prefixes() and must equal
  the committed files (tests/deploy/layout_json.py --write updates them);
* `terraform plan` of examples/localstack against a moto server renders the real policy documents;
  each role's S3 grants must equal role_prefixes() for that role: a layout change the policies miss
  fails here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddiloco_geo.core import layout

import layout_json
from conftest import deadline
from deploykit import REPO, TERRAFORM_DIR, expected_grants, granted_prefixes, terraform_bin, tf, tf_env, tf_tree  # noqa: F401 (fixtures)

FLEETS = ["fleet-a", "fleet-b"]
BUCKET = "ddiloco-plan"
RUN = "run7"


def test_committed_layout_json_matches_role_prefixes():
    stale = layout_json.stale_targets()
    assert not stale, (
        f"{[str(p.relative_to(REPO)) for p in stale]} differ from layout.role_prefixes(); "
        "run: python tests/deploy/layout_json.py --write (and review the IAM modules)"
    )


def test_layout_json_script_check_mode_exits_zero():
    proc = subprocess.run([sys.executable, str(REPO / "tests/deploy/layout_json.py")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_bucket_lifecycle_expires_the_layout_learner_prefix():
    text = (TERRAFORM_DIR / "aws/modules/run-bucket/variables.tf").read_text()
    assert f'default     = "{layout.LEARNERS}"' in text
    text = (TERRAFORM_DIR / "gcp/modules/run-bucket/variables.tf").read_text()
    assert f'default     = "{layout.LEARNERS}"' in text


def test_granted_prefixes_rejects_a_grant_outside_the_layout():
    doc = {"Statement": [{"Effect": "Allow", "Action": "s3:PutObject", "Resource": f"arn:aws:s3:::{BUCKET}/other/x"}]}
    with pytest.raises(AssertionError):
        granted_prefixes(doc, BUCKET, RUN)


def test_planned_policies_grant_exactly_the_layout_prefixes(terraform_bin, tf_env, tf_tree, moto_endpoint, tmp_path):
    root = tf_tree / "terraform/examples/localstack"
    env = dict(tf_env, AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test")
    tf(terraform_bin, env, root, "init", "-backend=false", "-input=false")
    plan = tmp_path / "plan.bin"
    tf(
        terraform_bin, env, root, "plan", "-input=false", f"-out={plan}",
        f"-var=endpoint_url={moto_endpoint}", f"-var=bucket_name={BUCKET}", f"-var=run_prefix={RUN}",
        f"-var=learner_fleets={json.dumps(FLEETS)}",
    )
    shown = json.loads(tf(terraform_bin, env, root, "show", "-json", str(plan)).stdout)
    policies = {}
    for module in shown["planned_values"]["root_module"].get("child_modules", []):
        for res in module.get("resources", []):
            if res["type"] == "aws_iam_role_policy" and res["name"] == "bucket":
                policies[res["index"]] = res["values"]["policy"]
    assert set(policies) == {f"learner-{f}" for f in FLEETS} | {"syncer"}
    for role_key, policy in policies.items():
        assert granted_prefixes(policy, BUCKET, RUN) == expected_grants(role_key), role_key
    # The fleets' write grants are disjoint: no fleet can write another fleet's learners.
    writes = [granted_prefixes(policies[f"learner-{f}"], BUCKET, RUN)["write"] for f in FLEETS]
    assert not writes[0] & writes[1]
    # No learner may write globals, syncer state, snapshots or the run spec.
    for f in FLEETS:
        for path in granted_prefixes(policies[f"learner-{f}"], BUCKET, RUN)["write"]:
            assert path.startswith(layout.LEARNERS), path


def test_fleet_ids_that_would_overlap_are_rejected(terraform_bin, tf_env, tf_tree, moto_endpoint):
    root = tf_tree / "terraform/examples/localstack"
    env = dict(tf_env, AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test")
    tf(terraform_bin, env, root, "init", "-backend=false", "-input=false")
    proc = subprocess.run(
        [terraform_bin, "plan", "-no-color", "-input=false", f"-var=endpoint_url={moto_endpoint}",
         '-var=learner_fleets=["us","us-east"]'],
        cwd=root, env=env, capture_output=True, text=True, timeout=deadline(300),
    )
    assert proc.returncode != 0
    assert "wildcard would cover the other fleet" in proc.stderr.replace("\n", " ")

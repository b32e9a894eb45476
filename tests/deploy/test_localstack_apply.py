"""Integration: `terraform apply` examples/localstack against LocalStack on 127.0.0.1, check what it
built (bucket rules, policies derived from the layout), run `ddiloco-geo selfcheck` and a short job
(a syncer and two learners, nano model) in the bucket it created, then `terraform destroy`.

LocalStack comes from the shared ``localstack_endpoint`` fixture (tests/conftest.py:
``$DDILOCO_TEST_LOCALSTACK_URL`` or ``localstack/host.sh start``). It accepts IAM and bucket
policies without enforcing them; the documents are checked against keys.role_prefixes() here.
"""

from __future__ import annotations

import json
import subprocess
import uuid

import boto3
import pytest

from conftest import deadline
from deploykit import REPO, expected_grants, granted_prefixes, terraform_bin, tf, tf_env, tf_tree  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow

RUN = "run1"
FLEETS = ["local-a", "local-b"]
CLI = REPO / ".venv/bin/ddiloco-geo"


def _client(service: str, endpoint: str):
    return boto3.client(
        service, endpoint_url=endpoint, region_name="us-east-1",
        aws_access_key_id="test", aws_secret_access_key="test",
    )


def _ddiloco(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=deadline(timeout), cwd=REPO)


def test_apply_then_short_job_then_destroy(terraform_bin, tf_env, tf_tree, localstack_endpoint, tmp_path):
    root = tf_tree / "terraform/examples/localstack"
    bucket = f"ddiloco-tf-{uuid.uuid4().hex[:8]}"
    env = dict(tf_env, AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test")
    tf_vars = [
        f"-var=endpoint_url={localstack_endpoint}", f"-var=bucket_name={bucket}",
        f"-var=run_prefix={RUN}", f"-var=learner_fleets={json.dumps(FLEETS)}",
    ]
    tf(terraform_bin, env, root, "init", "-backend=false", "-input=false")
    applied = False
    try:
        tf(terraform_bin, env, root, "apply", "-auto-approve", "-input=false", *tf_vars, timeout=400)
        applied = True
        outputs = json.loads(tf(terraform_bin, env, root, "output", "-json").stdout)
        store_url = outputs["store_url"]["value"]
        assert store_url == f"s3://{bucket}/{RUN}"

        # --- what was built ---------------------------------------------------------------------
        s3 = _client("s3", localstack_endpoint)
        assert s3.get_bucket_versioning(Bucket=bucket)["Status"] == "Enabled"
        sse = s3.get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"]["Rules"][0]
        assert sse["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "AES256"
        block = s3.get_public_access_block(Bucket=bucket)["PublicAccessBlockConfiguration"]
        assert all(block.values()), block
        rules = {r["ID"]: r for r in s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]}
        assert rules["expire-deltas"]["Filter"]["Prefix"] == f"{RUN}/learners/"
        assert rules["expire-noncurrent-versions"]["NoncurrentVersionExpiration"]["NoncurrentDays"] >= 1
        policy = json.loads(s3.get_bucket_policy(Bucket=bucket)["Policy"])
        sids = {st["Sid"]: st for st in policy["Statement"]}
        assert sids["DenyInsecureTransport"]["Condition"]["Bool"]["aws:SecureTransport"] == "false"
        iam = _client("iam", localstack_endpoint)
        role_arns = {iam.get_role(RoleName=f"{bucket}-{k}")["Role"]["Arn"] for k in ["syncer", *(f"learner-{f}" for f in FLEETS)]}
        writers = sids["DenyWritesByOthers"]["Condition"]["ArnNotLike"]["aws:PrincipalArn"]
        assert set(writers if isinstance(writers, list) else [writers]) == role_arns
        for role_key in ["syncer", *(f"learner-{f}" for f in FLEETS)]:
            doc = iam.get_role_policy(RoleName=f"{bucket}-{role_key}", PolicyName="run-bucket")["PolicyDocument"]
            doc = json.loads(doc) if isinstance(doc, str) else doc
            assert granted_prefixes(doc, bucket, RUN) == expected_grants(role_key), role_key

        # --- the bucket works for ddiloco-geo -----------------------------------------------------
        endpoint = f"storage.endpoint_url={localstack_endpoint}"
        check = _ddiloco("selfcheck", "--store", store_url, "--set", endpoint, "--json", timeout=120)
        assert check.returncode == 0, f"selfcheck failed:\n{check.stdout[-3000:]}\n{check.stderr[-3000:]}"

        out = tmp_path / "out"
        job = _ddiloco(
            "local", "--learners", "2", "--store", store_url, "--set", endpoint,
            "--set", "model.name=nano", "--set", "learner.max_steps=30", "--out", str(out), "--json",
            timeout=240,
        )
        assert job.returncode == 0, f"short job failed:\n{job.stdout[-3000:]}\n{job.stderr[-3000:]}"
        listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"{RUN}/globals/")
        globals_ = [o["Key"] for o in listed.get("Contents", [])]
        assert any(k.endswith(".st") for k in globals_), f"no global version was published: {globals_}"
        learners = s3.list_objects_v2(Bucket=bucket, Prefix=f"{RUN}/learners/", Delimiter="/")
        assert len(learners.get("CommonPrefixes", [])) == 2
    finally:
        if applied or (root / "terraform.tfstate").exists():
            tf(terraform_bin, env, root, "destroy", "-auto-approve", "-input=false", *tf_vars, timeout=400)
    s3 = _client("s3", localstack_endpoint)
    names = [b["Name"] for b in s3.list_buckets().get("Buckets", [])]
    assert bucket not in names, "terraform destroy left the bucket behind"

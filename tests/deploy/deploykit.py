"""Fixtures and helpers for the deployment-kit tests (imported by the test modules; deliberately not
a conftest.py, so `from conftest import ...` elsewhere keeps meaning tests/conftest.py): the terraform and checkov binaries, an offline CLI config,
and a scratch copy of terraform/ and deploy/ (so `terraform init` never writes into the checkout).

Tools are guarded: without terraform, checkov or systemd-analyze a test fails under CI (``$CI`` set;
``.ci/run`` sets it itself) and is skipped with a message elsewhere, and ``.ci/run`` also fails on
any skip that is not GPU-only.
"""

from __future__ import annotations

import json
import os
import shutil
import string
import subprocess
from pathlib import Path

import pytest
from conftest import deadline

REPO = Path(__file__).resolve().parents[2]
TERRAFORM_DIR = REPO / "terraform"
DEPLOY_DIR = REPO / "deploy"
CHECKOV = REPO / ".venv-checkov/bin/checkov"
CHECKOV_PYTHON = REPO / ".venv-checkov/bin/python"
MIRROR_CANDIDATES = ("/opt/tf-plugins", "/usr/share/terraform/plugins", "/usr/local/share/terraform/plugins")

AWS_MODULES = sorted(p for p in (TERRAFORM_DIR / "aws/modules").iterdir() if p.is_dir())
GCP_MODULES = sorted(p for p in (TERRAFORM_DIR / "gcp/modules").iterdir() if p.is_dir())
AWS_EXAMPLES = [TERRAFORM_DIR / "examples/multi-region", TERRAFORM_DIR / "examples/localstack"]
GCP_EXAMPLES = [TERRAFORM_DIR / "examples/multi-region/gcp"]
AWS_ROOTS = AWS_MODULES + AWS_EXAMPLES


def missing_tool(what: str) -> None:
    """Fail under CI, skip elsewhere: a CI run must never pass without the tool."""
    message = f"{what} is not installed"
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI is set: the deployment checks must run)")
    pytest.skip(f"{message}; install it to run this check (CI fails instead of skipping)")


def find_mirror() -> Path | None:
    env = os.environ.get("DDILOCO_TF_MIRROR")
    for candidate in ([env] if env else []) + list(MIRROR_CANDIDATES):
        if (Path(candidate) / "registry.terraform.io/hashicorp/aws").is_dir():
            return Path(candidate)
    return None


@pytest.fixture(scope="session")
def terraform_bin() -> str:
    found = shutil.which("terraform")
    if not found:
        missing_tool("terraform")
    return found


@pytest.fixture(scope="session")
def checkov_bin() -> Path:
    if not CHECKOV.exists():
        missing_tool(f"checkov ({CHECKOV}; run: make .venv-checkov/.installed)")
    return CHECKOV


@pytest.fixture(scope="session")
def tf_env(terraform_bin, tmp_path_factory) -> dict[str, str]:
    """Environment for terraform: the project-local CLI config rendered with the offline mirror."""
    mirror = find_mirror()
    if mirror is None:
        missing_tool("the offline hashicorp/aws provider mirror (set DDILOCO_TF_MIRROR)")
    tmp = tmp_path_factory.mktemp("tfcli")
    template = string.Template((TERRAFORM_DIR / "cli-config.tfrc.tmpl").read_text())
    cli_config = tmp / "cli-config.tfrc"
    cli_config.write_text(template.substitute(mirror=str(mirror)))
    env = dict(os.environ)
    env.update(
        TF_CLI_CONFIG_FILE=str(cli_config),
        TF_IN_AUTOMATION="1",
        TF_INPUT="0",
        CHECKPOINT_DISABLE="1",
    )
    return env


@pytest.fixture(scope="session")
def tf_tree(tmp_path_factory) -> Path:
    """A scratch copy of terraform/ and deploy/ (modules find deploy/ by relative path)."""
    root = tmp_path_factory.mktemp("tftree")
    ignore = shutil.ignore_patterns(".terraform", ".terraform.lock.hcl", "*.tfstate*", "*.tfrc")
    shutil.copytree(TERRAFORM_DIR, root / "terraform", ignore=ignore)
    shutil.copytree(DEPLOY_DIR, root / "deploy")
    return root


def tf(terraform_bin: str, env: dict[str, str], cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [terraform_bin, *args, "-no-color"], cwd=cwd, env=env, capture_output=True, text=True, timeout=deadline(timeout)
    )
    assert proc.returncode == 0, f"terraform {' '.join(args)} in {cwd} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def parse_hcl(paths: list[Path]) -> dict[str, dict]:
    """Parse .tf files with python-hcl2 (installed in the checkov venv) -> {path: parsed dict}."""
    if not CHECKOV_PYTHON.exists():
        missing_tool(f"python-hcl2 ({CHECKOV_PYTHON}; run: make .venv-checkov/.installed)")
    code = (
        "import hcl2, json, sys\n"
        "out = {}\n"
        "for p in sys.argv[1:]:\n"
        "    with open(p) as f:\n"
        "        out[p] = hcl2.load(f)\n"
        "def unwrap(x):\n"
        "    if isinstance(x, dict):\n"
        "        return {k: unwrap(v) for k, v in x.items()}\n"
        "    if isinstance(x, list) and len(x) == 1 and not isinstance(x[0], dict):\n"
        "        return unwrap(x[0])\n"
        "    return [unwrap(v) for v in x] if isinstance(x, list) else x\n"
        "print(json.dumps({p: unwrap(d) for p, d in out.items()}, default=str))\n"
    )
    proc = subprocess.run(
        [str(CHECKOV_PYTHON), "-c", code, *map(str, paths)], capture_output=True, text=True, timeout=deadline(120)
    )
    assert proc.returncode == 0, f"HCL parse failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


# --- IAM policy analysis (shared by the plan test and the LocalStack apply test) ----------------

READ_ACTIONS = {"s3:GetObject"}
WRITE_ACTIONS = {"s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"}
LIST_ACTIONS = {"s3:ListBucket"}


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def granted_prefixes(policy: dict | str, bucket: str, run: str) -> dict[str, set[str]]:
    """What an S3 policy document grants, as layout prefixes relative to the run.

    Object ARNs ``.../<run>/<dir>/*`` become ``<dir>/`` and ``.../<run>/<key>`` stay ``<key>``;
    ``s3:prefix`` list patterns ``<run>/<p>*`` become ``<p>``. Anything outside the run, any other
    S3 action, a Deny, or a wildcard action raises AssertionError.
    """
    doc = json.loads(policy) if isinstance(policy, str) else policy
    object_root = f"arn:aws:s3:::{bucket}/{run}/"
    out: dict[str, set[str]] = {"read": set(), "write": set(), "list": set()}
    for st in _as_list(doc["Statement"]):
        assert st.get("Effect", "Allow") == "Allow", st
        actions = set(_as_list(st["Action"]))
        assert not any("*" in a for a in actions), f"wildcard action in {st}"
        s3_actions = {a for a in actions if a.startswith("s3:")}
        if not s3_actions:
            continue  # e.g. kms:*, autoscaling:* (checked elsewhere)
        unknown = s3_actions - READ_ACTIONS - WRITE_ACTIONS - LIST_ACTIONS
        assert not unknown, f"unexpected S3 actions {unknown}"
        kinds = {k for k, acts in (("read", READ_ACTIONS), ("write", WRITE_ACTIONS), ("list", LIST_ACTIONS)) if s3_actions & acts}
        assert len(kinds) == 1, f"statement mixes read/write/list: {st}"
        kind = kinds.pop()
        if kind == "write":
            assert s3_actions == WRITE_ACTIONS, f"write statement should carry exactly {WRITE_ACTIONS}: {st}"
        if kind == "list":
            assert _as_list(st["Resource"]) == [f"arn:aws:s3:::{bucket}"], st
            patterns = _as_list(st["Condition"]["StringLike"]["s3:prefix"])
            for pattern in patterns:
                assert pattern.startswith(f"{run}/") and pattern.endswith("*"), pattern
                out["list"].add(pattern[len(run) + 1 : -1])
            continue
        for resource in _as_list(st["Resource"]):
            assert resource.startswith(object_root), f"{resource} is outside the run {object_root}"
            rel = resource[len(object_root) :]
            if rel.endswith("/*"):
                rel = rel[:-1]
            assert "*" not in rel.replace("-*/", ""), f"unexpected wildcard in {resource}"
            out[kind].add(rel)
    return out


def expected_grants(role_key: str) -> dict[str, set[str]]:
    """What layout.role_prefixes() says a role key ('syncer' or 'learner-<fleet>') may do."""
    from ddiloco_geo.core import layout

    if role_key == "syncer":
        spec = layout.role_prefixes("syncer")
    else:
        spec = layout.role_prefixes("learner", f"{role_key.removeprefix('learner-')}-*")
    return {"read": set(spec["read"]), "write": set(spec["write"]), "list": set(spec["read"])}

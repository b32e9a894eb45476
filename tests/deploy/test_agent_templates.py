"""The agent as users install it: the systemd units, the cloud-init user data for learners and the
syncer, the environment-file template, the scripts and the container image definition.

Templates use only ${name} placeholders (and $${...} for a literal), so Terraform's templatefile()
and Python's string.Template render them identically; both renderings are compared here.
"""

from __future__ import annotations

import base64
import configparser
import json
import re
import shutil
import string
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import deadline

from ddiloco_geo.core import config

from deploykit import DEPLOY_DIR, REPO, missing_tool, terraform_bin, tf_env  # noqa: F401 (fixtures)

UNIT = DEPLOY_DIR / "systemd/ddiloco-geo@.service"
NODE_AGENT_UNIT = DEPLOY_DIR / "systemd/ddiloco-node-agent.service"
ENV_TEMPLATE = DEPLOY_DIR / "env/ddiloco-geo.env.tmpl"
CLOUD_INIT = {role: DEPLOY_DIR / f"cloud-init/{role}.yaml.tmpl" for role in ("learner", "syncer")}
SCRIPTS = [DEPLOY_DIR / "bin/ddiloco-node-setup", DEPLOY_DIR / "bin/ddiloco-node-agent"]
STATIC_FILES = {
    "/etc/systemd/system/ddiloco-geo@.service": UNIT,
    "/etc/systemd/system/ddiloco-node-agent.service": NODE_AGENT_UNIT,
    "/usr/local/sbin/ddiloco-node-setup": SCRIPTS[0],
    "/usr/local/sbin/ddiloco-node-agent": SCRIPTS[1],
}
GCE_PREEMPTION_NOTICE_S = 30


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def env_vars(role: str) -> dict[str, str]:
    return {
        "role": role, "run_id": "run1", "store_url": "s3://ddiloco-test/run1", "bucket_region": "us-east-1",
        "region": "eu-west-1", "extra_env": "DDILOCO_MODEL__NAME=nano\nDDILOCO_SYNCER__QUORUM=2",
    }


def user_data_vars(role: str, env_text: str) -> dict[str, str]:
    return {
        "cloud": "aws", "fleet": "aws-eu-west-1" if role == "learner" else "", "package_spec": "ddiloco-geo==0.1.0",
        "lifecycle_hook": "ddiloco-flush" if role == "learner" else "", "web_identity_role_arn": "",
        "env_b64": base64.b64encode(env_text.encode()).decode(),
        "unit_b64": b64(UNIT), "node_agent_unit_b64": b64(NODE_AGENT_UNIT),
        "node_setup_b64": b64(SCRIPTS[0]), "node_agent_b64": b64(SCRIPTS[1]),
    }


def render(path: Path, values: dict[str, str]) -> str:
    return string.Template(path.read_text()).substitute(values)  # strict: a missing name raises


@pytest.mark.parametrize("template", [ENV_TEMPLATE, *CLOUD_INIT.values()], ids=lambda p: p.name)
def test_templates_use_only_placeholders_both_renderers_agree_on(template):
    text = template.read_text()
    for m in re.finditer(r"\$", text):
        rest = text[m.start():]
        assert re.match(r"\$\{[a-z_][a-z0-9_]*\}|\$\$\{", rest) or text[m.start() - 1:m.start()] == "$", (
            f"{template.name}: bare '$' at offset {m.start()}: use ${{name}} or $${{...}}"
        )
    assert "%{" not in text, "Terraform template directives would not render in string.Template"


@pytest.mark.parametrize("role", ["learner", "syncer"])
def test_env_file_renders_to_valid_settings(role):
    text = render(ENV_TEMPLATE, env_vars(role))
    pairs = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z][A-Z0-9_]*", key), f"not KEY=VALUE: {line!r}"
        assert key not in pairs, f"{key} set twice"
        pairs[key] = value
    settings, origin = config.load(environ=pairs)
    assert settings.storage.url == "s3://ddiloco-test/run1"
    assert settings.learner.region == "eu-west-1"
    assert settings.model.name == "nano" and origin["model.name"] == "env"
    assert not any(k.startswith("AWS_") for k in pairs), "credentials must stay commented out in the template"


@pytest.mark.parametrize("role", ["learner", "syncer"])
def test_user_data_renders_to_cloud_config_with_the_repository_files(role):
    env_text = render(ENV_TEMPLATE, env_vars(role))
    text = render(CLOUD_INIT[role], user_data_vars(role, env_text))
    assert text.startswith("#cloud-config\n")
    doc = yaml.safe_load(text)
    files = {f["path"]: f for f in doc["write_files"]}
    for path, source in STATIC_FILES.items():
        assert base64.b64decode(files[path]["content"]) == source.read_bytes(), path
    assert base64.b64decode(files[f"/etc/ddiloco-geo/{role}.env"]["content"]).decode() == env_text
    assert files[f"/etc/ddiloco-geo/{role}.env"]["permissions"] == "0640"
    assert files["/usr/local/sbin/ddiloco-node-setup"]["permissions"] == "0755"
    node_conf = dict(line.split("=", 1) for line in files["/etc/ddiloco-geo/node.conf"]["content"].splitlines())
    assert node_conf["CLOUD"] == "aws"
    assert doc["runcmd"] == [["/usr/local/sbin/ddiloco-node-setup", role]]


def test_terraform_templatefile_renders_the_same_user_data(terraform_bin, tf_env, tmp_path):
    role = "learner"
    env_values = env_vars(role)
    env_text = render(ENV_TEMPLATE, env_values)
    values = user_data_vars(role, env_text)
    (tmp_path / "vars.json").write_text(json.dumps({"env": env_values, "ud": values}))
    expr = (
        f'jsonencode({{env = templatefile("{ENV_TEMPLATE}", jsondecode(file("{tmp_path}/vars.json")).env), '
        f'ud = templatefile("{CLOUD_INIT[role]}", jsondecode(file("{tmp_path}/vars.json")).ud)}})'
    )
    proc = subprocess.run(
        [terraform_bin, "console"], input=expr + "\n", cwd=tmp_path, env=tf_env, capture_output=True, text=True, timeout=deadline(60)
    )
    assert proc.returncode == 0, proc.stderr
    rendered = json.loads(json.loads(proc.stdout.strip()))
    assert rendered["env"] == env_text
    assert rendered["ud"] == render(CLOUD_INIT[role], values)


def _unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str
    parser.read_string(path.read_text())
    return parser


def test_agent_unit_restarts_on_failure_and_stops_inside_the_preemption_notice():
    unit = _unit(UNIT)
    service = unit["Service"]
    assert service["Restart"] == "on-failure"
    assert service["KillSignal"] == "SIGTERM"
    assert service["EnvironmentFile"] == "/etc/ddiloco-geo/%i.env"
    assert service["ExecStart"].split()[-1] == "%i"
    assert 0 < int(service["TimeoutStopSec"]) <= GCE_PREEMPTION_NOTICE_S - 5
    assert service["User"] != "root"
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    assert "network-online.target" in unit["Unit"]["After"]


@pytest.mark.parametrize("unit_path", [UNIT, NODE_AGENT_UNIT], ids=lambda p: p.name)
def test_units_pass_systemd_analyze_verify(unit_path, tmp_path):
    analyze = shutil.which("systemd-analyze")
    if not analyze:
        missing_tool("systemd-analyze (package systemd)")
    # verify checks that ExecStart exists and that User= resolves: point them at this machine.
    text = unit_path.read_text()
    text = text.replace("/opt/ddiloco-geo/bin/ddiloco-geo", str(REPO / ".venv/bin/ddiloco-geo"))
    text = text.replace("/usr/local/sbin/ddiloco-node-agent", str(SCRIPTS[1]))
    text = re.sub(r"^(User|Group)=.*$", r"\1=root", text, flags=re.M)
    name = unit_path.name.replace("@.service", "@learner.service")
    target = tmp_path / name
    target.write_text(text)
    proc = subprocess.run([analyze, "verify", str(target)], capture_output=True, text=True, timeout=deadline(60))
    problems = [l for l in (proc.stdout + proc.stderr).splitlines() if str(target) in l or name in l]
    assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_are_executable_valid_bash(script):
    assert script.stat().st_mode & 0o111, f"{script} is not executable"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_containerfile_is_slim_nonroot_and_secret_free():
    text = (DEPLOY_DIR / "Containerfile").read_text()
    instructions = [l.split(None, 1)[0] for l in text.splitlines() if l.strip() and not l.startswith("#")]
    assert instructions[0] == "FROM"
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)
    assert re.search(r'^ENTRYPOINT \["ddiloco-geo"\]$', text, re.M)
    assert re.search(r"^USER ddiloco$", text, re.M)
    assert re.search(r"^STOPSIGNAL SIGTERM$", text, re.M)
    assert not re.search(r"AWS_(SECRET|ACCESS|SESSION)|GOOGLE_APPLICATION_CREDENTIALS|PRIVATE KEY", text)
    for line in text.splitlines():
        if line.startswith(("COPY", "ADD")):
            assert ".env" not in line and "credentials" not in line, line


def test_localstack_compose_creates_the_run_bucket():
    compose = yaml.safe_load((REPO / "localstack/docker-compose.yml").read_text())
    service = compose["services"]["localstack"]
    assert any(str(p).startswith("127.0.0.1:") for p in service["ports"]), "bind to loopback only"
    assert any("ready.d" in str(v) for v in service["volumes"])
    hooks = sorted((REPO / "localstack/init/ready.d").glob("*.sh"))
    assert hooks and all(h.stat().st_mode & 0o111 for h in hooks)
    for hook in hooks:
        assert subprocess.run(["bash", "-n", str(hook)]).returncode == 0
        assert "create-bucket" in hook.read_text() or "s3 mb" in hook.read_text()

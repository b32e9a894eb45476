"""Static checks of terraform/: formatting, module structure, typed and described variables,
described outputs, an HCL parse of every .tf file, and `init -backend=false` + `validate` of every
AWS root against the offline provider mirror (GCP roots: no google provider offline)."""

from __future__ import annotations

import pytest

from deploykit import AWS_ROOTS, GCP_EXAMPLES, GCP_MODULES, TERRAFORM_DIR, parse_hcl, terraform_bin, tf, tf_env, tf_tree  # noqa: F401 (fixtures)

ALL_MODULES = [p for p in AWS_ROOTS + GCP_MODULES + GCP_EXAMPLES]
STANDARD_FILES = ("main.tf", "variables.tf", "outputs.tf", "versions.tf", "README.md")


def _rel(path) -> str:
    return str(path.relative_to(TERRAFORM_DIR))


def test_terraform_fmt_check_passes_everywhere(terraform_bin, tf_env):
    tf(terraform_bin, tf_env, TERRAFORM_DIR, "fmt", "-check", "-recursive", "-diff")


@pytest.mark.parametrize("module", ALL_MODULES, ids=_rel)
def test_module_has_standard_structure(module):
    missing = [name for name in STANDARD_FILES if not (module / name).exists()]
    assert not missing, f"{_rel(module)} lacks {missing} (standard module structure, STYLE.md habit 14)"


def test_every_tf_file_parses_and_variables_outputs_are_typed_and_described():
    files = sorted(TERRAFORM_DIR.rglob("*.tf"))
    files = [f for f in files if ".terraform" not in f.parts]
    assert len(files) >= 20
    parsed = parse_hcl(files)
    problems = []
    for path, doc in parsed.items():
        for block in doc.get("variable", []):
            for name, body in block.items():
                if "type" not in body:
                    problems.append(f"{path}: variable {name} has no type")
                if not str(body.get("description", "")).strip():
                    problems.append(f"{path}: variable {name} has no description")
        for block in doc.get("output", []):
            for name, body in block.items():
                if not str(body.get("description", "")).strip():
                    problems.append(f"{path}: output {name} has no description")
        if path.endswith(("variables.tf",)):
            other = set(doc) - {"variable"}
            if other:
                problems.append(f"{path}: holds {sorted(other)} besides variables")
        if path.endswith("outputs.tf") and set(doc) - {"output"}:
            problems.append(f"{path}: holds {sorted(set(doc) - {'output'})} besides outputs")
    assert not problems, "\n".join(problems)


def test_readmes_mention_every_variable_and_output():
    files = [m / n for m in ALL_MODULES for n in ("variables.tf", "outputs.tf")]
    parsed = parse_hcl(files)
    problems = []
    for module in ALL_MODULES:
        readme = (module / "README.md").read_text()
        for kind, fname in (("variable", "variables.tf"), ("output", "outputs.tf")):
            for block in parsed[str(module / fname)].get(kind, []):
                for name in block:
                    if f"`{name}`" not in readme:
                        problems.append(f"{_rel(module)}/README.md does not document {kind} `{name}`")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("root", AWS_ROOTS, ids=_rel)
def test_aws_root_validates_offline(terraform_bin, tf_env, tf_tree, root):
    copy = tf_tree / "terraform" / root.relative_to(TERRAFORM_DIR)
    tf(terraform_bin, tf_env, copy, "init", "-backend=false", "-input=false")
    out = tf(terraform_bin, tf_env, copy, "validate")
    assert "Success" in out.stdout

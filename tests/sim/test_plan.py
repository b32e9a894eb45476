"""The planner: deterministic, respects its constraints, cost terms add up, bandwidth gates learners,
the tfvars it writes validate in terraform/examples/multi-region, and the CLI's outputs."""

from __future__ import annotations

import copy
import json
import sys
import tomllib
from pathlib import Path

import pytest

from ddiloco_geo.cli.main import main
from ddiloco_geo.core.errors import ConfigError
from ddiloco_geo.tools.plan import parse_plan, plan_run
from ddiloco_geo.tools.plan import tfvars as tfvarsmod
from ddiloco_geo.tools.plan.costs import bytes_per_step
from ddiloco_geo.tools.plan.options import enumerate_options

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))
from deploykit import TERRAFORM_DIR, terraform_bin, tf, tf_env, tf_tree  # noqa: E402,F401 (fixtures)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "docs/examples/regions.toml"
RAW = tomllib.loads(EXAMPLE.read_text())


def raw(**job) -> dict:
    out = copy.deepcopy(RAW)
    out["job"].update(job)
    return out


def region(out: dict, name: str) -> dict:
    return next(r for r in out["regions"] if r["name"] == name)


@pytest.mark.unit
def test_example_plan_recommends_ddiloco_across_regions_within_the_deadline():
    result = plan_run(parse_plan(raw()))
    best = result["recommended"]
    assert best["system"] == "ddiloco" and best["feasible"]
    assert len(best["regions"]) >= 2 and best["wall_h"] <= RAW["job"]["deadline_hours"]
    # the example's links carry H = 12's bytes, and its better token efficiency buys fewer tokens
    assert best["codec"] == "int4" and best["H"] == best["P"] == 12
    # DP in one region misses the deadline; DP over the WAN is bandwidth-bound
    assert result["dp_cheapest_region"]["wall_h"] > RAW["job"]["deadline_hours"]
    assert result["dp_across_regions"]["utilization"] < 0.5
    assert result["dp_across_regions"]["wan_bytes_per_token"] > 50 * best["wan_bytes_per_token"]


@pytest.mark.unit
def test_recommendation_is_deterministic():
    a = plan_run(parse_plan(raw()))
    b = plan_run(parse_plan(raw()))
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@pytest.mark.unit
def test_recommendation_respects_every_constraint_and_is_the_cheapest_feasible():
    for deadline, budget in ((72, None), (40, None), (None, 60_000), (100, 90_000)):
        result = plan_run(parse_plan(raw(deadline_hours=deadline, budget_usd=budget)))
        best = result["recommended"]
        if best is None:
            assert result["why_none"]
            continue
        assert deadline is None or best["wall_h"] <= deadline
        assert budget is None or best["total_usd"] <= budget
        assert best["utilization"] >= RAW["job"]["min_utilization"]
        feasible = [r for r in result["options"] if r["system"] == "ddiloco" and r["feasible"]]
        assert best["total_usd"] == min(r["total_usd"] for r in feasible)
        assert all(not r["reasons"] for r in feasible)


@pytest.mark.unit
def test_a_tight_deadline_buys_more_regions():
    loose = plan_run(parse_plan(raw(deadline_hours=None)))["recommended"]
    tight = plan_run(parse_plan(raw(deadline_hours=72)))["recommended"]
    assert loose["wall_h"] > 72 and tight["wall_h"] <= 72
    assert tight["accelerators"] > loose["accelerators"]


@pytest.mark.unit
def test_thinner_links_move_the_plan_to_a_longer_horizon_and_then_to_no_plan():
    """H trades bytes for token efficiency (the measured rows): as the WAN thins, the cheapest feasible
    option moves from H = 12 to a larger H, and with no usable link nothing is recommended (a reason
    for each option, no exception, even where a data-parallel step outlasts the time between failures)."""
    def planned(scale: float) -> dict:
        out = raw()
        for r in out["regions"]:
            r["bandwidth_gbps"] = {k: v * scale for k, v in r.get("bandwidth_gbps", {}).items()}
        return plan_run(parse_plan(out))

    wide, thin, none = planned(1.0), planned(0.02), planned(0.005)
    assert wide["recommended"]["H"] == 12
    assert thin["recommended"]["H"] > 12 and thin["recommended"]["feasible"]
    assert none["recommended"] is None and none["why_none"]
    assert all(o["reasons"] for o in none["options"] if not o["feasible"])


@pytest.mark.unit
def test_cost_terms_add_up():
    result = plan_run(parse_plan(raw()))
    tokens = RAW["job"]["tokens"]
    for r in result["options"]:
        if r["usd_per_billion_tokens"] is None:
            continue
        usd = r["usd_per_billion_tokens"]
        parts = usd["compute"] + usd["egress"] + usd["requests"] + usd["storage"]
        assert usd["total"] == pytest.approx(parts, abs=0.02)
        assert usd["total"] * tokens / 1e9 == pytest.approx(r["total_usd"], rel=1e-3)
        assert min(usd.values()) >= 0
    best = result["recommended"]
    assert best["usd_per_billion_tokens"]["egress"] > 0 and best["usd_per_billion_tokens"]["requests"] > 0
    assert best["usd_per_billion_tokens"]["storage"] > 0
    assert result["dp_cheapest_region"]["usd_per_billion_tokens"]["egress"] == 0


@pytest.mark.unit
def test_a_region_without_bandwidth_cannot_host_a_learner_that_needs_it():
    out = raw(deadline_hours=None)
    for r in out["regions"]:
        r.get("bandwidth_gbps", {}).pop("eu-west-1", None)  # eu-west-1 is reachable from nowhere
    options = enumerate_options(parse_plan(out))
    remote = [o for o in options if o.system == "ddiloco" and "eu-west-1" in o.regions and o.home != "eu-west-1"]
    assert remote and all(not o.feasible for o in remote)
    assert all(any("no bandwidth from eu-west-1" in why for why in o.reasons) for o in remote)
    # alone, with its bucket at home, it needs no WAN and stays plannable
    alone = [o for o in options if o.system == "ddiloco" and o.regions == ["eu-west-1"] and o.codec == "int4"]
    assert alone and all(o.feasible for o in alone)
    dp = [o for o in options if o.system == "dp_wan" and "eu-west-1" in o.regions]
    assert all(not o.feasible for o in dp)


@pytest.mark.unit
def test_scarce_bandwidth_lowers_utilization_and_an_efficiency_row_unlocks_topk():
    out = raw(deadline_hours=None, min_utilization=0.5)
    for name in ("us-east-1", "us-east-2", "us-west-2"):
        region(out, name)["bandwidth_gbps"] = {k: 0.05 for k in region(out, name).get("bandwidth_gbps", {})}
    plan = parse_plan(out)
    opts = {o.id: o for o in enumerate_options(plan)}
    int4 = opts["ddiloco:us-east-1+us-east-2@us-east-1:spot:x1:int4:H24"]
    topk = opts["ddiloco:us-east-1+us-east-2@us-east-1:spot:x1:topk:H24"]
    assert int4.utilization < 0.9  # the remote learner stalls on its 50 Mbit/s link
    assert not topk.feasible and "no token-efficiency row" in topk.reasons[0]
    out["efficiency"] = [{"system": "ddiloco", "codec": "topk", "H": 24, "ratio": 0.6, "source": "test"}]
    topk = {o.id: o for o in enumerate_options(parse_plan(out))}["ddiloco:us-east-1+us-east-2@us-east-1:spot:x1:topk:H24"]
    # topk shrinks the upload only; the int4 updates coming back still bound the step
    assert topk.feasible and topk.utilization >= int4.utilization and topk.efficiency == 0.6


@pytest.mark.unit
def test_token_efficiency_scales_the_tokens_to_buy():
    best = plan_run(parse_plan(raw()))["recommended"]
    assert best["tokens_to_buy"] == pytest.approx(RAW["job"]["tokens"] / best["efficiency"])


@pytest.mark.unit
def test_bytes_per_step_is_one_fragment_each_way():
    up, down = bytes_per_step(24e6, "int4", "int4", 24)
    assert up == down == pytest.approx(1e6 * 4 * 0.13292)
    assert bytes_per_step(24e6, "topk", "int4", 24)[0] == pytest.approx(1e6 * 4 / 107.7, rel=0.01)  # ~1/108 of fp32 (84 of 4096 kept)


@pytest.mark.unit
@pytest.mark.parametrize("change, message", [
    ({"job": {"params": 0}}, "params"),
    ({"job": {"codecs": ["int3"]}}, "codec"),
    ({"regions": [{"name": "x"}]}, "regions"),
])
def test_bad_files_say_what_to_fix(change, message):
    out = raw()
    if "job" in change:
        out["job"].update(change["job"])
    else:
        out["regions"] = change["regions"]
    with pytest.raises(ConfigError, match=message):
        parse_plan(out)


@pytest.mark.unit
def test_unknown_region_in_a_bandwidth_table_is_refused():
    out = raw()
    region(out, "us-east-1")["bandwidth_gbps"]["ap-south-1"] = 5
    with pytest.raises(ConfigError, match="unknown region"):
        parse_plan(out)


def test_cli_json_png_and_tfvars(tmp_path, capsys):
    tfvars = tmp_path / "terraform.tfvars"
    rc = main(["plan", str(EXAMPLE), "--json", "--out", str(tmp_path), "--tfvars", str(tfvars)])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["recommended"]["id"]
    assert (tmp_path / "plan.png").stat().st_size > 10_000
    text = tfvars.read_text()
    assert f'home_region = "{result["recommended"]["home"]}"' in text
    assert 'DDILOCO_RUN__CODEC = "int4"' in text


def test_cli_table_and_bad_file(tmp_path, capsys):
    assert main(["plan", str(EXAMPLE), "--no-chart"]) == 0
    assert "recommended" in capsys.readouterr().out
    assert main(["plan", str(tmp_path / "missing.toml"), "--no-chart"]) == 2


@pytest.mark.slow
def test_written_tfvars_validate_in_the_multi_region_example(terraform_bin, tf_env, tf_tree):  # noqa: F811 (fixtures)
    plan = parse_plan(raw())
    text = tfvarsmod.render(plan, plan_run(plan), "docs/examples/regions.toml")
    root = tf_tree / "terraform" / "examples/multi-region"
    (root / "terraform.tfvars").write_text(text)
    tf(terraform_bin, tf_env, root, "init", "-backend=false", "-input=false")
    out = tf(terraform_bin, tf_env, root, "validate")
    assert "Success" in out.stdout
    # a variable the example does not declare would only warn; the file sets only declared ones
    declared = set(__import__("re").findall(r'variable "(\w+)"', (TERRAFORM_DIR / "examples/multi-region/variables.tf").read_text()))
    written = {line.split(" = ")[0] for line in text.splitlines() if " = " in line and not line.startswith((" ", "#"))}
    assert written <= declared

"""run.json: the run-level codec settings it records, old files, and a joining process's check."""

import json

import pytest

from ddiloco_geo import protocol
from ddiloco_geo.core import config
from ddiloco_geo.core.errors import ConfigError

pytestmark = pytest.mark.unit  # no servers, no subprocesses


def _spec(**run):
    settings = config.Settings(model={"name": "nano"}, run=run)
    return protocol.build_spec(settings)[0], settings


def test_top_k_settings_are_recorded_and_used_for_the_top_k_codec_only():
    spec, _ = _spec(codec="topk", topk_chunk=1024, topk_keep=8)
    back = protocol.RunSpec.from_json(spec.to_json())
    assert (back.topk_chunk, back.topk_keep, back.quant_block) == (1024, 8, 128)
    assert back.codec_args("topk") == {"block_size": 1024, "topk": 8}
    assert back.codec_args("int4") == {"block_size": 128}  # update objects of a top-k run stay blockwise
    default, _ = _spec(codec="topk")
    assert default.codec_args("topk") == {"block_size": 4096, "topk": 84}  # 84 of 4096 (SparseLoCo: 64)


def test_a_run_json_without_top_k_settings_keeps_the_chunk_it_was_written_with():
    spec, _ = _spec(codec="topk")
    old = json.loads(spec.to_json())
    del old["topk_chunk"], old["topk_keep"]
    legacy = protocol.RunSpec.from_json(json.dumps(old))
    # before these settings, top-k chunks were cut at the quantization block (2 kept of 128)
    assert legacy.codec_args("topk") == {"block_size": 128, "topk": 2}


@pytest.mark.parametrize("fields", [{"topk_chunk": 0}, {"topk_chunk": 8192}, {"topk_keep": 0},
                                    {"topk_chunk": 64, "topk_keep": 65}, {"topk_keep": "many"}])
def test_a_run_json_with_unusable_top_k_settings_is_a_clear_error(fields):
    spec, _ = _spec(codec="topk")
    bad = {**json.loads(spec.to_json()), **fields}
    with pytest.raises(ConfigError, match="run.json is malformed"):
        protocol.RunSpec.from_json(json.dumps(bad))


def test_a_process_must_match_a_top_k_runs_chunk_and_count():
    spec, settings = _spec(codec="topk")
    spec.check_settings(settings.run)
    with pytest.raises(ConfigError, match=r"run.topk_keep=16 but the run uses 84"):
        spec.check_settings(config.RunConfig(codec="topk", topk_keep=16))
    int4, _ = _spec()
    int4.check_settings(config.RunConfig(topk_keep=16))  # irrelevant to an int4 run
    # a top-k run started before the default became 84 recorded 64: a default process is told the flag
    old, _ = _spec(codec="topk", topk_keep=64)
    with pytest.raises(ConfigError, match=r"run.topk_keep=84 but the run uses 64.*--set run.topk_keep=64"):
        old.check_settings(config.RunConfig(codec="topk"))
    with pytest.raises(ValueError, match="topk_keep=300 exceeds run.topk_chunk=256"):
        config.RunConfig(topk_chunk=256, topk_keep=300)

"""Settings precedence (CLI > env > file > defaults), provenance, and clear errors."""

import pydantic
import pytest

from ddiloco_geo.core import config
from ddiloco_geo.core.errors import ConfigError

pytestmark = pytest.mark.unit  # no servers, no subprocesses


def write_toml(tmp_path, text):
    path = tmp_path / "ddiloco.toml"
    path.write_text(text)
    return path


def test_defaults_match_the_design_numbers():
    settings, origin = config.load(environ={})
    assert settings.fragments.num_fragments == 24
    assert settings.fragments.sync_every == 16  # 7 runs: 1.5 points better than 24 (docs/benchmarks.md)
    assert settings.fragments.overlap == 2
    assert settings.syncer.quorum == 1
    assert settings.syncer.outer_lr == 0.4  # Nesterov 0.4/0.9: measured best at the full budget (docs/benchmarks.md)
    assert settings.syncer.outer_momentum == 0.9
    assert settings.syncer.stale_damping == "inverse"  # 12 chaos runs, six seeds quiet and loaded, all within 3% (docs/benchmarks.md, Chaos, stops 48-49)
    assert settings.run.codec == "int4"
    assert settings.storage.url.startswith("file://")
    assert origin == {}


def test_precedence_cli_over_env_over_file_over_default(tmp_path):
    toml = write_toml(tmp_path, "[syncer]\nquorum = 2\nouter_lr = 0.5\npoll_s = 0.3\n[local]\nlearners = 4\n")
    env = {"DDILOCO_SYNCER__QUORUM": "3", "DDILOCO_SYNCER__OUTER_LR": "0.3"}
    settings, origin = config.load(cli={"syncer": {"quorum": 4}}, config_file=toml, environ=env)
    assert settings.syncer.quorum == 4 and origin["syncer.quorum"] == "cli"
    assert settings.syncer.outer_lr == 0.3 and origin["syncer.outer_lr"] == "env"
    assert settings.syncer.poll_s == 0.3 and origin["syncer.poll_s"] == "file"
    assert settings.syncer.outer_momentum == 0.9 and "syncer.outer_momentum" not in origin


def test_config_file_from_environment_variable(tmp_path):
    toml = write_toml(tmp_path, 'run_id = "from-file"\n')
    settings, origin = config.load(environ={"DDILOCO_CONFIG": str(toml)})
    assert settings.run_id == "from-file" and origin["run_id"] == "file"


def test_process_switches_are_not_settings_keys():
    """DDILOCO_NATIVE_CODEC / _NATIVE_DIR / _MALLOC_TUNING are read outside the settings tree; a
    command that loads settings must not reject them as unknown keys (as it did when they came)."""
    env = {name: "0" for name in config.PROCESS_ENV}
    settings, _ = config.load(environ={**env, "DDILOCO_SYNCER__QUORUM": "2"})
    assert settings.syncer.quorum == 2
    with pytest.raises(ConfigError, match="DDILOCO_NATIVE_CODECS|native_codecs"):
        config.load(environ={"DDILOCO_NATIVE_CODECS": "0"})  # a misspelling is still an unknown key


def test_env_lists_are_parsed_as_json():
    settings, _ = config.load(environ={"DDILOCO_MODEL__EMBEDDING_PATTERNS": '["tok", "head"]'})
    assert settings.model.embedding_patterns == ["tok", "head"]


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"cli": {"syncer": {"quorom": 2}}}, "syncer.quorom"),
        ({"environ": {"DDILOCO_SYNCER__QUORUM": "0"}}, "DDILOCO_SYNCER__QUORUM"),
        ({"cli": {"run": {"codec": "int3"}}}, "run.codec"),
        ({"cli": {"syncer": {"shard": "3/2"}}}, "0 <= i < N"),
        ({"cli": {"data": {"shard": "x"}}}, "i/N"),
        ({"cli": {"syncer": {"outer_warmup": -1}}}, "syncer.outer_warmup"),
        ({"environ": {"DDILOCO_SYNCER__OUTER_WARMUP": "a few"}}, "DDILOCO_SYNCER__OUTER_WARMUP"),
    ],
)
def test_invalid_values_are_rejected_with_a_fix(kwargs, needle):
    kwargs.setdefault("environ", {})
    with pytest.raises(ConfigError) as exc:
        config.load(**kwargs)
    assert needle in str(exc.value)


def test_unknown_key_names_its_source_and_the_fix(tmp_path):
    toml = write_toml(tmp_path, "[syncer]\nbogus = 1\n")
    with pytest.raises(ConfigError) as exc:
        config.load(config_file=toml, environ={})
    assert "syncer.bogus (from file" in str(exc.value)
    assert "config --show" in str(exc.value)


def test_bad_toml_and_missing_file_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        config.load(config_file=tmp_path / "nope.toml", environ={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(config_file=write_toml(tmp_path, "[syncer\n"), environ={})


def test_json_settings_file_round_trips(tmp_path):
    settings, _ = config.load(cli={"run_id": "abc", "syncer": {"quorum": 2}, "local": {"learners": 3}}, environ={})
    path = tmp_path / "settings.json"
    path.write_text(settings.model_dump_json())
    again, origin = config.load(config_file=path, environ={})
    assert again == settings
    assert origin["syncer.quorum"] == "file"


def test_explain_lists_every_leaf_with_its_source():
    settings, origin = config.load(cli={"syncer": {"quorum": 2}, "local": {"learners": 3}}, environ={})
    rows = {r["key"]: r for r in config.explain(settings, origin)}
    assert rows["syncer.quorum"] == {"key": "syncer.quorum", "value": 2, "source": "cli"}
    assert rows["storage.url"]["source"] == "default"
    assert len(rows) > 40


def test_every_key_is_documented():
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    settings, origin = config.load(environ={})
    missing = [r["key"] for r in config.explain(settings, origin) if f"`{r['key']}`" not in doc]
    assert not missing, f"add these keys to docs/configuration.md: {missing}"


def test_a_quorum_above_local_learners_is_valid_for_the_syncer_command():
    """The check that K <= M belongs to `ddiloco-geo local` (which knows M); a syncer of a
    multi-machine run may well wait for more learners than `local.learners` says."""
    settings, _ = config.load(cli={"syncer": {"quorum": 4}}, environ={})
    assert settings.syncer.quorum == 4 and settings.local.learners == 3


def test_a_check_across_sections_prints_no_broken_provenance():
    class Strict(config.Settings):
        @pydantic.model_validator(mode="after")
        def _across(self):
            raise ValueError("sections disagree")

    with pytest.raises(pydantic.ValidationError) as info:
        Strict.model_validate({})
    text = config._describe(info.value, {})
    assert "sections disagree" in text and "env DDILOCO_)" not in text and "(from default" not in text


def test_the_settings_codec_names_are_the_codecs_names():
    import typing

    from ddiloco_geo import codec

    assert typing.get_args(config.Codec) == codec.CODECS
    assert set(typing.get_args(config.SyncerConfig.model_fields["update_codec"].annotation)) == {"none", *codec.CODECS}


def test_local_refuses_a_quorum_above_its_learners(capsys, tmp_path):
    from ddiloco_geo.cli.main import main

    assert main(["local", "--quorum", "5", "--learners", "2", "--store", f"file://{tmp_path}/run", "--no-live"]) == 2
    err = capsys.readouterr().err
    assert "syncer.quorum=5 exceeds local.learners=2" in err and "env DDILOCO_)" not in err


def test_a_topk_run_defaults_to_plain_averaging_unless_the_outer_optimizer_is_set():
    settings, _ = config.load(environ={}, cli={"run": {"codec": "topk"}, "syncer": {"quorum": 2}})
    assert (settings.syncer.outer_lr, settings.syncer.outer_momentum) == config.TOPK_OUTER == (1.0, 0.0)
    settings, _ = config.load(environ={"DDILOCO_SYNCER__OUTER_MOMENTUM": "0.5"}, cli={"run": {"codec": "topk"}})
    assert (settings.syncer.outer_lr, settings.syncer.outer_momentum) == (0.4, 0.5)  # explicit: theirs
    settings, _ = config.load(environ={})
    assert (settings.syncer.outer_lr, settings.syncer.outer_momentum) == (0.4, 0.9)  # int4: Nesterov


def test_two_learners_default_to_the_outer_lr_measured_for_two_unless_it_is_set(tmp_path):
    assert config.OUTER_LR_BY_LEARNERS[2] != config.SyncerConfig().outer_lr
    for learners, expected in ((2, config.OUTER_LR_BY_LEARNERS[2]), (3, 0.4), (4, 0.4)):
        settings, _ = config.load(environ={}, cli={"local": {"learners": learners}})
        assert (settings.syncer.outer_lr, settings.syncer.outer_momentum) == (expected, 0.9)
    settings, _ = config.load(environ={"DDILOCO_SYNCER__OUTER_LR": "0.4"}, cli={"local": {"learners": 2}})
    assert settings.syncer.outer_lr == 0.4  # explicit: theirs
    settings, _ = config.load(environ={}, cli={"local": {"learners": 2}, "run": {"codec": "topk"}})
    assert (settings.syncer.outer_lr, settings.syncer.outer_momentum) == config.TOPK_OUTER  # top-k has its own
    # `local` hands its children the resolved settings as a file: they run at the same outer lr
    settings, _ = config.load(environ={}, cli={"local": {"learners": 2}})
    (tmp_path / "settings.json").write_text(settings.model_dump_json())
    child, _ = config.load(environ={}, config_file=tmp_path / "settings.json")
    assert child.syncer.outer_lr == config.OUTER_LR_BY_LEARNERS[2]

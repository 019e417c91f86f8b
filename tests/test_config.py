"""Every yaml in conf/ composes and instantiates; bad input fails before any work with one clear line."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from attnzoo.config.schema import ConfigError, resolve_model
from attnzoo.training.config_checks import validate
from attnzoo.models.decoder import DecoderLM
from attnzoo.config.paths import CONF_DIR
from tests.conftest import cli_train, compose_cfg, tiny_model_cfg
from tests.shards_fixture import text_corpus


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


ALL_OPTIONS = [
    (group, option)
    for group in ("model", "model/mixer", "model/ffn", "model/position", "model/norm", "data", "trainer", "optim",
                  "scheduler", "logger", "callbacks", "experiment", "debug")
    for option in group_options(group)
]


@pytest.mark.parametrize("group,option", ALL_OPTIONS, ids=[f"{g}={o}" for g, o in ALL_OPTIONS])
def test_every_option_composes_validates_and_builds(group, option, tmp_path):
    from attnzoo.training.families import SEQ2SEQ_DATA, family_of

    extra = []  # the partner a family needs: an encoder-decoder trains on seq2seq data and only there
    if (group, option) == ("model", "encdec"):
        extra = ["data=reversal"]
    elif group == "data" and option in SEQ2SEQ_DATA:
        extra = ["model=encdec"]
    elif group == "model" and option in ("vit", "swin"):  # image classifiers, and the VLM on shapes VQA
        extra = ["data=digits"]
    elif (group, option) == ("model", "vlm"):
        extra = ["data=shapes"]
    elif (group, option) in (("data", "shards"), ("experiment", "lm_125m")):  # a prepared corpus (docs/data.md)
        extra = [f"data.path={text_corpus(tmp_path / 'shards', n_files=8, vocab_size=300)}"]
    cfg = compose_cfg([f"{group}={option}", *extra, "debug=smoke"] if group != "debug" else [f"debug={option}"], tmp_path)
    if (group, option) == ("experiment", "linearize"):  # needs model.init_from (tests/test_linearize.py runs it)
        with pytest.raises(ConfigError, match="^model.init_from: experiment=linearize needs"):
            validate(cfg)
        return
    parts = validate(cfg)
    model_cfg, data = parts["model"], parts["data"]
    family = family_of(model_cfg)
    if family.name in ("vision", "vlm"):  # a vision model is built for its data's images (train() passes them)
        model_cfg.vision = {**model_cfg.vision, "image_size": data.image_size, "channels": data.channels}
    model = family.build_model(model_cfg, 64)
    x = torch.randint(3, 64, (1, 8))
    if family.name == "vision":
        with torch.no_grad():
            assert model(torch.rand(1, data.channels, data.image_size, data.image_size)).shape == (1, 64)
        return
    with torch.no_grad():
        if family.name == "vlm":
            logits = model(x, torch.rand(1, data.channels, data.image_size, data.image_size))
        else:
            logits = model(x, x) if family.name == "encdec" else model(x)
    assert logits.shape[:2] == (1, 8) and logits.shape[-1] in (64, 65)  # the encoder MLM adds [MASK]


def test_debug_smoke_is_tiny(tmp_path):
    parts = validate(compose_cfg(["debug=smoke"], tmp_path))
    assert parts["model"].d_model <= 64 and parts["run"].trainer.max_steps <= 10


def test_documented_field_names_exist(tmp_path):
    cfg = compose_cfg([], tmp_path)
    for key in ("model.d_model", "model.n_layers", "model.n_heads", "model.n_kv_heads", "data.seq_len",
                "data.batch_size", "trainer.max_steps", "seed"):
        assert OmegaConf.select(cfg, key) is not None, key


@pytest.mark.parametrize(
    "overrides,field,phrase",
    [
        (["model.d_model=100", "model.n_heads=8"], "model.d_model", "not divisible by n_heads"),
        (["model.n_kv_heads=3"], "model.n_kv_heads", "allowed: 1, 2, 4"),
        (["model.mixer.name=nope"], "model.mixer.name", "allowed:"),
        (["+model.bogus=1"], "model.bogus", "unknown key"),
        (["+model.mixer.bogus=1"], "model.mixer.bogus", "unknown key"),
        (["model.n_layers=abc"], "model.n_layers", ""),
        (["model.norm_position=middle"], "model.norm_position", "allowed: pre, post"),
        (["model.pattern=[gqa,nope]"], "model.pattern", "unknown mixer"),
        (["model.pattern=[gqa,mqa,gqa]"], "model.pattern", "does not divide n_layers"),
        (["data.tokenizer=word"], "data.tokenizer", "allowed: bpe, char"),
        (["+data.bogus=1"], "data.bogus", "unknown key"),
        (["optim.lr=-1"], "optim.lr", "must be positive"),
        (["scheduler.name=step"], "scheduler.name", "allowed: cosine, noam, constant"),
        (["trainer.precision=8bit"], "trainer.precision", "allowed"),
        (["model/position=learned", "model.max_seq_len=16", "data.seq_len=64"], "data.seq_len", "max_seq_len"),
    ],
)
def test_bad_config_fails_with_one_line_naming_the_field(overrides, field, phrase, tmp_path):
    cfg = compose_cfg(overrides, tmp_path)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(field), msg
    assert phrase in msg


def test_pattern_builds_per_layer_mixers():
    cfg = tiny_model_cfg("gqa", n_layers=4, pattern="mqa,gqa", mixers={})
    m = DecoderLM(cfg, vocab_size=10)
    assert [x.name for x in m.layer_mixers] == ["mqa", "gqa", "mqa", "gqa"]
    assert [x.n_kv_heads for x in m.mixers] == [1, 2, 1, 2]
    named = tiny_model_cfg("gqa", n_layers=2, pattern=["wide", "gqa"], mixers={"wide": {"name": "gqa", "n_kv_heads": 4}})
    m = DecoderLM(named, vocab_size=10)
    assert [x.n_kv_heads for x in m.mixers] == [4, 2]


def test_resolve_model_accepts_plain_dicts():
    cfg = resolve_model(tiny_model_cfg("mha"))
    assert cfg.mixer.name == "mha" and cfg.ffn.name == "swiglu" and cfg.position.name == "rope"


def run_cli(*args, tmp_path):
    return subprocess.run(
        [sys.executable, "-m", "attnzoo.cli.train", *args, f"hydra.run.dir={tmp_path}/cli"],
        capture_output=True, text=True, timeout=120,
    )


def test_cli_bad_value_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    code, _, err = cli_train(["model.n_kv_heads=3", f"hydra.run.dir={tmp_path}/cli"], monkeypatch, capsys)
    assert code == 2
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert lines[-1].startswith("attnzoo: error: model.n_kv_heads:"), err
    assert len([ln for ln in lines if "attnzoo: error" in ln]) == 1
    assert not (Path(tmp_path) / "cli" / "checkpoints").exists()  # nothing written half-way


def test_cli_unknown_group_option_lists_choices(tmp_path):
    r = run_cli("model/mixer=nope", tmp_path=tmp_path)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert lines == ["attnzoo: error: model/mixer: unknown option 'nope'; allowed: " + ", ".join(
        sorted(p.stem for p in (CONF_DIR / "model" / "mixer").glob("*.yaml")))]


def test_cli_missing_data_path(tmp_path, monkeypatch, capsys):
    code, _, err = cli_train(["debug=smoke", f"data.path={tmp_path}/missing.txt", f"hydra.run.dir={tmp_path}/cli"],
                             monkeypatch, capsys)
    assert code == 2
    assert "data.path:" in err and "does not exist" in err


def test_slurm_launcher_composes(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["hydra/launcher=slurm", "trainer=ddp", "trainer.devices=4",
                                                      f"paths.output_dir={tmp_path}"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert "SlurmLauncher" in launcher._target_
    assert launcher.tasks_per_node == 4 and launcher.gpus_per_node == 4 and launcher.nodes == 1


def test_ddp_presets():
    from attnzoo.training.launch import processes_to_launch

    parts = validate(compose_cfg(["trainer=ddp_cpu"], "/tmp/unused"))
    assert parts["run"].trainer.strategy == "ddp" and processes_to_launch(parts["run"].trainer) == 2
    gpu = validate(compose_cfg(["trainer=ddp"], "/tmp/unused"))["run"].trainer
    assert gpu.accelerator == "gpu" and gpu.devices == -1 and gpu.precision == "bf16-mixed"


@pytest.mark.parametrize("mixer", ["mqa", "mha", "deltanet", "mla"])
def test_a_field_the_mixer_ignores_is_not_refused(mixer):
    """model.n_kv_heads=3 with 4 query heads only matters to gqa / sliding-window layers."""
    from attnzoo.config.schema import resolve_model

    resolve_model({"d_model": 32, "n_heads": 4, "n_kv_heads": 3, "mixer": {"name": mixer}})
    with pytest.raises(ConfigError, match=r"^model.n_kv_heads: n_heads=4 is not divisible by n_kv_heads=3"):
        resolve_model({"d_model": 32, "n_heads": 4, "n_kv_heads": 3, "mixer": {"name": "gqa"}})


@pytest.mark.parametrize("mixer,kv", [("mha", 4), ("mqa", 1), ("gqa", 2)])
def test_summary_names_the_kv_heads_each_layer_really_has(mixer, kv):
    from attnzoo.models.decoder import DecoderLM
    from attnzoo.training.summary import describe_model, kv_heads_of

    m = DecoderLM({"d_model": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "mixer": {"name": mixer}}, vocab_size=16)
    assert kv_heads_of(m) == kv and f"heads=4/{kv}kv" in describe_model(m)


def test_the_suites_compose_shortcut_equals_hydras_compose(tmp_path):
    """tests/conftest.compose_cfg merges each set of group overrides once per worker and applies the plain ones to
    a copy with Hydra's own step: for each kind of override the suite gives it (plain values of every type, NaN, a
    list, a mapping, `+` additions, `~` deletions, groups before and after values, an experiment's own values
    overridden, a misspelt key, a group that does not exist), the same config as a full compose, or the same
    refusal."""
    from omegaconf import OmegaConf

    from tests.conftest import SESSION_CACHE, _compose_full, _compose_split

    lists = [
        [], ["debug=smoke", "data.max_chars=300000", "data.tokenizer=char", "trainer.max_flops=nan"],
        ["optim.betas=[0.9]", "model.pattern=[gqa,deltanet]", "model.n_layers=2"],
        ["model/ffn=none", "+model_budget={params: 10}"], ["+trainer.fsdp.nosuch=1"], ["~model.mixer"],
        ["model.n_head=4"], ["model/mixer=nope"], ["data.seq_len=32", "experiment=mqar", "model.d_model=16"],
        ["experiment=mqar", "model.mixers.gla.expand_k=1", "debug=smoke"], ["model=vlm", "data=shapes",
        "model/connector=resampler", "model.connector.n_queries=0"], ["+model/connector=concat", "model=vit", "data=digits"],
        ["trainer=fsdp_cpu", "trainer.fsdp.reshard_after_forward=2"], ["logger=[tensorboard,wandb]", "seed=3"],
    ]
    for overrides in lists:
        ov = [*overrides, f"paths.cache_dir={SESSION_CACHE}", f"paths.output_dir={tmp_path / 'run'}"]
        try:
            want = OmegaConf.to_yaml(_compose_full(ov))
        except Exception as e:  # noqa: BLE001 - the same refusal, then
            with pytest.raises(type(e)) as got:
                _compose_split(ov)
            assert str(got.value) == str(e), overrides
            continue
        assert OmegaConf.to_yaml(_compose_split(ov)) == want, overrides

"""The model-family registry and values resolved once (issue 14): every family is built, counted and
checked through `attnzoo.training.families`, and every derived size is settled in `resolve_model`."""
import dataclasses

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from attnzoo.training.budget import count_params
from attnzoo.config.schema import ConfigError, resolve_model
from attnzoo.training.config_checks import validate
from attnzoo.models.encoder_decoder import EncoderDecoder, EncoderMLM
from attnzoo.training.families import FAMILIES, family_of
from attnzoo.models.decoder import DecoderLM
from attnzoo.config.paths import CONF_DIR
from attnzoo.config.registry import MIXERS
from tests.conftest import compose_cfg


def _model_cfg(*overrides):
    from attnzoo import load_config

    return OmegaConf.to_container(load_config(list(overrides)).model, resolve=True)


@pytest.mark.parametrize("overrides,cls,vocab", [
    (["model=encdec", "data=reversal"], EncoderDecoder, 64),
    (["model=encdec", "data=reversal", "model/ffn=moe", "~model.ffn.activation", "+model.encdec.share_embeddings=false"], EncoderDecoder, 64),
    (["model=encoder"], EncoderMLM, 65),  # + [MASK]
    (["model=hybrid_gdn"], DecoderLM, 64),
])
def test_budget_counts_the_model_its_family_builds(overrides, cls, vocab):
    """model_budget counted a DecoderLM for every family: 27,200 for an encoder-decoder of 60,672."""
    mc = _model_cfg(*overrides)
    real = cls(mc, vocab_size=vocab)
    assert count_params(mc, 64, "total") == sum(p.numel() for p in real.parameters())
    emb = {id(m.weight): m.weight.numel() for m in real.modules() if isinstance(m, torch.nn.Embedding)}
    assert count_params(mc, 64, "non_embedding") == sum(p.numel() for p in real.parameters()) - sum(emb.values())


def test_family_routing_and_data_check():
    assert family_of({"name": "encdec"}).name == "encdec"
    assert family_of({"name": "encoder"}).name == "encoder"
    assert family_of({"name": "gpt2"}).name == "decoder" and family_of({}).name == "decoder"
    assert set(FAMILIES) >= {"decoder", "encdec", "encoder"}
    for bad, phrase in [(["model=encdec", "data=mqar"], "data=mqar; allowed: reversal"),
                        (["data=sorting"], "data=sorting; allowed: text or a synthetic"),
                        (["model=encoder", "data=copying"], "data=copying; allowed: text")]:
        with pytest.raises(ConfigError, match=phrase) as e:
            validate(compose_cfg(bad, "/tmp/attnzoo-unused"))
        assert str(e.value).startswith("data: ")


def test_head_dim_is_resolved_once():
    cfg = resolve_model(_model_cfg("model.d_model=96", "model.n_heads=3", "model.n_kv_heads=3"))
    assert cfg.head_dim == 32
    m = DecoderLM(cfg, vocab_size=32)
    assert all(getattr(mx, "head_dim", 32) == 32 for mx in m.mixers)
    cfg = resolve_model(_model_cfg("model.head_dim=8"))
    assert cfg.head_dim == 8 and DecoderLM(cfg, vocab_size=32).mixers[0].head_dim == 8


@pytest.mark.parametrize("mixer,kv", [("mha", 4), ("mqa", 1), ("gqa", 2)])
def test_layer_shape_reports_what_was_built(mixer, kv):
    """The summary printed heads=4/2kv for mha and mqa: it now reads each built layer."""
    m = DecoderLM(resolve_model(_model_cfg(f"model/mixer={mixer}", "model.n_heads=4", "model.n_kv_heads=2")), vocab_size=32)
    shape = m.mixers[0].layer_shape()
    assert shape["mixer"] == mixer and shape["n_heads"] == 4 and shape["n_kv_heads"] == kv
    assert shape["n_kv_heads"] == m.mixers[0].k_proj.out_features // m.mixers[0].head_dim if hasattr(m.mixers[0], "k_proj") else True


def test_recurrent_layer_shape_has_its_state():
    m = DecoderLM(resolve_model(_model_cfg("model/mixer=gated_deltanet", "model.d_model=64", "model.n_heads=2")), vocab_size=32)
    shape = m.mixers[0].layer_shape()
    assert shape["state_shape"] == [32, 32] and shape["conv"] == 4
    assert m.mixers[0].new_cache(1, 8, torch.float32, "cpu").state.shape[-2:] == (32, 32)


# one Seq2SeqConfig serves addition / reversal / sorting; these task yamls set their own sequence length
TASK_OWN = {("reversal", "seq_len"), ("sorting", "seq_len")}


def _registered(group: str):
    from attnzoo.data import DATAMODULES
    from attnzoo.config.registry import FFNS

    registry = {"model/mixer": MIXERS, "model/ffn": FFNS, "data": DATAMODULES}[group]
    return [(group, registry, n) for n in registry.names()]


@pytest.mark.parametrize("group,registry,name", _registered("model/mixer") + _registered("model/ffn") + _registered("data"),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_yaml_defaults_equal_dataclass_defaults(group, registry, name):
    """conf/<group>/<name>.yaml and the registered config dataclass must agree on every default (mixers,
    FFNs, data modules)."""
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        pytest.fail(f"{name} has no conf/{group}/{name}.yaml")
    raw = {k: v for k, v in yaml.safe_load(path.read_text()).items() if k != "defaults"}
    fields = {f.name: f for f in dataclasses.fields(registry.get(name).config_cls)}
    assert set(raw) <= set(fields), f"yaml keys the dataclass does not have: {set(raw) - set(fields)}"
    assert set(fields) <= set(raw), f"dataclass fields missing from the yaml: {set(fields) - set(raw)}"
    assert raw["name"] == name
    for k, v in raw.items():
        f = fields[k]
        if k == "name" or (name, k) in TASK_OWN:  # one dataclass may serve several registered names
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if isinstance(default, tuple):
            default = list(default)
        assert v == default, f"{name}.{k}: yaml {v!r} != dataclass {default!r}"


def test_encdec_moe_balances_through_the_shared_training_module(tmp_path):
    """model=encdec model/ffn=moe: the routed FFNs' aux loss reaches the training loss and the
    aux-loss-free bias moves after each optimizer step, as in the decoder (LitSeq2Seq skipped both)."""
    from attnzoo.training.run import train

    out = tmp_path / "run"
    train(compose_cfg(["model=encdec", "data=reversal", "debug=smoke", "model/ffn=moe", "~model.ffn.activation",
                       "model.ffn.n_experts=4", "model.ffn.top_k=1", "model.ffn.aux_loss_coef=0.01",
                       "model.ffn.bias_update_speed=0.01", "trainer.max_steps=3", "callbacks.save_best=false"], out))
    state = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")["state_dict"]
    biases = [v for k, v in state.items() if k.endswith("expert_bias")]
    assert len(biases) >= 4 and all(b.abs().sum() > 0 for b in biases)  # every MoE layer (encoder and decoder) updated
    import csv

    rows = [r for r in csv.DictReader(open(out / "csv" / "metrics.csv")) if r.get("moe/aux_loss")]
    assert rows and float(rows[0]["moe/aux_loss"]) > 0


def test_aux_loss_is_added_for_every_family():
    """TrainingModule._with_aux adds the routed FFNs' aux loss to each family's training loss."""
    from attnzoo.layers import aux_loss as hooks
    from attnzoo.training.lit_lm import TrainingModule
    from attnzoo.training.lit_seq2seq import LitMLM, LitSeq2Seq

    for lit_cls in (LitSeq2Seq, LitMLM):
        assert issubclass(lit_cls, TrainingModule)
        assert "_with_aux" not in vars(lit_cls) and "optimizer_step" not in vars(lit_cls)  # inherited, not redone
    mc = _model_cfg("model=encdec", "data=reversal", "model/ffn=moe", "~model.ffn.activation", "model.ffn.aux_loss_coef=0.5")
    model = EncoderDecoder(mc, vocab_size=32)
    src = torch.randint(3, 32, (4, 6))
    model(src, src)
    aux = hooks.aux_loss(model)
    assert aux is not None and aux.item() > 0
    assert len([m for m in model.modules() if getattr(m, "aux_loss", None) is not None]) == 4  # 2 encoder + 2 decoder layers

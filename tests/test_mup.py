"""µP (model.parametrization=mup; models/mup.py, docs/mup.md): the standard parametrization untouched, µP's init,
multipliers, q.k scales and AdamW groups as specified, the refusals, a training run, and the coordinate check the µP
authors use (attnzoo-bench mup_coord): activation and update sizes flat across widths under µP, growing under the
standard parametrization."""
from __future__ import annotations

import json
import math

import pytest
import torch

from attnzoo.bench.cli import main as bench_main
from attnzoo.config.errors import ConfigError
from attnzoo.config.registry import MIXERS
from attnzoo.config.schema import resolve_model
from attnzoo.interop.hf.archs import arch_for
from attnzoo.models import mup
from attnzoo.models.decoder import DecoderLM
from attnzoo.training.lit_lm import LitLM, param_groups
from attnzoo.training.run import train
from tests.conftest import SESSION_CACHE, SMALL_TEXT, assert_learns, compose_cfg, tiny_model_cfg

V = 97
BASE, WIDTH = 32, 128  # m = 4: init / 2, learning rate / 4, weight decay * 4, logits / 4 (all exact in binary)


def build(seed: int = 0, **model) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(tiny_model_cfg(**model), vocab_size=V)


def mup_pair(mixer="gqa", **kw) -> tuple[DecoderLM, DecoderLM]:
    """The standard and the µP model at WIDTH from the same seed."""
    std = build(mixer=mixer, d_model=WIDTH, **kw)
    return std, build(mixer=mixer, d_model=WIDTH, parametrization="mup", mup_base_width=BASE, **kw)


# ----------------------------------------------------------------------------- standard: unchanged


STANDARD_CASES = {
    "gqa": {},
    "mla_untied": {"mixer": "mla", "tie_embeddings": False},
    "linear_unnormalised": {"mixer": {"name": "linear_attention", "normalize": False, "feature_map": "identity"}},
    "gdn_moe": {"mixer": "gated_deltanet", "ffn": {"name": "moe", "n_experts": 4, "top_k": 2}},
    "pytorch_init": {"init": "pytorch", "tie_embeddings": False},
}


@pytest.mark.parametrize("case", STANDARD_CASES)
def test_standard_parametrization_never_enters_mup(case, monkeypatch):
    """Without the new keys, with parametrization=standard spelled out, and with µP's code made to fail: the same
    parameters, logits and random state after building, the attention's own scale, two plain AdamW groups."""

    def refuse(*a, **k):
        raise AssertionError("the standard parametrization called models/mup.py")

    built = []
    for model_kw in ({}, {"parametrization": "standard"}):
        with monkeypatch.context() as mp:
            mp.setattr(mup, "apply", refuse)
            mp.setattr(mup, "delta_config", refuse)
            m = build(**STANDARD_CASES[case], **model_kw)
        x = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            built.append((m, m(x), torch.rand(4)))
    (a, la, ra), (b, lb, rb) = built
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    assert torch.equal(la, lb) and torch.equal(ra, rb)
    assert a.readout_multiplier == 1.0
    for layer in a.mixers:
        if type(layer).mup_qk_grows(layer.cfg) and hasattr(layer, "scale"):
            configured = getattr(layer.cfg, "softmax_scale", getattr(layer.cfg, "scale", None))
            assert layer.scale == configured or configured is None  # the config's, or the class's own default
    groups = param_groups(a, 0.1, 1e-3)
    assert len(groups) == 2 and not any("lr_scale" in g for g in groups)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]


# ----------------------------------------------------------------------------- µP: init, multipliers, scales


@pytest.mark.parametrize("tied", [True, False])
def test_mup_init_readout_and_roles(tied):
    """Hidden weights: the standard draws times m^-1/2; everything else the standard draws (an untied readout
    zeroed); logits = lm_head(norm(h)) / m."""
    std, mp = mup_pair("gated_deltanet", tie_embeddings=tied, ffn={"name": "moe", "n_experts": 4, "top_k": 2})
    m = WIDTH / BASE
    roles = mup.roles(mp)
    hidden = {n for n, r in roles.items() if r == "hidden"}
    # fan-in d_model (or a hidden size that grows with it): the projections, gates, experts and router
    assert {"blocks.0.mixer.qkv.weight", "blocks.0.mixer.o_proj.weight", "blocks.0.mixer.b_proj.weight",
            "blocks.0.mixer.a_proj.weight", "blocks.0.mixer.g_proj.weight", "blocks.0.ffn.w_up",
            "blocks.0.ffn.w_down", "blocks.0.ffn.router.weight"} <= hidden
    # fan-in fixed: the embedding (its rows), the conv taps (kernel), vectors
    assert not hidden & {"embed.weight", "blocks.0.mixer.conv.weight", "blocks.0.mixer.A_log", "norm.weight"}
    assert (roles.get("lm_head.weight") == "readout") == (not tied)
    std_p, mup_p = dict(std.named_parameters()), dict(mp.named_parameters())
    for name, p in mup_p.items():
        if name in hidden:
            assert torch.equal(p, std_p[name] * m**-0.5), name
        elif name == "lm_head.weight":
            assert not p.any()
        else:
            assert torch.equal(p, std_p[name]), name
    assert mp.readout_multiplier == 1 / m
    x = torch.randint(0, V, (2, 10))
    positions = torch.arange(10)
    with torch.no_grad():
        h = mp.position(mp.embed(x), positions)
        for block in mp.blocks:
            h = block(h, positions)
        assert torch.equal(mp(x), mp.lm_head(mp.norm(h)) / m)  # 1/m a power of two: exact either side of the head


def test_raw_parameters_by_their_growing_dimensions():
    """Raw (not nn.Linear) parameters: two growing dimensions make a hidden matrix (MoE experts); one counts only
    when it is the declared fan-in (RWKV-7's input-major LoRA: down d -> r is hidden, up r -> d is not); a per-head
    (heads, head_dim) vector or the conv's (channels, taps) is width-independent."""
    _, mp = mup_pair("rwkv7", ffn={"name": "moe", "n_experts": 4, "top_k": 2})
    roles = mup.roles(mp)
    for name in ("w_lora.down", "a_lora.down", "g_lora.down"):
        assert roles[f"blocks.0.mixer.{name}"] == "hidden", name
    for name in ("w_lora.up", "g_lora.up", "r_k", "x_r", "k_k"):
        assert roles[f"blocks.0.mixer.{name}"] == "width-independent", name
    assert roles["blocks.0.ffn.w_up"] == roles["blocks.0.ffn.w_down"] == "hidden"
    _, gdn = mup_pair("gated_deltanet")
    assert mup.roles(gdn)["blocks.0.mixer.conv.weight"] == "width-independent"


def qk_size(layer) -> int:
    """d of a layer's q.k: the head (or feature / key) size the scale is for."""
    if hasattr(layer, "dn"):  # MLA: nope + rope dims
        return layer.dn + layer.dr
    return getattr(layer, "qk_dim", None) or layer.head_dim


@pytest.mark.parametrize("mixer, grows, multiplier", [
    ("gqa", True, 1.0), ("sliding_window", True, 1.0), ("mla", True, 1.0), ("moba", True, 1.0),
    ({"name": "gqa", "softmax_scale": 8.0}, True, 8.0), ({"name": "mla", "softmax_scale": 2.0}, True, 2.0),
    ({"name": "linear_attention", "normalize": False, "feature_map": "identity"}, True, 1.0),
    ({"name": "gla", "use_output_norm": False}, True, 1.0),
    ("linear_attention", False, None), ("gla", False, None), ("retnet", False, None), ("mamba2", False, None),
    ("deltanet", False, None), ("gated_deltanet", False, None),
])
def test_mup_qk_scale(mixer, grows, multiplier):
    """Where q.k grows with d (softmax attention, linear attention without its normaliser or output norm, GLA without
    its output norm) µP's scale is multiplier / d (the config's scale field, default 1: softmax 1/d, mup's 8/d with
    8); elsewhere the standard one."""
    std, mp = mup_pair(mixer)
    for a, b in zip(std.mixers, mp.mixers):
        assert type(b).mup_qk_grows(b.cfg) is grows
        if grows:
            assert b.scale == multiplier / qk_size(b)
        else:
            assert getattr(b, "scale", None) == getattr(a, "scale", None)


@pytest.mark.parametrize("mixer", MIXERS.names())
def test_every_mixer_trains_a_step_under_mup(mixer):
    """Each registered mixer builds under µP and one AdamW step on its groups lowers the loss of its batch."""
    torch.manual_seed(0)
    lit = LitLM({"model": tiny_model_cfg(mixer, d_model=64, parametrization="mup", mup_base_width=32),
                 "optim": {"lr": 3e-3}, "scheduler": {"name": "constant", "warmup_steps": 1}}, vocab_size=V)
    opt = lit.configure_optimizers()["optimizer"]
    x = torch.randint(0, V, (4, 17))
    losses = []
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(lit.model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert math.isfinite(losses[0]) and losses[1] < losses[0]


# ----------------------------------------------------------------------------- the optimizer groups


def test_mup_adamw_groups():
    """Hidden weights at lr / m with weight decay * m (lr x wd kept); the embedding, norms, biases, A_log / dt_bias at
    lr, undecayed; the scheduler starts each group from its own lr."""
    lr, wd = 2e-3, 0.1
    lit = LitLM({"model": tiny_model_cfg(d_model=WIDTH, parametrization="mup", mup_base_width=BASE,
                                         pattern=["gated_deltanet", "gqa"]),
                 "optim": {"lr": lr, "weight_decay": wd}}, vocab_size=V)
    conf = lit.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    roles = mup.roles(lit.model)
    names = {id(p): n for n, p in lit.model.named_parameters()}
    m = WIDTH / BASE
    kinds = []
    for group, base_lr in zip(opt.param_groups, sched.base_lrs):
        kind = {roles[names[id(p)]] for p in group["params"]}
        assert len(kind) == 1, kind
        kinds.append(kind.pop())
        if kinds[-1] == "hidden":
            assert group["lr_scale"] == 1 / m and base_lr == pytest.approx(lr / m, rel=1e-15)
            assert group["weight_decay"] == pytest.approx(wd * m, rel=1e-15)
        else:
            assert "lr_scale" not in group and base_lr == lr and group["weight_decay"] in (0.0, wd)
    assert sorted(set(kinds)) == ["hidden", "width-independent"]
    by_name = {names[id(p)]: g for g in opt.param_groups for p in g["params"]}
    for name in ("embed.weight", "norm.weight", "blocks.0.mixer.A_log", "blocks.0.mixer.dt_bias"):
        assert by_name[name]["weight_decay"] == 0.0 and "lr_scale" not in by_name[name], name
    for name in ("blocks.0.mixer.a_proj.weight", "blocks.1.mixer.qkv.weight", "blocks.1.ffn.down.weight"):
        assert by_name[name]["lr_scale"] == 1 / m, name
    assert sum(len(g["params"]) for g in opt.param_groups) == len(names)


def test_chunked_loss_sees_the_readout_multiplier():
    """trainer.ce_chunk_tokens computes the loss from hidden_states and lm_head.weight: under µP it is the loss of
    the logits lm_head(norm(h)) / m, built here from the blocks (fp64: the two differ by rounding only)."""
    torch.manual_seed(0)
    lit = LitLM({"model": tiny_model_cfg(d_model=64, parametrization="mup", mup_base_width=16),
                 "trainer": {"ce_chunk_tokens": 7}}, vocab_size=V).double()
    model, x = lit.model, torch.randint(0, V, (2, 13))
    inputs, targets, positions = x[:, :-1], x[:, 1:], torch.arange(12)
    with torch.no_grad():
        h = model.position(model.embed(inputs), positions)
        for block in model.blocks:
            h = block(h, positions)
        logits = model.lm_head(model.norm(h))
        expected = torch.nn.functional.cross_entropy((logits / 4).flatten(0, 1), targets.flatten())
        without = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        chunked = lit._loss((inputs, targets))[0]
    assert abs(chunked.item() - expected.item()) < 1e-10 and abs(without.item() - expected.item()) > 1e-3


# ----------------------------------------------------------------------------- refusals and a run


@pytest.mark.parametrize("model, field", [
    ({"parametrization": "mu_p"}, "model.parametrization"),
    ({"parametrization": "mup"}, "model.mup_base_width"),
    ({"parametrization": "mup", "mup_base_width": 0}, "model.mup_base_width"),
    ({"parametrization": "mup", "mup_base_width": 32, "init": "pytorch"}, "model.init"),
    ({"parametrization": "mup", "mup_base_width": 32, "name": "encdec"}, "model.parametrization"),
    ({"parametrization": "mup", "mup_base_width": 32, "init_from": "/some/hf/dir"}, "model.init_from"),
])
def test_refusals_name_the_field(model, field):
    with pytest.raises(ConfigError) as e:
        resolve_model(tiny_model_cfg(**model))
    assert str(e.value).startswith(f"{field}: ") and "\n" not in str(e.value)


def test_mup_model_is_not_exported():
    """A transformers architecture has neither µP's readout multiplier nor its attention scale: export refuses."""
    with pytest.raises(ConfigError, match=r"^model.parametrization: mup \(µP's readout multiplier"):
        arch_for(build(d_model=64, parametrization="mup", mup_base_width=32))


def test_mup_run_trains(tmp_path):
    """attnzoo-train's path (Lightning, fused AdamW on µP's groups, the LR schedule) on the embedded corpus."""
    cfg = compose_cfg([*SMALL_TEXT, "debug=smoke", "model.d_model=64", "model.parametrization=mup",
                       "model.mup_base_width=32", "optim.lr=1e-2", "trainer.max_steps=8",
                       "trainer.val_check_interval=4", "perf.measure_decode=false"], tmp_path / "run")
    train(cfg)
    assert_learns(tmp_path / "run")
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["model"]["vocab_size"] > 0


# ----------------------------------------------------------------------------- the coordinate check


def test_coordinate_check(tmp_path):
    """attnzoo-bench mup_coord at 4 widths (32..256, base 32), 4 AdamW steps at lr 1e-2: under µP every size's
    exponent against the width (size ~ width^a, fitted per step) is flat (|mean a| < 1/2, and here |a| < 1/2 at every
    step; µP predicts 0); under the standard parametrization the updates of the logits and of the last block's output
    grow (mean a > 1/2; Adam predicts 1). The bound 1/2 is the midpoint of the two predictions: each side is
    classified by the nearer one."""
    bench_main(["--out", str(tmp_path), "mup_coord", "--widths", "32", "64", "128", "256", "--steps", "4",
                "--seeds", "1", "--seq-len", "32", "--batch-size", "8", "--override", SMALL_TEXT[0], "--override",
                SMALL_TEXT[1], "--override", f"paths.cache_dir={SESSION_CACHE}"])
    result = json.loads((tmp_path / "mup_coord.json").read_text())["result"]
    for size, exps in result["mup"]["exponents"].items():
        assert all(abs(a) < 0.5 for a in exps) and result["mup"]["flat"][size], (size, exps)
    for size in ("logits update", "hidden update"):
        exps = result["standard"]["exponents"][size]
        assert sum(exps) / len(exps) > 0.5 and not result["standard"]["flat"][size], (size, exps)
    assert (tmp_path / "mup_coord.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("mixer", sorted(MIXERS.names()))
def test_roles_do_not_depend_on_the_widths_compared(mixer):
    """A parameter's µP role is what the parameter is, at every width (issue 43 item 4: RWKV-7's default LoRA ranks
    followed d_model, so between d 256 and 512 its up-projections turned hidden - learning rate / m, init / sqrt(m) -
    while at 128 vs 256 they were not). Roles built on the meta device at widths 64..1024, base 64."""
    seen = {}
    for width in (64, 128, 256, 512, 1024):
        with torch.device("meta"):
            model = DecoderLM(tiny_model_cfg(mixer=mixer, d_model=width, n_heads=4, parametrization="mup",
                                             mup_base_width=64), vocab_size=V)
        seen[width] = mup.roles(model)
    for width, roles in seen.items():
        assert roles == seen[64], (width, {k: (v, seen[64].get(k)) for k, v in roles.items() if seen[64].get(k) != v})

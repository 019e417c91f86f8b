"""Multimodal (issue 19): the resampler and the gated cross-attention against transformers (weights copied),
cached multimodal decoding == the full forward for every connector and language side, zero gates == the
text-only decoder, the resampler's size independent of the image, the accounting, bad connector options
refused in one line, and a tiny end-to-end VQA run."""
import json

import pytest
import torch

from attnzoo.config.schema import ConfigError
from attnzoo.config.schema import resolve_model
from attnzoo.models.vision import VisionLanguageModel
from attnzoo.models.vision.connectors import GatedCrossAttention, PerceiverResampler
from tests.conftest import compose_cfg

TOL = 1e-5


def _randomize(model: torch.nn.Module, seed: int = 0, scale: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def _load(dst: torch.nn.Module, pairs: dict) -> None:
    missing, unexpected = dst.load_state_dict({k: v.detach().clone() for k, v in pairs.items()}, strict=True)
    assert not missing and not unexpected


# ----------------------------------------------------------------------------- parity with transformers


def test_resampler_matches_idefics2_perceiver_resampler():
    from transformers.models.idefics2.configuration_idefics2 import Idefics2PerceiverConfig
    from transformers.models.idefics2.modeling_idefics2 import Idefics2PerceiverResampler

    hf = Idefics2PerceiverResampler(Idefics2PerceiverConfig(
        hidden_size=32, resampler_n_latents=5, resampler_depth=2, resampler_n_heads=4, resampler_head_dim=12,
        num_key_value_heads=4, rms_norm_eps=1e-6, hidden_act="silu")).eval()
    _randomize(hf)
    ours = PerceiverResampler(32, n_queries=5, depth=2, n_heads=4, head_dim=12, eps=1e-6).eval()
    pairs = {"latents": hf.latents, "norm.weight": hf.norm.weight}
    for i, layer in enumerate(hf.layers):
        p, a = f"layers.{i}", layer.self_attn
        pairs.update({f"{p}.input_latents_norm.weight": layer.input_latents_norm.weight,
                      f"{p}.input_context_norm.weight": layer.input_context_norm.weight,
                      f"{p}.post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
                      f"{p}.q_proj.weight": a.q_proj.weight, f"{p}.k_proj.weight": a.k_proj.weight,
                      f"{p}.v_proj.weight": a.v_proj.weight, f"{p}.o_proj.weight": a.o_proj.weight,
                      f"{p}.mlp.gate_up.weight": torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]),
                      f"{p}.mlp.down.weight": layer.mlp.down_proj.weight})
    _load(ours, pairs)
    ctx = torch.randn(3, 9, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ctx, attention_mask=torch.ones(3, 9, dtype=torch.long))
        err = (ours(ctx) - ref).abs().max().item()
    assert ref.shape == (3, 5, 32) and err < TOL, err


@pytest.mark.parametrize("gate", ["float", "vector"])
def test_gated_cross_attention_matches_idefics(gate):
    from transformers import IdeficsConfig
    from transformers.models.idefics.modeling_idefics import IdeficsGatedCrossAttentionLayer

    hf_cfg = IdeficsConfig(hidden_size=32, num_attention_heads=4, intermediate_size=48, vision_config={"embed_dim": 24},
                           alpha_type=gate, rms_norm_eps=1e-6)
    hf_cfg._attn_implementation = "eager"
    hf = IdeficsGatedCrossAttentionLayer(hf_cfg, layer_idx=0).eval()
    _randomize(hf)  # gates open (random): both sublayers contribute
    cfg = resolve_model({"d_model": 32, "n_heads": 4, "n_kv_heads": 4, "ffn": {"name": "swiglu", "d_ff": 48},
                         "norm": {"name": "rmsnorm", "eps": 1e-6}})
    ours = GatedCrossAttention(cfg, d_image=24, gate=gate).eval()
    a = hf.cross_attn
    _load(ours, {"norm1.weight": hf.input_layernorm.weight, "norm2.weight": hf.post_attention_layernorm.weight,
                 "q_proj.weight": a.q_proj.weight, "k_proj.weight": a.k_proj.weight, "v_proj.weight": a.v_proj.weight,
                 "o_proj.weight": a.o_proj.weight, "alpha_attn": hf.alpha_cross_attn, "alpha_ffn": hf.alpha_dense,
                 "ffn.gate_up.weight": torch.cat([hf.mlp.gate_proj.weight, hf.mlp.up_proj.weight]),
                 "ffn.down.weight": hf.mlp.down_proj.weight})
    g = torch.Generator().manual_seed(2)
    h, image = torch.randn(2, 6, 32, generator=g), torch.randn(2, 7, 24, generator=g)
    with torch.no_grad():
        ref = hf(h, image_hidden_states=image, cross_attention_gate=torch.ones(2, 6))
        ref = ref[0] if isinstance(ref, tuple) else ref
        err = (ours(h, ours.image_kv(image)) - ref).abs().max().item()
    assert err < TOL, err


# ----------------------------------------------------------------------------- the model


def vlm_cfg(connector: dict, **kw) -> dict:
    cfg = {"name": "vlm", "d_model": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "connector": connector,
           "vision": {"encoder": "vit", "patch_size": 4, "d_model": 24, "n_layers": 1, "n_heads": 4}}
    cfg.update(kw)
    return cfg


CONNECTORS = {
    "concat": {"name": "concat"},
    "cross_attention": {"name": "cross_attention", "every": 2},
    "resampler-concat": {"name": "resampler", "n_queries": 3, "after": "concat"},
    "resampler-xattn": {"name": "resampler", "n_queries": 3, "after": "cross_attention", "gate": "vector"},
}
LANGUAGE = {
    "gqa": {},
    "gdn-hybrid": {"pattern": ["gated_deltanet", "gqa"], "mixers": {"gated_deltanet": {"name": "gated_deltanet"}}},
    "swin-encoder": {"vision": {"encoder": "swin", "patch_size": 2, "d_model": 16, "depths": [2, 2],
                                "stage_heads": [2, 4], "window_size": 2}},
}


def _open_gates(m: VisionLanguageModel) -> None:
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "alpha" in name:
                p.fill_(0.7)


@pytest.mark.parametrize("lang", list(LANGUAGE))
@pytest.mark.parametrize("conn", list(CONNECTORS))
def test_cached_multimodal_decode_equals_full_forward(conn, lang):
    """Prefill a prompt about the image, then one token at a time: every step's logits == the full forward's,
    and greedy generation with the cache == generation recomputing everything."""
    torch.manual_seed(0)
    m = VisionLanguageModel(vlm_cfg(CONNECTORS[conn], **LANGUAGE[lang]), vocab_size=40, image_size=16, channels=3).eval()
    _open_gates(m)
    g = torch.Generator().manual_seed(1)
    x, img = torch.randint(0, 40, (2, 9), generator=g), torch.rand(2, 3, 16, 16, generator=g)
    with torch.no_grad():
        full = m(x, img)
        cache = m.prepare_cache(img, max_len=9)
        steps = [m.decode_step(x[:, :5], cache)] + [m.decode_step(x[:, t:t + 1], cache) for t in range(5, 9)]
    err = (torch.cat(steps, dim=1) - full).abs().max().item()
    assert err < TOL, err
    assert cache.seq_len == 9 + (m.image_tokens_per_image if m.concat else 0)
    assert torch.equal(m.generate(x[:, :3], img, 5), m.generate(x[:, :3], img, 5, use_cache=False))


@pytest.mark.parametrize("lang", ["gqa", "gdn-hybrid"])
def test_zero_gates_equal_the_text_only_decoder_at_init(lang):
    """cross_attention at init: tanh(0) = 0 on both sublayers, so the logits are the text-only decoder's
    whatever the image; opening one gate makes the image matter."""
    m = VisionLanguageModel(vlm_cfg(CONNECTORS["cross_attention"], **LANGUAGE[lang]), vocab_size=40, image_size=16,
                            channels=3).eval()
    x = torch.randint(0, 40, (2, 7))
    with torch.no_grad():
        text_only = m.lm(x)
        assert torch.equal(m(x, torch.rand(2, 3, 16, 16)), text_only)
        next(iter(m.xattn.values())).alpha_attn.fill_(0.5)
        assert (m(x, torch.rand(2, 3, 16, 16)) - text_only).abs().max() > 1e-4


@pytest.mark.parametrize("size,patch", [(16, 4), (32, 4), (32, 2)])
def test_resampler_output_size_is_independent_of_the_image(size, patch):
    """16, 64 or 256 image tokens in, n_queries out; the decoder's concat prefix and the cache follow."""
    cfg = vlm_cfg({"name": "resampler", "n_queries": 5})
    cfg["vision"] = {**cfg["vision"], "patch_size": patch}
    m = VisionLanguageModel(cfg, vocab_size=40, image_size=size, channels=3).eval()
    with torch.no_grad():
        tokens = m.encode_image(torch.rand(2, 3, size, size))
    assert m.encoder.n_tokens == (size // patch) ** 2
    assert tokens.shape == (2, 5, 32) and m.image_tokens_per_image == 5
    assert m.cache_bytes(8) == m.lm.cache_bytes(8 + 5)


def test_cross_attention_cache_bytes_are_measured_and_constant_in_text_length():
    m = VisionLanguageModel(vlm_cfg({"name": "cross_attention", "every": 2}), vocab_size=40, image_size=16, channels=3).eval()
    img = torch.rand(1, 3, 16, 16)
    with torch.no_grad():
        cache = m.prepare_cache(img, max_len=12)
        assert sum(c.nbytes() for c in cache.cross.values()) == m.cross_cache_bytes() == 2 * 2 * 4 * 8 * 16 * 4
        m.decode_step(torch.randint(0, 40, (1, 12)), cache)
    assert cache.nbytes() == m.cache_bytes(12)  # decoder KV over 12 text tokens + the image K/V of 2 gated layers
    assert m.cross_cache_bytes() == sum(c.nbytes() for c in cache.cross.values())  # unchanged by the text


def test_flops_per_token_include_the_image_side():
    """concat runs the image tokens through the decoder too; every connector adds the encoder's FLOPs."""
    text = VisionLanguageModel(vlm_cfg({"name": "concat"}), vocab_size=40, image_size=16, channels=3)
    L = 12
    lm_only = text.lm.flops_per_token(L)
    for conn in CONNECTORS.values():
        m = VisionLanguageModel(vlm_cfg(conn), vocab_size=40, image_size=16, channels=3)
        assert m.flops_per_token(L) > lm_only + m.encoder.flops_per_image() / L
    concat = VisionLanguageModel(vlm_cfg({"name": "concat"}), vocab_size=40, image_size=16, channels=3)
    M = concat.image_tokens_per_image
    dec = sum(b.mixer.flops_per_token(L + M) + b.ffn.flops_per_token() for b in concat.lm.blocks)
    expect = (concat.encoder.flops_per_image() + M * concat.projector.flops_per_token() + (L + M) * dec
              + L * 2 * 32 * 40) / L
    assert concat.flops_per_token(L) == pytest.approx(expect)


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize("overrides,field,phrase", [
    (["model/connector=resampler", "model.connector.n_queries=0"], "model.connector.n_queries", ">= 1 learned queries"),
    (["model/connector=resampler", "model.connector.after=ring"], "model.connector.after", "allowed: concat, cross_attention"),
    (["model/connector=cross_attention", "model.connector.every=0"], "model.connector.every", "must be >= 1"),
    (["model.vision.patch_size=5"], "model.vision.patch_size", "5 does not divide the image size 16; allowed: 1, 2, 4, 8, 16"),
    (["model.vision.n_layers=null"], "model.vision.n_layers", "needs its own n_layers"),
    (["data.task=classify"], "data", "cannot train on data=shapes"),
    (["model/position=learned", "model.max_seq_len=20"], "model.max_seq_len", "cannot hold the image tokens and the text (32)"),
])
def test_bad_vlm_config_is_one_line(overrides, field, phrase, tmp_path):
    from attnzoo.training.run import train

    with pytest.raises(ConfigError) as e:
        train(compose_cfg(["model=vlm", "data=shapes", "debug=smoke", "data.seq_len=16", *overrides], tmp_path / "run"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(field) and phrase in msg, msg
    assert not (tmp_path / "run").exists()


def test_connector_yamls_are_connector_options():
    """Every conf/model/connector/*.yaml composes into model=vlm and is a valid ConnectorConfig."""
    import dataclasses

    import yaml

    from attnzoo.config.paths import CONF_DIR
    from attnzoo.training.config_checks import validate
    from attnzoo.models.vision.options import ConnectorConfig

    names = {f.name for f in dataclasses.fields(ConnectorConfig)}
    files = sorted((CONF_DIR / "model" / "connector").glob("*.yaml"))
    assert {p.stem for p in files} == {"concat", "cross_attention", "resampler"}
    for p in files:
        raw = yaml.safe_load(p.read_text())
        assert raw["name"] == p.stem and set(raw) <= names, p
        parts = validate(compose_cfg(["model=vlm", "data=shapes", f"model/connector={p.stem}"], "/tmp/attnzoo-unused"))
        assert parts["model"].connector["name"] == p.stem


# ----------------------------------------------------------------------------- end to end


def test_vlm_learns_easy_shapes_vqa(tmp_path):
    """One object per scene, colour / shape / count questions (chance of the text prior ~0.42): the
    cross-attention VLM answers >= 60% exactly after 250 steps (about 20 s on one CPU thread; measured 0.68),
    with the multimodal metrics in summary.json."""
    from attnzoo.training.run import train

    out = tmp_path / "run"
    metrics = train(compose_cfg(["experiment=vlm_shapes", "model/connector=cross_attention", "data.max_objects=1",
                                 "data.relations=false", "data.train_size=2000", "data.val_size=200",
                                 "trainer.max_steps=250", "trainer.val_check_interval=250",
                                 "trainer.enable_progress_bar=false", "callbacks.save_best=false"], out))
    assert metrics["val/acc"] >= 0.6, metrics["val/acc"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"]["family"] == "vlm" and summary["status"] == "ok"
    # 2 gated layers x (K and V) x 4 heads x 16 dims x 16 image tokens x 4 bytes
    assert metrics["vision/tokens_per_image"] == 16 and metrics["cache/cross_attn_bytes"] == 2 * 2 * 64 * 16 * 4
    assert metrics["perf/tokens_per_sec"] > 0 and metrics["perf/flops_per_token"] > 0


def test_multimodal_smoke_sweep_reports_every_connector(tmp_path):
    """`attnzoo-sweep multimodal debug=smoke` on a cut grid: every job ok, with the multimodal metrics in the report."""
    import csv

    from attnzoo.analysis.report import build_report
    from attnzoo.cli.sweep import main as sweep_main
    from tests.conftest import SESSION_CACHE

    d = tmp_path / "mm"
    sweep_main(["multimodal", "debug=smoke", f"hydra.sweep.dir={d}", f"paths.cache_dir={SESSION_CACHE}",
                "hydra/launcher=basic", "model/connector=concat,cross_attention", "model.connector.n_queries=0,4",
                "optim.lr=3e-3", "data.train_size=64", "data.val_size=16"])
    build_report(d)
    rows = list(csv.DictReader(open(d / "report.csv", newline="")))
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
    by = {(json.loads((d / r["job"] / "summary.json").read_text())["config"]["model"]["connector"]["name"],
           json.loads((d / r["job"] / "summary.json").read_text())["config"]["model"]["connector"]["n_queries"]): r
          for r in rows}
    assert float(by[("concat", 4)]["vision/tokens_per_image"]) == 4 and float(by[("concat", 0)]["vision/tokens_per_image"]) == 16
    assert float(by[("concat", 0)]["cache/cross_attn_bytes"]) == 0 < float(by[("cross_attention", 4)]["cache/cross_attn_bytes"])
    assert float(by[("cross_attention", 4)]["cache/cross_attn_bytes"]) < float(by[("cross_attention", 0)]["cache/cross_attn_bytes"])
    assert all(0 <= float(r["val/acc"]) <= 1 for r in rows)


def test_concat_keeps_the_image_in_its_tokens_while_training(tmp_path):
    """The concat failure (docs/vision.md): trained at the decoder's lr, the from-scratch image encoder turns
    image-independent behind the concat connector (the image tokens' across-image std / rms: 0.59 at init,
    0.003 after 40 steps), and concat stays at the text-only accuracy while cross-attention learns.
    model.vision.lr_scale = 0.1 trains the encoder at optim.lr x 0.1 in its own AdamW groups: 0.10 here."""
    from omegaconf import OmegaConf

    from attnzoo.data.shapes import ShapesConfig, ShapesDataModule
    from attnzoo.training.lit_lm import param_groups

    cfg = compose_cfg(["experiment=vlm_shapes", "data.max_objects=1", "data.relations=false"], tmp_path)
    dm = ShapesDataModule(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ShapesConfig), cfg.data)), seed=0)
    dm.setup()
    torch.manual_seed(0)
    model = VisionLanguageModel(OmegaConf.to_container(cfg.model, resolve=True), dm.vocab_size, dm.image_size, 3)
    groups = param_groups(model, 0.05, lr=3e-3)
    assert {g.get("lr_scale") for g in groups} == {None, 0.1}
    assert all(g["lr"] == pytest.approx(3e-4) for g in groups if "lr" in g)
    opt = torch.optim.AdamW(groups, lr=3e-3)
    x, y, mask, images = dm.train_set.tensors
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        i = torch.randint(0, len(x), (64,), generator=g)
        logits = model(x[i], images[i])
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[i].flatten(), reduction="none")
        loss = (ce * mask[i].flatten()).sum() / mask[i].sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    with torch.no_grad():
        tokens = model.encode_image(images[:256])  # (B, M, d)
    varying = (tokens.var(0).mean() / tokens.pow(2).mean()).sqrt().item()  # the part that depends on the image
    assert varying > 0.03, varying

"""The vision families' options: `model.vision` (the image encoder) and `model.connector` (how image tokens meet
the text), settled once by `split_config` into typed objects that every part reads.

For the classifiers (model=vit|swin) the ModelConfig itself describes the encoder (d_model, n_layers, n_heads,
mixer, ffn, norm); `model.vision` adds the image geometry and the Swin stages. For model=vlm the ModelConfig is
the language side (the zoo decoder) and the image encoder's own width / depth / heads are `model.vision.*`;
its layers are pre-norm LayerNorm + bidirectional MHA with biases + GELU MLP, as ViT / Swin.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import DictConfig, OmegaConf

from attnzoo.config.schema import ModelConfig, resolve_model
from attnzoo.config.errors import ConfigError, check, check_choice

ENCODERS = ("vit", "swin")
CONNECTORS = ("concat", "cross_attention", "resampler")


@dataclass
class VisionOptions:
    """`model.vision`."""

    encoder: str = "vit"  # vit (Dosovitskiy et al. 2021) | swin (Liu et al. 2021)
    patch_size: int = 2  # non-overlapping p x p patches (a strided conv), one token each
    image_size: Optional[int] = None  # null: the data's (set when the model is built for a data module)
    channels: Optional[int] = None  # null: the data's
    pool: str = "cls"  # the classifier's image vector: cls (ViT's [CLS] token) | mean (of the output tokens; swin: always)
    # Swin: windows of window_size x window_size patches, every second block shifted by window_size // 2;
    # a patch merging (2x2 -> 1, width x2) between stages. depths / stage_heads give the blocks and heads per
    # stage; model.n_layers and model.n_heads are set from them.
    window_size: int = 2
    depths: List[int] = field(default_factory=lambda: [2, 2])
    stage_heads: List[int] = field(default_factory=lambda: [2, 4])
    # model=vlm: the image encoder's width, layers (vit) and heads (vit); null for the classifiers (model.*)
    d_model: Optional[int] = None
    n_layers: Optional[int] = None
    n_heads: Optional[int] = None
    # model=vlm: the image encoder's learning rate as a fraction of optim.lr (0: frozen, as LLaVA keeps its
    # CLIP encoder). Trained from scratch at the decoder's lr behind the concat connector, the encoder turns
    # image-independent within ~30 steps (the image tokens' across-image std / rms 0.59 -> 0.01) and concat
    # stays at the text-only accuracy; at 0.1 it learns like cross-attention (docs/vision.md).
    lr_scale: float = 0.1


@dataclass
class ConnectorConfig:
    """`model.connector` (model=vlm), one of conf/model/connector/*.yaml."""

    name: str = "concat"  # concat (LLaVA) | cross_attention (Flamingo / IDEFICS) | resampler (then `after`)
    # Perceiver resampler (Alayrac et al. 2022; Idefics2): n_queries learned queries cross-attend to the image
    # tokens, `resampler_depth` layers; the connector then sees n_queries tokens per image whatever the image
    # size. 0: no resampler (concat / cross_attention); the resampler connector needs >= 1.
    n_queries: int = 0
    resampler_depth: int = 2
    resampler_heads: int = 4
    resampler_head_dim: Optional[int] = None  # null: vision width / resampler_heads
    after: str = "concat"  # resampler: how the resampled tokens meet the text: concat | cross_attention
    projector: str = "mlp"  # concat: mlp (Linear-GELU-Linear, LLaVA-1.5) | linear (LLaVA)
    every: int = 1  # cross_attention: a gated cross-attention layer before every k-th decoder layer (0, k, 2k, ..)
    gate: str = "float"  # cross_attention: tanh gates, zero at init: float (one per sublayer) | vector (per channel)

    @property
    def meet(self) -> str:
        """concat | cross_attention: where the (possibly resampled) image tokens enter the decoder."""
        return self.after if self.name == "resampler" else self.name

    def validate(self, field_: str = "model.connector") -> None:
        check_choice(self.name, f"{field_}.name", CONNECTORS)
        if self.name == "resampler":
            check(self.n_queries >= 1, f"{field_}.n_queries", f"the resampler needs >= 1 learned queries, got {self.n_queries}")
            check_choice(self.after, f"{field_}.after", ("concat", "cross_attention"))
        else:
            check(self.n_queries >= 0, f"{field_}.n_queries", f"must be >= 0 (0: no resampler), got {self.n_queries}")
        if self.n_queries:
            check(self.resampler_depth >= 1, f"{field_}.resampler_depth", f"must be >= 1, got {self.resampler_depth}")
            check(self.resampler_heads >= 1, f"{field_}.resampler_heads", f"must be >= 1, got {self.resampler_heads}")
            check(self.resampler_head_dim is None or self.resampler_head_dim > 0, f"{field_}.resampler_head_dim",
                  "must be positive or null")
        check_choice(self.projector, f"{field_}.projector", ("mlp", "linear"))
        check(self.every >= 1, f"{field_}.every", f"must be >= 1 (a gated layer before every k-th decoder layer), got {self.every}")
        check_choice(self.gate, f"{field_}.gate", ("float", "vector"))


@dataclass
class VisionSetup:
    """Everything settled: `model` (the ModelConfig: the classifier's encoder, or the vlm's decoder),
    `vision` (options with image size / channels filled), `encoder` (the image encoder's own ModelConfig),
    `connector` (None for the classifiers)."""

    model: ModelConfig
    vision: VisionOptions
    encoder: ModelConfig
    connector: Optional[ConnectorConfig]


def _typed(cls, raw: Any, where: str):
    if isinstance(raw, cls):
        return raw
    if isinstance(raw, DictConfig):
        raw = OmegaConf.to_container(raw, resolve=True)
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"expected a mapping, got {type(raw).__name__}", field=where)
    allowed = {f.name for f in dataclasses.fields(cls)}
    for k in raw or {}:
        check(k in allowed, f"{where}.{k}", f"unknown key; allowed keys: {', '.join(sorted(allowed))}")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), raw or {}))
    except Exception as e:  # noqa: BLE001 - a wrong type: one line naming the key
        key = getattr(e, "full_key", "") or ""
        raise ConfigError(str(e).splitlines()[0], field=f"{where}.{key}" if key else where) from None


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def encoder_config(cfg: ModelConfig, vis: VisionOptions, multimodal: bool) -> ModelConfig:
    """The image encoder's ModelConfig: the model's own for a classifier; for the vlm one built from
    model.vision (pre-norm LayerNorm eps 1e-6, bidirectional MHA with biases, GELU MLP x4, no 1-D positions)."""
    if not multimodal:
        return cfg
    swin = vis.encoder == "swin"  # its depth and heads are vision.depths / stage_heads
    for name in ("d_model",) if swin else ("d_model", "n_layers", "n_heads"):
        check(getattr(vis, name) is not None and getattr(vis, name) > 0, f"model.vision.{name}",
              f"the vlm's image encoder needs its own {name}; allowed: a positive integer")
    n_layers, n_heads = (sum(vis.depths), vis.stage_heads[0]) if swin else (vis.n_layers, vis.n_heads)
    check(vis.d_model % n_heads == 0, "model.vision.d_model" if not swin else "model.vision.stage_heads",
          f"{vis.d_model} is not divisible by {n_heads} heads; allowed: {_divisors(vis.d_model)}")
    return resolve_model({
        "name": f"{vis.encoder}_encoder", "d_model": vis.d_model, "n_layers": n_layers, "n_heads": n_heads,
        "n_kv_heads": n_heads, "max_seq_len": 1, "norm_position": "pre", "tie_embeddings": False,
        "mixer": {"name": "mha", "causal": False, "qkv_bias": True, "out_bias": True},
        "ffn": {"name": "mlp", "activation": "gelu"}, "position": {"name": "none"},
        "norm": {"name": "layernorm", "eps": 1e-6},
    })


def split_config(node: Any, vocab_size: Optional[int] = None, image_size: Optional[int] = None,
                 channels: Optional[int] = None) -> VisionSetup:
    """The settled configs of a vision model section (model=vit|swin|vlm); every check here names its field."""
    if isinstance(node, ModelConfig):
        raw_vis, raw_conn, cfg = node.vision, node.connector, node
        if vocab_size is not None:
            cfg.vocab_size = vocab_size
    else:
        if isinstance(node, DictConfig):
            node = OmegaConf.to_container(node, resolve=True)
        node = dict(node or {})
        raw_vis, raw_conn = node.get("vision"), node.get("connector")
        cfg = resolve_model({k: v for k, v in node.items() if k not in ("vision", "connector")}, vocab_size=vocab_size)
    multimodal = cfg.name == "vlm"
    vis = dataclasses.replace(_typed(VisionOptions, raw_vis, "model.vision"))
    vis.image_size = image_size or vis.image_size
    vis.channels = channels or vis.channels
    check_choice(vis.encoder, "model.vision.encoder", ENCODERS)
    if not multimodal:
        check(vis.encoder == cfg.name, "model.vision.encoder", f"model={cfg.name} builds a {cfg.name} encoder; "
              f"allowed: {cfg.name} (model=vit or model=swin picks the other)")
    check(vis.patch_size >= 1, "model.vision.patch_size", f"must be >= 1, got {vis.patch_size}")
    check(vis.lr_scale >= 0, "model.vision.lr_scale", f"must be >= 0 (0: a frozen encoder), got {vis.lr_scale}")
    check_choice(vis.pool, "model.vision.pool", ("cls", "mean"))
    enc = encoder_config(cfg, vis, multimodal)
    check(getattr(enc.mixer, "causal", True) is False, "model.mixer.causal" if not multimodal else "model.vision",
          f"the image encoder attends bidirectionally; allowed: model.mixer.causal=false with a mixer that has it "
          f"(mha, gqa, mqa), got {enc.mixer.name} causal={getattr(enc.mixer, 'causal', 'n/a')}")
    if vis.encoder == "swin":
        check(len(vis.depths) >= 1 and all(d >= 1 for d in vis.depths), "model.vision.depths",
              f"allowed: a list of blocks per stage, each >= 1, got {list(vis.depths)}")
        check(len(vis.stage_heads) == len(vis.depths), "model.vision.stage_heads",
              f"{len(vis.stage_heads)} entries for {len(vis.depths)} stages; allowed: one head count per stage")
        for s, h in enumerate(vis.stage_heads):
            width = enc.d_model * 2 ** s
            check(h >= 1 and width % h == 0, "model.vision.stage_heads",
                  f"stage {s} has width {width}, not divisible by {h} heads; allowed: {_divisors(width)}")
        check(vis.window_size >= 1, "model.vision.window_size", f"must be >= 1, got {vis.window_size}")
        check(getattr(enc.ffn, "d_ff", None) is None, "model.ffn.d_ff", "Swin's MLP widens with each stage "
              "(hidden_mult x the stage width); allowed: null (set model.ffn.hidden_mult)")
        enc = dataclasses.replace(enc, n_layers=sum(vis.depths), n_heads=vis.stage_heads[0],
                                  head_dim=enc.d_model // vis.stage_heads[0], n_kv_heads=vis.stage_heads[0])
        if not multimodal:
            cfg = enc
    conn = None
    if multimodal:
        conn = _typed(ConnectorConfig, raw_conn if raw_conn is not None else {}, "model.connector")
        conn.validate()
        check(conn.meet != "cross_attention" or cfg.n_layers >= 1, "model.connector.every", "needs decoder layers")
    if vis.image_size is not None:
        check_geometry(vis)
    return VisionSetup(cfg, vis, enc, conn)


def check_geometry(vis: VisionOptions) -> None:
    """The image is whole patches; Swin's windows tile the patch grid at every stage (and the grid halves
    evenly between stages). One line naming the field and the values that fit."""
    S, p = vis.image_size, vis.patch_size
    check(S % p == 0, "model.vision.patch_size", f"{p} does not divide the image size {S}; allowed: {_divisors(S)}")
    if vis.encoder != "swin":
        return
    grid = S // p
    for s in range(len(vis.depths)):
        g = grid // 2 ** s
        if s > 0:
            check(grid % 2 ** s == 0 and g >= 1, "model.vision.depths", f"{len(vis.depths)} stages halve a {grid}x{grid} "
                  f"patch grid {len(vis.depths) - 1} times; allowed: at most {1 + _halvings(grid)} stages")
        w = min(vis.window_size, g)  # a window larger than the grid is clipped to it (as Swin / transformers)
        check(g % w == 0, "model.vision.window_size", f"{vis.window_size} does not divide the {g}x{g} patch grid "
              f"of stage {s}; allowed: {_divisors(g)} (or >= {g}: one window)")


def _halvings(n: int) -> int:
    k = 0
    while n % 2 == 0 and n > 1:
        n //= 2
        k += 1
    return k


def image_tokens(vis: VisionOptions, conn: Optional[ConnectorConfig]) -> int:
    """Tokens of one image the text sees: the resampler's queries, else the encoder's output tokens (ViT:
    every patch, no [CLS]; Swin: the last stage's grid)."""
    if conn is not None and conn.n_queries:
        return conn.n_queries
    grid = vis.image_size // vis.patch_size
    if vis.encoder == "swin":
        grid //= 2 ** (len(vis.depths) - 1)
    return grid * grid

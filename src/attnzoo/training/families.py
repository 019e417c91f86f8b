"""Model families: one place that knows how to build each kind of model and what it trains on.

A family owns a set of `model.name` values (the decoder LM owns every name the others do not claim) and
provides, from the resolved run config:
  build_model(model_cfg, vocab_size) -> nn.Module     the bare network (parameter counts, budgets)
  build_lit(container, model_cfg, dm) -> LightningModule  the training module (one `TrainingModule`
                                                       subclass: aux losses and post-step hooks for all)
  accepts(data_cfg) -> bool, data_help                 which data modules it can use (checked by
                                                       `validate`, before any work)
  metrics(data_cfg) -> validation metric names         what `callbacks.monitor` may name
  decoder_only                                          has a decode cache and `generate` (inference timing,
                                                       text samples at the end of a run)

`train()`, `validate()`, `budget.count_params()` and the summary all go through `family_of(model_cfg)`,
so a new family (vision, multimodal) is one `register_family(...)` call here, not edits in three files.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from typing import TYPE_CHECKING

from attnzoo.config.errors import ConfigError, check
from attnzoo.data import DATAMODULES
from attnzoo.models.encdec_options import check_decoder_causal
from attnzoo.models.encdec_options import split_config as split_encdec_config
from attnzoo.models.vision.options import image_tokens
from attnzoo.models.vision.options import split_config as split_vision_config

if TYPE_CHECKING:
    from torch import nn

# The networks (torch) and the LightningModules are imported by the build functions, when a model is built:
# validate() goes through this module, and a refused value is reported before torch's import (issue 45: each
# refusal in under 1.5 s; tests/test_lean_imports.py checks it).

SEQ2SEQ_DATA = ("reversal", "sorting", "addition")  # (src, tgt) batches: data/seq2seq.py


@dataclass(frozen=True)
class Family:
    name: str
    model_names: tuple[str, ...]  # model.name values routed here (empty: the default family)
    build_model: Callable[[Any, int], nn.Module]
    build_lit: Callable[[dict, Any, Any], Any]
    accepts: Callable[[Any], bool]
    data_help: str  # the allowed data modules, for the error message
    metrics: Callable[[Any], list]
    decoder_only: bool = False
    check_model: Callable[[dict], Any] | None = None  # family-only options (model.encdec), checked by validate
    # options that depend on the data (an image encoder's patches and windows against the image size), checked
    # by validate after the data section
    check_with_data: Callable[[Any, Any], Any] | None = None
    sections: tuple[str, ...] = ()  # family-only model sections it reads (model.vision, model.connector)


FAMILIES: dict[str, Family] = {}
DEFAULT_FAMILY = "decoder"


def register_family(family: Family) -> Family:
    if family.name in FAMILIES and FAMILIES[family.name] != family:
        raise ValueError(f"model family '{family.name}' registered twice")
    FAMILIES[family.name] = family
    return family


def family_of(model_cfg: Any) -> Family:
    """The family of a model section (dict, DictConfig or typed ModelConfig) from its `name`."""
    name = model_cfg.get("name") if hasattr(model_cfg, "get") else getattr(model_cfg, "name", None)
    for fam in FAMILIES.values():
        if name in fam.model_names:
            return fam
    return FAMILIES[DEFAULT_FAMILY]


def check_data(model_cfg: Any, data_cfg: Any) -> None:
    """A data module the model's family cannot train on: one line naming `data` and what is allowed."""

    fam = family_of(model_cfg)
    if not fam.accepts(data_cfg):
        raise ConfigError(f"model={getattr(model_cfg, 'name', fam.name)} ({fam.name} family) cannot train on "
                          f"data={data_cfg.name}; allowed: {fam.data_help}", field="data")


def _check_encdec_options(model_node: dict) -> None:
    split_encdec_config(model_node, vocab_size=model_node.get("vocab_size") or 2)  # the vocabulary is not known yet


def _check_encdec(model_node: dict) -> None:
    _check_encdec_options(model_node)
    check_decoder_causal(model_node.get("mixer") or {})


def embedding_params(model: nn.Module) -> int:
    """Parameters of every embedding table (token and learned-position), each shared tensor once."""
    from torch import nn

    seen = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding)}
    return sum(seen.values())


# ----------------------------------------------------------------------------- the families so far
def _lm_metrics(data_cfg: Any) -> list:
    """val/acc only where the data has answer positions (synthetic tasks); natural text (a data config class
    with `natural_text = True`: data=text, data=shards) has loss and perplexity."""
    name = getattr(data_cfg, "name", "text")
    text = name in DATAMODULES.names() and getattr(DATAMODULES.get(name).config_cls, "natural_text", False)
    return ["val/loss", "val/ppl"] + ([] if text else ["val/acc"])


def _decoder_model(model_cfg, vocab_size):
    from attnzoo.models.decoder import DecoderLM

    return DecoderLM(model_cfg, vocab_size=vocab_size)


def _decoder_lit(container, model_cfg, dm):
    from attnzoo.training.lit_lm import LitLM

    return LitLM(container, vocab_size=dm.vocab_size, model_cfg=model_cfg)


def _encdec_model(model_cfg, vocab_size):
    from attnzoo.models.encoder_decoder import EncoderDecoder

    return EncoderDecoder(model_cfg, vocab_size=vocab_size)


def _encdec_lit(container, model_cfg, dm):
    from attnzoo.training.lit_seq2seq import LitSeq2Seq

    return LitSeq2Seq(container, vocab_size=dm.vocab_size, pad_id=getattr(dm, "pad_id", 0),
                      bos_id=getattr(dm, "bos_id", 1), eos_id=getattr(dm, "eos_id", 2), model_cfg=model_cfg)


def _encoder_model(model_cfg, vocab_size):
    from attnzoo.models.encoder_decoder import EncoderMLM

    return EncoderMLM(model_cfg, vocab_size=vocab_size + 1)  # + [MASK], as LitMLM builds it


def _encoder_lit(container, model_cfg, dm):
    from attnzoo.training.lit_seq2seq import LitMLM

    return LitMLM(container, vocab_size=dm.vocab_size, model_cfg=model_cfg)


register_family(Family(
    name="decoder", model_names=(), build_model=_decoder_model, build_lit=_decoder_lit,
    accepts=lambda d: d.name not in SEQ2SEQ_DATA, data_help="text or a synthetic LM task (mqar, copying, ...)",
    metrics=_lm_metrics, decoder_only=True,
))
def _linearize_lit(container, model_cfg, dm):
    from attnzoo.training.linearize import LitLinearize

    return LitLinearize(container, vocab_size=dm.vocab_size, model_cfg=model_cfg)


# experiment=linearize: a decoder LM (the student) distilled from the imported model it was planned from
register_family(Family(
    name="linearize", model_names=("linearize",), build_model=_decoder_model, build_lit=_linearize_lit,
    accepts=lambda d: d.name not in SEQ2SEQ_DATA, data_help="text or a synthetic LM task (mqar, copying, ...)",
    metrics=lambda d: _lm_metrics(d) + ["val/loss_teacher"], decoder_only=True,
))
register_family(Family(
    name="encdec", model_names=("encdec",), build_model=_encdec_model, build_lit=_encdec_lit,
    accepts=lambda d: d.name in SEQ2SEQ_DATA, data_help=", ".join(SEQ2SEQ_DATA),
    metrics=lambda d: ["val/loss", "val/ppl", "val/acc", "val/token_acc"], check_model=_check_encdec,
))
register_family(Family(
    name="encoder", model_names=("encoder",), build_model=_encoder_model, build_lit=_encoder_lit,
    accepts=lambda d: d.name == "text", data_help="text", metrics=lambda d: ["val/loss", "val/ppl", "val/acc"],
    check_model=_check_encdec_options,
))


# ----------------------------------------------------------------------------- vision (attnzoo.models.vision)
def _vision_setup(model_cfg, data_cfg=None):
    size = getattr(data_cfg, "image_size", None) if data_cfg is not None else None
    channels = getattr(data_cfg, "channels", None) if data_cfg is not None else None
    return split_vision_config(model_cfg, image_size=size, channels=channels)


def _image_geometry(vis, vocab_size: int) -> tuple:
    if vis.image_size is None or vis.channels is None:  # model_budget counts a model before the data is known
        raise ConfigError("counting a vision model's parameters needs the image size; allowed: set "
                          "model.vision.image_size and model.vision.channels", field="model.vision.image_size")
    return vocab_size, vis.image_size, vis.channels


def _vision_model(model_cfg, vocab_size):
    from attnzoo.models.vision import ImageClassifier

    return ImageClassifier(model_cfg, *_image_geometry(_vision_setup(model_cfg).vision, vocab_size))


def _vision_lit(container, model_cfg, dm):
    from attnzoo.training.lit_vision import LitImageClassifier

    return LitImageClassifier(container, vocab_size=dm.vocab_size, image_size=dm.image_size, channels=dm.channels,
                              model_cfg=model_cfg)


def _vlm_model(model_cfg, vocab_size):
    from attnzoo.models.vision import VisionLanguageModel

    return VisionLanguageModel(model_cfg, *_image_geometry(_vision_setup(model_cfg).vision, vocab_size))


def _vlm_lit(container, model_cfg, dm):
    from attnzoo.training.lit_vision import LitVLM

    return LitVLM(container, vocab_size=dm.vocab_size, image_size=dm.image_size, channels=dm.channels,
                  model_cfg=model_cfg)


def _check_vlm_with_data(model_cfg, data_cfg) -> None:
    """The image geometry, and with learned positions the image prefix (concat) plus the text within
    model.max_seq_len."""

    setup = _vision_setup(model_cfg, data_cfg)
    if setup.connector.meet == "concat" and setup.model.position.name == "learned":
        total = data_cfg.seq_len + image_tokens(setup.vision, setup.connector)
        check(total <= setup.model.max_seq_len, "model.max_seq_len", f"{setup.model.max_seq_len} cannot hold "
              f"the image tokens and the text ({total}) with learned positions; allowed: >= {total}")


register_family(Family(
    name="vision", model_names=("vit", "swin"), build_model=_vision_model, build_lit=_vision_lit,
    accepts=lambda d: d.name == "digits" or (d.name == "shapes" and d.task == "classify"),
    data_help="digits, or shapes with data.task=classify", metrics=lambda d: ["val/loss", "val/acc"],
    check_model=lambda node: _vision_setup(node), check_with_data=_vision_setup, sections=("vision",),
))
register_family(Family(
    name="vlm", model_names=("vlm",), build_model=_vlm_model, build_lit=_vlm_lit,
    accepts=lambda d: d.name == "shapes" and d.task in ("vqa", "caption"),
    data_help="shapes with data.task=vqa or caption", metrics=lambda d: ["val/loss", "val/ppl", "val/acc", "val/token_acc"],
    check_model=lambda node: _vision_setup(node), check_with_data=_check_vlm_with_data, sections=("vision", "connector"),
))

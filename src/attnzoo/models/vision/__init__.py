"""Vision and multimodal attention (issue 19; docs/vision.md).

  options.py     model.vision / model.connector, settled once (split_config), image geometry checks
  vit.py         patch embedding, ViT encoder (the zoo's Block with a bidirectional mixer)
  swin.py        Swin: (shifted) window attention, its mask, relative position bias, patch merging
  classifier.py  model=vit | model=swin image classifiers
  connectors.py  concat projector, gated cross-attention (zero-init tanh gates), Perceiver resampler
  vlm.py         model=vlm: image encoder + connector + the zoo's DecoderLM, cached decoding
"""
from attnzoo.models.vision.options import ConnectorConfig, VisionOptions, split_config

# the networks (torch) load on first use, so that the options (validate(): torch-free, issue 45) do not pull them
_LAZY = {"ImageClassifier": "attnzoo.models.vision.classifier", "VisionLanguageModel": "attnzoo.models.vision.vlm"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ConnectorConfig", "ImageClassifier", "VisionLanguageModel", "VisionOptions", "split_config"]

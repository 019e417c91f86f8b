"""Vision and multimodal attention (issue 19; docs/vision.md).

  options.py     model.vision / model.connector, settled once (split_config), image geometry checks
  vit.py         patch embedding, ViT encoder (the zoo's Block with a bidirectional mixer)
  swin.py        Swin: (shifted) window attention, its mask, relative position bias, patch merging
  classifier.py  model=vit | model=swin image classifiers
  connectors.py  concat projector, gated cross-attention (zero-init tanh gates), Perceiver resampler
  vlm.py         model=vlm: image encoder + connector + the zoo's DecoderLM, cached decoding
"""
from attnzoo.models.vision.classifier import ImageClassifier
from attnzoo.models.vision.options import ConnectorConfig, VisionOptions, split_config
from attnzoo.models.vision.vlm import VisionLanguageModel

__all__ = ["ConnectorConfig", "ImageClassifier", "VisionLanguageModel", "VisionOptions", "split_config"]

"""attnzoo: compare Transformer building blocks (token mixers, FFNs, MoE) under one training harness."""
from attnzoo.api import build_model, load, load_config

__all__ = ["build_model", "load", "load_config"]
__version__ = "0.1.0"

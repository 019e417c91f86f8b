"""attnzoo: compare Transformer building blocks (token mixers, FFNs, MoE) under one training harness."""
import time

# when attnzoo was first imported: the start of a command (every console script imports it first) or of a script
# using the library; a run's summary reports its first optimizer step from here (first_step_seconds, issue 45)
STARTED = time.perf_counter()

from attnzoo.api import build_model, load, load_config

__all__ = ["build_model", "load", "load_config"]
__version__ = "0.1.0"

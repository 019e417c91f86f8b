"""`data=shards data.mixture`: several prepared folders mixed by weight (docs/data.md#mixtures), torch-free: the
source dataclass and the checks a mixture gets before any work (data/configs.py's ShardsDataConfig.validate calls
`check_mixture`). The blend itself is data/_shards_loader.py's `blend` / `MixtureLoader`."""
from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING

from attnzoo.config.errors import ConfigError, check

NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a source's name is a metric key: data/tokens/<name>


@dataclass
class MixtureSource:
    path: str = MISSING  # OUT of `attnzoo-data prepare SRC OUT`
    weight: float = MISSING  # relative share of the training blocks (normalised over the sources), > 0


def check_mixture(cfg, model, field: str) -> dict[str, dict]:
    """The mixture of a ShardsDataConfig, checked (one-line ConfigError naming the source's field): names usable
    as metric keys, weights finite and > 0, every path a finished prepared folder, all of them prepared with one
    tokenizer (tokenizer.json, and the same end-of-text id: packing's document masks read it), the embedding rows
    enough for it, and with packing a seq_len some document reaches. Returns each source's manifest."""
    from attnzoo.data.configs import PREPARE, read_manifest

    at = f"{field}.mixture"
    check(cfg.path is None and cfg.source is None, at, f"given with {field}.{'path' if cfg.path else 'source'}; "
          f"allowed: one of {field}.path, {field}.source or {field}.mixture")
    check(not cfg.prepare, f"{field}.prepare", f"{cfg.prepare} with {at}; allowed: a mixture of folders "
          f"`{PREPARE}` finished")
    check(len(cfg.mixture) >= 1, at, "is empty; allowed: {NAME: {path: OUT, weight: W}, ...}")
    for name, src in cfg.mixture.items():
        check(NAME.fullmatch(str(name)) is not None, f"{at}.{name}", "is not a usable source name (it names the "
              "data/tokens/<name> metric); allowed: letters, digits, _ . -")
        check(math.isfinite(src.weight) and src.weight > 0, f"{at}.{name}.weight",
              f"got {src.weight}; allowed: a finite number > 0 (weights are relative)")
    manifests = {name: read_manifest(src.path, f"{at}.{name}.path") for name, src in cfg.mixture.items()}
    first, *others = cfg.mixture
    first_path = cfg.mixture[first].path
    ref_tok, ref = manifests[first]["tokenizer"], _tokenizer_sha(first_path)
    for name in others:
        path, tok = cfg.mixture[name].path, manifests[name]["tokenizer"]
        sha = _tokenizer_sha(path)
        if sha != ref and not _same_tokenizer(path, first_path):
            raise ConfigError(f"{path} was prepared with another tokenizer than {at}.{first} ({first_path}: "
                              f"tokenizer.json sha256 {sha[:12]} vs {ref[:12]}), so the same id would be another "
                              f"token; allowed: folders prepared with one tokenizer (`{PREPARE} --tokenizer-file "
                              f"{first_path}/tokenizer.json`)", field=f"{at}.{name}.path")
        if tok["eos_id"] != ref_tok["eos_id"]:
            raise ConfigError(f"{path} ends its documents with id {tok['eos_id']}, {at}.{first} with "
                              f"{ref_tok['eos_id']} (another --eos-token); allowed: folders prepared with one "
                              f"end-of-text token", field=f"{at}.{name}.path")
    vocab = int(ref_tok["vocab_size"])
    if cfg.vocab_size is not None:
        check(cfg.vocab_size >= vocab, f"{field}.vocab_size", f"{cfg.vocab_size} embedding rows, fewer than the "
              f"mixture's tokenizer ({vocab} tokens); allowed: >= {vocab}, or null (the manifests')")
    rows = getattr(model, "vocab_size", None)
    if rows is not None:
        check(rows >= vocab, "model.vocab_size", f"{rows} embedding rows, fewer than the mixture's tokenizer "
              f"({vocab} tokens); allowed: a model with >= {vocab}, or corpora prepared with its tokenizer")
    longest = [m["splits"]["train"].get("max_document_tokens") for m in manifests.values()]
    if cfg.packing and None not in longest:
        check(cfg.seq_len <= max(longest), f"{field}.seq_len", f"{cfg.seq_len} is longer than every document of "
              f"every source (the longest: {max(longest)} tokens): with data.packing=true no token would see more "
              f"than {max(longest)} tokens of context; allowed: <= {max(longest)}, or data.packing=false")
    return manifests


def _tokenizer_sha(path: str) -> str:
    return hashlib.sha256((Path(path).expanduser() / "tokenizer.json").read_bytes()).hexdigest()


def _same_tokenizer(a: str, b: str) -> bool:
    """Two tokenizer.json files of one tokenizer written differently (whitespace, key order): HF tokenizers'
    canonical serialisation of each (the bytes differ, so this is the rare path)."""
    from tokenizers import Tokenizer

    def canonical(path: str) -> str:
        return Tokenizer.from_file(str(Path(path).expanduser() / "tokenizer.json")).to_str()

    try:
        return canonical(a) == canonical(b)
    except Exception:  # one that tokenizers cannot read is not the same tokenizer (setup reports the file itself)
        return False

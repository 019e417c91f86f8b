"""Directories in and out: the tokenizer files, `export_model` (a save_pretrained directory) and `model.init_from`
for attnzoo-train (`apply_init_from`, `check_init_vocab`, `init_weights_from`). The `attnzoo-export` command
is attnzoo.cli.export."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from attnzoo.config.errors import ConfigError
from attnzoo.config.paths import check_dir_path, follow_umask
from attnzoo.interop.hf.archs import FIELD, _no, arch_for
from attnzoo.interop.hf.configs import config_from_hf, hf_config
from attnzoo.interop.hf.weights import hf_state_dict, load_hf_weights, read_hf_config, read_hf_state_dict, safetensors_files


# ----------------------------------------------------------------------------- tokenizers


def hf_tokenizer_json(tokenizer) -> Optional[str]:
    """tokenizer.json text for a run's tokenizer: byte-level BPE as it is; the char tokenizer as a
    WordLevel model over single characters (split on every character, pieces fused back on decode)."""
    if getattr(tokenizer, "kind", None) in ("bpe", "file"):  # file: an imported model's tokenizer.json
        return tokenizer.tok.to_str()
    if getattr(tokenizer, "kind", None) == "char":
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

        tok = Tokenizer(models.WordLevel(vocab=dict(tokenizer.stoi), unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens([AddedToken("<|endoftext|>", special=True), AddedToken("<unk>", special=True)])
        return tok.to_str()
    return None


def write_tokenizer(tokenizer, out: Path, max_len: int) -> Optional[int]:
    """tokenizer.json + tokenizer_config.json (AutoTokenizer -> PreTrainedTokenizerFast); returns the
    <|endoftext|> id, or None when the run has no tokenizer (synthetic tasks: ids are the task's own)."""
    text = hf_tokenizer_json(tokenizer)
    if text is None:
        return None
    (out / "tokenizer.json").write_text(text)
    if tokenizer.kind == "file":
        eos_id = tokenizer.tok.token_to_id("<|endoftext|>")
    else:
        eos = tokenizer.encode("<|endoftext|>") if tokenizer.kind == "bpe" else [0]
        eos_id = eos[0] if len(eos) == 1 else None
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
            "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>"}
    if tokenizer.kind == "char":
        conf["unk_token"] = "<unk>"
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2))
    return eos_id


def check_export_dir(out: Path, field: str = "OUT_DIR", empty: bool = False) -> None:
    """`out` can become the export directory: not a file, under a writable directory (and, with `empty`,
    new or an empty directory). One line, before any work."""
    check_dir_path(out, field, allowed="a new or empty directory", allowed_under="a path under a writable directory",
                   empty=empty)


def export_model(model, out_dir: str | Path, tokenizer=None) -> dict:
    """Write `model` (an attnzoo DecoderLM) as a save_pretrained-style directory; returns its config.json.

    All files are written into a temporary sibling directory, then renamed into place: a full disk or a
    kill mid-write leaves no half-written export (an OSError propagates, and the temporary is removed).
    Files and directory follow the umask. Into an existing non-empty directory, each file replaces its
    namesake (os.replace) once all of them were written."""
    import os
    import shutil
    import tempfile

    from safetensors.torch import save_file

    config = hf_config(model)  # refuses (one line) before anything is written
    weights = hf_state_dict(model)
    out = Path(out_dir).expanduser().absolute()
    check_export_dir(out)
    created = out.parent  # the outermost parent this call creates, removed again on failure
    while not created.parent.exists():
        created = created.parent
    created = None if created.exists() else created
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        eos = write_tokenizer(tokenizer, tmp, model.cfg.max_seq_len) if tokenizer is not None else None
        if eos is not None:
            config["eos_token_id"] = eos
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for f in tmp.iterdir():
            follow_umask(f)  # safetensors and mkdtemp create 0600 / 0700
        follow_umask(tmp, directory=True)
        if out.is_dir() and any(out.iterdir()):
            for f in tmp.iterdir():
                os.replace(f, out / f.name)
            tmp.rmdir()
        else:
            os.replace(tmp, out)  # onto a missing or empty directory: atomic
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
    return config


# ----------------------------------------------------------------------------- init_from (attnzoo-train)


def apply_init_from(cfg, overrides: Optional[list] = None):
    """A run config whose `model` section comes from model.init_from's config.json (a copy; `cfg` itself is
    unchanged; no init_from: `cfg` as is). Precedence: config.json decides the architecture; of the composed
    model section only `dropout`, `init_std` and `init` are kept; command-line overrides `model.<key>=v` of
    keys config.json does not set (training knobs: model.ffn.aux_loss_coef, model.mixer.chunk_size, ...) are
    applied on top, and one that contradicts config.json, or a model preset/group override, is refused in
    one line. With a `linearize` section (experiment=linearize) `model.pattern` / `model.mixers` are kept too:
    they name the layers to replace (attnzoo.training.linearize.apply_linearize reads them next).
    `data=text` with a tokenizer.json in the directory: the corpus is encoded with it (data.tokenizer=file,
    data.vocab_size = the model's), unless data.tokenizer is given on the command line.
    `overrides`: the command line's (default: Hydra's, when running under Hydra)."""
    from omegaconf import OmegaConf, open_dict

    init = OmegaConf.select(cfg, "model.init_from")
    if not init:
        return cfg
    path = Path(str(init)).expanduser().resolve()
    derived = config_from_hf(read_hf_config(path))
    safetensors_files(path)  # the weights are there: checked now, read when the model is built
    if OmegaConf.select(cfg, "model_budget"):
        raise ConfigError("sizes the model to a budget, but model.init_from fixes it; allowed: null",
                          field="model_budget")
    # experiment=linearize: the pattern (and a planned run's name) describe the student, not config.json
    student = LINEARIZE_KEYS if OmegaConf.select(cfg, "linearize") is not None else ()
    if _agrees(OmegaConf.to_container(cfg.model, resolve=True), derived, ignore=student):
        return cfg  # already derived (a DDP worker's or a resumed run's config): knobs given then are kept
    plan = ("pattern", "mixers") if student else ()  # the student's layer plan, as composed / given
    kept = {k: OmegaConf.select(cfg, f"model.{k}") for k in ("dropout", "init_std", "init", *plan)}
    model = OmegaConf.create({**derived, **{k: v for k, v in kept.items() if v is not None}, "init_from": str(path)})
    given = _hydra_overrides() if overrides is None else overrides
    for o in given:
        key = str(o).split("=", 1)[0].lstrip("+~")
        if key in ("model", "override model") or key.startswith(("model/", "model@")):
            raise ConfigError(f"{o}: model.init_from={path} sets the whole architecture from its config.json; allowed: "
                              f"drop the preset/group override", field="model")
        if not key.startswith("model.") or key in ("model.init_from", "model.dropout", "model.init_std", "model.init"):
            continue
        if key.split(".")[1] in student:
            continue
        sub = key[len("model."):]
        value = OmegaConf.select(cfg, key)
        if OmegaConf.select(model, sub, default="__absent__") == "__absent__":
            OmegaConf.update(model, sub, value, force_add=True)
        elif OmegaConf.select(model, sub) != value:
            given = OmegaConf.select(model, sub)
            raise ConfigError(f"{value!r} contradicts {path}/config.json, which gives {given!r}; "
                              f"allowed: drop the override (the imported architecture is fixed)", field=key)
    out = cfg.copy()
    with open_dict(out):
        out.model = model
        _use_model_tokenizer(out, path, derived["vocab_size"], given)
    return out


LINEARIZE_KEYS = ("name", "pattern", "mixers")  # model keys that describe a linearized student (attnzoo.training.linearize)


def _use_model_tokenizer(cfg, path: Path, vocab_size: int, given: list) -> None:
    """data=text: encode the corpus with the imported model's tokenizer.json (its ids index the model's
    embedding), unless the command line chose data.tokenizer. A file tokenizers cannot read is refused."""
    from omegaconf import OmegaConf

    if OmegaConf.select(cfg, "data.name") == "shards":  # prepared corpora (a mixture's each): their ids are the model's
        mixture = OmegaConf.select(cfg, "data.mixture") or {}
        for field, prepared in [("data.path", OmegaConf.select(cfg, "data.path")),
                                *((f"data.mixture.{k}.path", v.get("path")) for k, v in mixture.items())]:
            _check_prepared_tokenizer(prepared, path, field)
        if OmegaConf.select(cfg, "data.vocab_size") is None:
            cfg.data.vocab_size = vocab_size  # the embedding rows: the imported model's
        return
    if OmegaConf.select(cfg, "data.name") != "text" or not (path / "tokenizer.json").is_file():
        return
    if any(str(o).lstrip("+~").split("=", 1)[0] in ("data.tokenizer", "data.tokenizer_file") for o in given):
        return
    from attnzoo.data.text import load_tokenizer_file

    try:
        load_tokenizer_file(str(path / "tokenizer.json"), vocab_size)  # usable: read now, one line if not
    except ConfigError as e:
        raise ConfigError(f"{path}/tokenizer.json cannot encode the text: {e}", field=FIELD) from None
    cfg.data.tokenizer, cfg.data.tokenizer_file, cfg.data.vocab_size = "file", str(path / "tokenizer.json"), vocab_size


def _check_prepared_tokenizer(prepared: Optional[str], path: Path, field: str = "data.path") -> None:
    """data=shards with model.init_from: the corpus must have been prepared with the model's own tokenizer
    (`attnzoo-data prepare SRC OUT --tokenizer-model DIR`), else its ids index other embedding rows."""
    from tokenizers import Tokenizer

    ours = Path(str(prepared)).expanduser() / "tokenizer.json" if prepared else None
    if ours is None or not ours.is_file() or not (path / "tokenizer.json").is_file():
        return
    if Tokenizer.from_file(str(ours)).to_str() != Tokenizer.from_file(str(path / "tokenizer.json")).to_str():
        raise ConfigError(f"{prepared} was prepared with another tokenizer than {path}/tokenizer.json, so its ids "
                          f"are not the model's; allowed: a corpus prepared with `attnzoo-data prepare SRC OUT "
                          f"--tokenizer-model {path}`", field=field)


def _agrees(section: dict, derived: dict, ignore: tuple = ()) -> bool:
    """Every value config.json gives is already in `section` (which may hold more keys), `ignore`d keys aside."""
    for key, want in derived.items():
        if key in ignore:
            continue
        have = section.get(key, "__absent__") if isinstance(section, dict) else "__absent__"
        if isinstance(want, dict) and want:
            if not isinstance(have, dict) or not _agrees(have, want):
                return False
        elif have != want:
            return False
    return True


def _hydra_overrides() -> list:
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except Exception:  # noqa: BLE001 - not under Hydra (tests, DDP workers): nothing given on a command line
        return []


def check_init_vocab(model_section: dict, vocab_size: int) -> None:
    """The run's data must use exactly the imported model's vocabulary (its ids index the embedding)."""
    want, init = model_section.get("vocab_size"), model_section.get("init_from")
    if init and want != vocab_size:
        tok = "" if (Path(init) / "tokenizer.json").is_file() else " and no tokenizer.json to encode text with"
        raise ConfigError(f"{init} has vocab_size={want}{tok}, the run's data {vocab_size} tokens; allowed: data "
                          f"with the same vocabulary (a model dir with its tokenizer.json for data=text, "
                          f"data.vocab_size={want} for a synthetic task)", field=FIELD)


def init_weights_from(model, model_section: dict) -> None:
    """Load model.init_from's weights into a freshly built model (train(), before fitting)."""
    path = model_section.get("init_from")
    if path:
        load_hf_weights(model, read_hf_state_dict(path))

"""`attnzoo-export RUN_DIR OUT_DIR`: a trained decoder LM as a transformers save_pretrained directory
(attnzoo.interop.hf does the conversion)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from attnzoo.config.errors import ConfigError
from attnzoo.config.paths import check_dir_path
from attnzoo.distributed.checkpoint_files import check_checkpoint_file, is_sharded_checkpoint

# torch, transformers and the model zoo are imported once the command line and the paths were checked (issue 45)


# ----------------------------------------------------------------------------- attnzoo-export


def run_checkpoint(run: str | Path, best: bool = False) -> Path:
    """The checkpoint of a run dir (or the .ckpt / sharded folder given), its path and file checked (no torch)."""
    p = Path(run).expanduser()
    run_dir = p.is_dir() and not is_sharded_checkpoint(p)  # a sharded checkpoint (trainer=fsdp) is a folder too
    ckpt = p / "checkpoints" / ("best.ckpt" if best else "last.ckpt") if run_dir else p
    if not ckpt.exists():
        raise ConfigError(f"{ckpt} does not exist; allowed: a run dir with checkpoints/{'best' if best else 'last'}.ckpt, or a .ckpt "
                          f"file",
                          field="RUN_DIR")
    check_checkpoint_file(ckpt, field="RUN_DIR")
    return ckpt


def load_run_model(run: str | Path, best: bool = False):
    """(DecoderLM in eval mode, its tokenizer or None, the run config) from a run dir or a .ckpt."""
    from attnzoo.config.schema import resolve_model, tagged
    from attnzoo.data import DATAMODULES, build_datamodule
    from attnzoo.interop.hf.archs import _no
    from attnzoo.training.checkpoint_io import check_checkpoint
    from attnzoo.training.families import family_of

    ckpt = run_checkpoint(run, best)
    state = check_checkpoint(ckpt, field="RUN_DIR")
    hp = state.get("hyper_parameters") or {}
    cfg = hp.get("cfg")
    if not isinstance(cfg, dict) or "model" not in cfg:
        raise ConfigError(f"{ckpt} carries no attnzoo run config (hyper_parameters.cfg)", field="RUN_DIR")
    fam = family_of(cfg["model"])
    if not fam.decoder_only:
        raise _no("model.name", f"{cfg['model'].get('name')} ({fam.name} family; exported: decoder-only LMs)")
    tokenizer, vocab = None, hp.get("vocab_size")
    data_cfg = tagged(DATAMODULES, cfg.get("data"), "data", default_name="text")
    if getattr(DATAMODULES.get(data_cfg.name).config_cls, "natural_text", False):  # text / shards: its tokenizer
        dm = build_datamodule(data_cfg, cache_dir=(cfg.get("paths") or {}).get("cache_dir") or "~/.cache/attnzoo",
                              seed=cfg.get("seed", 0))
        dm.setup("validate")
        tokenizer, vocab = dm.tokenizer, dm.vocab_size
    model = fam.build_model(resolve_model(cfg["model"], vocab_size=vocab), vocab)
    weights = {k[len("model."):]: v for k, v in state["state_dict"].items() if k.startswith("model.")}
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise ConfigError(f"{ckpt}: the weights do not fit the config it carries ({str(e).splitlines()[0][:160]})",
                          field="RUN_DIR") from None
    return model.eval(), tokenizer, cfg


def main(argv: Optional[list] = None) -> None:
    ap = argparse.ArgumentParser(prog="attnzoo-export", description="Write a trained decoder LM as a transformers "
                                 "save_pretrained directory (config.json, model.safetensors, tokenizer files).")
    ap.add_argument("run", help="a run directory (its checkpoints/last.ckpt) or a .ckpt file")
    ap.add_argument("out", help="the output directory (AutoModelForCausalLM.from_pretrained(out) reads it)")
    ap.add_argument("--best", action="store_true", help="use checkpoints/best.ckpt")
    args = ap.parse_args(argv)
    try:
        out = Path(args.out).expanduser()
        check_dir_path(out, "OUT_DIR", allowed="a new or empty directory",  # = interop/hf/convert.check_export_dir
                       allowed_under="a path under a writable directory", empty=True)
        run_checkpoint(args.run, args.best)
        model, tokenizer, cfg = load_run_model(args.run, args.best)
        from attnzoo.interop.hf.archs import arch_for
        from attnzoo.interop.hf.convert import export_model

        arch = arch_for(model)
        try:
            export_model(model, out, tokenizer)
        except OSError as e:  # a full disk, a quota, a vanished directory: nothing partial is left (export_model)
            raise ConfigError(f"cannot write {out} ({e.strerror or e}); nothing was written", field="OUT_DIR") from None
        data = (cfg.get("data") or {}).get("name", "text")
        print(f"attnzoo-export: wrote {out} ({arch.cls}, {model.num_params():,} parameters)")
        if tokenizer is None:
            print(f"attnzoo-export: data={data} has no tokenizer (its token ids are the task's own): weights and "
                  f"config only")
    except ConfigError as e:
        print(f"attnzoo-export: error: {e}", file=sys.stderr)
        sys.exit(2)



if __name__ == "__main__":
    main()

"""Bad input: one clear line naming the field and what is allowed, before any work, nothing written.

One case per row of the table in docs/reliability.md."""
import pytest
import torch

from attnzoo.config import ConfigError
from attnzoo.paths import CONF_DIR
from attnzoo.registry import FFNS, MIXERS
from attnzoo.train import check_group_overrides, train
from tests.conftest import compose_cfg

FAST = ["debug=smoke", "data.max_chars=300000", "data.tokenizer=char"]


def _cases(tmp):
    (tmp / "empty.txt").write_text("")
    (tmp / "short.txt").write_text("just a few characters of text\n")
    (tmp / "bad.ckpt").write_bytes(b"PK\x03\x04 truncated")
    cases = [
        ("unknown mixer", ["model.mixer.name=softmaxx"], "model.mixer.name", "allowed: " + ", ".join(MIXERS.names())),
        ("unknown ffn", ["model.ffn.name=glu"], "model.ffn.name", "allowed: " + ", ".join(FFNS.names())),
        ("unknown position", ["model.position.name=alibi"], "model.position.name", "allowed: rope, sinusoidal, learned, none"),
        ("unknown data", ["data.name=imagenet"], "data.name", "allowed:"),
        ("unknown accelerator", ["trainer.accelerator=tpu"], "trainer.accelerator", "allowed:"),
        ("heads", ["model.d_model=30"], "model.d_model", "not divisible by n_heads"),
        ("kv heads", ["model.n_kv_heads=3"], "model.n_kv_heads", "allowed: 1, 2, 4"),
        ("missing corpus", [f"data.path={tmp}/nope.txt"], "data.path", "does not exist"),
        ("empty corpus", [f"data.path={tmp}/empty.txt"], "data.path", "is empty"),
        ("seq_len > data", [f"data.path={tmp}/short.txt", "data.seq_len=64"], "data.seq_len", "too few"),
        ("missing ckpt", [f"ckpt_path={tmp}/none.ckpt"], "ckpt_path", "does not exist"),
        ("corrupt ckpt", [f"ckpt_path={tmp}/bad.ckpt"], "ckpt_path", "corrupt or truncated"),
        ("ckpt last absent", ["ckpt_path=last"], "ckpt_path", "no checkpoint"),
        ("ckpt is a directory", [f"ckpt_path={tmp}"], "ckpt_path", "is a directory"),
        ("one beta", ["optim.betas=[0.9]"], "optim.betas", "two values in [0, 1)"),
        ("negative weight decay", ["optim.weight_decay=-1"], "optim.weight_decay", ">= 0"),
        ("val interval 0", ["trainer.val_check_interval=0"], "trainer.val_check_interval", "allowed:"),
        ("negative val batches", ["trainer.limit_val_batches=-1"], "trainer.limit_val_batches", "allowed:"),
        ("zero devices", ["trainer.devices=0"], "trainer.devices", "allowed:"),
        ("negative clip", ["trainer.gradient_clip_val=-1"], "trainer.gradient_clip_val", "null (no clipping)"),
        ("negative checkpoint interval", ["callbacks.checkpoint_every_n_steps=-1"], "callbacks.checkpoint_every_n_steps", "allowed:"),
        ("unknown monitor", ["callbacks.monitor=val/nosuch"], "callbacks.monitor", "allowed: val/loss, val/ppl"),
        ("negative head_dim", ["model.head_dim=-4"], "model.head_dim", "positive or null"),
        ("zero head_dim", ["model.head_dim=0"], "model.head_dim", "positive or null"),
        ("negative norm eps", ["model.norm.eps=-1"], "model.norm.eps", "positive"),
        ("negative workers", ["data.num_workers=-1"], "data.num_workers", ">= 0"),
        ("context > max_seq_len", ["model.max_seq_len=16"], "data.seq_len", "exceeds model.max_seq_len=16"),
        ("negative warmup", ["scheduler.warmup_steps=-5"], "scheduler.warmup_steps", ">= 0"),
        ("negative lr floor", ["scheduler.min_lr_ratio=-1"], "scheduler.min_lr_ratio", "in [0, 1]"),
        ("misspelt key", ["+model.n_head=4"], "model.n_head", "did you mean model.n_heads?"),
        ("encdec on text", ["model=encdec"], "data", "cannot train on data=text; allowed: reversal, sorting, addition"),
        ("output dir under a file", [f"paths.output_dir={tmp}/empty.txt/run"], "paths.output_dir", "not writable"),
    ]
    if not torch.cuda.is_available():
        cases.append(("gpu without a gpu", ["trainer=gpu"], "trainer.accelerator", "no CUDA device"))
    if "mla" in MIXERS.names():
        cases.append(("mla ranks", ["model/mixer=mla", "model.mixer.kv_lora_rank=0"], "model.layers[0].mixer.kv_lora_rank", ""))
    if "sliding_window" in MIXERS.names():
        cases.append(("window <= 0", ["model/mixer=sliding_window", "model.mixer.window=0"], "model.layers[0].mixer.window", ""))
    if "moe" in FFNS.names():
        cases.append(("top-k > experts", ["model/ffn=moe", "model.ffn.n_experts=4", "model.ffn.top_k=5"], "model.ffn.top_k", ""))
    return cases


CASE_NAMES = [c[0] for c in _cases(__import__("pathlib").Path("/tmp"))]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_bad_input_fails_before_work_with_one_line(case, tmp_path):
    name, overrides, field, phrase = next(c for c in _cases(tmp_path) if c[0] == case)
    out = tmp_path / "run"
    own_out = any(o.startswith("paths.output_dir=") for o in overrides)  # the case names its own output dir
    with pytest.raises(ConfigError) as e:
        train(compose_cfg(FAST + overrides, None if own_out else out))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(field), msg
    assert phrase in msg, msg
    assert not out.exists() or not any(out.iterdir())  # nothing written half-way


@pytest.mark.parametrize("arg,group", [("model/mixer=softmaxx", "model/mixer"), ("trainer=tpu", "trainer"),
                                       ("data=imagenet", "data"), ("model/ffn=swiglu,glu", "model/ffn"),
                                       ("model/position=alibi", "model/position")])
def test_unknown_group_option_is_one_line_listing_choices(arg, group):
    msg = check_group_overrides([arg])
    allowed = ", ".join(sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")))
    assert msg.startswith(f"{group}: unknown option") and msg.endswith("allowed: " + allowed)


def test_valid_group_options_pass():
    assert check_group_overrides(["model/mixer=gqa,mqa", "trainer=cpu", "model.d_model=64", "seed=1"]) is None
    assert check_group_overrides(["logger=[csv,tensorboard]"]) is None  # several options of a group at once
    assert check_group_overrides(["logger=[csv,nosuch]"]).startswith("logger: unknown option 'nosuch'")


def test_several_loggers_at_once(tmp_path):
    """`logger=[tensorboard,wandb]` (Hydra's list syntax) composes both loggers into one run."""
    from attnzoo.validation import validate

    parts = validate(compose_cfg(FAST + ["logger=[tensorboard,wandb]"], tmp_path / "run"))
    assert {"csv", "tensorboard", "wandb"} <= set(parts["logger"])

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
    ]
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
    with pytest.raises(ConfigError) as e:
        train(compose_cfg(FAST + overrides, out))
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

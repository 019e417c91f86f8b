"""experiment=linearize (attnzoo.training.linearize) and text data in an imported model's own tokens.

The teacher is real, not random: a 2-layer GQA model trained by attnzoo for 150 steps on the embedded corpus
(char tokenizer), exported with attnzoo-export (LlamaForCausalLM + tokenizer.json), then imported with
model.init_from. A random-init teacher would make "the student is as good as the teacher" trivially true
(both near ln V)."""
from __future__ import annotations

import csv
import json
import shutil

import pytest
import torch

pytest.importorskip("safetensors")

from attnzoo.cli import export  # noqa: E402
from attnzoo.interop import hf  # noqa: E402
from attnzoo.config.errors import ConfigError  # noqa: E402

from tests.conftest import compose_cfg  # noqa: E402

TEXT = ["data.max_chars=100000", "data.seq_len=64", "data.batch_size=8"]
QUIET = ["perf.measure_decode=false", "sample.max_new_tokens=0", "logger=csv", "callbacks.save_best=false"]
MARGIN = 0.1  # nats: the linearized model's val loss may exceed the teacher's by this much (measured: 0.014)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """(run dir, exported transformers dir) of a tiny char-level model trained 150 steps (~6 s)."""
    from attnzoo.training.run import train

    root = tmp_path_factory.mktemp("teacher")
    run, out = root / "run", root / "hf"
    train(compose_cfg(["debug=smoke", "data.tokenizer=char", *TEXT, "model.n_layers=2", "model.d_model=64",
                       "trainer.max_steps=150", "trainer.val_check_interval=150", "trainer.limit_val_batches=8",
                       "optim.lr=3e-3", "scheduler.warmup_steps=10", *QUIET], run))
    export.main([str(run), str(out)])
    return run, out


def _lin(src, *extra):
    return ["experiment=linearize", f"model.init_from={src}", "debug=smoke", *TEXT, "trainer.limit_val_batches=8",
            *QUIET, *extra]


def one_line(err, field, *needles):
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{field}: "), msg
    for n in needles:
        assert n in msg, msg


def test_linearize_gated_deltanet_matches_its_teacher(teacher, tmp_path, monkeypatch, capsys):
    """Both layers -> Gated DeltaNet through train(): projections copied at step 0, stage-1 MSE falls, the
    teacher is untouched, and the student's val loss ends within MARGIN of the teacher's."""
    import attnzoo
    import attnzoo.training.run as T

    _, src = teacher
    built = {}
    build = T.build_module

    def capture(*a, **k):  # the module train() builds, as it is before the first step
        family, lit = build(*a, **k)
        built.update(lit=lit, student=_copy(lit.model), teacher=_copy(lit.teacher))
        return family, lit

    monkeypatch.setattr(T, "build_module", capture)
    out = tmp_path / "run"
    s1, s2 = 30, 60
    metrics = T.train(compose_cfg(_lin(src, "linearize.mixer=gated_deltanet", f"linearize.stage1_steps={s1}",
                                       f"linearize.stage2_steps={s2}", "linearize.stage1_lr=1e-2",
                                       "trainer.val_check_interval=30", "trainer.max_steps=null"), out))
    lit, s0, t0 = built["lit"], built["student"], built["teacher"]
    assert [m.name for m in lit.model.layer_mixers] == ["gated_deltanet"] * 2 and lit.layers == [0, 1]

    # step 0: q, k, v (k/v heads repeated over their query group), o from the attention; the rest equal
    H, Hkv, D = 4, 2, 16
    for i in lit.layers:
        q, k, v = t0[f"blocks.{i}.mixer.qkv.weight"].split([H * D, Hkv * D, Hkv * D])
        rep = lambda w: w.view(Hkv, D, -1).repeat_interleave(H // Hkv, 0).reshape(H * D, -1)  # noqa: E731
        torch.testing.assert_close(s0[f"blocks.{i}.mixer.qkv.weight"], torch.cat([q, rep(k), rep(v)]), rtol=0, atol=0)
        assert torch.equal(s0[f"blocks.{i}.mixer.o_proj.weight"], t0[f"blocks.{i}.mixer.o_proj.weight"])
    shared = [k for k in t0 if ".mixer." not in k]
    assert shared and all(torch.equal(s0[k], t0[k]) for k in shared)
    assert not torch.equal(lit.model.blocks[0].mixer.o_proj.weight, s0["blocks.0.mixer.o_proj.weight"])  # trained

    # the teacher is frozen: the same weights as before the first step, and as the imported file
    assert all(torch.equal(v, t0[k]) for k, v in lit.teacher.state_dict().items())
    assert not any(p.requires_grad for p in lit.teacher.parameters())

    rows = list(csv.DictReader(open(out / "csv" / "metrics.csv")))
    mse = [float(r["linearize/mse"]) for r in rows if r.get("linearize/mse") and int(r["step"]) < s1]
    assert len(mse) >= s1 - 1 and sum(mse[-3:]) < 0.5 * sum(mse[:3]), mse  # stage 1 (mean of first/last 3 steps)
    assert any(r.get("linearize/mse_layer1") for r in rows) and any(r.get("linearize/kl") for r in rows)
    assert 0 < metrics["linearize/val_kl"] < MARGIN  # held out, what stage 2 minimises
    gap = metrics["val/loss"] - metrics["val/loss_teacher"]
    assert gap < MARGIN, (metrics["val/loss"], metrics["val/loss_teacher"])
    assert metrics["val/loss_teacher"] < 3.0  # a trained teacher (ln 97 = 4.6 at random)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["linearize"]["layers"] == [0, 1]
    assert summary["linearize"]["copied"] == {"0": ["q", "k", "v", "o"], "1": ["q", "k", "v", "o"]}
    assert summary["global_step"] == s1 + s2 and summary["data"]["tokenizer_file"] == str(src / "tokenizer.json")
    printed = capsys.readouterr().out
    assert "encoded with" in printed and "linearize  layers [0, 1] -> gated_deltanet" in printed

    # the run is an ordinary decoder LM: attnzoo.load reads the student (the checkpoint has no teacher)
    ck = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert not any(k.startswith("teacher.") for k in ck["state_dict"])
    run = attnzoo.load(out)
    assert [m.name for m in run.model.layer_mixers] == ["gated_deltanet"] * 2


def _copy(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_text_is_encoded_with_the_imported_tokenizer(teacher, tmp_path):
    """model.init_from + data=text: the corpus in the model's own ids (as the run that trained it encoded it);
    data.tokenizer on the command line is kept; no usable tokenizer and another vocabulary: one line."""
    import attnzoo
    from attnzoo.data import build_datamodule
    from attnzoo.training.run import train
    from attnzoo.training.config_checks import validate

    run_dir, src = teacher
    base = [f"model.init_from={src}", "debug=smoke", *TEXT, *QUIET]
    cfg = hf.apply_init_from(compose_cfg(base, tmp_path / "a"), overrides=[])
    assert cfg.data.tokenizer == "file" and cfg.data.tokenizer_file == str(src / "tokenizer.json")
    assert cfg.data.vocab_size == cfg.model.vocab_size == 97
    dm = build_datamodule(validate(cfg)["data"], cache_dir=cfg.paths.cache_dir)
    dm.setup("fit")
    text = "def fib(n):\n\treturn n if n < 2 else fib(n - 1)  # ✓"
    assert dm.vocab_size == 97 and dm.encode(text) == attnzoo.load(run_dir).encode(text)
    kept = hf.apply_init_from(compose_cfg(base + ["data.tokenizer=char"], tmp_path / "b"),
                              overrides=["data.tokenizer=char"])
    assert kept.data.tokenizer == "char"

    bare = tmp_path / "bare"  # the same model without its tokenizer: the run's own BPE (300) does not fit 97
    shutil.copytree(src, bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(ConfigError) as err:
        train(compose_cfg([f"model.init_from={bare}", "debug=smoke", "data.max_chars=20000", "data.vocab_size=300",
                           *QUIET], tmp_path / "c"))
    one_line(err, "model.init_from", "vocab_size=97 and no tokenizer.json", "300 tokens")
    (bare / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError) as err:
        hf.apply_init_from(compose_cfg([f"model.init_from={bare}", "debug=smoke"], tmp_path / "d"), overrides=[])
    one_line(err, "model.init_from", "tokenizer.json cannot encode the text", "not a HF tokenizers file")


def test_linearize_plans_and_refusals(teacher, tmp_path):
    """Layers from linearize.layers or model.pattern; refused in one line before any work: no init_from, a
    layer out of range, an unknown target mixer, shapes that cannot be copied when copying is required."""
    from attnzoo.training.linearize import apply_linearize
    from attnzoo.training.run import train

    _, src = teacher
    out = tmp_path / "run"

    def planned(*extra, overrides=()):
        return apply_linearize(hf.apply_init_from(compose_cfg(_lin(src, *extra), out), overrides=list(overrides)))

    p = planned("linearize.layers=[1]", "linearize.mixer=deltanet")
    assert list(p.model.pattern) == ["gqa", "deltanet"] and p.model.name == "linearize"
    assert p.model.mixers.deltanet.n_heads == 4 and p.model.mixers.deltanet.head_dim == 16
    # debug=smoke caps every experiment: its 6 steps, the two stages (100 + 100) shortened in proportion
    assert (p.trainer.max_steps, p.linearize.stage1_steps, p.linearize.stage2_steps) == (6, 3, 3)
    p = planned("linearize.layers=[1]", "linearize.mixer=deltanet", "trainer.max_steps=null")
    assert (p.trainer.max_steps, p.linearize.stage1_steps, p.linearize.stage2_steps) == (200, 100, 100)
    p = planned("model.pattern=[gqa,linear_attention]", overrides=["model.pattern=[gqa,linear_attention]"])
    assert list(p.model.pattern) == ["gqa", "linear_attention"]
    assert apply_linearize(hf.apply_init_from(p, overrides=[])) .model == p.model  # a planned run is kept as is
    ok = planned("linearize.copy_weights=where_possible", "+linearize.mixer_options.head_dim=8",
                 "linearize.mixer=deltanet")
    assert ok.model.mixers.deltanet.head_dim == 8

    for extra, field, needles in [
        (["linearize.layers=[0,2]"], "linearize.layers", ["layer 2 is out of range", "0..1"]),
        (["linearize.mixer=mamba"], "linearize.mixer", ["unknown target mixer 'mamba'", "gated_deltanet"]),
        (["model.pattern=[gqa,mla]"], "model.pattern", ["unknown target mixer 'mla'"]),
        (["+linearize.mixer_options.head_dim=8", "linearize.mixer=deltanet"], "linearize.copy_weights",
         ["layer 0: q_proj cannot be copied", "where_possible"]),
    ]:
        with pytest.raises(ConfigError) as err:
            train(compose_cfg(_lin(src, *extra), out))
        one_line(err, field, *needles)
    with pytest.raises(ConfigError) as err:
        train(compose_cfg(["experiment=linearize", "debug=smoke", *QUIET], out))
    one_line(err, "model.init_from", "needs a pretrained model")
    assert not out.exists()


def test_linearize_resumes_with_the_teacher_read_again(teacher, tmp_path):
    """--resume / ckpt_path=last: the checkpoint holds the student only; the teacher comes from model.init_from."""
    from attnzoo.training.run import train

    _, src = teacher
    out = tmp_path / "run"
    base = _lin(src, "linearize.mixer=gated_deltanet", "linearize.stage1_steps=2", "trainer.val_check_interval=2")
    first = train(compose_cfg(base + ["linearize.stage2_steps=2"], out))
    again = train(compose_cfg(base + ["linearize.stage2_steps=4", "ckpt_path=last"], out))
    assert json.loads((out / "summary.json").read_text())["global_step"] == 6
    assert again["val/loss_teacher"] == first["val/loss_teacher"] and again["val/loss"] != first["val/loss"]


def test_a_later_max_steps_caps_both_stages_in_proportion():
    """debug=smoke (or trainer.max_steps=N) after experiment=linearize: the run stops there, both stages shortened
    in proportion, each non-empty stage keeping a step; stages that already fit are kept as given."""
    from attnzoo.training.linearize import fit_stages

    assert fit_stages(100, 100, None) == (100, 100)
    assert fit_stages(100, 100, 6) == (3, 3)
    assert fit_stages(30, 60, 6) == (2, 4)
    assert fit_stages(0, 100, 6) == (0, 6) and fit_stages(100, 0, 6) == (6, 0)
    assert fit_stages(1, 1000, 5) == (1, 4)  # round(5/1001) = 0, but stage 1 had steps
    assert fit_stages(2, 2, 6) == (2, 2)  # fits: unchanged (no stretching)

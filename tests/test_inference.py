"""attnzoo.load / attnzoo-generate / attnzoo-eval on runs trained here: the loaded weights reproduce the
run's own validation numbers, generation streams what greedy decoding gives, bad checkpoints are one line."""
import json

import pytest
import torch

import attnzoo
from attnzoo.inference.generate import eval_main, generate_main
from attnzoo.training.run import train
from tests.conftest import SMALL_TEXT, compose_cfg

TEXT = ["debug=smoke", *SMALL_TEXT, "data.tokenizer=char", "data.seq_len=32", "data.batch_size=8", "optim.lr=3e-3",
        "trainer.max_steps=12", "trainer.val_check_interval=6"]


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("inference") / "run"
    train(compose_cfg(TEXT, out))
    return out


def test_load_reproduces_the_runs_validation(text_run):
    run = attnzoo.load(text_run)
    summary = json.loads((text_run / "summary.json").read_text())
    from attnzoo.inference.generate import evaluate

    got = evaluate(run, run.datamodule.val_dataloader(), max_batches=2)  # debug=smoke: limit_val_batches=2
    assert got["val/loss"] == pytest.approx(summary["metrics"]["val/loss"], rel=1e-5)
    assert run.global_step == 12 and run.config["model"]["d_model"] == 32
    assert run.decode(run.encode("def f(x):")) == "def f(x):"


def test_generate_streams_the_greedy_continuation(text_run, capsys):
    run = attnzoo.load(text_run)
    ids = torch.tensor([run.encode("def ")])
    greedy = run.decode(run.model.generate(ids, 10, temperature=0)[0].tolist())
    generate_main([str(text_run), "def ", "--max-new-tokens", "10", "--temperature", "0"])
    assert capsys.readouterr().out.rstrip("\n") == greedy


def test_generate_a_file_of_prompts(text_run, tmp_path, capsys):
    p = tmp_path / "prompts.txt"
    p.write_text("def \nclass \n")
    generate_main([str(text_run), "--prompts", str(p), "--max-new-tokens", "5", "--seed", "3"])
    out = capsys.readouterr().out
    assert out.count("--- prompt") == 2 and "\nclass " in out


def test_generate_batches_prompts_of_other_lengths(text_run, tmp_path, capsys):
    """Three prompts of other lengths, two at a time (--batch-size 2), greedy: each is its prompt's own greedy
    continuation (rows at their own positions in one static cache)."""
    run = attnzoo.load(text_run)
    prompts = ["def ", "class Foo(object):", "x = 1 + "]
    p = tmp_path / "prompts.txt"
    p.write_text("\n".join(prompts) + "\n")
    generate_main([str(text_run), "--prompts", str(p), "--max-new-tokens", "8", "--temperature", "0", "--batch-size", "2"])
    out = capsys.readouterr().out
    for i, prompt in enumerate(prompts):
        want = run.decode(run.model.generate(torch.tensor([run.encode(prompt)]), 8, temperature=0)[0].tolist())
        assert f"--- prompt {i + 1}: {prompt!r}\n{want}\n" in out


def test_eval_writes_json_with_lengths_and_other_text(text_run, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text("def add(a, b):\n    return a + b\n" * 200)
    eval_main([str(text_run), "--context-lengths", "64", "--max-batches", "2"])
    res = json.loads((text_run / "eval.json").read_text())
    assert {"val/loss", "val/ppl", "val/loss@64", "cache/bytes_at_ctx@64"} <= set(res["metrics"])
    eval_main([str(text_run), "--text", str(other), "--out", str(tmp_path / "o.json")])
    res2 = json.loads((tmp_path / "o.json").read_text())
    assert res2["source"] == str(other) and res2["metrics"]["val/loss"] != res["metrics"]["val/loss"]


def test_eval_of_a_synthetic_run_reports_accuracy(tmp_path):
    out = tmp_path / "mq"
    metrics = train(compose_cfg(["experiment=mqar", "debug=smoke", "trainer.max_steps=6"], out))
    eval_main([str(out), "--max-batches", "2"])  # debug=smoke validates on 2 batches
    res = json.loads((out / "eval.json").read_text())["metrics"]
    assert res["val/acc"] == pytest.approx(metrics["val/acc"], abs=1e-6)


def test_bad_checkpoints_are_one_line(text_run, tmp_path, capsys):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"PK\x03\x04 nope")
    state = torch.load(text_run / "checkpoints" / "last.ckpt", weights_only=True)
    state["hyper_parameters"]["cfg"]["model"]["d_model"] = 64  # weights of another shape than the config says
    torch.save(state, tmp_path / "mismatch.ckpt")
    for path, phrase in [(tmp_path / "nope", "does not exist"), (bad, "corrupt or truncated"),
                         (tmp_path / "mismatch.ckpt", "the weights do not fit the config")]:
        with pytest.raises(SystemExit) as e:
            eval_main([str(path)])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and "\n" not in err and phrase in err, err


def test_stream_writes_whole_characters_where_tokens_split_them(monkeypatch):
    """Byte-level BPE with no merges beyond ASCII: every CJK character is 3 byte tokens, an emoji 4, so most
    tokens end inside a UTF-8 character. The stream holds those bytes back and writes each character whole
    (before: U+FFFD for the incomplete bytes, then nothing more once the text stopped extending it)."""
    from types import SimpleNamespace

    import attnzoo.models.decoding as decode_mod
    from attnzoo.data.tokenizer import BPETokenizer
    from attnzoo.inference.generate import stream
    from attnzoo.models.decoder import DecoderLM
    from tests.conftest import tiny_model_cfg

    tok = BPETokenizer.train("plain ascii text, nothing else " * 20, vocab_size=300)
    want = "a 中文字 🙂 é!"
    ids = tok.encode(want)
    assert len(ids) > len(want) + 8  # the multi-byte characters really are split across tokens
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(1, len(ids)))  # prefixes end mid-character
    script = iter(ids)
    monkeypatch.setattr(decode_mod, "draw", lambda *a, **k: torch.tensor([[next(script)]]))
    model = DecoderLM(tiny_model_cfg("gqa"), vocab_size=tok.vocab_size).eval()
    run = SimpleNamespace(model=model, encode=tok.encode, decode=tok.decode)
    pieces: list[str] = []
    got = stream(run, "plain", len(ids), 1.0, None, None, 0, pieces.append)
    assert got == "".join(pieces) == want
    assert all(p and "\ufffd" not in p for p in pieces), pieces
    assert "中" in pieces and "🙂" in pieces  # written when its last byte came, as one piece

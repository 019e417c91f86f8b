"""Sampling, schedules, optimizer groups and the text data pipeline."""
import math

import pytest
import torch

from attnzoo.config.schema import SchedulerConfig
from attnzoo.data.corpus import load_corpus
from attnzoo.data.text import Blocks, TextDataConfig, TextDataModule
from attnzoo.data.tokenizer import BPETokenizer, CharTokenizer, get_tokenizer
from attnzoo.training.lit_lm import param_groups
from attnzoo.training.schedules import lr_lambda, noam_lr
from attnzoo.models.decoder import DecoderLM, sample_next
from tests.conftest import tiny_model_cfg


def test_sampling_rules():
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    assert sample_next(logits, temperature=0).item() == 2
    g = torch.Generator().manual_seed(0)
    draws = {sample_next(logits, 1.0, top_k=2, generator=g).item() for _ in range(200)}
    assert draws == {2, 3}
    # top_p: probs of [3, 2, 1, 0] logits = .64, .24, .09, .03 -> p=0.7 keeps the top two
    draws = {sample_next(logits, 1.0, top_p=0.7, generator=g).item() for _ in range(300)}
    assert draws == {2, 3}
    draws = {sample_next(logits, 1.0, top_p=0.5, generator=g).item() for _ in range(100)}
    assert draws == {2}


def test_noam_schedule_equals_formula():
    sched = SchedulerConfig(name="noam", warmup_steps=50)
    f = lr_lambda(sched, max_steps=1000, d_model=64)
    peak = noam_lr(50, 64, 50)
    for s in (0, 1, 10, 49, 50, 51, 200, 999):
        assert f(s) * peak == pytest.approx(noam_lr(s + 1, 64, 50), rel=1e-12)
    assert f(49) == pytest.approx(1.0)


def test_cosine_schedule_shape():
    f = lr_lambda(SchedulerConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1), max_steps=110, d_model=8)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)


def test_no_weight_decay_on_norms_biases_embeddings():
    m = DecoderLM(tiny_model_cfg("gqa", ffn={"name": "mlp"}), vocab_size=30)
    decay, no_decay = param_groups(m, 0.1)
    decay_ids = {id(p) for p in decay["params"]}
    names = {id(p): n for n, p in m.named_parameters()}
    assert all(p.dim() == 2 for p in decay["params"])
    assert id(m.embed.weight) not in decay_ids  # tied with the head: counted once, no decay
    assert any("norm" in names[id(p)] for p in no_decay["params"])
    assert any(names[id(p)].endswith("bias") for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(m.parameters()))


def test_tokenizers_roundtrip_and_cache(tmp_path):
    text = "def f(x):\n    return x * 2  # ünïcode\n" * 50
    bpe = get_tokenizer("bpe", text, 300, tmp_path, "abc")
    assert bpe.decode(bpe.encode(text)) == text
    cached = list((tmp_path / "tokenizers").glob("bpe-300-abc.json"))
    assert cached and isinstance(get_tokenizer("bpe", "", 300, tmp_path, "abc"), BPETokenizer)
    char = get_tokenizer("char", text, 0, tmp_path, "abc")
    assert isinstance(char, CharTokenizer) and char.decode(char.encode(text)) == text
    assert char.vocab_size == len(set(text)) + 2


def test_blocks_are_contiguous_shifted_pairs():
    ids = torch.arange(100, dtype=torch.int32)
    ds = Blocks(ids, 9)
    assert len(ds) == 11
    x, y = ds[3]
    assert torch.equal(x, torch.arange(27, 36)) and torch.equal(y, torch.arange(28, 37))


def test_text_datamodule_split_is_deterministic(tmp_path):
    cfg = TextDataConfig(max_chars=60_000, tokenizer="char", seq_len=16, batch_size=4)
    a, b = TextDataModule(cfg, cache_dir=tmp_path), TextDataModule(cfg, cache_dir=tmp_path)
    a.setup(), b.setup()
    assert torch.equal(a.val_ids, b.val_ids) and torch.equal(a.train_ids, b.train_ids)
    assert len(a.val_ids) == max(int(a.info["tokens"] * 0.05), 17)
    assert a.info["source"] == "python-stdlib"
    batch = next(iter(a.train_dataloader()))
    assert batch[0].shape == (4, 16)


def test_user_text_folder_and_missing_path(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 10)
    (tmp_path / "b.md").write_text("# title\n")
    text, source = load_corpus(str(tmp_path), None)
    assert "hello world" in text and "# title" in text
    with pytest.raises(ValueError, match="data.path"):
        load_corpus(str(tmp_path / "nope"), None)

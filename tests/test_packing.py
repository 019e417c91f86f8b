"""Sequence packing with document masks (packing.py, data.packing): a packed batch equals each document alone,
for every mixer, in outputs and gradients; no state or conv tail leaks across a document start."""
from __future__ import annotations

import pytest
import torch

from attnzoo.data.text import DocumentRows, PackedBlocks
from attnzoo.config.errors import ConfigError
from attnzoo.models.decoder import DecoderLM
from attnzoo.ops.packing import Documents, masked_conv
from attnzoo.config.registry import MIXERS
from attnzoo.training.run import train
from attnzoo.training.config_checks import validate
from tests.conftest import SMALL_TEXT, compose_cfg, gap_atol, tiny_model_cfg

LENGTHS = [[5, 12, 3, 20], [1, 30, 9]]  # two rows of 40 tokens, 7 documents (one of a single token)
T = 40


def packed_ids(lengths=LENGTHS, T: int = T) -> torch.Tensor:
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, ls in enumerate(lengths):
        t = 0
        for d, n in enumerate(ls):
            ids[b, t:t + n] = d
            t += n
        ids[b, t:] = len(ls)
    return ids


def test_documents_positions_mask_and_gather_scatter():
    ids = packed_ids()
    docs = Documents(ids)
    pos = docs.positions()
    assert pos[0, :6].tolist() == [0, 1, 2, 3, 4, 0] and pos[1, :3].tolist() == [0, 0, 1]
    mask = docs.mask(causal=True, window=4, sinks=1)[:, 0]
    for b in range(2):
        for i in range(T):
            for j in range(T):
                same = ids[b, i] == ids[b, j]
                want = bool(same and j <= i and (i - j < 4 or pos[b, j] < 1))
                assert bool(mask[b, i, j]) == want, (b, i, j)
    x = torch.randn(2, T, 3)
    g = docs.gather(x)
    assert g.shape == (docs.n_documents, 30, 3) and docs.n_documents == 7
    assert torch.equal(docs.scatter(g), x)
    assert torch.equal(g[0, :5], x[0, :5]) and not g[0, 5:].any()  # zeros after each document's end


def test_masked_conv_never_reads_the_previous_document():
    from attnzoo.mixers.short_conv import ShortConvolution

    torch.manual_seed(0)
    conv = ShortConvolution(6, 4, bias=True, activation="silu").double()
    ids = packed_ids()
    x = torch.randn(2, T, 6, dtype=torch.float64)
    y = masked_conv(conv, x, Documents(ids).positions())
    for b in range(2):
        for d in ids[b].unique():
            sel = (ids[b] == d).nonzero().squeeze(1)
            alone, _ = conv(x[b:b + 1, sel])
            torch.testing.assert_close(y[b, sel], alone[0], rtol=0, atol=1e-14)


CASES = [(name, {}, "rope") for name in MIXERS.names()] + [
    ("sliding_window", {"window": 6, "sink_tokens": 2}, "rope"),
    ("gqa", {}, "alibi"),
    ("gqa", {}, "learned"),
    ("gqa", {"conv_size": 3}, "rope"),
    ("mha", {"causal": False}, "none"),
    ("gated_deltanet", {"n_v_heads": 8, "chunk_size": 8}, "rope"),
    ("linear_attention", {"normalize": False, "feature_map": "identity"}, "none"),
    ("linear_attention", {"chunk_size": 4}, "none"),  # documents over several chunks: segmented prefix sums
    ("deltanet", {"chunk_size": 4}, "none"),
]


def _model(name, extra, pos, impl, **kw):
    torch.manual_seed(0)
    cfg = tiny_model_cfg({"name": name, **extra}, position={"name": pos}, max_seq_len=64, **kw)
    model = DecoderLM(cfg, vocab_size=50).double()
    for m in model.mixers:
        m.impl = impl
    return model


@pytest.fixture(params=["split", "batched"])
def strategy(request, monkeypatch):
    """Both execution strategies: each document by its own call (few documents) and one batched call under the
    mask / over gathered rows (many documents)."""
    import attnzoo.ops.packing as packing

    monkeypatch.setattr(packing, "SPLIT_MAX_DOCUMENTS", 1000 if request.param == "split" else 0)
    return request.param


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("name, extra, pos", CASES, ids=lambda v: str(v) if not isinstance(v, dict) else
                         "-".join(f"{k}{w}" for k, w in v.items()))
def test_a_packed_batch_equals_each_document_alone(name, extra, pos, impl, strategy):
    """Outputs and every parameter gradient (fp64): a loss over the packed batch == the same loss summed over
    each document run alone."""
    model = _model(name, extra, pos, impl)
    ids = packed_ids()
    torch.manual_seed(1)
    x = torch.randint(0, 50, (2, T))
    w = torch.randn(2, T, 50, dtype=torch.float64)  # a random linear loss reaches every output
    out = model(x, documents=Documents(ids))
    (out * w).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for b in range(2):
        for d in ids[b].unique():
            sel = (ids[b] == d).nonzero().squeeze(1)
            alone = model(x[b:b + 1, sel])
            torch.testing.assert_close(out[b, sel], alone[0], rtol=0, atol=1e-12)
            (alone[0] * w[b, sel]).sum().backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(packed_grads[n], p.grad, rtol=1e-10, atol=1e-12, msg=n)


def test_hybrid_stack_packed_equals_alone(strategy):
    cfg = tiny_model_cfg("gqa", n_layers=3, pattern=["gdn", "swa", "attn"],
                         mixers={"gdn": {"name": "gated_deltanet", "chunk_size": 4}, "swa": {"name": "sliding_window", "window": 5},
                                 "attn": {"name": "mla"}}, max_seq_len=64)
    torch.manual_seed(0)
    model = DecoderLM(cfg, vocab_size=50).double()
    ids, x = packed_ids(), torch.randint(0, 50, (2, T))
    out = model(x, documents=Documents(ids))
    for b in range(2):
        for d in ids[b].unique():
            sel = (ids[b] == d).nonzero().squeeze(1)
            torch.testing.assert_close(out[b, sel], model(x[b:b + 1, sel])[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["gated_deltanet", "deltanet", "linear_attention", "gqa"])
def test_no_state_leaks_across_a_document_start(name, strategy):
    """Changing the first document changes nothing in the second (the state and conv tail reset); without the
    document mask it does (the test can see a leak)."""
    model = _model(name, {}, "rope", "fast")
    ids = packed_ids([[10, 30]])
    torch.manual_seed(2)
    x = torch.randint(0, 50, (1, T))
    x2 = x.clone()
    x2[0, :10] = torch.randint(0, 50, (10,))
    docs = Documents(ids)
    torch.testing.assert_close(model(x, documents=docs)[0, 10:], model(x2, documents=docs)[0, 10:], rtol=0, atol=0)
    assert (model(x)[0, 10:] - model(x2)[0, 10:]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["linear_attention", "deltanet", "gated_deltanet"])
def test_a_later_document_is_bit_identical_whatever_came_before_in_fp32(name, strategy):
    """In fp32, with the second document spread over many chunks (chunk_size 4, 30 tokens): its outputs do not
    depend on the first document's numbers even by rounding (a global prefix sum minus its value at the reset
    would leak ~1e-7 relative): bit-identical."""
    torch.manual_seed(0)
    model = DecoderLM(tiny_model_cfg({"name": name, "chunk_size": 4}, position={"name": "none"}, max_seq_len=64),
                      vocab_size=50)
    ids = packed_ids([[10, 30]])
    x = torch.randint(0, 50, (1, T), generator=torch.Generator().manual_seed(2))
    x2 = x.clone()
    x2[0, :10] = torch.randint(0, 50, (10,), generator=torch.Generator().manual_seed(3))
    docs = Documents(ids)
    with torch.no_grad():
        a, b = model(x, documents=docs)[0, 10:], model(x2, documents=docs)[0, 10:]
    assert torch.equal(a, b), (a - b).abs().max()


def test_decoding_with_documents_is_refused():
    model = _model("gqa", {}, "rope", "fast")
    with pytest.raises(ValueError, match="documents .* decode with a cache"):
        model(torch.zeros(1, 4, dtype=torch.long), cache=model.new_cache(1, 8), documents=Documents(torch.zeros(1, 4)))


# ----------------------------------------------------------------------------- data
def _stream():
    ids = torch.arange(100, 160, dtype=torch.int32)
    starts = torch.tensor([0, 7, 19, 20, 41])
    ids[starts] = 0  # separators
    return ids, starts


def test_packed_blocks_mark_each_document_and_cover_the_stream():
    ids, starts = _stream()
    ds = PackedBlocks(ids, starts, 16)
    x, y, loss_mask, token_mask, docs = ds[1]  # stream 16..31: starts 19 and 20 inside
    assert torch.equal(x, ids[16:32].long()) and torch.equal(y, ids[17:33].long())
    assert docs.tolist() == [0, 0, 0] + [1] + [2] * 12 and loss_mask.all() and token_mask.all()
    assert ds[0][4].tolist() == [0] * 7 + [1] * 9


def test_document_rows_predict_the_same_targets_as_packing():
    ids, starts = _stream()
    rows = DocumentRows(ids, starts, 8)
    targets = []
    for i in range(len(rows)):
        x, y, loss_mask, token_mask = rows[i]
        n = int(token_mask.sum())
        assert torch.equal(loss_mask, token_mask)
        assert (int(x[0]) == 0) == (rows.rows[i][0] in starts.tolist())  # a row starts at a separator or continues
        targets += y[:n].tolist()
        assert not token_mask[n:].any()
    assert targets == ids[1:].tolist()  # every token after the first is a target exactly once
    assert [r[1] - r[0] for r in rows.rows] == [7, 8, 4, 1, 8, 8, 5, 8, 8, 2]


def test_loss_on_a_packed_batch_is_the_token_mean_over_documents(tmp_path):
    from attnzoo.training.lit_lm import LitLM

    cfg = {"model": tiny_model_cfg("gated_deltanet"), "trainer": {"max_steps": 1}}
    lit = LitLM(cfg, vocab_size=50).double()  # fp64 model; the loss's cross entropy runs on fp32 logits
    ids = packed_ids()
    torch.manual_seed(3)
    x, y = torch.randint(0, 50, (2, T)), torch.randint(0, 50, (2, T))
    ones = torch.ones(2, T, dtype=torch.bool)
    loss, total, count = lit._loss((x, y, ones, ones, ids))
    ce = []
    for b in range(2):
        for d in ids[b].unique():
            sel = (ids[b] == d).nonzero().squeeze(1)
            logits = lit.model(x[b:b + 1, sel])[0]
            ce.append(torch.nn.functional.cross_entropy(logits, y[b, sel], reduction="sum"))
    want = torch.stack(ce).sum() / (2 * T)  # in fp64
    # the loss's own rounding: its fp32 cross entropy against the fp64 one on the same logits, x FP32_FACTOR
    logits = lit.model(x, documents=Documents(ids)).flatten(0, 1)
    ce = torch.nn.functional.cross_entropy
    atol = gap_atol(ce(logits.float(), y.flatten()), ce(logits, y.flatten()))
    torch.testing.assert_close(loss.double(), want, atol=atol, rtol=0)
    assert lit.tokens_in_batch((x, y, ones, ones, ids)) == 2 * T
    pad = ones.clone()
    pad[1, 30:] = False
    assert lit.tokens_in_batch((x, y, pad, pad)) == 2 * T - 10


# ----------------------------------------------------------------------------- runs and refusals
FAST = ["debug=smoke", *SMALL_TEXT, "data.tokenizer=char", "data.seq_len=64", "data.batch_size=4",
        "perf.measure_decode=false", "sample.max_new_tokens=0", "trainer.max_steps=3"]


@pytest.mark.parametrize("layout", ["data.packing=true", "data.pad_documents=true"])
def test_training_on_documents_end_to_end(layout, tmp_path):
    import json

    from tests.conftest import assert_learns

    train(compose_cfg(FAST + [layout, "model=hybrid_gdn"], tmp_path / "run"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["data"]["documents"] > 1
    assert_learns(tmp_path / "run", falls=False)  # 3 steps validate once: below the uniform loss ln(V)


@pytest.mark.parametrize("overrides, match", [
    (["data.packing=true", "data.pad_documents=true"], r"^data.pad_documents: packing and pad_documents .* allowed"),
    (["data.packing=true", "trainer=ddp_cpu", "trainer.context_parallel=2"],
     r"^data.packing: with trainer.context_parallel > 1: .* allowed: false"),
])
def test_packing_refusals(overrides, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        validate(compose_cfg(FAST + overrides, tmp_path / "run"))


def test_packing_benchmark_quick(tmp_path):
    """`attnzoo-bench packing --quick` writes its table; performance itself is reported, never asserted."""
    import json

    from attnzoo.bench import cli
    from tests.conftest import SESSION_CACHE

    threads = torch.get_num_threads()
    try:
        cli.main(["--out", str(tmp_path), "--threads", "1", "packing", "--quick", "--mixers", "gated_deltanet",
                  "--cache-dir", str(SESSION_CACHE)])
    finally:
        torch.set_num_threads(threads)
    res = json.loads((tmp_path / "packing.json").read_text())
    by = {r["layout"]: r for r in res["rows"]}
    assert set(by) == {"packed", "padded", "stream"} and by["packed"]["padding %"] == 0
    assert by["padded"]["rows/epoch"] > by["packed"]["rows/epoch"] and by["padded"]["padding %"] > 0
    assert all(r["real tokens/s"] > 0 for r in res["rows"]) and by["padded"]["vs padded"] == 1

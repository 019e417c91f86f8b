"""Memory options of the decoder LM's training step: chunked cross-entropy (ops/cross_entropy.py,
trainer.ce_chunk_tokens) against full logits, and activation checkpointing (trainer.activation_checkpointing)
giving the losses, gradients and MoE balancing state of the plain step, alone, in LitLM, under context
parallelism (2 gloo processes) and end to end; refusals."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnzoo.layers import aux_loss as hooks

from attnzoo.layers import moe
from attnzoo.bench.mixers import PeakMemory
from attnzoo.config.schema import ConfigError, ModelConfig, TrainerConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.ops.cross_entropy import chunked_cross_entropy, reference_cross_entropy
from attnzoo.ops.packing import Documents
from attnzoo.training.config_checks import _check_memory, validate
from tests.conftest import SMALL_TEXT, compose_cfg, gap_atol, tiny_model_cfg

V = 37


def _ce_inputs(dtype=torch.float64, N=(2, 13), d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*N, d, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(V, d, generator=g, dtype=dtype, requires_grad=True)
    t = torch.randint(0, V, N, generator=g)
    t[0, 3] = t[1, 0] = -100  # ignored positions
    return h, w, t, g


def _mask(kind: str, shape, g):
    if kind == "none":
        return None
    if kind == "bool":
        return torch.rand(shape, generator=g) > 0.3
    return torch.rand(shape, generator=g, dtype=torch.float64)  # token weights


# ----------------------------------------------------------------------------- chunked cross-entropy
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize("chunk", [1, 5, 26, 64], ids=lambda c: f"C{c}")  # 26 tokens: 5 does not divide, 64 > all
def test_chunked_ce_equals_full_logits_fp64(chunk, mask_kind):
    h, w, t, g = _ce_inputs()
    mask = _mask(mask_kind, t.shape, g)
    scale = 1.7  # any upstream gradient (e.g. 1 / count)
    got = chunked_cross_entropy(h, w, t, mask, chunk_tokens=chunk)
    got_grads = torch.autograd.grad(got * scale, (h, w))
    ref = reference_cross_entropy(h, w, t, mask)
    ref_grads = torch.autograd.grad(ref * scale, (h, w))
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert got_grads[0][0, 3].abs().max() == 0  # an ignored position gets no gradient


def test_chunked_ce_with_tied_embeddings_sums_both_gradients():
    """The head weight is the embedding table: its gradient is the lookup's plus the loss's."""
    g = torch.Generator().manual_seed(1)
    emb = torch.nn.Embedding(V, 8).double()
    idx, t = torch.randint(0, V, (3, 11), generator=g), torch.randint(0, V, (3, 11), generator=g)
    grads = []
    for fn in (lambda h: chunked_cross_entropy(h, emb.weight, t, chunk_tokens=4),
               lambda h: reference_cross_entropy(h, emb.weight, t)):
        emb.zero_grad(set_to_none=True)
        fn(torch.tanh(emb(idx))).backward()
        grads.append(emb.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)


def test_chunked_ce_under_bf16_autocast_is_the_linear_head_with_an_fp32_softmax():
    h, w, t, g = _ce_inputs(torch.float32)
    mask = _mask("bool", t.shape, g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunked_cross_entropy(h, w, t, mask, chunk_tokens=7)
        ref = reference_cross_entropy(h, w, t, mask)  # nn.Linear under autocast: bf16 logits, then fp32
    assert got.dtype == ref.dtype == torch.float32
    got_grads, ref_grads = torch.autograd.grad(got, (h, w)), torch.autograd.grad(ref, (h, w))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)  # the same bf16 logits, the same fp32 softmax
    for a, b in zip(got_grads, ref_grads):
        assert a.dtype == b.dtype == torch.float32
        # bf16 products; the weight gradient summed over chunks in fp32 (the reference rounds the whole sum to bf16)
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))


def test_chunked_ce_never_holds_the_full_logits():
    N, d, vocab, chunk = 512, 16, 4096, 64
    h = torch.randn(N, d, requires_grad=True)
    w = torch.randn(vocab, d, requires_grad=True)
    t = torch.randint(0, vocab, (N,))
    full = N * vocab * 4
    peaks = {}
    for name, fn in (("chunked", lambda: chunked_cross_entropy(h, w, t, chunk_tokens=chunk)),
                     ("full", lambda: reference_cross_entropy(h, w, t))):
        with PeakMemory() as pm:
            fn().backward()
        peaks[name] = pm.peak
        h.grad = w.grad = None
    assert peaks["full"] >= 2 * full  # logits and their gradient
    # one chunk's fp32 logits (+ its bf16/copy and index temporaries) and the two gradients, never N x V
    assert peaks["chunked"] < 3 * chunk * vocab * 4 + 2 * (N * d + vocab * d) * 4 < full / 2


def test_chunked_ce_without_gradients_computes_the_loss_only():
    h, w, t, _ = _ce_inputs()
    with torch.no_grad():
        got = chunked_cross_entropy(h, w, t, chunk_tokens=5)
    assert not got.requires_grad
    torch.testing.assert_close(got, reference_cross_entropy(h, w, t).detach(), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- activation checkpointing
MOE = {"name": "moe", "n_experts": 4, "top_k": 2, "d_ff": 16, "bias_update_speed": 0.01}
CASES = {
    "gqa": tiny_model_cfg("gqa"),
    "gdn-hybrid": tiny_model_cfg("gqa", pattern=["gdn", "attn"], mixers={"gdn": {"name": "gated_deltanet", "chunk_size": 4},
                                                                         "attn": {"name": "gqa"}}),
    # aux loss + z-loss + aux-loss-free bias; post-norm so that the recomputation reaches the balancing
    "moe": tiny_model_cfg("gqa", ffn=MOE, norm_position="post"),
    "dropout-moe": tiny_model_cfg("gqa", ffn=MOE, dropout=0.1),
    "packed-gdn-hybrid": tiny_model_cfg("gqa", pattern=["gdn", "attn"], dropout=0.1,
                                        mixers={"gdn": {"name": "gated_deltanet", "chunk_size": 4}, "attn": {"name": "gqa"}}),
}


def _batch(T: int = 16, B: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    token_mask = torch.ones(B, T, dtype=torch.bool)
    token_mask[1, -3:] = False  # padding: balancing ignores it
    return x, y, token_mask


def _step(model: DecoderLM, checkpointing: bool, x, y, token_mask, documents=None) -> dict:
    """One training step's forward + backward (fp64 loss + aux) and what it leaves behind."""
    model.activation_checkpointing = checkpointing
    model.zero_grad(set_to_none=True)
    routed = [b.ffn for b in model.blocks if isinstance(b.ffn, moe.MoE)]
    for m in routed:
        m._load_acc.zero_()
    saved = []
    torch.manual_seed(7)  # the dropout masks
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
        logits = model(x, token_mask=token_mask, documents=documents)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
        loss = (loss * token_mask.flatten()).sum() / token_mask.sum()
        aux = model.aux_loss()
    (loss if aux is None else loss + aux).backward()
    out = {"loss": loss.detach(), "aux": None if aux is None else aux.detach(), "saved": len(saved),
           "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
           "stats": model.stats(), "load": [m._load_acc.clone() for m in routed]}
    model.after_optimizer_step()  # aux-loss-free bias update from the accumulated load
    out["bias"] = [m.expert_bias.clone() for m in routed]
    for m in routed:
        m.expert_bias.zero_()
    return out


@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "full-recompute"])
@pytest.mark.parametrize("case", list(CASES))
def test_activation_checkpointing_gives_the_plain_step(case, early_stop):
    """Loss, every gradient, MoE aux loss, stats, accumulated load and bias update equal (fp64) with and without
    checkpointing; fewer tensors saved outside the checkpointed blocks. The MoE's grouped_mm probe runs inside
    the first checkpointed forward (it used to leave tensors the recomputation did not make)."""
    torch.manual_seed(0)
    model = DecoderLM(CASES[case], vocab_size=V).double().train()
    x, y, token_mask = _batch()
    documents = None
    if case.startswith("packed"):
        documents = Documents(torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 7]))
    moe._GROUPED_MM_OK.clear()
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        ckpt = _step(model, True, x, y, token_mask, documents)
        plain = _step(model, False, x, y, token_mask, documents)
    assert ckpt["saved"] < plain["saved"]
    torch.testing.assert_close(ckpt["loss"], plain["loss"], rtol=1e-12, atol=1e-12)
    assert set(ckpt["grads"]) == set(plain["grads"])
    for n, g in plain["grads"].items():
        torch.testing.assert_close(ckpt["grads"][n], g, rtol=1e-10, atol=1e-12, msg=n)
    if "moe" in case:
        torch.testing.assert_close(ckpt["aux"], plain["aux"], rtol=1e-12, atol=1e-12)
        assert ckpt["stats"].keys() == plain["stats"].keys() and plain["stats"]
        for k, v in plain["stats"].items():
            torch.testing.assert_close(ckpt["stats"][k], v, msg=k)
        for a, b in zip(ckpt["load"], plain["load"]):
            assert torch.equal(a, b)  # counted once: the recomputation left the accumulator alone
            assert a.sum() == 2 * token_mask.sum()  # top-2 of the real tokens
        for a, b in zip(ckpt["bias"], plain["bias"]):
            assert torch.equal(a, b) and a.abs().sum() > 0
    assert not hooks.recomputing()


def test_checkpointing_only_while_training_with_gradients():
    torch.manual_seed(0)
    model = DecoderLM(CASES["gqa"], vocab_size=V).double()
    model.activation_checkpointing = True
    x = _batch()[0]
    model.eval()
    ref = model(x)
    with torch.no_grad():
        model.train()
        torch.testing.assert_close(model(x), ref.detach())
    cache = model.new_cache(2, 20, torch.float64)
    torch.testing.assert_close(model(x, cache=cache), ref)  # with a cache: the plain path


def test_compiled_checkpointed_model_gives_the_eager_gradients():
    """compile=true + activation checkpointing (dense model; aot_eager traces dynamo + AOTAutograd in seconds)."""
    torch.manual_seed(0)
    model = DecoderLM(CASES["gqa"], vocab_size=V).double().train()  # compiled and eager compared in fp64
    x = _batch()[0]
    model(x).square().mean().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.activation_checkpointing = True
    torch._dynamo.reset()
    try:
        torch.compile(model, backend="aot_eager")(x).square().mean().backward()
    finally:
        torch._dynamo.reset()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=0, atol=1e-10, msg=n)


# ----------------------------------------------------------------------------- LitLM: both options
def test_lit_training_step_with_both_options_equals_the_plain_one():
    from attnzoo.training.lit_lm import LitLM

    model_cfg = tiny_model_cfg("gqa", ffn=MOE, tie_embeddings=True)
    mods = {}
    for name, trainer in (("plain", {}), ("memory", {"activation_checkpointing": True, "ce_chunk_tokens": 7}),
                          ("plain64", {})):
        torch.manual_seed(0)
        mods[name] = LitLM({"model": model_cfg, "trainer": trainer}, vocab_size=V)
        mods[name].log = lambda *a, **k: None
    mods["plain64"].double()  # the plain step's own fp32-vs-fp64 gap sets the tolerance
    assert mods["memory"].model.activation_checkpointing and mods["memory"].ce_chunk_tokens == 7
    x, y, token_mask = _batch()
    loss_mask = token_mask.clone()
    loss_mask[0, :4] = False  # e.g. a synthetic task's answer positions
    out = {}
    for name, lit in mods.items():
        lit.train()
        loss = lit.training_step((x, y, loss_mask, token_mask), 0)
        loss.backward()
        out[name] = (loss.detach(), {n: p.grad for n, p in lit.named_parameters() if p.grad is not None},
                     [b.ffn._load_acc.clone() for b in lit.model.blocks])
        # validation keeps the full logits (accuracy) and the same loss
        _, total, count, logits = lit._loss((x, y, loss_mask, token_mask), return_logits=True)
        assert logits.shape == (2, 16, V)
    # fp32 (the plain loss is computed from fp32 logits even in an fp64 model): FP32_FACTOR x that gap
    loss_atol = gap_atol(out["plain"][0], out["plain64"][0])
    torch.testing.assert_close(out["memory"][0], out["plain"][0], atol=loss_atol, rtol=0)
    for n, g in out["plain"][1].items():
        torch.testing.assert_close(out["memory"][1][n], g, atol=gap_atol(g, out["plain64"][1][n]), rtol=0, msg=n)
    assert all(torch.equal(a, b) for a, b in zip(out["memory"][2], out["plain"][2]))


# ----------------------------------------------------------------------------- context parallelism (2 processes)
def _cp_worker(rank: int, world: int, port: int, out_path: str) -> None:
    import torch.distributed as dist

    from attnzoo.bench.context_parallel import _init
    from attnzoo.distributed.context_parallel import ContextParallel, check_layout, sharded

    _init(rank, world, port, 1)
    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    model = DecoderLM(CASES["gdn-hybrid"], vocab_size=V).double().train()
    x, y, _ = _batch(T=32)
    mask = torch.rand(x.shape, generator=torch.Generator().manual_seed(3)) > 0.2
    ref = reference_cross_entropy(model.hidden_states(x), model.lm_head.weight, y, mask) / mask.sum()
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    lay = check_layout(32, world, "zigzag", 3)
    model.activation_checkpointing = True
    with sharded(ContextParallel(group, lay)):
        h = model.hidden_states(lay.shard(x, rank), positions=lay.positions(rank))
    total = chunked_cross_entropy(h, model.lm_head.weight, lay.shard(y, rank), lay.shard(mask, rank), chunk_tokens=5)
    (total / mask.sum()).backward()
    loss = total.detach().clone()
    dist.all_reduce(loss, group=group)
    err = float((loss / mask.sum() - ref).abs())
    for n, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        err = max(err, float((g - ref_grads[n]).abs().max()))
    if rank == 0:
        Path(out_path).write_text(json.dumps({"err": err}))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow  # starts 2 worker processes (~8-12 s on 2 busy cores)
def test_context_parallel_with_checkpointing_and_chunked_ce_equals_one_process(tmp_path):
    """The recomputation re-enters the forward's context-parallel group: the ring and the state passing run again
    sharded in backward; chunked cross-entropy on each rank's shard sums to the whole sequence's loss."""
    import torch.multiprocessing as mp

    from attnzoo.bench.context_parallel import _free_port

    out = tmp_path / "cp.json"
    mp.spawn(_cp_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    assert json.loads(out.read_text())["err"] < 1e-10


# ----------------------------------------------------------------------------- end to end and refusals
FAST = ["debug=smoke", *SMALL_TEXT, "data.tokenizer=char", "data.seq_len=32", "data.batch_size=4",
        "perf.measure_decode=false", "sample.max_new_tokens=0", "trainer.max_steps=4", "trainer.log_every_n_steps=1",
        "model/ffn=moe", "model.ffn.bias_update_speed=0.01", "model.dropout=0.1"]


def _losses(run_dir: Path) -> dict:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


def test_training_with_both_options_logs_the_plain_losses(tmp_path):
    from attnzoo.training.run import train

    plain = train(compose_cfg(FAST, tmp_path / "plain"))
    memory = train(compose_cfg(FAST + ["trainer.activation_checkpointing=true", "trainer.ce_chunk_tokens=24"],
                               tmp_path / "memory"))
    a, b = _losses(tmp_path / "plain"), _losses(tmp_path / "memory")
    assert sorted(a) == sorted(b) and len(a) >= 3
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5, (step, a[step], b[step])
    assert abs(plain["val/loss"] - memory["val/loss"]) <= 1e-5


@pytest.mark.parametrize("overrides, match", [
    (["trainer.ce_chunk_tokens=-1"], r"^trainer.ce_chunk_tokens: got -1; allowed: 0 \(full logits\) or the tokens per chunk"),
    (["model=encdec", "data=reversal", "trainer.activation_checkpointing=true"],
     r"^trainer.activation_checkpointing: is not available for model=encdec \(encdec family\): .*allowed: false"),
    (["model=vit", "data=digits", "trainer.ce_chunk_tokens=64"],
     r"^trainer.ce_chunk_tokens: is not available for model=vit \(vision family\): .*allowed: 0"),
    (["compile=true", "model/ffn=moe", "trainer.activation_checkpointing=true"],
     r"^trainer.activation_checkpointing: with compile=true and model/ffn=moe: .*allowed: false, or compile=false"),
    (["trainer=ddp_cpu", "trainer.context_parallel=2", "compile=true", "trainer.activation_checkpointing=true"],
     r"^trainer.activation_checkpointing: with compile=true and trainer.context_parallel > 1"),
], ids=["negative-chunk", "encdec", "vit", "compile-moe", "compile-cp"])
def test_refusals_are_one_line(overrides, match, tmp_path):
    with pytest.raises(ConfigError, match=match) as e:
        text = [] if any(o.startswith("data=") for o in overrides) else [*SMALL_TEXT, "data.tokenizer=char"]
        validate(compose_cfg(["debug=smoke", *text, *overrides], tmp_path / "run"))
    assert "\n" not in str(e.value)


def test_linearize_refuses_chunked_ce():
    with pytest.raises(ConfigError, match=r"^trainer.ce_chunk_tokens: .*linearize family.*full logits.*allowed: 0"):
        _check_memory(type("Run", (), {"trainer": TrainerConfig(ce_chunk_tokens=8), "compile": False})(),
                      ModelConfig(name="linearize"))
    _check_memory(type("Run", (), {"trainer": TrainerConfig(activation_checkpointing=True), "compile": False})(),
                  ModelConfig(name="linearize"))  # the student's blocks checkpoint like any decoder's


def test_memory_bench_quick(tmp_path):
    """`attnzoo-bench memory --quick --in-process`: the four configurations, the same loss, less memory with either
    option (performance is reported, never asserted)."""
    from tests.test_bench import positive, run_bench

    res = run_bench(tmp_path, "memory", "--quick", "--in-process")
    rows = {r["config"]: r for r in res["rows"]}
    assert list(rows) == ["baseline", "activation checkpointing", "chunked CE", "both"]
    assert all(positive(r["tokens/s"]) and positive(r["peak MiB (tensors)"]) for r in rows.values())
    assert len({round(r["loss"], 5) for r in rows.values()}) == 1
    assert rows["both"]["peak MiB (tensors)"] < min(rows[c]["peak MiB (tensors)"] for c in ("activation checkpointing",
                                                                                            "chunked CE"))
    assert rows["chunked CE"]["peak MiB (tensors)"] < rows["baseline"]["peak MiB (tensors)"]

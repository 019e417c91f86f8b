"""MoE FFN: dispatch vs the dense reference, balancing losses, aux-loss-free bias, HF parity, in the LM.
Tolerances: two forms of ours compare in fp64; the fp32-only _grouped_mm path and transformers' blocks (their
routers compute in fp32) within FP32_FACTOR x the same computation's fp32-vs-fp64 gap (conftest.gap_atol)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from attnzoo.config.schema import ConfigError, resolve_model
from attnzoo.layers.ffn import MLP, MLPConfig, SwiGLU, SwiGLUConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.layers.moe import MoE, MoEConfig, grouped_mm_works
from tests.conftest import gap_atol

CONF = Path(__file__).resolve().parents[1] / "conf"
D = 32


def make_moe(d_model: int = D, dtype=torch.float32, seed: int = 0, **kw) -> MoE:
    """A MoE with O(1) weights (the 0.02 init makes every output tiny and every test too easy)."""
    torch.manual_seed(seed)
    m = MoE(MoEConfig(**kw), d_model).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.3)
    return m


def fp64_copy(m: MoE) -> MoE:
    """The same MoE (weights, balancing state, impl) in fp64; the router still scores in fp32 (MoE.route)."""
    m64 = MoE(m.cfg, m.router.in_features).double()
    m64.load_state_dict(m.state_dict())
    m64.impl = m.impl
    return m64.train(m.training)


def fwd_bwd(m: MoE, x: torch.Tensor, g: torch.Tensor, mask=None):
    x = x.detach().clone().requires_grad_(True)
    m.zero_grad()
    y = m(x, token_mask=mask)
    (y * g).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


# ----------------------------------------------------------------------------- one expert = dense FFN


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("expert_type", ["swiglu", "mlp"])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_one_expert_top1_equals_dense_ffn(expert_type, scoring, impl):
    m = make_moe(n_experts=1, top_k=1, d_ff=48, expert_type=expert_type, scoring=scoring, dtype=torch.float64)
    m.impl = impl
    if expert_type == "swiglu":
        dense = SwiGLU(SwiGLUConfig(d_ff=48), D).double()
        dense.gate_up.weight.data.copy_(m.w_up[0].T)
    else:
        dense = MLP(MLPConfig(d_ff=48, bias=False), D).double()
        dense.up.weight.data.copy_(m.w_up[0].T)
    dense.down.weight.data.copy_(m.w_down[0].T)
    x = torch.randn(2, 7, D, dtype=torch.float64)
    torch.testing.assert_close(m(x), dense(x), atol=1e-12, rtol=1e-12)


# ----------------------------------------------------------------------------- dispatch vs dense reference

DISPATCH_CASES = {
    "E8-K2-softmax": dict(n_experts=8, top_k=2),
    "E8-K1-softmax-nonorm": dict(n_experts=8, top_k=1, norm_topk_prob=False),
    "E16-K4-sigmoid-group4of2-scale2.5": dict(
        n_experts=16, top_k=4, scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5
    ),
    "E8-K2-mlp-shared2": dict(n_experts=8, top_k=2, expert_type="mlp", n_shared_experts=2),
    "E4-K2-sharedgate": dict(n_experts=4, top_k=2, shared_d_ff=24, shared_expert_gate=True),
    "E8-K2-capacity1.0": dict(n_experts=8, top_k=2, capacity_factor=1.0),
    "E4-K1-capacity0.5": dict(n_experts=4, top_k=1, capacity_factor=0.5),
}


@pytest.mark.parametrize("dispatch", ["grouped_mm", "loop"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("case", list(DISPATCH_CASES), ids=list(DISPATCH_CASES))
def test_dispatch_matches_dense_reference(case, masked, dispatch):
    """The loop in fp64 against the reference in fp64 (1e-12); _grouped_mm (fp32 / bf16 only) in fp32 against
    the reference in fp32, within FP32_FACTOR x the reference's own fp32-vs-fp64 gap."""
    if dispatch == "grouped_mm" and not grouped_mm_works(torch.device("cpu"), torch.float32):
        pytest.skip("torch._grouped_mm unavailable on this CPU build")
    m = make_moe(d_ff=16, dispatch=dispatch, **DISPATCH_CASES[case])
    torch.manual_seed(1)
    x, g = torch.randn(3, 11, D), torch.randn(3, 11, D)
    mask = (torch.rand(3, 11) > 0.3) if masked else None
    fp32 = dispatch == "grouped_mm"
    if not fp32:
        m, x, g = m.double(), x.double(), g.double()
    y, gx, gp = fwd_bwd(m, x, g, mask)
    stats = m.stats()
    m.impl = "reference"
    y_ref, gx_ref, gp_ref = fwd_bwd(m, x, g, mask)
    if fp32:
        y64, gx64, gp64 = fwd_bwd(fp64_copy(m), x.double(), g.double(), mask)
        tol = lambda ref, ref64: dict(atol=gap_atol(ref, ref64), rtol=0)  # noqa: E731
    else:
        y64, gx64, gp64 = y_ref, gx_ref, gp_ref
        tol = lambda ref, ref64: dict(atol=1e-12, rtol=1e-12)  # noqa: E731
    assert y.abs().max() > 0.1  # a real output, not a vanishing one
    torch.testing.assert_close(y, y_ref, **tol(y_ref, y64))
    torch.testing.assert_close(gx, gx_ref, **tol(gx_ref, gx64))
    assert gp.keys() == gp_ref.keys() and {"router.weight", "w_up", "w_down"} <= gp.keys()
    # the parameter gradient as one vector sets its tolerance: with top-1 renormalised weights the router's gradient
    # is zero up to rounding, and its own size says nothing about how far a wrong gradient would be
    flat = lambda grads: torch.cat([grads[n].flatten() for n in sorted(grads)])  # noqa: E731
    gp_tol = tol(flat(gp_ref), flat(gp64))
    for name in gp:
        torch.testing.assert_close(gp[name], gp_ref[name], **gp_tol, msg=name)
    for k, v in m.stats().items():  # the two forms route identically
        torch.testing.assert_close(v, stats[k], msg=k)


def test_dispatch_matches_reference_fp64():
    """fp64 (not a _grouped_mm dtype: `auto` falls back to the loop) against the reference, tightly."""
    m = make_moe(dtype=torch.float64, n_experts=8, top_k=3, d_ff=20, n_shared_experts=1)
    x, g = torch.randn(2, 9, D, dtype=torch.float64), torch.randn(2, 9, D, dtype=torch.float64)
    y, gx, gp = fwd_bwd(m, x, g)
    m.impl = "reference"
    y_ref, gx_ref, gp_ref = fwd_bwd(m, x, g)
    torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(gx, gx_ref, atol=1e-12, rtol=1e-12)
    for name in gp:
        torch.testing.assert_close(gp[name], gp_ref[name], atol=1e-12, rtol=1e-12, msg=name)


def test_never_computes_all_experts():
    """The fast dropless form runs each expert on its own rows only: N*K rows in total, not N*E."""
    m = make_moe(n_experts=16, top_k=2, d_ff=16)
    seen = []
    orig = m.experts_sorted
    m.experts_sorted = lambda xs, counts: (seen.append((xs.shape[0], int(counts.sum()))), orig(xs, counts))[1]
    m(torch.randn(2, 5, D))
    assert seen == [(2 * 5 * 2, 2 * 5 * 2)]


def test_bf16_autocast_runs_close_to_fp32():
    m = make_moe(n_experts=8, top_k=2, d_ff=16, n_shared_experts=1)
    x = torch.randn(2, 8, D)
    y32 = m(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16 = m(x)
    assert y16.dtype == torch.float32  # the residual stream keeps its dtype
    assert (y16 - y32).norm() / y32.norm() < 0.05


def test_bf16_model_keeps_the_balancing_bias_fp32():
    m = make_moe(n_experts=4, top_k=2, d_ff=16, bias_update_speed=1e-3).train().to(torch.bfloat16)
    assert m.w_up.dtype == torch.bfloat16 and m.expert_bias.dtype == torch.float32
    with torch.no_grad():
        m.expert_bias.fill_(1.0)  # bf16 spacing at 1.0 is 2^-7: a 1e-3 step would be lost
    m(torch.randn(2, 8, D, dtype=torch.bfloat16))
    m.after_optimizer_step()
    assert (m.expert_bias - 1.0).abs().max().item() == pytest.approx(1e-3, rel=1e-3)


# ----------------------------------------------------------------------------- capacity


def test_capacity_drops_overflow_and_padding_first():
    """E=2, K=1, every token to expert 0, cf=1 -> C=ceil(1*4*1/2)=2 rows. Token 0 is padding: it is
    dropped first, then the latest real token; dropped tokens get no routed output."""
    m = make_moe(n_experts=2, top_k=1, d_ff=16, capacity_factor=1.0, dtype=torch.float64)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[0, 0] = 10.0
    x = torch.randn(1, 4, D, dtype=torch.float64)
    x[..., 0] = 1.0  # logits (10, 0): expert 0 for all
    mask = torch.tensor([[False, True, True, True]])
    y = m(x, token_mask=mask)
    dense_e0 = m._act(x[0] @ m.w_up[0]) @ m.w_down[0]
    w0 = 1.0  # top-1 renormalised
    torch.testing.assert_close(y[0, 1:3], w0 * dense_e0[1:3], atol=1e-12, rtol=1e-12)
    assert torch.equal(y[0, 0], torch.zeros_like(y[0, 0])) and torch.equal(y[0, 3], torch.zeros_like(y[0, 3]))
    assert m.stats()["moe/dropped_frac"].item() == pytest.approx(1 / 3)  # 1 of 3 real tokens
    assert m.stats()["moe/load_max_over_mean"].item() == pytest.approx(2.0)


# ----------------------------------------------------------------------------- aux losses by hand


def _hand_router(logits_rows):
    """A MoE whose router logits equal the given rows: d = E, router = identity, x = logits."""
    E = len(logits_rows[0])
    m = make_moe(d_model=E, n_experts=E, top_k=1, d_ff=4, multiple_of=1)
    with torch.no_grad():
        m.router.weight.copy_(torch.eye(E))
    return m, torch.tensor([logits_rows], dtype=torch.float32)


@pytest.mark.parametrize("masked", [False, True], ids=["all", "last-is-padding"])
def test_aux_and_z_loss_hand_example(masked):
    rows = [[2.0, 0.0], [1.0, 0.0], [0.0, 1.0], [3.0, 0.0]]
    m, x = _hand_router(rows)
    mask = torch.tensor([[True, True, True, not masked]])
    m(x, token_mask=mask)
    real = rows[:3] if masked else rows
    n = len(real)
    p0 = [1 / (1 + math.exp(r[1] - r[0])) for r in real]  # softmax prob of expert 0
    f0 = sum(r[0] > r[1] for r in real) / n  # top-1 -> fraction of tokens routed to expert 0
    P0 = sum(p0) / n
    aux = 2 * (f0 * P0 + (1 - f0) * (1 - P0))
    z = sum(math.log(math.exp(r[0]) + math.exp(r[1])) ** 2 for r in real) / n
    s = m.stats()
    assert s["moe/aux_loss"].item() == pytest.approx(aux, rel=1e-6)  # all: 2*(.75*.70835+.25*.29165)=1.2083
    assert s["moe/z_loss"].item() == pytest.approx(z, rel=1e-6)
    assert m.aux_loss.item() == pytest.approx(0.01 * aux + 1e-3 * z, rel=1e-6)
    load = [sum(r[0] > r[1] for r in real), sum(r[0] <= r[1] for r in real)]
    assert s["moe/load_max_over_mean"].item() == pytest.approx(max(load) / (sum(load) / 2))
    ent = sum(-(p * math.log(p) + (1 - p) * math.log(1 - p)) for p in p0) / n
    assert s["moe/routing_entropy"].item() == pytest.approx(ent, rel=1e-6)


def test_aux_loss_matches_transformers_formula():
    """HF's load_balancing_loss_func (Mixtral) sums f over K slots (=K when balanced); ours is / K."""
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    m = make_moe(n_experts=8, top_k=2, d_ff=16)
    x = torch.randn(2, 16, D)
    mask = torch.rand(2, 16) > 0.25
    m(x, token_mask=mask)
    aux = m.stats()["moe/aux_loss"]
    m64 = fp64_copy(m)
    m64(x.double(), token_mask=mask)
    logits = m.router(x.view(-1, D))
    hf = mixtral.load_balancing_loss_func((logits,), 8, 2, mask.long())  # casts to fp32 inside
    torch.testing.assert_close(aux, hf / 2, atol=gap_atol(aux, m64.stats()["moe/aux_loss"]), rtol=0)


def test_disabled_losses_leave_no_aux_loss():
    m = make_moe(n_experts=4, top_k=2, d_ff=16, aux_loss_coef=0.0, z_loss_coef=0.0)
    m(torch.randn(1, 5, D))
    assert m.aux_loss is None
    assert m.stats()["moe/aux_loss"] > 0  # still reported


# ----------------------------------------------------------------------------- the loss the optimiser sees


def tiny_lm_cfg(**ffn):
    node = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "default.yaml"))
    node.pop("defaults")
    node.update(d_model=D, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61)
    node["mixer"] = {"name": "gqa"}
    node["ffn"] = {**OmegaConf.to_container(OmegaConf.load(CONF / "model" / "ffn" / "moe.yaml")), "d_ff": 16, **ffn}
    return node


def test_aux_loss_reaches_the_training_loss():
    torch.manual_seed(0)
    model = DecoderLM(tiny_lm_cfg(n_experts=4, top_k=2))
    idx = torch.randint(0, 61, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 8:] = False

    def router_grad(with_aux: bool):
        model.zero_grad()
        logits = model(idx, token_mask=mask)
        loss = F.cross_entropy(logits.view(-1, 61), idx.view(-1))
        aux = model.aux_loss()
        assert aux is not None and aux.item() > 0 and aux.requires_grad
        (loss + aux if with_aux else loss).backward()
        return model.blocks[0].ffn.router.weight.grad.clone()

    g_with, g_without = router_grad(True), router_grad(False)
    assert (g_with - g_without).abs().max() > 1e-6
    # the aux term alone reaches every layer's router
    model.zero_grad()
    model(idx, token_mask=mask)
    model.aux_loss().backward()
    for b in model.blocks:
        assert b.ffn.router.weight.grad.abs().sum() > 0
    last = model.blocks[-1].ffn  # its experts do not feed any router: balancing leaves them alone
    assert last.w_up.grad is None or last.w_up.grad.abs().sum() == 0


def test_lightning_training_step_adds_aux_loss():
    lit = pytest.importorskip("attnzoo.training.lit_lm")
    cfg = {"model": tiny_lm_cfg(n_experts=4, top_k=2)}
    cfg["model"].pop("vocab_size")
    module = lit.LitLM(cfg, vocab_size=61)
    module.log = lambda *a, **k: None
    x = torch.randint(0, 61, (2, 12))
    torch.manual_seed(0)
    total = module.training_step((x, x), 0)
    ce, _, _ = module._loss((x, x))
    torch.testing.assert_close(total, ce + module.model.aux_loss())
    assert (total - ce).item() > 0


def test_padding_does_not_count_in_balance():
    m = make_moe(n_experts=4, top_k=1, d_ff=16, dtype=torch.float64)
    x = torch.randn(1, 8, D, dtype=torch.float64)
    mask = torch.tensor([[True] * 4 + [False] * 4])
    m(x, token_mask=mask)
    masked = m.stats()
    m(x[:, :4])
    for k in ("moe/aux_loss", "moe/z_loss", "moe/load_max_over_mean", "moe/routing_entropy"):
        torch.testing.assert_close(masked[k], m.stats()[k], atol=1e-12, rtol=1e-12, msg=k)


# ----------------------------------------------------------------------------- aux-loss-free balancing


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_aux_free_bias_reduces_imbalance(scoring):
    """A router skewed towards expert 0; the bias alone (no gradient step) must even out the load."""
    m = make_moe(n_experts=8, top_k=2, d_ff=16, scoring=scoring, bias_update_speed=0.005,
                 aux_loss_coef=0.0, z_loss_coef=0.0).train()
    torch.manual_seed(3)
    with torch.no_grad():
        m.router.weight.mul_(0.2)
        m.router.weight[0] += 2.0 * torch.ones(D) / math.sqrt(D)
    x = torch.randn(4, 32, D) * 0.5 + torch.ones(D) / math.sqrt(D)
    balance = []
    for _ in range(100):
        m(x)
        balance.append(m.stats()["moe/load_max_over_mean"].item())
        m.after_optimizer_step()
    assert balance[0] > 3.5  # expert 0 takes (nearly) every token: max/mean = 4
    late = sum(balance[-10:]) / 10
    assert late < 1.75 and late < balance[0] / 2  # measured: sigmoid 1.16, softmax 1.50
    assert m.expert_bias[0] < 0 and m._load_acc.abs().sum() == 0
    # selection only: the combine weights are the unbiased scores
    logits, probs, idx, w = m.route(x.view(-1, D))
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    sel = scores.gather(1, idx)
    torch.testing.assert_close(w, sel / sel.sum(-1, keepdim=True))


def test_bias_is_frozen_in_eval_and_without_gamma():
    m = make_moe(n_experts=4, top_k=1, d_ff=16, bias_update_speed=0.1).eval()
    m(torch.randn(2, 5, D))
    m.after_optimizer_step()
    assert m.expert_bias.abs().sum() == 0


# ----------------------------------------------------------------------------- parity with transformers

N_TOK = 48


def _well_separated(scores_for_choice: torch.Tensor, k: int, min_gap: float = 1e-3) -> torch.Tensor:
    """Rows whose k-th and (k+1)-th choice scores differ by more than min_gap (no near-ties)."""
    top = scores_for_choice.topk(k + 1, dim=-1).values
    return (top[:, k - 1] - top[:, k]) > min_gap


def _copy_experts(ours: MoE, hf_experts) -> None:
    ours.w_up.data.copy_(hf_experts.gate_up_proj.transpose(1, 2))
    ours.w_down.data.copy_(hf_experts.down_proj.transpose(1, 2))


def _copy_mlp(ours: SwiGLU, hf_mlp) -> None:
    ours.gate_up.weight.data.copy_(torch.cat([hf_mlp.gate_proj.weight, hf_mlp.up_proj.weight]))
    ours.down.weight.data.copy_(hf_mlp.down_proj.weight)


def _init_hf(block) -> None:
    torch.manual_seed(7)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)


def _compare(ours: MoE, hf_block, hf_router, x: torch.Tensor, k: int, choice_fn) -> None:
    with torch.no_grad():
        _, _, hf_idx = hf_router(x.view(-1, x.shape[-1]))
        keep = _well_separated(choice_fn(x.view(-1, x.shape[-1])), k)
        assert keep.sum() >= N_TOK // 2
        x = x.view(-1, x.shape[-1])[keep].view(1, -1, x.shape[-1])
        hf_idx = hf_idx[keep]
        _, _, idx, _ = ours.route(x.view(-1, x.shape[-1]))
        assert torch.equal(idx.sort(-1).values, hf_idx.sort(-1).values)
        y_hf = hf_block(x.clone())
        ours64 = fp64_copy(ours)
        for impl in ("fast", "reference"):
            ours.impl = ours64.impl = impl
            y = ours(x)
            # transformers' routers compute in fp32 whatever the input: FP32_FACTOR x our own fp32-vs-fp64 gap
            torch.testing.assert_close(y, y_hf, atol=gap_atol(y, ours64(x.double())), rtol=0)


def test_parity_mixtral_sparse_moe_block():
    tr = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = tr.MixtralConfig(hidden_size=D, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
                           router_jitter_noise=0.0, experts_implementation="eager")
    hf = MixtralSparseMoeBlock(cfg).eval()
    _init_hf(hf)
    ours = MoE(MoEConfig(n_experts=8, top_k=2, d_ff=16, scoring="softmax", norm_topk_prob=True), D).eval()
    ours.router.weight.data.copy_(hf.gate.weight)
    _copy_experts(ours, hf.experts)
    x = torch.randn(1, N_TOK, D)
    _compare(ours, hf, hf.gate, x, 2, lambda h: F.linear(h, hf.gate.weight).softmax(-1))


def test_parity_deepseek_v3_moe():
    tr = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = tr.DeepseekV3Config(hidden_size=D, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
                              n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                              norm_topk_prob=True, experts_implementation="eager")
    hf = DeepseekV3MoE(cfg).eval()
    _init_hf(hf)
    with torch.no_grad():
        hf.gate.e_score_correction_bias.copy_(torch.randn(16) * 0.1)
    ours = MoE(MoEConfig(n_experts=16, top_k=4, d_ff=16, scoring="sigmoid", norm_topk_prob=True,
                         routed_scaling_factor=2.5, n_group=4, topk_group=2, n_shared_experts=2), D).eval()
    ours.router.weight.data.copy_(hf.gate.weight)
    ours.expert_bias.copy_(hf.gate.e_score_correction_bias)
    _copy_experts(ours, hf.experts)
    _copy_mlp(ours.shared, hf.shared_experts)

    def choice(h):
        # HF's own choice scores after group masking: the k-th/(k+1)-th gap within the chosen groups
        s = F.linear(h, hf.gate.weight).sigmoid() + hf.gate.e_score_correction_bias
        g = s.view(-1, 4, 4).topk(2, dim=-1).values.sum(-1)
        top = g.topk(3, dim=-1).values
        ok = (top[:, 1] - top[:, 2]) > 1e-3  # group choice well separated too
        gi = g.topk(2, dim=-1).indices
        gm = torch.zeros_like(g, dtype=torch.bool).scatter_(1, gi, True).repeat_interleave(4, 1)
        return s.masked_fill(~gm, -1e9).masked_fill(~ok.unsqueeze(-1), 0.0)

    x = torch.randn(1, N_TOK * 2, D)
    _compare(ours, hf, hf.gate, x, 4, choice)


def test_parity_qwen3_next_sparse_moe_block():
    tr = pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    cfg = tr.Qwen3NextConfig(hidden_size=D, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                             experts_implementation="eager")
    hf = Qwen3NextSparseMoeBlock(cfg).eval()
    _init_hf(hf)
    ours = MoE(MoEConfig(n_experts=8, top_k=2, d_ff=16, shared_d_ff=24, shared_expert_gate=True), D).eval()
    ours.router.weight.data.copy_(hf.gate.weight)
    _copy_experts(ours, hf.experts)
    _copy_mlp(ours.shared, hf.shared_expert)
    ours.shared_gate.weight.data.copy_(hf.shared_expert_gate.weight)
    x = torch.randn(1, N_TOK, D)
    _compare(ours, hf, hf.gate, x, 2, lambda h: F.linear(h, hf.gate.weight).softmax(-1))


# ----------------------------------------------------------------------------- in the language model


def test_tiny_moe_lm_forward_backward_and_accounting():
    torch.manual_seed(0)
    cfg = tiny_lm_cfg(n_experts=8, top_k=2, n_shared_experts=1, first_k_dense=1, dense_d_ff=64)
    model = DecoderLM(cfg)
    assert isinstance(model.blocks[0].ffn, SwiGLU) and model.blocks[0].ffn.hidden == 64
    moe = model.blocks[1].ffn
    assert isinstance(moe, MoE) and moe.layer_idx == 1
    idx = torch.randint(0, 61, (2, 10))
    logits = model(idx)
    loss = F.cross_entropy(logits.view(-1, 61), idx.view(-1)) + model.aux_loss()
    loss.backward()
    assert torch.isfinite(loss) and moe.router.weight.grad.abs().sum() > 0 and moe.w_up.grad.abs().sum() > 0
    stats = model.stats()
    for k in ("moe/aux_loss", "moe/z_loss", "moe/load_max_over_mean", "moe/dropped_frac", "moe/routing_entropy",
              "moe/layer1/load_max_over_mean"):
        assert k in stats and torch.isfinite(stats[k]), k
    # params: active = total - 6 inactive routed experts; FLOPs: router + 2 experts + shared
    per_expert = 3 * D * 16
    assert model.num_params() - model.active_params() == 6 * per_expert
    assert moe.flops_per_token() == 2 * D * 8 + 2 * (2 * per_expert) + 2 * per_expert


def test_moe_preset_composes():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF / "model"), version_base="1.3"):
        cfg = compose(config_name="moe", overrides=["d_model=32", "n_heads=4", "n_layers=2"])
    mc = resolve_model(cfg, vocab_size=50)
    assert isinstance(mc.ffn, MoEConfig) and mc.ffn.n_shared_experts == 1
    model = DecoderLM(mc)
    model(torch.randint(0, 50, (1, 6))).sum().backward()
    assert model.active_params() < model.num_params()


@pytest.mark.parametrize(
    "bad,field",
    [
        (dict(top_k=9), "top_k"),
        (dict(n_group=3), "n_group"),
        (dict(n_group=4, topk_group=1, top_k=3), "top_k"),
        (dict(scoring="tanh"), "scoring"),
        (dict(capacity_factor=0.0), "capacity_factor"),
        (dict(first_k_dense=5), "first_k_dense"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_config_errors_name_the_field(bad, field):
    with pytest.raises(ConfigError, match=rf"model\.ffn\.{field}"):
        resolve_model(tiny_lm_cfg(**bad))


# ----------------------------------------------------------------------------- end to end


def test_train_end_to_end_with_moe_balances(tmp_path):
    """`attnzoo-train model/ffn=moe debug=smoke`: the MoE metrics are logged, the load stays bounded
    (max/mean <= E/K = 4 always; balanced training keeps it well under), params/active < params/total."""
    train_mod = pytest.importorskip("attnzoo.training.run")
    from tests.conftest import SMALL_TEXT, compose_cfg

    out = tmp_path / "run"
    cfg = compose_cfg(["model/ffn=moe", "debug=smoke", *SMALL_TEXT, "data.tokenizer=char", "trainer.max_steps=12",
                       "trainer.val_check_interval=6", "perf.decode_tokens=4", "model.ffn.d_ff=32",
                       "model.ffn.bias_update_speed=0.001"], out)
    metrics = train_mod.train(cfg)
    for k in ("moe/aux_loss", "moe/z_loss", "moe/load_max_over_mean", "moe/dropped_frac", "moe/routing_entropy",
              "moe/layer0/load_max_over_mean", "moe/layer1/load_max_over_mean"):
        assert k in metrics and math.isfinite(metrics[k]), k
    assert 1.0 <= metrics["moe/load_max_over_mean"] < 2.0
    assert metrics["moe/dropped_frac"] == 0.0
    assert 0.9 < metrics["moe/aux_loss"] < 1.5  # 1 when balanced
    assert metrics["params/active"] < metrics["params/total"]
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    bias = ckpt["state_dict"]["model.blocks.0.ffn.expert_bias"]
    assert bias.abs().sum() > 0  # the aux-loss-free bias moved during training and is checkpointed


def test_grouped_mm_probe_does_not_depend_on_grad_mode(monkeypatch):
    """The probe's first call may come from an eval/no_grad forward; it must not cache a false 'unavailable'."""
    import attnzoo.layers.moe as moe_mod

    monkeypatch.setattr(moe_mod, "_GROUPED_MM_OK", {})
    with torch.no_grad():
        inside = moe_mod.grouped_mm_works(torch.device("cpu"), torch.float32)
    monkeypatch.setattr(moe_mod, "_GROUPED_MM_OK", {})
    assert inside == moe_mod.grouped_mm_works(torch.device("cpu"), torch.float32)

"""optim=muon (training/optimizers.py): Muon on the hidden matrices and AdamW on the rest, in one optimizer.

Exactness. Against torch.optim.Muon (adjust_lr_fn="match_rms_adamw") and torch.optim.AdamW run separately on a copy
of the model: bit for bit in fp32 (the same ops, Newton-Schulz in bf16 as torch runs it). Against Moonlight's update
written out as the paper and its released code write it (arXiv:2502.16982: sum momentum, Nesterov, the quintic
iteration as a polynomial; MoE expert stacks one matrix at a time) in float64: 1e-12. FSDP2 on two processes
against one: bit for bit."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnzoo.config.errors import ConfigError
from attnzoo.config.schema import OptimConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.training.optimizers import MuonWithAdamW, build_optimizer
from attnzoo.training.run import train
from tests.conftest import compose_cfg
from tests.test_resume import BASE, train_losses

VOCAB = 61
DENSE = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "mixer": {"name": "gqa"},
         "ffn": {"name": "swiglu"}, "tie_embeddings": False}
MOE = {**DENSE, "ffn": {"name": "moe", "n_experts": 3, "top_k": 2}}  # 3 experts: uneven shards on 2 ranks


def model(spec: dict, dtype=torch.float32, seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(spec, vocab_size=VOCAB).to(dtype)


def backward(m: DecoderLM, step: int) -> None:
    x = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(step))
    F.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()


def split(opt, other: DecoderLM, mine: DecoderLM) -> tuple[list, list]:
    """`opt`'s groups over `other`'s parameters (a copy of `mine`): (Muon's, AdamW's), each group's own decay."""
    theirs = dict(other.named_parameters())
    name = {id(p): n for n, p in mine.named_parameters()}
    muon, adamw = [], []
    for g in opt.param_groups:
        (muon if g["muon"] else adamw).append({"params": [theirs[name[id(p)]] for p in g["params"]],
                                               "weight_decay": g["weight_decay"]})
    return muon, adamw


def adamw_fused(opt) -> bool:
    """Whether the optimizer's AdamW half runs torch's fused kernel (the reference must run the same)."""
    return next(g["fused"] for g in opt.param_groups if not g["muon"])


def test_muon_groups_hold_the_hidden_matrices_and_keep_the_groups_flags():
    """Muon gets every nn.Linear weight and the MoE expert stacks; AdamW the embedding, the untied head, norms, the
    short conv's taps, A_log / dt_bias (no decay); µP's per-layer learning rates and decays stay on both halves."""
    spec = {**MOE, "mixer": {"name": "gated_deltanet"}, "parametrization": "mup", "mup_base_width": 16}
    m = model(spec)
    opt = build_optimizer(m, OptimConfig(name="muon", lr=1e-2))
    name = {id(p): n for n, p in m.named_parameters()}
    muon = {name[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]}
    adamw = {name[id(p)] for g in opt.param_groups if not g["muon"] for p in g["params"]}
    assert muon == {n for n, p in m.named_parameters() if n.startswith("blocks.") and (
        n.endswith(("proj.weight", "qkv.weight", "router.weight", "w_up", "w_down")))}
    assert muon | adamw == set(name.values()) and not muon & adamw
    assert {"embed.weight", "lm_head.weight", "norm.weight", "blocks.0.mixer.conv.weight",
            "blocks.0.mixer.A_log"} <= adamw
    m_ = spec["d_model"] / spec["mup_base_width"]
    for g in opt.param_groups:  # µP's hidden weights (all of Muon's here): lr / m, weight decay x m
        if g["muon"] and g["params"]:
            assert g["lr"] == pytest.approx(1e-2 / m_) and g["weight_decay"] == pytest.approx(0.1 * m_)
    assert opt.param_groups[0]["ns_dtype"] == "fp32"  # auto on a CPU


def test_muon_equals_torch_muon_and_adamw_run_separately_bit_for_bit():
    """3 steps under a LambdaLR schedule: the one optimizer equals torch.optim.Muon (Nesterov, match_rms_adamw, its
    bf16 Newton-Schulz) on the hidden matrices plus torch.optim.AdamW on the rest, every parameter bit for bit."""
    mine = model(DENSE)
    ref = copy.deepcopy(mine)
    opt = build_optimizer(mine, OptimConfig(name="muon", lr=2e-2, ns_dtype="bf16"))
    muon, adamw = split(opt, ref, mine)
    refs = [torch.optim.Muon(muon, lr=2e-2, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(adamw, lr=2e-2, betas=(0.9, 0.95), eps=1e-8, fused=adamw_fused(opt))]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)) for o in (opt, *refs)]
    for step in range(3):
        backward(mine, step)
        backward(ref, step)
        for o in (opt, *refs):
            o.step()
            o.zero_grad()
        for s in scheds:
            s.step()
    theirs = dict(ref.named_parameters())
    for n, p in mine.named_parameters():
        assert torch.equal(p, theirs[n]), n
    assert any(not torch.equal(p, q) for p, q in zip(mine.parameters(), model(DENSE).parameters()))  # it moved


def newton_schulz_plain(G: torch.Tensor, steps: int = 5, a=3.4445, b=-4.7750, c=2.0315) -> torch.Tensor:
    """X <- a X + b (X X^T) X + c (X X^T)^2 X from X = G / ||G||_F, on the wide orientation."""
    X = G / G.norm()
    tall = X.shape[0] > X.shape[1]
    X = X.T if tall else X
    for _ in range(steps):
        A = X @ X.T
        X = a * X + b * A @ X + c * A @ A @ X
    return X.T if tall else X


def test_muon_in_float64_equals_moonlights_update_written_out():
    """Moonlight's update (arXiv:2502.16982, Nesterov as in its released code), per matrix (each expert alone):
    M <- mu M + G;  O = NS(G + mu M);  W <- W - lr (0.2 sqrt(max(A, B)) O + wd W). Our momentum is the EMA form
    (1 - mu) x this one: the same O. 3 steps on a MoE model in float64, AdamW's half against torch.optim.AdamW."""
    lr, wd, mu = 1e-2, 0.1, 0.95
    mine = model(MOE, torch.float64)
    ref = copy.deepcopy(mine)
    opt = build_optimizer(mine, OptimConfig(name="muon", lr=lr, weight_decay=wd, momentum=mu))
    assert opt.param_groups[0]["ns_dtype"] == "fp64"  # auto, for float64 parameters
    muon, adamw = split(opt, ref, mine)
    ref_adamw = torch.optim.AdamW(adamw, lr=lr, betas=(0.9, 0.95), eps=1e-8)
    matrices = [p for g in muon for p in g["params"]]
    assert any(p.dim() == 3 for p in matrices)  # the expert stacks are Muon's
    momenta = [torch.zeros_like(p) for p in matrices]
    with torch.no_grad():
        for step in range(3):
            with torch.enable_grad():
                backward(mine, step)
                backward(ref, step)
            opt.step()
            opt.zero_grad()
            ref_adamw.step()
            for W, M in zip(matrices, momenta):
                M.mul_(mu).add_(W.grad)
                U = W.grad + mu * M
                O = torch.stack([newton_schulz_plain(u) for u in U.reshape(-1, *U.shape[-2:])]).view_as(U)
                W.sub_(lr * (0.2 * math.sqrt(max(W.shape[-2:])) * O + wd * W))
            ref.zero_grad()
    theirs = {n: p.detach() for n, p in ref.named_parameters()}
    err = max(float((p.detach() - theirs[n]).abs().max()) for n, p in mine.named_parameters())
    assert err <= 1e-12, err


def test_state_dict_round_trip_continues_both_halves_exactly():
    """A checkpoint's optimizer state loaded into a fresh optimizer (Lightning's resume): the next steps equal the
    uninterrupted ones bit for bit, with the schedule still driving AdamW's groups (the loaded dicts are its own)."""
    a = model(DENSE)
    opt_a = build_optimizer(a, OptimConfig(name="muon", lr=2e-2))
    sched_a = torch.optim.lr_scheduler.LambdaLR(opt_a, lambda s: 1 / (1 + s))
    for step in range(2):
        backward(a, step)
        opt_a.step()
        opt_a.zero_grad()
        sched_a.step()
    b = copy.deepcopy(a)
    opt_b = build_optimizer(b, OptimConfig(name="muon", lr=2e-2))
    sched_b = torch.optim.lr_scheduler.LambdaLR(opt_b, lambda s: 1 / (1 + s))
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    sched_b.load_state_dict(sched_a.state_dict())
    assert isinstance(opt_b, MuonWithAdamW)
    for step in range(2, 4):
        for m, o, s in ((a, opt_a, sched_a), (b, opt_b, sched_b)):
            backward(m, step)
            o.step()
            o.zero_grad()
            s.step()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n


def _fsdp_worker(rank: int, world: int, port: int, spec: dict, out: str) -> None:
    import json

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from attnzoo.bench.context_parallel import _init
    from attnzoo.config.schema import FSDPConfig
    from attnzoo.distributed.fsdp import shard_model

    _init(rank, world, port, 1)
    plain = model(spec)
    sharded = shard_model(model(spec), init_device_mesh("cpu", (world,)), FSDPConfig())
    cfg = OptimConfig(name="muon", lr=2e-2, ns_dtype="bf16")
    opts = [build_optimizer(m, cfg) for m in (plain, sharded)]
    for step in range(3):  # the same gradients on both: each rank its rows of them on the sharded model
        if step == 2:  # a sharded checkpoint's optimizer state (Lightning's FSDP save / resume) into a new one
            state = get_optimizer_state_dict(sharded, opts[1])
            opts[1] = build_optimizer(sharded, cfg)
            set_optimizer_state_dict(sharded, opts[1], state)
        g = torch.Generator().manual_seed(step)
        for p, q in zip(plain.parameters(), sharded.parameters()):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = distribute_tensor(p.grad, q.device_mesh, q.placements, src_data_rank=None)
        for o in opts:
            o.step()
            o.zero_grad()
    uneven = sum(p.shape[0] % world != 0 for g in opts[1].param_groups if g["muon"] for p in g["params"])
    equal = [torch.equal(p, q.full_tensor()) for p, q in zip(plain.parameters(), sharded.parameters())]
    Path(f"{out}.{rank}").write_text(json.dumps({"equal": equal, "uneven": uneven}))
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp2_muon_equals_one_process_bit_for_bit():
    """Under FSDP2 (parameters and gradients sharded on dim 0 over 2 ranks) each matrix is gathered whole for the
    Newton-Schulz iteration and each rank keeps its own rows: 3 steps equal one process's, every parameter bit for
    bit on both ranks, uneven shards (3 experts, 61-token vocabulary) included, the last step after the optimizer
    state went through torch.distributed.checkpoint's sharded form (with a tied head: no group left empty)."""
    from attnzoo.bench.common import spawn_ranks

    for row in spawn_ranks(_fsdp_worker, 2, {**MOE, "tie_embeddings": True}):
        assert all(row["equal"]) and row["uneven"] > 0, row


def test_optim_muon_trains_and_resumes_exactly(tmp_path):
    """`optim=muon` end to end: a run split by a checkpoint equals the uninterrupted one step for step; resuming
    it under optim=adamw is refused in one line (its optimizer state is Muon's)."""
    muon = ["optim=muon", "optim.lr=3e-3"]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    train(compose_cfg(BASE + muon + ["trainer.max_steps=8"], ref))
    train(compose_cfg(BASE + muon + ["trainer.max_steps=4"], cut))
    train(compose_cfg(BASE + muon + ["trainer.max_steps=8", "ckpt_path=last"], cut))
    la, lb = train_losses(ref), train_losses(cut)
    assert sorted(la) == sorted(lb) == list(range(8))
    for s in la:
        assert lb[s] == pytest.approx(la[s], abs=1e-6), (s, la[s], lb[s])
    assert la[7] < la[0]
    opt = torch.load(cut / "checkpoints" / "last.ckpt", weights_only=True)["optimizer_states"][0]
    assert any(g["muon"] and g["params"] for g in opt["param_groups"])
    assert any("momentum_buffer" in s for s in opt["state"].values())  # Muon's state, checkpointed
    with pytest.raises(ConfigError, match="holds the optimizer state of optim=muon, which optim=adamw cannot"):
        train(compose_cfg(BASE + ["trainer.max_steps=10", "ckpt_path=last"], cut))  # refused before any work

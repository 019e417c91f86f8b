"""Shared fixtures: compose the real configs from conf/ on tiny sizes, with tmp output dirs."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from attnzoo.config.paths import CONF_DIR

# Tiny test models run fastest on one thread (no OpenMP hand-offs per op); the suite runs two test workers side
# by side (pyproject addopts), so the processes tests start (DDP workers, CLI runs) take one thread each too.
# ATTNZOO_TEST_THREADS=N runs the suite on N threads everywhere (a check that no test depends on the thread count).
THREADS = int(os.environ.get("ATTNZOO_TEST_THREADS", "1"))
torch.set_num_threads(THREADS)
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

# One tokenizer/token cache for the whole session: the BPE tokenizer is trained once.
# tests/interp runs under Triton's interpreter, in the process tests/test_fla_interpreter.py starts with triton on
# its path; the rest of the suite never imports triton (DESIGN 6.7), so it never collects them
collect_ignore = [] if os.environ.get("ATTNZOO_INTERP_TESTS") == "1" else ["interp"]

SESSION_CACHE = Path(os.environ.get("ATTNZOO_TEST_CACHE", Path.home() / ".cache" / "attnzoo-tests"))

# Small text corpus for end-to-end tests (the default corpus is 2M characters).
SMALL_TEXT = ["data.max_chars=300000", "data.vocab_size=512"]


def compose_cfg(overrides: list[str], output_dir: Path | str | None = None):
    """Compose conf/train.yaml with overrides, as `attnzoo-train` would (outside a Hydra run).

    Hydra's compose makes the defaults list from the config-group overrides, merges it, and then applies the other
    overrides (plain values, `+key`, `~key`) to the merged config (ConfigLoaderImpl._apply_overrides_to_config).
    A worker keeps each merged config it composed (one per set of group overrides: ~0.2 s a compose, issue 45) and
    applies the plain overrides of a call to a copy of it with that same Hydra function: the same config
    (tests/test_config.py checks it against a full compose over every bad-input case)."""
    ov = list(overrides) + [f"paths.cache_dir={SESSION_CACHE}"]
    if output_dir is not None:
        ov.append(f"paths.output_dir={output_dir}")
    return _compose_split(ov)


_MERGED: dict = {}  # (group overrides...) -> the composed config (with its hydra node), per worker


def _compose_full(overrides: list[str], hydra_node: bool = False):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides), return_hydra_config=hydra_node)


def _compose_split(overrides: list[str]):
    import copy

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import open_dict

    parsed = OverridesParser.create().parse_overrides(overrides)
    if any(o.is_sweep_override() for o in parsed):
        return _compose_full(overrides)

    def group(o) -> bool:  # consumed by the defaults list (a config group's option, Hydra's own settings)
        key = o.key_or_group.lstrip("+~")
        return (o.package is not None or "/" in key or key.startswith("hydra") or (CONF_DIR / key).is_dir())

    groups = tuple(o.input_line for o in parsed if group(o))
    if groups not in _MERGED:
        _MERGED[groups] = _compose_full(list(groups), hydra_node=True)
    cfg = copy.deepcopy(_MERGED[groups])
    ConfigLoaderImpl._apply_overrides_to_config([o for o in parsed if not group(o)], cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


@pytest.fixture
def make_cfg(tmp_path):
    def _make(*overrides: str, output_dir: Path | None = None):
        return compose_cfg(list(overrides), output_dir or tmp_path / "run")

    return _make


def tiny_model_cfg(mixer: str | dict = "gqa", **kw) -> dict:
    """A plain-dict model config for unit tests (d_model 32, 4 heads, 2 KV heads, 2 layers)."""
    cfg = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "mixer": mixer if isinstance(mixer, dict) else {"name": mixer},
           "ffn": {"name": "swiglu"}}
    cfg.update(kw)
    return cfg


# fp32 against another fp32 implementation (transformers, an exported model): the two differ by their
# rounding, which grows with the depth and the size of the values - on the widened Qwen3-Next hybrid
# fp32 vs fp64 differs by ~3e-3 in both. A fixed 1e-5 passes on one CPU and fails on the next. So the
# tolerance is derived from the same computation: FP32_FACTOR x max|ours in fp32 - ours in fp64|, i.e.
# the other side may round up to FP32_FACTOR - 1 times worse than ours; a wrong weight mapping moves the
# logits by O(1) on these widened models, orders of magnitude above it.
FP32_FACTOR = 10.0


def fp32_atol(model, forward, floor: float = 1e-5, factor: float = FP32_FACTOR):
    """`forward(model)` in fp32 and `forward` of an fp64 copy of `model`: returns the fp32 output and the
    absolute tolerance for comparing it with another fp32 implementation of the same computation:
    `factor` x max|fp32 - fp64| of this computation, at least `floor`."""
    import copy

    import torch

    with torch.no_grad():
        out32 = forward(model)
        out64 = forward(copy.deepcopy(model).double())
    gap = (out32.double() - out64).abs().max().item()
    return out32, max(floor, factor * gap)


def gap_atol(out32, out64, factor: float = FP32_FACTOR) -> float:
    """The absolute tolerance for comparing `out32`, a computation run in fp32, with another fp32 form of the same
    computation (a reference that computes in fp32 internally, or a test about fp32 behaviour): `factor` x
    max|out32 - out64|, `out64` being the same computation run in fp64. The gap counts as at least one fp32
    rounding of the output's size (eps x max|out64|), so an fp32 result that happens to be exact does not ask
    the other side for bit equality. Where both sides accept fp64, compare in fp64 instead (tolerance 1e-10).
    A gap above 1e-3 of the values' size fails here: the fp32 run took another branch (a top-k, a routing choice)
    or is unstable, and a tolerance derived from it would be as large as the bugs it has to catch."""
    import torch

    out64 = out64.detach().double()
    gap = (out32.detach().double() - out64).abs().max().item()
    size = out64.abs().max().item()
    assert gap <= 1e-3 * size, f"fp32 differs from fp64 by {gap:.3g} on values of size {size:.3g}"
    return factor * max(gap, torch.finfo(torch.float32).eps * size)


def projected_grads(outputs, leaves: dict, seed: int = 7) -> dict:
    """The gradients w.r.t. each of `leaves` ({name: tensor requiring grad}) of a fixed random projection of
    `outputs` (tensors, None skipped): sum_i <W_i, outputs[i]>, W_i ~ N(0, 1) of outputs[i]'s shape drawn in fp64
    from seed + i and cast to its dtype - the same loss for two implementations (outputs in one layout) and for
    both dtypes of one. Every leaf must reach the loss: one a form ignores or detaches fails here, by name."""
    import torch

    outs = [o for o in outputs if o is not None]
    loss = sum((o * torch.randn(o.shape, generator=torch.Generator().manual_seed(seed + i), dtype=torch.float64)
                .to(o.dtype)).sum() for i, o in enumerate(outs))
    grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)))
    unused = [name for name, g in grads.items() if g is None]
    assert not unused, f"no gradient reaches {unused}: the outputs do not depend on them through autograd"
    return grads


def outputs_and_grads(fn, tensors: dict, dtype=None, seed: int = 7) -> tuple:
    """`fn(**leaves)` -> (its outputs, detached, as a tuple; their `projected_grads` w.r.t. the leaves by name). The
    leaves are fresh copies of `tensors` ({name: tensor}), cast to `dtype` where given. `fn` returns its outputs
    (a tensor or a tuple) in one layout for every implementation compared, a reference's transposed to ours."""
    leaves = {n: t.detach().to(dtype or t.dtype).clone().requires_grad_() for n, t in tensors.items()}
    outs = fn(**leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return tuple(None if o is None else o.detach() for o in outs), projected_grads(outs, leaves, seed)


def module_outputs_and_grads(module, forward, x, seed: int = 7) -> tuple:
    """`forward(module, x)` on a fresh leaf copy of x -> (the output, detached; its `projected_grads` w.r.t. x
    (named "x") and every parameter of `module`, by its name in the module)."""
    x = x.detach().clone().requires_grad_()
    out = forward(module, x)
    return out.detach(), projected_grads([out], {"x": x, **dict(module.named_parameters())}, seed)


def assert_grads_close(ours: dict, ref: dict, ours64: dict | None = None, what: str = "") -> None:
    """`projected_grads` of ours and of a reference, name by name (the same names): every reference gradient
    carries signal (not all zero), and ours matches it - within gap_atol(ours, ours64) of that gradient where the
    reference computes in fp32 (`ours` then fp32, `ours64` the same computation in fp64), within 1e-10 where
    `ours64` is None (both sides in fp64)."""
    import torch

    assert sorted(ours) == sorted(ref), (sorted(ours), sorted(ref))
    for name, expected in ref.items():
        assert expected.abs().max() > 0, f"{what} d/d{name}: the reference gradient is all zero"
        atol = 1e-10 if ours64 is None else gap_atol(ours[name], ours64[name])
        torch.testing.assert_close(ours[name].double(), expected.double(), atol=atol, rtol=0,
                                   msg=lambda m, name=name: f"{what} d/d{name}: {m}")


def assert_learns(run_dir, *, falls: bool = True, below_uniform: bool = True) -> None:
    """Value checks for a short end-to-end run instead of "the loss is finite": the validation loss (read from the
    run's metrics.csv) falls from its first evaluation to its last (`falls`, needs two evaluations) and ends below
    ln(V), the loss of predicting every token uniformly, which a random init starts near (`below_uniform`)."""
    import csv
    import json
    import math

    with open(Path(run_dir) / "csv" / "metrics.csv", newline="") as f:
        val = [float(r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")]
    assert val and all(math.isfinite(v) for v in val), val
    if falls:
        assert len(set(val)) >= 2 and val[-1] < val[0], val
    if below_uniform:
        vocab = json.loads((Path(run_dir) / "summary.json").read_text())["model"]["vocab_size"]
        assert val[-1] < math.log(vocab), (val, vocab)


@pytest.fixture(autouse=True)
def _no_logging_to_closed_streams():
    """A handler created during one test can hold that test's captured stream (capsys, or a run's console tee
    around it) - Hydra's job logging of an in-process run, a library's handler made on first import. Once the
    test ends the stream is closed, and a later test's log record prints '--- Logging error ---' to stderr
    (seen in random order: a one-line refusal became a traceback). Each test leaves no handler on a closed
    stream."""
    import logging

    yield
    for lg in [logging.getLogger()] + [x for x in logging.Logger.manager.loggerDict.values()
                                       if isinstance(x, logging.Logger)]:
        for h in list(lg.handlers):
            if isinstance(h, logging.StreamHandler) and getattr(getattr(h, "stream", None), "closed", False):
                lg.removeHandler(h)


# ----------------------------------------------------------------------------------------- the inner tier
# `pytest -m "not slow"` (README, "Tests"): the math, every mixer's equivalence fixtures, every refusal, at the
# speed of an edit-test loop. Marked slow here, in one place (besides the `@pytest.mark.slow` in the files): whole
# files of end-to-end runs (processes, DDP / FSDP / torchrun workers, the README's commands, sweeps, learning
# checks), and single tests that train, compile with inductor or start a process for more than a few seconds.
# CI runs everything.
E2E_FILES = {"test_fsdp", "test_readme_chains", "test_readme_commands", "test_sweeps", "test_fla_interpreter",
             "test_shards", "test_recall", "test_bench", "test_faults_ddp", "test_context_parallel", "test_lifecycle",
             "test_data_prepare", "test_multimodal", "test_lm_eval", "test_scaling_fit", "test_train_e2e"}
SLOW_TESTS = (
    "test_resume.py::test_refused_run_keeps", "test_resume.py::test_resume_hint",
    "test_resume.py::test_resume_continues_the_tensorboard", "test_resume.py::test_checkpoint_restores",
    "test_static_decode.py::test_compiled_decode_equals_eager", "test_encdec.py::test_tiny_transformer_learns",
    "test_lean_imports.py::test_entry_points", "test_stops.py::test_a_token_budget_counts_every",
    "test_stops.py::test_a_flop_budget_resumed", "test_gpu_defaults.py::test_fused_adamw_under_bf16",
    "test_gpu_defaults.py::test_a_text_run_does_not_import", "test_report_html.py::test_the_command_and_the_module",
    "test_console.py::test_a_refused_run_leaves", "test_console.py::test_what_a_run_prints",
    "test_memory.py::test_context_parallel_with", "test_memory.py::test_compiled_checkpointed",
    "test_mup.py::test_coordinate_check", "test_linearize.py::test_linearize_gated_deltanet_matches",
    "test_vision.py::test_classifier_trains_from_the_cli", "test_checkpoint_safety.py::test_a_payload_never_runs",
    "test_gpu_check.py::test_the_spawned_worker", "test_static_kv_formats.py::test_aot_autograd",
    "test_dispatch.py::test_probes_never_import", "test_dispatch.py::test_gpu_check_harness",
    "test_help.py::test_help_of_the_hydra", "test_hf_io.py::test_init_from_trains",
    "test_kv_quant.py::test_eval_says",
    "test_bad_input.py::test_disk_full_after_a_checkpoint", "test_lean_imports.py::test_validation_modules",
)


def pytest_collection_modifyitems(config, items):
    """Marks the slow tests. The order stays the collection's (file order): each xdist worker (worksteal) takes a
    contiguous half of it and steals from the other's queue at the end. Running each share's slow tests first
    (2026-12-07) put the process-heavy tests of both workers side by side at the start; measured on one host, idle,
    cold caches: file order 7 min 59 s and 7 min 50 s in random order, against 8 min 18 s and 8 min 20 s slow-first
    (docs/testing.md)."""
    for item in items:
        path = Path(str(item.fspath))
        if path.stem in E2E_FILES or f"{path.name}::{item.name}".startswith(SLOW_TESTS):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _no_hydra_state_left():
    """A test that runs a sweep or composes a multirun config in process leaves Hydra's global HydraConfig set; a
    later run in the same worker would read that sweep's overrides and output dir (model.init_from's override
    check, the loggers' folders). Cleared after every test."""
    yield
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().cfg = None


def cli_train(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """`attnzoo-train ARGV` through the console script's own main function, in this process: (exit code, stdout,
    stderr). For tests about what the command does with its command line (refusals, --resume, the run dir's
    record), not about a process boundary: it saves the ~5-7 s of imports a `python -m attnzoo.cli.train`
    subprocess pays on a 2-core machine (issue 45, item 3)."""
    from hydra.core.global_hydra import GlobalHydra

    from attnzoo.cli.train import main

    capsys.readouterr()
    monkeypatch.setattr("sys.argv", ["attnzoo-train", *argv])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        GlobalHydra.instance().clear()
    out, err = capsys.readouterr()
    return code, out, err


"""The console scripts' lean import of Lightning (attnzoo/_lean_imports.py, issue 45 item 2): through attnzoo.cli,
`import lightning.pytorch` leaves transformers, scipy and matplotlib unimported (torchmetrics, which Lightning
imports unconditionally, sees them as absent); through plain `import attnzoo` nothing changes. Both in fresh
processes (started together), since an import cannot be undone in this one."""
from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("transformers", "scipy", "matplotlib")
PROBE = """
import json, sys
{first}
import lightning.pytorch
import torchmetrics.utilities.imports as flags
seen = {{m: m in sys.modules for m in {heavy!r}}}
import transformers  # still importable for attnzoo's own use
print(json.dumps({{"seen": seen, "bert": bool(flags._TRANSFORMERS_GREATER_EQUAL_4_4),
                   "tm": "torchmetrics" in sys.modules, "tf": transformers.__name__}}))
"""


def _probe(first: str) -> subprocess.Popen:
    env_clean = {k: v for k, v in __import__("os").environ.items() if k != "ATTNZOO_FULL_IMPORTS"}
    return subprocess.Popen([sys.executable, "-c", PROBE.format(first=first, heavy=HEAVY)], env=env_clean,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_entry_points_import_lightning_without_torchmetrics_backends_and_the_library_leaves_it_whole():
    lean, whole = _probe("import attnzoo.cli"), _probe("import attnzoo")
    results = {}
    for name, proc in (("lean", lean), ("whole", whole)):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        results[name] = json.loads(out.strip().splitlines()[-1])
    assert results["lean"]["seen"] == {m: False for m in HEAVY}, results["lean"]
    assert results["lean"]["tm"] and not results["lean"]["bert"] and results["lean"]["tf"] == "transformers"
    # the library alone changes nothing: torchmetrics imports its back-ends as it always does
    assert results["whole"]["bert"] and results["whole"]["seen"]["transformers"], results["whole"]


def test_every_console_script_enters_through_attnzoo_cli():
    """A script entered elsewhere would import Lightning whole (pyproject.toml's [project.scripts])."""
    import importlib
    import tomllib
    from pathlib import Path

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert len(scripts) >= 10
    for name, target in scripts.items():
        module, func = target.split(":")
        # attnzoo-bench, the layer above attnzoo.cli (docs/architecture.md), imports it first itself
        assert module.startswith("attnzoo.cli.") or module == "attnzoo.bench.cli", (name, target)
        assert callable(getattr(importlib.import_module(module), func)), (name, target)


VALIDATED = [  # the configs VALIDATE_PROBE checks (besides the pattern of every mixer)
    ["data=mqar"], ["data=noisy_ar"], ["data=copying"], ["data=induction_heads"], ["model=encdec", "data=reversal"],
    ["model=encdec", "data=addition"], ["model=encoder", "data=text"], ["model=vit", "data=digits"],
    ["model=swin", "data=digits"], ["model=vlm", "data=shapes"], ["trainer=ddp_cpu", "trainer.context_parallel=2"],
    ["trainer=fsdp_cpu"], ["model/ffn=moe"], ["model/ffn=mlp"], ["model=gpt2"],
]
REFUSED_HERE = [  # refused on a machine without CUDA (config/machine.py: a CPU build of torch, or no driver)
    ["trainer=gpu"], ["trainer=ddp"], ["trainer=fsdp"], ["model/mixer=gated_deltanet", "model.impl=fla"],
    ["model/mixer=sliding_window", "model.impl=flex"],
]
REFUSED_EARLY = [  # refused from the config alone, where the exact answer needs the model (issue 45: floors)
    (["trainer.max_flops=1000"], "trainer.max_flops: 1000 is below one optimizer step (at least"),
    (["model/ffn=none", "+model_budget={params: 10}"], "model_budget.params: 10 parameters is out of reach"),
]
REFUSED_PREFLIGHT = [  # refused by preflight in the data's own tokens: the corpus's tokenizer, loaded without torch
    (["data.max_chars=300000", "data.tokenizer=char", "eval.niah_tasks=[passkey]", "eval.context_lengths=[48]"],
     "eval.niah_tasks: passkey's question and needles alone take"),
]
VALIDATE_PROBE = f"""
import json, sys
from pathlib import Path
from hydra import compose, initialize_config_dir
from attnzoo.config.errors import ConfigError
from attnzoo.config.paths import CONF_DIR
from attnzoo.config.registry import MIXERS
from attnzoo.config.machine import no_cuda_reason
from attnzoo.training.config_checks import check_devices_present, check_kernels_present, preflight, validate
from attnzoo.distributed.checkpoint_files import check_checkpoint_file
tmp = Path(sys.argv[1])
every = "model.pattern=[" + ",".join(MIXERS.names()) + "]"
runs = [[every, f"model.n_layers={{len(MIXERS.names())}}", "inference.kv_cache_dtype=int8", "data.seq_len=128"]] + {VALIDATED!r}
checked = 0
with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
    for i, extra in enumerate(runs):
        cfg = compose("train", overrides=["debug=smoke", f"paths.output_dir={{tmp}}/run{{i}}", *extra])
        check_kernels_present(validate(cfg))
        checked += 1
    for i, extra in enumerate({REFUSED_HERE!r} if no_cuda_reason() else []):
        cfg = compose("train", overrides=["debug=smoke", f"paths.output_dir={{tmp}}/refused{{i}}", *extra])
        parts = validate(cfg)
        try:
            check_devices_present(parts["run"].trainer)
            check_kernels_present(parts)
        except ConfigError as e:
            checked += 1
            assert "no CUDA" in str(e), e
    for i, (extra, start) in enumerate({REFUSED_EARLY!r}):
        cfg = compose("train", overrides=[f"paths.output_dir={{tmp}}/early{{i}}", *extra])
        try:
            validate(cfg)
        except ConfigError as e:
            checked += str(e).startswith(start)
    for i, (extra, start) in enumerate({REFUSED_PREFLIGHT!r}):
        cfg = compose("train", overrides=["debug=smoke", f"paths.output_dir={{tmp}}/pre{{i}}",
                                          f"paths.cache_dir={{tmp}}/cache", *extra])
        try:
            preflight(cfg)
        except ConfigError as e:
            checked += str(e).startswith(start)
(tmp / "bad.ckpt").write_bytes(b"PK truncated")
try:
    check_checkpoint_file(tmp / "bad.ckpt")
except ConfigError:
    checked += 1
seen = {{"torch": "torch" in sys.modules, "lightning": "lightning" in sys.modules}}
import attnzoo.layers.moe
MIXERS.load_all()
print(json.dumps({{"checked": checked, "refused_here": len({REFUSED_HERE!r}) if no_cuda_reason() else 0, **seen,
                  "dynamo": "torch._dynamo" in sys.modules}}))
"""


def test_config_checks_import_neither_torch_nor_lightning(tmp_path):
    """What a refused value costs (issue 45 item 1): `validate()` of configs that reach every mixer (one pattern of
    all of them, with a KV format), the data modules, the model families and the trainer presets, the checkpoint
    file's check, preflight's refusals in the corpus's own tokens (the end-of-run needle prompts), and (on a machine
    without CUDA) the GPU presets and fla / flex kernels refused by what config/machine.py reads without torch, in
    one process that imports neither torch nor Lightning (the config dataclasses and what the checks ask of a class
    are declared torch-free: mixers/configs.py, layers/ffn_configs.py, data/configs.py). Then the whole zoo
    imported leaves torch._dynamo out (~2 s on a 2-core machine)."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "ATTNZOO_FULL_IMPORTS"}
    out = subprocess.run([sys.executable, "-c", VALIDATE_PROBE, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    checked = len(VALIDATED) + 2 + len(REFUSED_EARLY) + len(REFUSED_PREFLIGHT) + got["refused_here"]
    assert got == {"checked": checked, "refused_here": got["refused_here"],
                   "torch": False, "lightning": False, "dynamo": False}, got


def test_constant_result_sets_the_mark_torch_sets():
    """ops/dispatch.constant_result stands in for torch.compiler.assume_constant_result without importing Dynamo:
    it must leave a function exactly as torch's decorator does (a torch release that changes the mark fails here)."""
    import torch

    from attnzoo.ops.dispatch import constant_result

    def ours():
        return True

    def theirs():
        return True

    import attnzoo.ops.dispatch as d

    saved = sys.modules.pop("torch._dynamo", None)  # the path taken when Dynamo is not loaded yet
    try:
        constant_result(ours)
    finally:
        if saved is not None:
            sys.modules["torch._dynamo"] = saved
    torch.compiler.assume_constant_result(theirs)
    assert vars(ours) == vars(theirs) and vars(ours), (vars(ours), vars(theirs))
    assert vars(d.fla_available) == vars(theirs) and vars(d.flex_available) == vars(theirs)


SCRIPTS_PROBE = """
import contextlib, io, json, sys
from pathlib import Path
tmp = Path(sys.argv[1])
(tmp / "bad.ckpt").write_bytes(b"PK truncated")
(tmp / "file.txt").write_text("x")
from attnzoo.cli import ckpt, data, export
from attnzoo.bench.cli import main as bench
from attnzoo.inference.commands import eval_main, generate_main
from attnzoo.inference.lm_eval_cli import main as lm_eval
from attnzoo.analysis.report.cli import main as report
cases = [
    (report, [str(tmp / "none")], "attnzoo-report: error: "),
    (generate_main, [str(tmp / "none"), "hi"], "attnzoo-generate: error: checkpoint: "),
    (generate_main, [str(tmp / "bad.ckpt"), "hi"], "attnzoo-generate: error: checkpoint: "),
    (generate_main, [str(tmp / "bad.ckpt"), "hi", "--top-p", "1.5"], "attnzoo-generate: error: --top-p: "),
    (eval_main, [str(tmp / "none")], "attnzoo-eval: error: checkpoint: "),
    (eval_main, [str(tmp / "bad.ckpt"), "--out", str(tmp / "file.txt" / "e.json")], "attnzoo-eval: error: --out: "),
    (ckpt.main, ["info", str(tmp / "bad.ckpt")], "attnzoo-ckpt: error: CKPT: "),
    (ckpt.main, ["consolidate", str(tmp), str(tmp / "x.ckpt")], "attnzoo-ckpt: error: SRC: "),
    (export.main, [str(tmp / "none"), str(tmp / "out")], "attnzoo-export: error: RUN_DIR: "),
    (export.main, [str(tmp / "bad.ckpt"), str(tmp / "file.txt")], "attnzoo-export: error: OUT_DIR: "),
    (data.main, ["prepare", str(tmp / "none"), str(tmp / "out")], "attnzoo-data: error: SRC: "),
    (data.main, ["info", str(tmp)], "attnzoo-data: error: OUT: "),
    (bench, ["--threads", "0", "decode"], "attnzoo-bench decode: error: --threads: "),
    (bench, ["--out", str(tmp / "file.txt" / "b"), "train"], "attnzoo-bench train: error: --out: "),
    (lm_eval, ["run", "--model", "attnzoo", "--model_args", f"path={tmp / 'none'}", "--tasks", "x"],
     "attnzoo-lm-eval: error: checkpoint: "),
]
refused = []
for main, argv, start in cases:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    lines = err.getvalue().strip().splitlines()
    refused.append(code == 2 and len(lines) == 1 and lines[0].startswith(start) or [argv, code, lines])
for main, argv in [(generate_main, ["--help"]), (eval_main, ["--help"]), (ckpt.main, ["--help"]),
                   (export.main, ["--help"]), (data.main, ["prepare", "--help"]), (bench, ["--help"]),
                   (bench, ["decode", "--help"]), (bench, ["train", "--help"]), (lm_eval, ["--help"]),
                   (report, ["--help"])]:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            main(argv)
        except SystemExit as e:
            refused.append(e.code == 0 and out.getvalue().startswith("usage:") or [argv, e.code])
print(json.dumps({"refused": refused, "torch": "torch" in sys.modules, "lightning": "lightning" in sys.modules}))
"""


def test_every_console_script_refuses_and_helps_without_torch(tmp_path):
    """Issue 45 item 1 beyond attnzoo-train: a missing or truncated checkpoint, a bad flag, a path under a file, a
    missing source, for attnzoo-generate / -eval / -ckpt / -export / -data / -bench / -lm-eval / -report, each refused in
    its one line, and their --help texts, in one process that never imports torch or Lightning (the command
    lines are checked before the work's modules are imported: inference/commands.py, cli/*.py, bench/cli.py,
    inference/lm_eval_cli.py)."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "ATTNZOO_FULL_IMPORTS"}
    out = subprocess.run([sys.executable, "-c", SCRIPTS_PROBE, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"refused": [True] * 25, "torch": False, "lightning": False}, got

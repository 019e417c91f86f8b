"""Every console script's --help, and each subcommand's, exits 0 with a usage text (issue 45 item 6:
`attnzoo-bench --help` crashed on a '%' in a subcommand's help string). The argparse scripts are called in
process (their main(argv)); attnzoo-train / attnzoo-sweep parse with Hydra, whose --help runs in a subprocess."""
from __future__ import annotations

import subprocess
import sys

import pytest

from attnzoo.analysis.report.cli import main as report_main
from attnzoo.bench.cli import main as bench_main, subcommands
from attnzoo.cli.ckpt import main as ckpt_main
from attnzoo.cli.data import main as data_main
from attnzoo.cli.export import main as export_main
from attnzoo.inference.generate import eval_main, generate_main
from attnzoo.inference.lm_eval import main as lm_eval_main

ARGPARSE = {
    "attnzoo-bench": (bench_main, [[]] + [[name] for name in sorted(subcommands())]),
    "attnzoo-ckpt": (ckpt_main, [[], ["consolidate"], ["info"]]),
    "attnzoo-data": (data_main, [[], ["prepare"], ["info"]]),
    "attnzoo-export": (export_main, [[]]),
    "attnzoo-generate": (generate_main, [[]]),
    "attnzoo-eval": (eval_main, [[]]),
    "attnzoo-lm-eval": (lm_eval_main, [[]]),
    "attnzoo-report": (report_main, [[]]),
}


@pytest.mark.parametrize("script", list(ARGPARSE))
def test_help_of_every_argparse_script_and_subcommand(script, capsys):
    main, commands = ARGPARSE[script]
    for command in commands:
        with pytest.raises(SystemExit) as e:
            main([*command, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0, (script, command)
        assert out.startswith("usage: "), (script, command, out[:200])


def test_bench_subcommand_help_from_source_is_the_modules():
    """`attnzoo-bench SUB --help` builds SUB's options from its source without importing it (no torch:
    bench/cli.arguments_from_source); every subcommand's help text equals the one its imported module gives, and
    a function the literal constants cannot run (a name from an import) falls back to the import."""
    import argparse

    from attnzoo.bench import cli

    for name, mod in sorted(subcommands().items()):
        built = cli.arguments_from_source(name)
        assert built is not None, name  # every subcommand answers --help without torch today
        texts = []
        for add in (built[0], mod.add_arguments):
            p = argparse.ArgumentParser(prog=f"attnzoo-bench {name}")
            add(p)
            texts.append(p.format_help())
        assert texts[0] == texts[1], name
        assert built[1] == getattr(mod, "QUICK", None), name
    source = "X = [1]\nY = object()\ndef add_arguments(p):\n    p.add_argument('--y', default=Y)\n"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(cli.Path, "read_text", lambda self: source)
        assert cli.arguments_from_source("anything") is None


@pytest.mark.parametrize("script", ["train", "sweep"])
def test_help_of_the_hydra_scripts(script):
    r = subprocess.run([sys.executable, "-m", f"attnzoo.cli.{script}", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "attnzoo" in (r.stdout + r.stderr).lower() and r.stdout.strip(), r.stdout[:500]


def test_train_help_lists_the_groups_hydra_lists():
    """attnzoo-train's own --help (one composition instead of Hydra's ~1.5 s listing: issue 45) names every config
    group and option Hydra's config loader knows, and nothing else."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from attnzoo.cli.train import config_groups
    from attnzoo.config.paths import CONF_DIR

    def walk(loader, parent=""):
        for g in loader.list_groups(parent):
            full = f"{parent}/{g}" if parent else g
            if full.split("/")[0] == "hydra":
                continue
            options = loader.get_group_options(full)
            if options:
                yield full, sorted(options)
            yield from walk(loader, full)

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            hydra_lists = sorted(walk(GlobalHydra.instance().config_loader()))
    finally:
        GlobalHydra.instance().clear()
    assert hydra_lists == config_groups() and len(hydra_lists) > 10, (hydra_lists, config_groups())

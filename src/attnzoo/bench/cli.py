"""Dispatcher for `attnzoo-bench`: discovers subcommand modules in this package."""
from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import platform
import sys
import time
from pathlib import Path

import attnzoo.cli  # noqa: F401 - an entry point: Lightning's import kept lean (attnzoo/_lean_imports.py)

# torch and the subcommand's module are imported once the command line's shared options were checked, and only
# the subcommand asked for (issue 45: `attnzoo-bench --threads 0 decode` refused, `attnzoo-bench --help` listed,
# in the time of Python's start; each module imports torch)

_SKIP = {"cli", "common", "__main__"}


def subcommand_names() -> list[str]:
    pkg = importlib.import_module("attnzoo.bench")
    return sorted(i.name for i in pkgutil.iter_modules(pkg.__path__) if i.name not in _SKIP and not i.name.startswith("_"))


def subcommands() -> dict:
    """Every subcommand's module, imported (tests; the command line imports the one it runs)."""
    return {name: importlib.import_module(f"attnzoo.bench.{name}") for name in subcommand_names()}


def help_of(name: str) -> str:
    """A subcommand module's HELP, read from its source without importing it (a literal string), else imported."""
    import ast

    path = Path(__file__).with_name(f"{name}.py")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "HELP" for t in node.targets):
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                break
    return getattr(importlib.import_module(f"attnzoo.bench.{name}"), "HELP", "")


def arguments_from_source(name: str) -> tuple | None:
    """A subcommand module's `add_arguments` and QUICK, built from its source without importing it (and torch):
    the function is compiled alone, in a namespace of the module's literal constants. None where the function
    needs more than that (the caller imports the module). `attnzoo-bench SUB --help` answers in Python's start
    time; tests/test_lean_imports.py checks every subcommand's help equals the imported module's."""
    import ast

    tree = ast.parse(Path(__file__).with_name(f"{name}.py").read_text())
    ns: dict = {"__name__": f"attnzoo.bench.{name}", "Path": Path, "argparse": argparse}
    func = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue
            ns.update({t.id: value for t in node.targets})
        elif isinstance(node, ast.FunctionDef) and node.name == "add_arguments":
            func = node
    if func is None:
        return None
    exec(compile(ast.Module(body=[func], type_ignores=[]), f"attnzoo/bench/{name}.py", "exec"), ns)  # noqa: S102
    try:
        ns["add_arguments"](argparse.ArgumentParser())  # a name the constants do not give: import the module
    except Exception:  # noqa: BLE001
        return None
    return ns["add_arguments"], ns.get("QUICK")


def markdown_table(columns: list[str], rows: list[dict]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
        if isinstance(v, int):
            return f"{v:,}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def environment() -> dict:
    import torch

    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_result(name: str, result: dict, out: Path, argv: list[str]) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    result = {**result, "command": "attnzoo-bench " + " ".join(argv), "environment": environment()}
    js, md = out / f"{name}.json", out / f"{name}.md"
    js.write_text(json.dumps(result, indent=2, default=str))
    text = [f"## {result.get('title', name)}", "", f"`{result['command']}`", ""]
    text.append(markdown_table(result["columns"], result["rows"]))
    for note in result.get("notes", []):
        text += ["", note]
    md.write_text("\n".join(text) + "\n")
    return js, md


def check_common(args) -> None:
    """--threads and --out, one line each (ConfigError) before any benchmark runs."""
    from attnzoo.config.errors import ConfigError
    from attnzoo.config.paths import check_dir_path

    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"must be >= 1, got {args.threads}; allowed: omit it for torch's default", field="--threads")
    check_dir_path(Path(args.out).expanduser(), "--out", allowed="a folder (new or existing)",
                   allowed_under="a folder under a writable directory")


def _common_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("bench_results"), help="folder for JSON + markdown")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (>= 1)")


def build_parser(argv: list[str], cmd: str | None, names: list[str]) -> tuple[argparse.ArgumentParser, dict]:
    """The whole command line: every subcommand listed, the one asked for with its options. For `SUB --help` the
    options come from the module's source (arguments_from_source: no torch); to run, from the imported module."""
    helping = bool({"-h", "--help"} & set(argv))
    built = arguments_from_source(cmd) if cmd and helping else None
    mods = {cmd: importlib.import_module(f"attnzoo.bench.{cmd}")} if cmd and built is None else {}
    parser = argparse.ArgumentParser(prog="attnzoo-bench", description=__doc__)
    _common_options(parser)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in names:
        mod = mods.get(name)
        p = sub.add_parser(name, help=getattr(mod, "HELP", "") if mod else help_of(name))
        if name != cmd:  # not the one asked for: named in the listing only
            continue
        add_arguments, quick = built if built is not None else (mod.add_arguments, getattr(mod, "QUICK", None))
        add_arguments(p)
        if quick is not None:  # modules without their own --quick: a dict of tiny argument values
            p.add_argument("--quick", action="store_true", help="tiny sizes for tests (seconds): " +
                           " ".join(f"--{k.replace('_', '-')} {v}" for k, v in quick.items()))
            if "--quick" in argv:  # the tiny sizes become the defaults; flags given explicitly still win
                p.set_defaults(**quick)
    return parser, mods


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    names = subcommand_names()
    pre = argparse.ArgumentParser(add_help=False)  # the shared options and the subcommand's name, nothing imported
    _common_options(pre)
    pre.add_argument("cmd", nargs="?")
    first, _ = pre.parse_known_args(argv)
    if first.cmd in names and not {"-h", "--help"} & set(argv):
        from attnzoo.config.errors import ConfigError

        try:
            check_common(first)
        except ConfigError as e:
            pre.exit(2, f"attnzoo-bench {first.cmd}: error: {str(e).splitlines()[0]}\n")
    parser, mods = build_parser(argv, first.cmd if first.cmd in names else None, names)
    args = parser.parse_args(argv)
    args.argv = argv  # for a mode that writes its results as they come (gpu_check), with the command in them
    from attnzoo.config.errors import ConfigError

    try:
        check_common(args)  # before the benchmark runs: a bad --out would otherwise fail after minutes of work
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        result = mods[args.cmd].run(args)
    except (ConfigError, ValueError) as e:  # a bad combination of flags: one line, not a traceback
        parser.exit(2, f"attnzoo-bench {args.cmd}: error: {str(e).splitlines()[0]}\n")
    exit_code = result.pop("exit_code", 0)  # a check (gpu_check) that failed: results written, then status 1
    js, md = write_result(result.pop("name", args.cmd), result, args.out, argv)  # a mode may name its own files
    print(md.read_text())
    print(f"wrote {js} and {md}")
    if exit_code:
        raise SystemExit(exit_code)

"""Run every command of the README's ```bash blocks in smoke form (tests/test_readme_commands.py and tests/test_readme_chains.py run it in CI, one test per command or chain).

- `attnzoo-train ...`, `attnzoo-sweep ...`, `attnzoo-report ...`, `attnzoo-bench ...`: run for real, with
  `debug=smoke` and 2 steps (bench: `--quick`), outputs in a temp dir; a sweep's grid is cut to its first
  point (the grid keys given again on the command line replace the file's lists); `~` is a temp home with
  a small text corpus in `~/my_corpus/`; wandb is offline.
- commands that need hardware this machine may lack (`trainer=gpu|ddp`, SLURM, `torchrun`/`srun` on
  several nodes): the config is composed and validated exactly as `attnzoo-train` would before starting
  (every value checked), but nothing is launched.
- `bash scripts/setup.sh && X`: X (setup is what CI has just done); the test command itself is not rerun.
- `attnzoo-train experiment=linearize ...`: as any training command, with one step per stage
  (`linearize.stage1_steps=1 linearize.stage2_steps=1`: the experiment sets max_steps from them).
- `attnzoo-lm-eval ... --model_args path=outputs/train/<run>,... --tasks ...`: on the last text run, the tasks
  replaced by one local multiple-choice task (offline; the harness's own tasks download from the hub).
- `attnzoo-export outputs/train/<run> OUT`: exports the last decoder LM trained on text above (like
  `attnzoo-generate` / `attnzoo-eval`); OUT under `~` lands in the temp home, where a later
  `attnzoo-train 'model.init_from="~/..."'` reads it.

Commands run in two lanes side by side (`lanes`): the ones that read an earlier command's output in README order,
the others beside them. The test suite runs them as separate tests (no test near a timeout): each independent
command alone (tests/test_readme_commands.py), each chain of dependent ones in its own sandbox
(tests/test_readme_chains.py). Each command is a process of its own, forked from a fork server that imported
torch, Lightning and attnzoo once (scripts/warm_run.py; `ATTNZOO_WORKER_START=spawn`: a fresh `python` each).

    .venv/bin/python scripts/check_readme.py [README.md]
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:  # the commands run as processes forked from a warm fork server (scripts/warm_run.py)
    from scripts.warm_run import run_python
except ImportError:  # run as `python scripts/check_readme.py`
    from warm_run import run_python

ROOT = Path(__file__).resolve().parents[1]
HARDWARE = ("trainer=gpu", "trainer=ddp ", "hydra/launcher=slurm")
SMOKE = ["debug=smoke", "trainer.max_steps=2", "trainer.val_check_interval=2", "perf.decode_tokens=2",
         "sample.max_new_tokens=4"]


def commands(readme: Path) -> list[str]:
    out, block = [], False
    lines = readme.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            block = line.strip() == "```bash" and not block
            i += 1
            continue
        if block and line.strip() and not line.lstrip().startswith("#"):
            cmd = line
            while cmd.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd.rstrip()[:-1] + " " + lines[i].strip()
            out.append(cmd)
        i += 1
    return out


def strip_comment(cmd: str) -> list[str]:
    return shlex.split(cmd, comments=True)


def sweep_first_point(name: str) -> list[str]:
    import yaml

    params = (yaml.safe_load((ROOT / "sweeps" / f"{name}.yaml").read_text()) or {}).get("hydra", {}) \
        .get("sweeper", {}).get("params", {})
    return [f"{k}={str(v).split(',')[0]}" for k, v in params.items()]


def first_values(args: list[str]) -> list[str]:
    """A multirun's first job: `a=x,y` -> `a=x` (lists in brackets are kept)."""
    out = []
    for a in args:
        k, eq, v = a.partition("=")
        out.append(f"{k}={v.split(',')[0]}" if eq and "," in v and not v.startswith("[") else a)
    return out


def config_check(args: list[str], env: dict) -> subprocess.CompletedProcess:
    """Compose and validate as `attnzoo-train` does before any work (no device check, nothing launched).

    In this process (a process start per check cost 8 s of the suite each): only the independent lane checks
    configs, one at a time, so Hydra's global state is never shared between threads."""
    args = [a for a in first_values(args) if a not in ("-m", "--multirun") and not a.startswith("hydra")]
    from attnzoo.api import load_config
    from attnzoo.cli.train import check_group_overrides
    from attnzoo.training.config_checks import validate

    try:
        code = check_group_overrides(args)
        if code:
            return subprocess.CompletedProcess(args, code, "", "a config-group override was refused")
        validate(load_config(args))
    except Exception as e:  # noqa: BLE001 - the message is the result
        return subprocess.CompletedProcess(args, 1, "", f"{type(e).__name__}: {e}")
    return subprocess.CompletedProcess(args, 0, "config ok", "")


def run(cmd: str, tmp: Path, env: dict, sweep_dirs: dict, n: int) -> tuple[str, subprocess.CompletedProcess | None]:
    if cmd.startswith("bash scripts/setup.sh && "):
        cmd = cmd.split("&&", 1)[1].strip()
    argv = strip_comment(cmd)
    if argv[0].startswith(".venv/bin/"):
        argv[0] = argv[0].removeprefix(".venv/bin/")
    if argv[:3] == ["python", "-m", "pytest"]:
        return "skipped: the test suite itself (it runs this check)", None
    if argv[0] in ("torchrun", "srun"):
        i = next(j for j, a in enumerate(argv) if a.endswith("attnzoo-train") or a == "attnzoo.cli.train")
        return "config checked (multi-node launcher)", config_check(argv[i + 1:], env)
    tool, args = argv[0], argv[1:]
    if tool == "attnzoo-train":
        if any(h.strip() in args for h in HARDWARE) or any(a in ("trainer=ddp", "trainer=fsdp") for a in args):
            return "config checked (needs a GPU or SLURM)", config_check(args, env)
        multirun = "-m" in args or "--multirun" in args
        where = f"hydra.sweep.dir={tmp}/train{n}" if multirun else f"hydra.run.dir={tmp}/train{n}"
        if not multirun and not any(a.startswith(("model=enc", "experiment=seq2seq", "data=")) for a in args):
            sweep_dirs["<run>"] = tmp / f"train{n}"  # a decoder LM on text: what attnzoo-generate / -eval use
        stages = ["linearize.stage1_steps=1", "linearize.stage2_steps=1"] if "experiment=linearize" in args else []
        return "ran", run_python(["-m", "attnzoo.cli.train", *args, *SMOKE, *stages, where],
                                 env=env, timeout=600)
    if tool == "attnzoo-sweep":
        name, rest = args[0], args[1:]
        given = next((a.split("=", 1)[1] for a in rest if a.startswith("hydra.sweep.dir=")), None)
        d = tmp / f"sweep{n}"
        if given:
            sweep_dirs[given] = d
        rest = [a for a in rest if not a.startswith("hydra.sweep.dir=")]
        return "ran (first grid point)", run_python(
            ["-m", "attnzoo.cli.sweep", name, *rest, *sweep_first_point(name), *SMOKE, f"hydra.sweep.dir={d}"],
            env=env, timeout=600, fresh=True)  # a fresh process: scripts/warm_run.py
    if tool == "attnzoo-report":
        d = sweep_dirs.get(args[0])
        if d is None:
            return f"failed: {args[0]} is not a sweep dir made by an earlier README command", None
        return "ran", run_python(["-m", "attnzoo.analysis.report", str(d)], env=env, timeout=300)
    if tool in ("attnzoo-generate", "attnzoo-eval"):
        run_dir = sweep_dirs.get("<run>")
        if run_dir is None:
            return "failed: no earlier README training run to use", None
        (tmp / "prompts.txt").write_text("def \nimport \n")
        (tmp / "other_corpus.txt").write_text((ROOT / "README.md").read_text())
        args = [str(run_dir) if "<run>" in a else str(tmp / a) if a in ("prompts.txt", "other_corpus.txt") else a
                for a in args]
        module = "generate_main" if tool == "attnzoo-generate" else "eval_main"
        code = f"import sys; from attnzoo.inference.generate import {module}; {module}(sys.argv[1:])"
        return "ran", run_python(["-c", code, *args], env=env, timeout=600)
    if tool == "attnzoo-export":  # the README's last decoder run on text, out to a dir under the temp home
        run_dir = sweep_dirs.get("<run>")
        if run_dir is None:
            return "failed: no earlier README training run to use", None
        args = [str(run_dir) if "<run>" in a else a for a in args]
        return "ran", run_python(["-m", "attnzoo.cli.export", *args], env=env, timeout=600)
    if tool == "attnzoo-lm-eval":  # the README's last text run; the hub tasks replaced by one local task
        run_dir = sweep_dirs.get("<run>")
        if run_dir is None:
            return "failed: no earlier README training run to use", None
        tasks = tmp / "lm_eval_tasks"
        tasks.mkdir(exist_ok=True)
        (tasks / "mc.jsonl").write_text('{"question": "import", "choices": [" os", "@@@"], "label": 0}\n'
                                        '{"question": "def f(x)", "choices": [":", "))"], "label": 0}\n')
        (tasks / "mc.yaml").write_text(
            "task: readme_smoke_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {tasks / 'mc.jsonl'}\n  cache_dir: {tmp / 'hf_cache'}\ntest_split: test\n"
            "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
            "doc_to_target: \"{{label}}\"\nmetric_list:\n  - metric: acc\n")
        args = [a.replace("outputs/train/<run>", str(run_dir)) for a in args]
        i = args.index("--tasks")
        args[i + 1] = "readme_smoke_mc"
        offline = {**env, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        return "ran (a local task)", run_python(
            ["-m", "attnzoo.inference.lm_eval", *args, "--include_path", str(tasks),
             "--output_path", str(tmp / "lm_eval_out")], env=offline, timeout=600)
    if tool == "attnzoo-bench":
        return "ran (--quick)", run_python(["-m", "attnzoo.bench", "--out", str(tmp / "bench"),
                                            *args, "--quick"], env=env, timeout=600)
    return f"failed: no smoke form for {tool!r}", None


CONSUMERS = ("attnzoo-generate", "attnzoo-eval", "attnzoo-export", "attnzoo-lm-eval", "attnzoo-report")


def sets_run(cmd: str) -> bool:
    """A command whose run becomes `<run>` for the generate / eval / export commands after it (as `run` decides)."""
    argv = strip_comment(cmd.split("&&", 1)[1] if cmd.startswith("bash scripts/setup.sh && ") else cmd)
    args = argv[1:]
    return (argv[0].removeprefix(".venv/bin/") == "attnzoo-train" and "-m" not in args and "--multirun" not in args
            and not any(h.strip() in args for h in HARDWARE) and "trainer=ddp" not in args and "trainer=fsdp" not in args
            and not any(a.startswith(("model=enc", "experiment=seq2seq", "data=")) for a in args))


def lanes(cmds: list[str]) -> tuple[list[int], list[int]]:
    """Two lanes run side by side (2 cores): the serial lane keeps, in README order, every command that reads
    what an earlier one made (generate / eval / export / lm-eval / report, `~/exported`, a sweep dir a report
    names) and the training run each of those reads (the last one before it); every other command is
    independent of the others and goes to the second lane."""
    serial = set()
    for i, cmd in enumerate(cmds):
        tool = strip_comment(cmd)[0] if not cmd.startswith("bash ") else ""
        if tool in CONSUMERS or "~/exported" in cmd or (tool == "attnzoo-sweep" and "hydra.sweep.dir=" in cmd):
            serial.add(i)
            if tool in CONSUMERS[:4]:
                last = max((j for j in range(i) if sets_run(cmds[j])), default=None)
                if last is not None:
                    serial.add(last)
    return sorted(serial), [i for i in range(len(cmds)) if i not in serial]


def reads_earlier(cmd: str) -> bool:
    """A command that reads what an earlier README command made (a run, `~/exported`, a sweep dir)."""
    tool = strip_comment(cmd)[0] if not cmd.startswith("bash ") else ""
    return tool in CONSUMERS or "~/exported" in cmd


def chains(cmds: list[str]) -> list[list[int]]:
    """The serial lane cut into independent chains: each starts at a command that reads nothing earlier (a
    training run, a sweep) and holds the commands after it that read what the chain made. Chains share nothing,
    so each runs in its own sandbox (tests/test_readme_chains.py: one test per chain)."""
    out: list[list[int]] = []
    for i in lanes(cmds)[0]:
        if reads_earlier(cmds[i]) and out:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def sandbox(tmp: Path) -> dict:
    """A temp home with a small text corpus in `~/my_corpus/`, and the environment the commands run in."""
    home = tmp / "home"
    (home / "my_corpus").mkdir(parents=True, exist_ok=True)
    (home / "my_corpus" / "a.txt").write_text((ROOT / "README.md").read_text() * 20)
    env = {**os.environ, "HOME": str(home), "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
           "ATTNZOO_CACHE": os.environ.get("ATTNZOO_CACHE", str(Path.home() / ".cache" / "attnzoo"))}
    env.pop("WANDB_API_KEY", None)
    return env


def run_checked(cmds: list[str], n: int, tmp: Path, env: dict, sweep_dirs: dict) -> tuple[bool, str]:
    """Run README command `n` in smoke form: (passed, a report line with its output when it failed)."""
    cmd = cmds[n]
    t0 = time.time()
    how, res = run(cmd, tmp, env, sweep_dirs, n)
    ok = not how.startswith("failed") and (res is None or res.returncode == 0)
    line = f"{'ok  ' if ok else 'FAIL'} {time.time() - t0:5.1f}s  {how:40s} {cmd.strip()}"
    if not ok and res is not None:
        line += "\n     " + (res.stdout[-1500:] + res.stderr[-1500:]).replace("\n", "\n     ")
    return ok, line


def main() -> None:
    import threading

    readme = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "README.md"
    failed = []
    lock = threading.Lock()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        env = sandbox(tmp)
        cmds = commands(readme)

        def lane(indices: list[int], sweep_dirs: dict) -> None:
            for n in indices:
                ok, line = run_checked(cmds, n, tmp, env, sweep_dirs)
                with lock:
                    if not ok:
                        failed.append(cmds[n])
                    print(line, flush=True)

        serial, independent = lanes(cmds)
        threads = [threading.Thread(target=lane, args=(serial, {})), threading.Thread(target=lane, args=(independent, {}))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    print(f"{len(failed)} failed" if failed else "every README command passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

"""`attnzoo-bench gpu_check` fits a short GPU rental (issue 50): rows streamed as cases end, a per-case time limit
that kills a hung case (timeout), a budget whose unreached cases are `not run` (never passed), the first call
(compile / autotune) timed apart from the check. All on the CPU with cases swapped in; the real harness on the CPU
is tests/test_dispatch.py's."""
import json
import os
import time

import pytest

from attnzoo.bench import cli, gpu_check as gc


def ok(ctx):
    return {"ran": True, "out": (0.0, None), "grad": (0.0, "w", None), "bounds": (0.02, 0.04)}


def hang(ctx):
    time.sleep(600)  # a compile that never ends: only killing the worker ends it
    return ok(ctx)


def case(name, run):
    return gc.Case(name, "fla", "bf16", run)


def check(tmp_path, *flags) -> tuple[int, dict]:
    """Run the command on the CPU; (exit status, {case: row}) from gpu_check.json."""
    try:
        cli.main(["--out", str(tmp_path), "gpu_check", "--device", "cpu", *flags])
        code = 0
    except SystemExit as e:
        code = e.code
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    return code, {r["case"]: r for r in rows}


def jsonl(tmp_path) -> list:
    return [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]


def test_each_row_is_written_when_its_case_ends(tmp_path, monkeypatch):
    """The second case reads the results folder while it runs: the first case's row is already in the JSON lines
    and the markdown, the others are listed as not run yet."""

    def looks(ctx):
        rows = jsonl(tmp_path)
        md = (tmp_path / "gpu_check.md").read_text()
        seen = f"{len(rows)} row {rows[0]['case']} {rows[0]['status']}"
        listed = "| first | torch | fp32 | yes |" in md and "| looks | torch | fp32 |" in md and "not run yet" in md
        return {"skip": f"{seen}; md {'current' if listed else 'stale'}"}

    monkeypatch.setattr(gc, "CASES", [case("first", ok), case("looks", looks), case("last", ok)])
    code, rows = check(tmp_path)
    assert code == 0
    assert rows["looks"]["status"] == "skip (1 row first ok; md current)"
    assert [r["case"] for r in jsonl(tmp_path)] == ["first", "looks", "last"]
    assert "not run yet" not in (tmp_path / "gpu_check.md").read_text()  # the final table: every case ended


def test_the_first_call_is_timed_apart_from_the_check(tmp_path, monkeypatch):
    """Each case runs twice; the errors are the second call's (the first one compiles and autotunes on a GPU)."""
    calls = []

    def second_call_differs(ctx):
        calls.append(1)
        return {"ran": True, "out": (0.5 if len(calls) == 1 else 0.0, None), "grad": (0.0, "w", None),
                "bounds": (0.02, 0.04)}

    monkeypatch.setattr(gc, "CASES", [case("twice", second_call_differs)])
    code, rows = check(tmp_path)
    row = rows["twice"]
    assert code == 0 and row["status"] == "ok" and row["out err"] == 0.0
    assert row["first s"] >= 0 and row["check s"] >= 0
    assert "| first s | check s |" in (tmp_path / "gpu_check.md").read_text()


def test_a_case_past_the_limit_is_killed_and_recorded_as_timeout(tmp_path, monkeypatch):
    """A hung first call and a hung check are both killed at --case-limit (the worker process, not a signal: a
    hung kernel compile never returns to Python); a fresh worker runs the cases after them; exit status 1."""
    calls = []

    def hangs_in_the_check(ctx):
        calls.append(1)  # the worker's own list: the first call returns, the second hangs
        return ok(ctx) if len(calls) == 1 else hang(ctx)

    monkeypatch.setattr(gc, "CASES", [case("hangs", hang), case("between", ok),
                                      case("hangs-in-check", hangs_in_the_check), case("after", ok)])
    code, rows = check(tmp_path, "--case-limit", "1")
    assert code == 1
    assert rows["hangs"]["status"] == "timeout (> 1 s per case, in the first call)"
    assert rows["hangs"]["first s"] is None
    assert rows["hangs-in-check"]["status"] == "timeout (> 1 s per case, in the check)"
    assert rows["hangs-in-check"]["first s"] is not None
    assert rows["between"]["status"] == rows["after"]["status"] == "ok"
    assert [r["case"] for r in jsonl(tmp_path)] == ["hangs", "between", "hangs-in-check", "after"]


def test_a_budget_that_runs_out_lists_the_rest_as_not_run(tmp_path, monkeypatch):
    monkeypatch.setattr(gc, "CASES", [case("done", ok), case("slow", hang), case("c", ok), case("d", ok)])
    code, rows = check(tmp_path, "--budget", "5")
    assert code == 1  # a case timed out
    assert rows["done"]["status"] == "ok"
    assert rows["slow"]["status"] == "timeout (the --budget of 5 s ran out in the first call)"
    assert rows["c"]["status"] == rows["d"]["status"] == "not run (the --budget of 5 s ran out)"
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| c | torch | fp32 |" in md and "result: 1 ok, 1 timeout, 2 not run of 4 cases; FAILED: slow" in md


def test_exit_status_of_an_incomplete_check_is_not_zero():
    rows = [{"case": "a", "status": "ok"}, {"case": "b", "status": "skip (no fla)"},
            {"case": "c", "status": "not run (the --budget of 5 s ran out)"}]
    assert gc.outcome(rows) == ("result: 1 ok, 1 skip, 1 not run of 3 cases", 4)
    assert gc.outcome(rows[:2])[1] == 0
    assert gc.outcome(rows + [{"case": "d", "status": "error: RuntimeError: x"}])[1] == 1


def test_a_worker_that_dies_is_an_error_and_the_rest_still_run(tmp_path, monkeypatch):
    def dies(ctx):
        os._exit(3)  # a crash in a kernel, or the out-of-memory killer

    monkeypatch.setattr(gc, "CASES", [case("dies", dies), case("after", ok)])
    code, rows = check(tmp_path)
    assert code == 1
    assert rows["dies"]["status"] == "error: the worker process died in this case (exit code 3)"
    assert rows["after"]["status"] == "ok"


def test_the_spawned_worker_cuda_uses(tmp_path, monkeypatch, capsys):
    """On CUDA the worker is spawned (a forked child cannot use CUDA): the same path on the CPU, with a real case."""
    monkeypatch.setitem(gc.START_METHOD, "cpu", "spawn")
    code, rows = check(tmp_path, "--cases", "sdpa-flash/gqa", "--quick")
    assert code == 0 and rows["sdpa-flash/gqa"]["status"] == "ok" and rows["sdpa-flash/gqa"]["ran"] == "yes"


@pytest.mark.parametrize("flags,message", [
    (["--case-limit", "0"], "attnzoo-bench gpu_check: error: --case-limit: must be > 0 seconds, got 0"),
    (["--budget", "-1"], "attnzoo-bench gpu_check: error: --budget: must be > 0 seconds, got -1; allowed: omit it "
                         "for no limit"),
])
def test_bad_limits_are_refused_in_one_line(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        cli.main(["--out", str(tmp_path), "gpu_check", "--device", "cpu", *flags])
    assert e.value.code == 2 and capsys.readouterr().err.strip() == message
    assert not (tmp_path / "gpu_check.jsonl").exists()


@pytest.mark.parametrize("flags,total", [([], 600), (["--quick"], 240)], ids=["full", "quick"])
def test_the_script_plans_within_its_total(flags, total):
    """scripts/gpu_check.sh --plan: every step's limit printed, the limits adding up to at most the script's own
    total, which is at most 10 minutes (--quick: 4); the script also cuts each step to what is left of it."""
    import re
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
    out = subprocess.run(["bash", str(script), "--plan", *flags], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    head, *steps = out.stdout.strip().splitlines()
    planned, of = map(int, re.search(r"limits adding up to (\d+) s of a (\d+) s total", head).groups())
    limits = [int(re.match(r"\s+\S+\s+(\d+) s\s", line).group(1)) for line in steps]
    assert len(limits) >= 5 and sum(limits) == planned <= of <= total
    assert any(line.split()[0] == "gpu_check" for line in steps)

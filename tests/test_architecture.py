"""The architecture contract (pyproject.toml [tool.importlinter]): layers import only downwards, no cycles.
`lint-imports` ships with the dev extra; CI installs it, so this test runs everywhere the suite does."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_layers_kept():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    r = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "0 broken" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


def test_every_module_is_in_a_layer():
    """A new subpackage (or top-level module) must be placed in the contract, or the contract silently ignores it."""
    import tomllib

    layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    listed = {m.strip() for layer in layers for part in layer.split("|") for m in part.split(":")}
    pkg = ROOT / "src" / "attnzoo"
    modules = {f"attnzoo.{p.stem}" for p in pkg.glob("*.py") if p.stem != "__init__"}
    modules |= {f"attnzoo.{p.name}" for p in pkg.iterdir() if (p / "__init__.py").is_file()}
    assert modules <= listed, f"modules missing from [tool.importlinter] layers: {sorted(modules - listed)}"


def test_the_tree_shows_the_architecture():
    """The code lives in the subpackages (docs/architecture.md): at most 6 modules at the top of src/attnzoo,
    and no file so long that it holds more than one room (500 lines)."""
    pkg = ROOT / "src" / "attnzoo"
    top = sorted(p.name for p in pkg.glob("*.py"))
    assert len(top) <= 6, top
    long = {str(p.relative_to(pkg)): n for p in pkg.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"files over 500 lines: {long}"

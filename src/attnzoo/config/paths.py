"""Where the shipped configs live: `conf/` inside an installed wheel, the repo's top-level `conf/` in a checkout."""
from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parents[1]  # the attnzoo package (this file is attnzoo/config/paths.py)


def _find(name: str) -> Path:
    for candidate in (_PKG / name, _PKG.parent.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"attnzoo: cannot find the '{name}/' folder next to the package or the repository root")


CONF_DIR = _find("conf")


def sweeps_dir() -> Path:
    return _find("sweeps")


# ----------------------------------------------------------------------------- files a user keeps


def umask() -> int:
    """The process umask, read without changing it where the OS says it (Linux /proc), else set and restored."""
    import os

    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path, directory: bool = False) -> None:
    """Give `path` the mode `open()` / `mkdir()` would have given it (0o666 / 0o777 less the umask):
    tempfile.mkstemp / mkdtemp and safetensors create 0600 / 0700 files, unreadable on a shared filesystem."""
    import os

    mode = (0o777 if directory else 0o666) & ~umask()
    if isinstance(path, int):
        os.fchmod(path, mode)
    else:
        os.chmod(path, mode)


def unwritable(path) -> str | None:
    """Why a file or directory cannot be created at `path` (its nearest existing ancestor is a file, or
    read-only), or None. Checked before any work, so a command fails in one line instead of at its end."""
    import os

    p = Path(path).expanduser().absolute()
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is read-only"
    return None


def check_dir_path(path: Path, field: str, *, allowed: str, allowed_under: str, empty: bool = False) -> None:
    """`path` can be (or become) a directory this command writes into: not a file, (with `empty`) new or empty,
    under a writable directory. One line naming `field` (ConfigError), before any work."""
    from attnzoo.config.errors import ConfigError

    if path.exists() and not path.is_dir():
        raise ConfigError(f"{path} is a file; allowed: {allowed}", field=field)
    if empty and path.is_dir() and any(path.iterdir()):
        raise ConfigError(f"{path} exists and is not empty; allowed: {allowed}", field=field)
    why = unwritable(path)
    if why:
        raise ConfigError(f"{path} cannot be created ({why}); allowed: {allowed_under}", field=field)

"""Command-line overrides checked before Hydra composes them (its own report of a bad option is several lines):
used by attnzoo-train / attnzoo-sweep (cli/train.py) and by `attnzoo.load_config` (the library and attnzoo-bench)."""
from __future__ import annotations

from attnzoo.config.paths import CONF_DIR


def check_group_overrides(args: list[str]) -> str | None:
    """One-line error for `group=option` overrides naming an option that does not exist (before Hydra's
    multi-line report). Handles `a,b` multirun lists; leaves sweep functions and `+`/`~` forms to Hydra."""
    for arg in args:
        if "=" not in arg or arg.startswith(("-", "+", "~", "hydra")):
            continue
        key, value = arg.split("=", 1)
        key = key.removeprefix("override ").strip()
        group_dir = CONF_DIR / key
        if not group_dir.is_dir() or "(" in value:
            continue
        allowed = sorted(p.stem for p in group_dir.glob("*.yaml"))
        # `logger=[csv,tensorboard]`: several options of one group at once (Hydra's list syntax)
        for option in value.strip().removeprefix("[").removesuffix("]").split(","):
            option = option.strip()
            if option and option != "null" and option not in allowed:
                return f"{key}: unknown option {option!r}; allowed: {', '.join(allowed)}"
    return None

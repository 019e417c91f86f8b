"""OmegaConf resolvers for configs that derive one size from another (registered when attnzoo.config is imported,
so every composition sees them: attnzoo-train, attnzoo-sweep, the API, the tests).

    ${attnzoo.mul:${model.n_layers},16}     n_layers x 16
    ${attnzoo.div:${model.d_model},16}      d_model / 16, refused in one line unless it divides exactly

sweeps/scaling.yaml builds its ladder of model sizes with them from one rule (a fixed aspect ratio
d_model / n_layers and a fixed head size), so a sweep over n_layers alone moves width and heads with depth.
"""
from __future__ import annotations

from omegaconf import OmegaConf

from attnzoo.config.errors import ConfigError


def _int(value, op: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"expects whole numbers, got {value!r}", field=f"attnzoo.{op}")
    return value


def mul(a, b) -> int:
    return _int(a, "mul") * _int(b, "mul")


def div(a, b) -> int:
    a, b = _int(a, "div"), _int(b, "div")
    if b == 0 or a % b:
        raise ConfigError(f"{a} is not a whole multiple of {b}; allowed: sizes whose ratio is a whole number",
                          field="attnzoo.div")
    return a // b


def register() -> None:
    for name, fn in (("attnzoo.mul", mul), ("attnzoo.div", div)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)

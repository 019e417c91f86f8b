"""Configuration: structured-config schemas, registries, errors and one-line refusals, paths, run length."""
from attnzoo.config.resolvers import register as _register_resolvers

_register_resolvers()

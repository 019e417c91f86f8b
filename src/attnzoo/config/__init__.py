"""Configuration: structured-config schemas, registries, errors and one-line refusals, paths, run length."""

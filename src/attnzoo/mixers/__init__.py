"""Token mixers: one module a mixer (its `nn.Module`, registered with `@register_mixer`), their config dataclasses in
`configs.py` (torch-free). Importing the package imports nothing: the registry (config/registry.MIXERS) finds the
modules by name and imports a mixer's when it is first built.

A new mixer = one file here + one yaml in conf/model/mixer/; the shared tests pick it up from the registry.
"""

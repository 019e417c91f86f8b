"""Knowledge of particular mixers lives in the mixer classes (src/attnzoo/mixers/): every other part of the package
asks the class (through the registry `attnzoo.config.registry.MIXERS`, or the built instance) and never compares a
mixer's name, so adding a mixer never means editing a list elsewhere (tests/test_add_a_mixer.py does it).

- No string literal outside mixers/ equals a registered mixer name, except where it configures a model the way a
  yaml does: the value of a `name` / `mixer` / `mixers` entry of a mapping (`{"name": "gqa"}`), or a default (a
  `default=` / `default_name=` argument, a parameter's or a dataclass field's default). Docstrings, comments and
  longer strings (messages) may mention names.
- Each attribute the rest of the package asks a mixer class is declared on `Mixer` with its default and set
  consistently by every registered class (checked on the classes and on a tiny built layer of each).
"""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import attnzoo
from attnzoo.config.registry import MIXERS
from attnzoo.mixers.attention_cache import KVCache
from attnzoo.mixers.base import HF_LAYERS, Mixer
from attnzoo.mixers.kv_quant import KVFormat
from attnzoo.models.decoder import DecoderLM
from attnzoo.ops.dispatch import FAMILY_NAMES
from tests.conftest import tiny_model_cfg

PACKAGE = Path(attnzoo.__file__).parent
NAMES = set(MIXERS.names())
CLASSES = sorted({MIXERS.get(n).cls for n in MIXERS.names()}, key=lambda c: c.__name__)
CONFIG_KEYS = {"name", "mixer", "mixers"}  # a mapping entry that configures a mixer, as a yaml would
DEFAULT_KEYWORDS = {"default", "default_name"}  # argparse's default=, schema.tagged's default_name=
# what the rest of the package asks a mixer class, each declared on Mixer with its default
ASKED = ("context_parallel", "full_causal_attention", "kernel_family", "kv_quantizable", "bidirectional",
         "linearize_source", "linearize_target", "hf_layer", "hf_missing", "dispatch_family", "check_seq_len",
         "linearize_sizes", "hf_mixer_config")


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out.add(id(value))
    return out


def _configures(node: ast.Constant, parents: dict) -> bool:
    """The literal configures a model (see the module docstring) rather than deciding something by a name."""
    parent = parents.get(id(node))
    if isinstance(parent, (ast.List, ast.Tuple)):  # ["gqa", "gated_deltanet"] as a whole value
        node, parent = parent, parents.get(id(parent))
    if isinstance(parent, ast.Dict):
        keys = [k for k, v in zip(parent.keys, parent.values) if v is node]
        return bool(keys) and isinstance(keys[0], ast.Constant) and keys[0].value in CONFIG_KEYS
    if isinstance(parent, ast.keyword):
        return parent.arg in DEFAULT_KEYWORDS
    if isinstance(parent, ast.arguments):  # def f(mixer="gqa")
        return any(node is d for d in parent.defaults + parent.kw_defaults)
    if isinstance(parent, ast.AnnAssign):  # a dataclass field's default: `mixer: str = "linear_attention"`
        return parent.value is node and isinstance(parents.get(id(parent)), ast.ClassDef)
    return False


def name_literals(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """'file:line: "name"' for each string literal equal to a registered mixer name that does not configure."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    skip = _docstrings(tree)
    skip |= {id(c) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for c in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES
                and id(node) not in skip and not _configures(node, parents)):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
    return found


def test_no_mixer_name_is_compared_outside_mixers():
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if (PACKAGE / "mixers") not in p.parents]
    assert len(files) > 50  # the whole package was scanned
    found = [hit for p in files for hit in name_literals(p)]
    assert not found, "mixer names outside mixers/ (ask the mixer class instead):\n" + "\n".join(found)


def test_the_scan_finds_what_it_should(tmp_path):
    """The rule itself: comparisons, name lists and dict keys are found; configuring values, defaults,
    docstrings and messages are not."""
    src = tmp_path / "probe.py"
    src.write_text('''"""gqa"""
from dataclasses import dataclass
FULL = ("mha", "gqa")  # found twice
def f(name, mixer="gqa"):
    """mla"""
    if name == "sliding_window":  # found
        return {"mla": 1}  # found (a key)
    return {"name": "gqa", "mixers": ["mha", "mqa"]}, p.add_argument("--m", default="nsa"), f"{name} gqa"
@dataclass
class C:
    mixer: str = "deltanet"
''')
    hits = [h.rsplit(": ", 1)[1] for h in name_literals(src, root=tmp_path)]
    assert sorted(hits) == sorted(["'mha'", "'gqa'", "'sliding_window'", "'mla'"])


# ----------------------------------------------------------------------------- the class attributes


def test_the_torch_free_declarations_cover_every_registering_module():
    """Every module of the mixers and data packages (and the FFNs') is declared in its torch-free specs or listed as a
    helper, so listing the names for the config checks imports no class (a plugin's module would be imported)."""
    from attnzoo.config.registry import FFNS
    from attnzoo.data import DATAMODULES

    for registry in (MIXERS, FFNS, DATAMODULES):
        assert registry.undeclared_modules() == [], registry.kind
        for name in registry.names():
            entry = registry.get(name)
            assert entry.cls.__module__ == entry.module and entry.config_cls.__module__.endswith("configs"), name


def test_every_asked_attribute_is_declared_on_mixer():
    for attr in ASKED:
        assert hasattr(Mixer, attr), attr


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_class_attributes_are_consistent(cls):
    assert cls.kernel_family in FAMILY_NAMES
    assert cls.hf_layer is None or cls.hf_layer in HF_LAYERS
    if cls.hf_layer is None:
        assert isinstance(cls.hf_missing, str) and "counterpart" in cls.hf_missing
    else:  # an import target: it says which mixer section a config.json describes
        assert cls.hf_mixer_config is not Mixer.hf_mixer_config
    if cls.full_causal_attention:  # only the context-parallel layout asks it
        assert cls.context_parallel
    if cls.linearize_target:
        assert cls.linearize_sizes is not Mixer.linearize_sizes
        names = [n for n in MIXERS.names() if MIXERS.get(n).cls is cls]
        fields = {f.name for f in dataclasses.fields(MIXERS.get(names[0]).config_cls)}
        assert set(cls.linearize_sizes(4, 8)) <= fields
    assert not (cls.linearize_source and cls.linearize_target)


def test_each_transformers_layer_has_one_mixer_class():
    for layer in HF_LAYERS:
        owners = [c for c in CLASSES if c.hf_layer == layer]
        assert len(owners) == 1, (layer, owners)


@pytest.mark.parametrize("name", sorted(NAMES))
def test_a_built_layer_agrees_with_its_class(name):
    entry = MIXERS.get(name)
    # d_model 64 / 4 heads: a head size of 16, the least flex_attention takes (ops/dispatch.FLEX_MIN_HEAD_DIM), so
    # that the default settings reach the class's fast family
    model = DecoderLM(tiny_model_cfg(name, n_layers=1, max_seq_len=64, d_model=64, n_heads=4), vocab_size=16)
    mixer = model.mixers[0]
    assert type(mixer) is entry.cls
    assert mixer.dispatch_family() == entry.cls.kernel_family  # default settings: the fast kernel's family
    entry.fact("check_seq_len")(model.layer_mixers[0], 64, "model.layers[0].mixer")  # whole blocks at 64
    for fact in MIXERS.facts:  # stated on the config dataclass (torch-free), the class's own by registration
        assert getattr(entry.cls, fact) == entry.fact(fact), fact
    if entry.cls.kv_quantizable:  # a plain KVCache that takes the KV formats
        assert isinstance(mixer.new_cache(1, 8, torch.float32, "cpu"), KVCache)
        fmt = KVFormat("int8", 4, 4)
        assert mixer.cache_bytes(32, kv_format=fmt) < mixer.cache_bytes(32)
        assert type(mixer.new_cache(1, 8, torch.float32, "cpu", kv_format=fmt)) is not KVCache
    if entry.cls.bidirectional:  # the encoder builds it with causal=false and reads its K/V heads from the config
        cfg = entry.config_cls(name=name, causal=False)
        assert cfg.kv_heads(model.cfg) >= 1
        layer = entry.cls(cfg, model.cfg, 0)
        x = torch.randn(1, 5, model.cfg.d_model)
        q, k, v = layer.project(x, torch.arange(5))
        assert layer.output(q, x).shape == x.shape
    if entry.cls.linearize_source:  # its q/k/v/o are what linearize copies
        assert hasattr(mixer, "qkv") and hasattr(mixer, "o_proj")

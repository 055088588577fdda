"""The MoE families of the installed transformers, read from the library itself (no hand-kept list).

A family is a package ``transformers.models.<name>``. It is on the *experts interface* when a modeling module of it
holds the text ``@use_experts_implementation`` (the test transformers' own
``PreTrainedModel._can_set_experts_implementation`` makes); importing it then shows its experts classes: those whose
``forward`` is the decorator's wrapper. It is an MoE family *outside the interface* when a modeling module assigns
``self.experts =`` without the decorator (transformers computes those experts in the model's own code, so
``experts_implementation`` never reaches them). ``aliases()``: model types that reuse another family's classes.
``build.py`` builds a tiny model of a family; ``coverage.py`` runs it through moeflow.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import pathlib
import re
from dataclasses import dataclass
from functools import cache

from torch import nn

from .requires import require_transformers

_DECORATOR = "@use_experts_implementation"
_EXPERTS_ATTRIBUTE = re.compile(r"self\.experts\s*=")


@dataclass(frozen=True)
class Family:
    """name: the package under transformers.models; modules: its modeling modules (dotted names);
    interface: True when its experts run through transformers' experts interface (experts_implementation)."""
    name: str
    modules: tuple[str, ...]
    interface: bool


def _models_root() -> pathlib.Path:
    """transformers/models of the installed transformers, found without importing it (MF701 when it is missing)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        require_transformers("moe_families()")  # raises MF701, with the reason
    return pathlib.Path(spec.submodule_search_locations[0]) / "models"


@cache
def moe_families() -> tuple[Family, ...]:
    """Every MoE family of the installed transformers, sorted by name: a scan of the modeling modules' source text
    (nothing imported, transformers included; a few hundred files, a tenth of a second)."""
    found = {}
    for path in sorted(_models_root().glob("*/modeling_*.py")):
        text = path.read_text(encoding="utf-8")
        interface = _DECORATOR in text
        if interface or _EXPERTS_ATTRIBUTE.search(text):
            name = path.parent.name
            old, module = found.get(name, Family(name, (), False)), f"transformers.models.{name}.{path.stem}"
            found[name] = Family(name, (*old.modules, module), old.interface or interface)
    return tuple(found[name] for name in sorted(found))


def family(name: str) -> Family:
    """The family of that package name; KeyError naming the families found when there is none."""
    for fam in moe_families():
        if fam.name == name:
            return fam
    raise KeyError(f"{name!r} is not an MoE family of this transformers; found: {[f.name for f in moe_families()]}")


@cache
def _wrapper_code():
    """The code object of the ``forward`` that ``use_experts_implementation`` puts on a class it decorates."""
    from transformers.integrations.moe import use_experts_implementation

    class Probe(nn.Module):
        def forward(self, x):
            return x

    return use_experts_implementation(Probe).forward.__code__


def experts_classes(fam: Family) -> list[type]:
    """The experts classes a family defines on the interface (imports its modeling modules)."""
    code = _wrapper_code()
    return [cls for mod in map(importlib.import_module, fam.modules) for cls in vars(mod).values()
            if inspect.isclass(cls) and cls.__module__ == mod.__name__
            and getattr(cls.__dict__.get("forward"), "__code__", None) is code]


def aliases() -> dict[str, str]:
    """model type -> family, for the model types of packages without modeling code of their own that transformers'
    auto mapping sends to a family's classes (e.g. a config-only package mapped onto glm4_moe's). Source text only."""
    require_transformers("aliases()")
    from transformers.models.auto import configuration_auto, modeling_auto
    root = _models_root()
    defines = {fam.name: (root / fam.name).glob("modeling_*.py") for fam in moe_families()}
    defines = {name: "\n".join(p.read_text(encoding="utf-8") for p in paths) for name, paths in defines.items()}
    out = {}
    for model_type, cls_name in modeling_auto.MODEL_MAPPING_NAMES.items():
        package = configuration_auto.model_type_to_module_name(model_type)
        if not isinstance(cls_name, str) or package in defines or any((root / package).glob("modeling_*.py")):
            continue
        owner = [name for name, text in defines.items() if f"class {cls_name}(" in text]
        if owner:
            out[model_type] = owner[0]
    return dict(sorted(out.items()))

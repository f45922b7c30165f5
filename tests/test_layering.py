"""The house plan as a test: every import points down the layer order of DESIGN.md section 2.

Top-level packages: eval -> calib -> kvjax -> pallas_kernels. Inside kvjax:
serving -> models -> cache -> config (assets is a leaf beside config; storage and the CLIs sit
at the top). The one sanctioned exception is the `kvjax.calibrate` entry shim into calib.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Higher rank may import lower rank (or equal: modules of one wing).
RANK = {
    "pallas_kernels": 0,
    "kvjax.config": 1,
    "kvjax.assets": 1,
    "kvjax.cli": 1,
    "kvjax.cache": 2,
    "kvjax.models": 3,
    "kvjax.serving": 4,
    "kvjax.storage": 5,
    "kvjax.generate": 6,
    "kvjax": 6,  # the package __init__ re-exports the public API
    "calib": 7,
    "eval": 8,
}
EXCEPTIONS = {("kvjax.calibrate", "calib.calibrate")}


def _unit(module: str) -> str:
    parts = module.split(".")
    for n in (2, 1):
        name = ".".join(parts[:n])
        if name in RANK:
            return name
    raise KeyError(module)


def _modules():
    for pkg in ("pallas_kernels", "kvjax", "calib", "eval"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            yield ".".join(parts), path


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from kvjax import assets` names a module
                yield f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_the_wings_exist():
    for wing in ("models", "cache", "serving"):
        assert (ROOT / "kvjax" / wing / "__init__.py").is_file()


@pytest.mark.parametrize(("module", "path"), list(_modules()), ids=lambda v: str(v))
def test_imports_point_down(module, path):
    if module == "kvjax.calibrate":
        return  # the entry shim
    src = RANK[_unit(module)]
    for target in _imports(path):
        if target.split(".")[0] not in RANK:
            continue
        try:
            dst_unit = _unit(target)
        except KeyError:
            continue
        if (module, target) in EXCEPTIONS or dst_unit == _unit(module):
            continue
        assert RANK[dst_unit] < src or (src == RANK[dst_unit] and dst_unit == "kvjax.assets"), (
            f"{module} imports {target}: points up ({_unit(module)} -> {dst_unit})"
        )


def test_public_api():
    import kvjax

    for name in ("load_model", "load_transforms", "Engine", "CacheConfig", "QuantConfig"):
        assert hasattr(kvjax, name), name

"""Imports run one way (docs/architecture.md): bench -> ckpt -> ckpt.reports ->
partitioners -> passes -> ckpt_compat (every private torch API, the bottom
layer), and within partitioners and passes each module imports only modules
before it in ORDER. Read from the source with ``ast``, so an import inside a
function or under TYPE_CHECKING counts too."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

LAYERS = {"bench": 5, "ckpt": 4, "ckpt.reports": 3, "partitioners": 2, "passes": 1, "ckpt_compat": 0}
"""A package may import its own layer's packages and lower ones, never higher
(a module is in the layer of the longest package name it starts with)."""
TOP_LEVEL = sorted({name.split(".")[0] for name in LAYERS})

ORDER = [
    "passes",
    "passes.joint",
    "passes.partitioned",
    "partitioners",
    "partitioners.fusion_policy",  # how ckpt's backward graphs fuse: a decision on ckpt_compat's hooks
    "partitioners.ops",
    "partitioners.cost",
    "partitioners.config",
    "partitioners.pytorch_settings",
    "partitioners.canonical",
    "partitioners.classify",
    "partitioners.mincut",
    "partitioners.peak.kinds",
    "partitioners.peak.workspace",
    "partitioners.peak.lowering",
    "partitioners.peak.layouts",
    "partitioners.peak.schedule",
    "partitioners.peak.buffers",
    "partitioners.peak.memory_plan",
    "partitioners.peak.liveness",
    "partitioners.peak",  # the package re-exports its modules' public names
    "partitioners.step",
    "partitioners.budget",
    "partitioners.regions",  # per-region budgets: budget.py's search, scoped
    "partitioners.plan",
    "partitioners.rank_sync",
    "partitioners.partition",
]
"""partitioners/ and passes/, lowest first: passes know nothing of decisions,
and partition.py, which runs them, comes last."""

TORCH_SEAM = "ckpt_compat"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    _module_name(path): path
    for package in TOP_LEVEL
    for path in sorted((ROOT / package).rglob("*.py"))
}


def _imported_names(name: str) -> set[str]:
    """Every module ``name`` imports, absolute, ``from x import y`` read as
    ``x.y`` when that is a module of the project."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _project_imports(name: str) -> set[str]:
    return {m for m in _imported_names(name) if m in MODULES and m != name}


IMPORTS = {name: _project_imports(name) for name in MODULES}


def test_every_module_is_found():
    assert {"partitioners.partition", "passes.joint", "ckpt.reports.report", "ckpt.backend", "bench.suite"} <= set(MODULES)
    assert "partitioners.classify" in IMPORTS["partitioners.budget"]  # relative imports resolve
    assert "passes.joint" in IMPORTS["partitioners.partition"]  # from passes import joint


def _layer(module: str) -> int:
    package = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[package]


def test_no_package_imports_a_higher_one():
    layer = {name: _layer(name) for name in MODULES}
    upward = sorted(f"{name} imports {m}" for name in MODULES for m in IMPORTS[name] if layer[m] > layer[name])
    assert not upward, "imports into a higher layer (bench -> ckpt -> ckpt.reports -> partitioners -> passes -> ckpt_compat):\n" + "\n".join(upward)


def test_partitioners_and_passes_import_only_modules_before_them():
    listed = {name for name in MODULES if name.split(".")[0] in ("partitioners", "passes")}
    assert listed == set(ORDER), f"place {sorted(listed - set(ORDER))} in ORDER (and drop {sorted(set(ORDER) - listed)})"
    position = {name: i for i, name in enumerate(ORDER)}
    for name in ORDER:
        later = sorted(m for m in IMPORTS[name] if position.get(m, -1) >= position[name])
        assert not later, f"{name} imports {later}, which come after it in ORDER"


def test_no_import_cycles():
    done, path = set(), []

    def visit(name):
        if name in path:
            cycle = path[path.index(name):] + [name]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        path.append(name)
        for imported in sorted(IMPORTS[name]):
            visit(imported)
        path.pop()
        done.add(name)

    for name in sorted(MODULES):
        visit(name)


def _is_private_torch(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "torch" and any(part.startswith("_") for part in parts[1:])


def test_private_torch_only_through_the_compat_module():
    # bench/ measures torch itself and may reach into it; the library may not.
    library = [n for n in MODULES if n.split(".")[0] != "bench" and n != TORCH_SEAM]
    private = sorted(f"{name} imports {m}" for name in library for m in _imported_names(name) if _is_private_torch(m))
    assert not private, f"reach private torch APIs through {TORCH_SEAM}:\n" + "\n".join(private)

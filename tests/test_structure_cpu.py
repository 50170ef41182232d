"""The package's shape, read from its sources: the vocabulary (dtype and architecture tables) is
defined in ``cake_cute.vocab`` only, and no two modules import each other, directly or through others.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import cake_cute

# The package root; subpackages (the kernels among them) are found below it.
ROOTS = {"cake_cute": Path(cake_cute.__file__).parent}
VOCABULARY = "cake_cute.vocab"
DTYPE_NAMES = {"bf16", "fp16", "fp32"}
TORCH_DTYPES = {"bfloat16", "float16", "float32"}
ARCHS = {"sm_90a", "sm_100a", "sm_103a"}


def _modules() -> dict[str, Path]:
    """{dotted module name: source} for every module of the package, subpackages included."""
    found = {}
    for package, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _is_torch_dtype(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr in TORCH_DTYPES


def _is_capability(node) -> bool:
    return (
        isinstance(node, ast.Tuple)
        and len(node.elts) == 2
        and all(isinstance(e, ast.Constant) and type(e.value) is int for e in node.elts)
    )


def _strings(nodes) -> set[str]:
    return {n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _translates(key, value) -> bool:
    """A dict entry that maps one word of the vocabulary to another: torch dtype -> name or size, name
    -> torch dtype, size or DSL type, compute capability -> anything."""
    if _is_capability(key):
        return True
    if _is_torch_dtype(key):
        return isinstance(value, ast.Constant) and type(value.value) in (str, int)
    if isinstance(key, ast.Constant) and key.value in DTYPE_NAMES:
        return isinstance(value, ast.Attribute) or (
            isinstance(value, ast.Constant) and type(value.value) is int
        )
    return False


def vocabulary_tables(source: str) -> list[str]:
    """Literals that restate the vocabulary: a dict translating dtypes or capabilities (see
    ``_translates``), or a sequence of all the dtype names or all the architectures."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            if any(k is not None and _translates(k, v) for k, v in zip(node.keys, node.values)):
                found.append(f"line {node.lineno}: {ast.unparse(node)[:60]}")
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            strings = _strings(node.elts)
            if DTYPE_NAMES <= strings or ARCHS <= strings:
                found.append(f"line {node.lineno}: {ast.unparse(node)[:60]}")
    return found


def test_the_detector_finds_each_kind_of_table():
    assert vocabulary_tables("A = {torch.bfloat16: 'bf16'}")
    assert vocabulary_tables("A = {(9, 0): 'sm_90a'}")
    assert vocabulary_tables("A = {'fp16': 2}")
    assert vocabulary_tables("A = {'bf16': torch.bfloat16}")
    assert vocabulary_tables("A = {'bf16': cutlass.BFloat16}")
    assert vocabulary_tables("A = ('bf16', 'fp16', 'fp32')")
    assert vocabulary_tables("A = ['sm_90a', 'sm_100a', 'sm_103a']")
    assert not vocabulary_tables("A = {'fwd': 1}; B = ('bf16', 'fp32'); C = {'sm_90': 'sm_90a'}")
    assert not vocabulary_tables("A = {torch.float32: 1e-5}; B = {'same': ('same',), 'fp32': ('fp32',)}")


@pytest.mark.parametrize("module", [m for m in MODULES if m != VOCABULARY])
def test_the_vocabulary_is_defined_once(module):
    tables = vocabulary_tables(MODULES[module].read_text())
    assert not tables, f"{module} restates the dtype or arch vocabulary (use {VOCABULARY}): {tables}"


def test_the_vocabulary_module_holds_the_tables():
    assert vocabulary_tables(MODULES[VOCABULARY].read_text())


def _imports(module: str, path: Path) -> set[str]:
    """The package modules ``module`` imports anywhere in its source (top level or inside functions)."""
    package = module if path.stem == "__init__" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base])
                base = base.rstrip(".")
            # ``from .pkg import mod`` imports the submodule; ``from .mod import name`` imports mod.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found |= {n for n in names if n in MODULES and n != module}
    return found


def test_no_import_cycles():
    graph = {m: _imports(m, p) for m, p in MODULES.items()}
    # The parser resolves relative imports, one and two levels up.
    assert graph["cake_cute.runtime.cache"] >= {"cake_cute.runtime.build"}
    assert graph["cake_cute.kernels.tiling"] >= {"cake_cute.vocab"}
    done, on_path = set(), []

    def visit(module):
        if module in on_path:
            cycle = on_path[on_path.index(module) :] + [module]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        on_path.append(module)
        for imported in sorted(graph[module]):
            visit(imported)
        on_path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


# The layers below the entries take a call value (``cake_cute.calls``) and check no argument again;
# a caller's workspace against T's launch plan is the one check that needs the plan.
_TRUSTING = {
    "cake_cute/launch.py": ("launch_forward", "launch_backward", "backward_from_saved"),
    "cake_cute/launch_fp8.py": ("fp8_forward", "_forward_cuda"),
    "cake_cute/dispatch.py": ("python_forward", "fp8_forward"),
}


def _checks_called(function: ast.FunctionDef) -> set[str]:
    names = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", "")
            if name.startswith("check_") or name.endswith("_call"):
                names.add(name)
    return names


@pytest.mark.parametrize("path", sorted(_TRUSTING))
def test_the_launch_layers_trust_the_call_value(path):
    tree = ast.parse((Path(cake_cute.__file__).parent.parent / path).read_text())
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    for name in _TRUSTING[path]:
        assert _checks_called(functions[name]) <= {"check_workspace_size"}, f"{path}: {name} checks again"


# --- the layers and folders docs/architecture.md draws ---------------------------------------------

ARCHITECTURE = Path(cake_cute.__file__).parent.parent / "docs" / "architecture.md"
MAX_LAYERS = 14
MAX_TOP_LEVEL_MODULES = 20
# The feature folders and what must live in them, not at the package's top level.
FOLDERS = {
    "gated": ("autograd", "distributed", "flashinfer", "module", "ops", "reference", "swap"),
    "hf": ("swap", "fusion", "forms", "plans", "templates", "norm_reading"),
    "runtime": ("device", "launch_plan", "views", "specs", "build", "cache", "native"),
}


def _between(text: str, marker: str) -> str:
    return text.split(f"<!-- {marker}")[1].split("-->", 1)[1].split(f"<!-- /{marker} -->")[0]


def documented_layers() -> dict[str, int]:
    """{module pattern below ``cake_cute.`` (``kernels.*`` for a folder): layer} from the table."""
    layers = {}
    for line in _between(ARCHITECTURE.read_text(), "layers").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            for name in cells[2].split(","):
                layers[name.strip().strip("`")] = int(cells[0])
    return layers


def _layer_of(module: str, layers: dict[str, int]) -> int | None:
    short = module.removeprefix("cake_cute.")
    if short in layers:
        return layers[short]
    folder = short.split(".")[0] + ".*"
    return layers.get(folder)


def _graph() -> dict[str, set[str]]:
    """The import graph of the package's modules, the root package (which imports every entry) left out."""
    return {m: _imports(m, p) - {"cake_cute"} for m, p in MODULES.items() if m != "cake_cute"}


def _core(module: str) -> bool:
    """A module the layer table names one by one (not the package roots, not a folder drawn as one row)."""
    return MODULES[module].stem != "__init__" and not module.startswith(
        ("cake_cute.kernels.", "cake_cute.tools", "cake_cute.integrations", "cake_cute.__main__")
    )


def test_the_layer_table_holds_every_module_once():
    layers = documented_layers()
    assert 1 <= max(layers.values()) <= MAX_LAYERS
    missing = [
        m
        for m in MODULES
        if m != "cake_cute" and MODULES[m].stem != "__init__" and _layer_of(m, layers) is None
    ]
    assert not missing, f"modules missing from docs/architecture.md's layer table: {missing}"
    stale = [n for n in layers if not n.endswith(".*") and f"cake_cute.{n}" not in MODULES]
    assert not stale, f"the layer table names modules that do not exist: {stale}"


def test_no_import_goes_up_a_layer():
    layers = documented_layers()
    upward = []
    for module, imported in _graph().items():
        here = _layer_of(module, layers)
        if here is None:  # a folder's __init__: a docstring, no imports of its own
            assert not imported, module
            continue
        upward += [f"{module} -> {m}" for m in imported if (_layer_of(m, layers) or 0) > here]
    assert not upward, f"imports from a lower layer to a higher one: {upward}"


def _longest_chain(graph: dict[str, set[str]]) -> list[str]:
    best: dict[str, list[str]] = {}

    def chain(module):
        if module not in best:
            below = [chain(m) for m in sorted(graph[module]) if m in graph]
            best[module] = [module, *max(below, key=len, default=[])]
        return best[module]

    return max((chain(m) for m in sorted(graph)), key=len)


def test_the_documented_longest_chain_is_the_code_s():
    core = {
        m: {i for i in imported if _core(i) or i.startswith("cake_cute.kernels.")}
        for m, imported in _graph().items()
        if _core(m)
    }
    core.update({m: _graph()[m] for m in MODULES if m.startswith("cake_cute.kernels.")})
    longest = _longest_chain(core)
    documented = [n.strip().strip("`") for n in _between(ARCHITECTURE.read_text(), "chain").split("→")]
    chain = [f"cake_cute.{n}" for n in documented]
    assert all(b in core[a] for a, b in zip(chain, chain[1:])), f"not an import chain: {documented}"
    assert len(chain) == len(longest), "the longest chain is now: " + " → ".join(
        m.removeprefix("cake_cute.") for m in longest
    )


def test_the_feature_folders_hold_their_slices():
    root = Path(cake_cute.__file__).parent
    top_level = sorted(p.stem for p in root.glob("*.py"))
    assert len(top_level) <= MAX_TOP_LEVEL_MODULES, top_level
    for folder, names in FOLDERS.items():
        for name in names:
            assert (root / folder / f"{name}.py").is_file(), f"{folder}/{name}.py"
    stray = [m for m in top_level if m.startswith(("gated", "fusion", "hf_")) or m in FOLDERS["runtime"]]
    assert not stray, f"modules of a feature folder at the top level: {stray}"


# --- the package speaks of its own code only ------------------------------------------------------

# The installed package ships no evidence/ folder; a measurement's entry belongs in docs/ and evidence/.
PACKAGE_SOURCE_SUFFIXES = {".py", ".cpp", ".h"}


def evidence_mentions(text: str) -> list[str]:
    """The lines of ``text`` that name a path under ``evidence/``."""
    return [f"line {n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if "evidence/" in line]


def test_the_evidence_detector_finds_a_path():
    assert evidence_mentions('"""Measured: evidence/kernel-rules/atomic-dw/."""')
    assert evidence_mentions("// see evidence/compiled-host-profile/")
    assert not evidence_mentions('root / "evidence" / name')


def test_no_package_file_cites_evidence():
    root = Path(cake_cute.__file__).parent
    files = [p for p in sorted(root.rglob("*")) if p.suffix in PACKAGE_SOURCE_SUFFIXES]
    assert any(p.suffix == ".cpp" for p in files) and any(p.suffix == ".h" for p in files)
    cited = {str(p.relative_to(root)): found for p in files if (found := evidence_mentions(p.read_text()))}
    assert not cited, f"package files cite evidence/ paths (name the rule's reason instead): {cited}"

"""The architecture, enforced: layers, the one door to the kernels, no cycles, few floors, small modules.

kernels (kvcx/codecs/cpu, one variant per instruction set) -> codecs -> formats -> file API (kvcx.api) -> the cache and quality wings
(torch, imported lazily) and integrations -> CLI. Each module imports only from its own layer or below; the
compiled kernels are imported only by kvcx.codecs and the fused-attention kernel's own wrapper. See
docs/ARCHITECTURE.md.
"""
import ast
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvcx"

# layer of each part of the package: a module may import from its own layer and those below
LAYERS = [("kvcx.errors", 0), ("kvcx.deps", 0), ("kvcx.version", 0), ("kvcx.codecs", 1), ("kvcx.presses", 1), ("kvcx.formats", 2), ("kvcx.api", 3),
          ("kvcx.cache", 4), ("kvcx.quality", 5), ("kvcx.integrations", 5), ("kvcx.cli", 6), ("kvcx.__main__", 7),
          ("kvcx", 7)]
# wings of one layer that must not import each other
SEPARATE = [("kvcx.quality", "kvcx.integrations")]
KERNEL_DOOR = "kvcx.codecs."     # the only importers of the CPU kernels (kvcx.codecs.cpu): the codecs
# the Triton kernels (the codec's, the fused attention's: they may import each other) and their importers, the
# codecs' GPU backend and its attention launcher (torch, triton lazily)
TRITON_KERNELS = {"kvcx.codecs.triton_kernels.codec", "kvcx.codecs.triton_kernels.attention",
                  "kvcx.codecs.triton_kernels.lattice", "kvcx.codecs.triton_kernels.widths",
                  "kvcx.codecs.triton_kernels.merge", "kvcx.codecs.triton_kernels.products"}
TRITON_DOOR = {"kvcx.codecs.gpu", "kvcx.codecs.gpu_lattice", "kvcx.codecs.gpu_widths",   # the codecs' launches,
               "kvcx.codecs.gpu_attn"}                                                      # the attention's
MAX_FLOORS = 13   # two added in 2026-11: the kernels choose their variant for the CPU (kvcx.codecs.cpu), and the
#                   CLI is split by command (kvcx.cli.app, the commands, the package that registers them); one more
#                   when KvcxCache's layer kinds (full, windowed) got a module of their own (kvcx.cache.layers,
#                   between the cache and its stores), to keep every module under MAX_LINES; one more in 2026-12
#                   when the windowed layer left it for its own (kvcx.cache.window_layer, on the full layer it
#                   extends) as MLA's latent steps took kvcx.cache.layers past MAX_LINES
MAX_LINES = 600
TORCH_AT_MODULE_LEVEL = {"kvcx.cache.kvcx_cache", "kvcx.cache.layers", "kvcx.cache.window_layer", "kvcx.cache.latent",
                         "kvcx.cache.scores", "kvcx.cache.kept",
                         "kvcx.cache.attention_fn", "kvcx.cache.query_tap", "kvcx.cache.buffers",
                         "kvcx.cache.device_store", "kvcx.cache.pressing", "kvcx.cache.static_cache",
                         "kvcx.cache.static_layers", "kvcx.cache.static_latent"}
RICH_MODULES = {"kvcx.cli", "kvcx.cli.app", "kvcx.cli.render", "kvcx.cli.files", "kvcx.cli.validate",
                "kvcx.cli.calibrate", "kvcx.cli.serve"}    # the CLI package: its app, renderers and commands


def _name(path: Path) -> str:
    mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return mod[:-len(".__init__")] if mod.endswith(".__init__") else mod


@lru_cache(maxsize=None)
def modules() -> dict:
    return {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@lru_cache(maxsize=None)
def imports() -> dict:
    """module -> [(imported name, at module level?)]: kvcx modules resolved to the module (a name imported
    from a package that is a submodule counts as that submodule), other packages by their dotted name."""
    mods = set(modules())
    graph = {}
    for mod, path in modules().items():
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        found = []
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{mod}: relative import; kvcx imports by absolute names"
                base = node.module
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                names = subs if subs and len(subs) == len(node.names) else [base] + subs
            found += [(n, id(node) in top) for n in names]
        graph[mod] = found
    return graph


def layer_of(mod: str) -> int:
    for prefix, rank in LAYERS:
        if mod == prefix or mod.startswith(prefix + "."):
            return rank
    raise AssertionError(f"{mod} belongs to no layer; add it to LAYERS (and docs/ARCHITECTURE.md)")


def edges() -> dict:
    mods = set(modules())
    return {m: {n for n, _ in deps if n in mods and n != m} for m, deps in imports().items()}


def test_every_import_goes_down_the_layers():
    bad = []
    for m, deps in edges().items():
        for n in deps:
            if layer_of(n) > layer_of(m):
                bad.append(f"{m} (layer {layer_of(m)}) imports {n} (layer {layer_of(n)})")
            for a, b in SEPARATE:
                if (m.startswith(a) and n.startswith(b)) or (m.startswith(b) and n.startswith(a)):
                    bad.append(f"{m} imports {n}: separate wings")
    assert not bad, "\n".join(bad)


def test_the_kernels_have_one_door():
    importers = {m for m, deps in imports().items() for n, _ in deps if n == "kvcx.codecs.cpu"}
    assert importers, "the import scan found no importer of kvcx.codecs.cpu"
    strays = {m for m in importers if not m.startswith(KERNEL_DOOR)}
    assert not strays, f"only kvcx.codecs may import the CPU kernels (kvcx.codecs.cpu): {sorted(strays)}"
    # nothing above the codecs reaches a codec's private members or private helpers of another module
    for m, path in modules().items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvcx"):
                private = [a.name for a in node.names if a.name.startswith("_")
                           and not (f"{node.module}.{a.name}" in TRITON_KERNELS and m in TRITON_DOOR)
                           and not (m in TRITON_KERNELS and node.module in TRITON_KERNELS)]
                assert not private, f"{m} imports private {private} from {node.module}"
            if isinstance(node, ast.Attribute) and node.attr in ("_layout", "_kernel_layout") \
                    and not m.startswith("kvcx.codecs."):
                raise AssertionError(f"{m} reads a codec's private {node.attr}; use codec.layout(shape)")


def test_no_import_cycle():
    graph, state = edges(), {}

    def visit(m, stack):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def floors() -> dict:
    """module -> its floor: 1 for a module importing no other kvcx module, else 1 + the highest floor below."""
    graph, memo = edges(), {}

    def floor(m):
        if m not in memo:
            memo[m] = 1 + max((floor(n) for n in graph[m]), default=0)
        return memo[m]

    return {m: floor(m) for m in graph}


def test_few_floors_and_small_modules():
    f = floors()
    top = max(f.values())
    assert top <= MAX_FLOORS, f"{top} import floors (at most {MAX_FLOORS}): " + \
        ", ".join(f"{m}={v}" for m, v in sorted(f.items(), key=lambda kv: -kv[1])[:6])
    long = {m: len(p.read_text().splitlines()) for m, p in modules().items()}
    assert max(long.values()) <= MAX_LINES, {m: n for m, n in long.items() if n > MAX_LINES}


def test_torch_rich_and_matplotlib_stay_in_their_modules():
    for mod, deps in imports().items():
        tops = {n.split(".")[0] for n, _ in deps}
        if {"torch", "transformers"} & tops:
            assert mod.startswith(("kvcx.cache.", "kvcx.quality.", "kvcx.integrations.")) or mod == "kvcx.deps" \
                or mod in TRITON_DOOR and "transformers" not in tops, mod
        if "triton" in tops:
            assert mod in TRITON_KERNELS or mod in TRITON_DOOR and not any(
                n.split(".")[0] == "triton" and top for n, top in deps), mod
        importers = {m for m, d in imports().items() for n, _ in d if n in TRITON_KERNELS} - TRITON_KERNELS
        assert importers <= TRITON_DOOR, f"only {sorted(TRITON_DOOR)} may import the Triton kernels: {sorted(importers)}"
        # torch and transformers load at import time only in the modules that exist to use them
        if mod not in TORCH_AT_MODULE_LEVEL and not mod.startswith("kvcx.integrations."):
            assert not any(n.split(".")[0] in ("torch", "transformers") and top for n, top in deps), mod
        if "rich" in tops or "typer" in tops:
            assert mod in RICH_MODULES, f"{mod} renders; rendering belongs in kvcx.cli"
        # matplotlib (the optional plot extra) only in kvcx.quality.plots, and only when a picture is drawn
        if "matplotlib" in tops:
            assert mod == "kvcx.quality.plots", mod
            assert not any(n.split(".")[0] == "matplotlib" and top for n, top in deps), mod


def test_library_does_not_print():
    for mod, path in modules().items():
        if mod in RICH_MODULES or mod == "kvcx.__main__":
            continue
        tree = ast.parse(path.read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "print"]
        assert not calls or mod == "kvcx.integrations.lmcache_local" and all(
            _in_main(tree, c) for c in calls), f"{mod} prints; report through return values, callbacks or logging"


def _in_main(tree, call) -> bool:
    """Whether a call sits in the module's ``main`` (a script entry point)."""
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and fn.name == "main" and any(n is call for n in ast.walk(fn)):
            return True
    return False


def test_no_attributes_stuck_on_other_objects():
    """Control flows one way: a module sets attributes on ``self`` (or a dataclass's own fields), never on
    tensors, arrays or other objects it was handed (``out=`` records are filled through their fields)."""
    allowed = {("kvcx.codecs.intcodec", "__dict__"), ("kvcx.codecs.widths", "__dict__"),
               ("kvcx.codecs.engine", "__dict__")}     # an encoder filling the caller's out= Packed
    for mod, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls")):
                    assert (mod, t.attr) in allowed, f"{mod}:{node.lineno} sets .{t.attr} on another object"
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
                raise AssertionError(f"{mod}:{node.lineno} calls setattr")


def test_kernel_constants_are_defined_once():
    """The Python layer reads the kernels' constants from the kernels (kvcx.codecs.cpu.core), never restates them."""
    from kvcx.codecs.cpu import core as _core
    from kvcx.codecs.dtypes import DTYPE_NAMES

    assert DTYPE_NAMES == {"F32": _core.DT_F32, "F16": _core.DT_F16, "BF16": _core.DT_BF16}
    assert len({_core.STATUS_NONFINITE, _core.STATUS_SCALE_OVERFLOW, _core.STATUS_NOMEM, _core.STATUS_CORRUPT}) == 4
    for p in (PACKAGE / "codecs" / "cpu").iterdir():
        if p.suffix in (".pyx", ".pxi"):
            assert "DEF " not in p.read_text() and "cdef extern from *" not in p.read_text(), p.name
    for mod, path in modules().items():
        src = path.read_text()
        assert "16384" not in src and "32768" not in src and "65536" not in src, mod
        # the encode/decode kernels are called only by the codecs, with a layout from their checks
        # (``_kernel_layout`` after ``layout``) and the status through ``check_status``
        if "_core.encode(" in src or "_core.decode(" in src or "_core.w_encode(" in src:
            assert mod in ("kvcx.codecs.intcodec", "kvcx.codecs.widths"), mod
            assert "_kernel_layout(" in src and "check_status(" in src, mod


def test_the_build_rebuilds_on_any_kernel_source():
    """The Makefile's extension rule and setup.py's depends cover every header, declaration and included body."""
    makefile = (ROOT / "Makefile").read_text()
    assert "$(wildcard kvcx/codecs/cpu/*.pyx kvcx/codecs/cpu/*.pxi kvcx/codecs/cpu/*.pxd kvcx/codecs/cpu/*.h)" in makefile
    assert "kvcx/.built: $(VENV)/.installed $(KERNEL_SOURCES)" in makefile
    setup = (ROOT / "setup.py").read_text()
    assert 'f.endswith((".h", ".pxd", ".pxi"))' in setup
    sources = {p.name for p in (PACKAGE / "codecs" / "cpu").iterdir() if p.suffix in (".h", ".pxd", ".pyx", ".pxi")}
    assert {"_v3.pyx", "_v4.pyx", "core.pxi", "kernels.h", "attn.h", "widths.h", "kernels.pxd", "openmp.pxd"} <= sources
    # every source file of the package stays small: C headers and Cython bodies too
    for p in sorted((PACKAGE / "codecs" / "cpu").iterdir()):
        if p.suffix in (".h", ".pxd", ".pyx", ".pxi"):
            assert len(p.read_text().splitlines()) <= MAX_LINES, p.name
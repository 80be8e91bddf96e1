"""The house's import rules: no module-level import cycle; only the run layer (`eqxzoo.run`)
imports the zoo, everything else in `eqxzoo` depends on the model contract; the
typed-config machinery imports no JAX."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "eqxzoo": ROOT / "src" / "eqxzoo",
    "models": ROOT / "models",
    "pipelines": ROOT / "pipelines",
}


def module_files() -> dict[str, Path]:
    files = {}
    for package, directory in PACKAGES.items():
        for path in directory.rglob("*.py"):
            parts = [
                p for p in path.relative_to(directory).with_suffix("").parts if p != "__init__"
            ]
            files[".".join([package, *parts])] = path
    return files


def module_level_imports(path: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports at module level (not inside functions)."""
    imported = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in known
                else node.module
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                imported.add(name)
    return imported


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: module_level_imports(path, set(files)) - {name} for name, path in files.items()}


def test_no_module_level_import_cycle():
    graph = import_graph()
    state: dict[str, str] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for dependency in sorted(graph[module]):
            if state.get(dependency) == "open":
                cycle = trail[trail.index(dependency) :] + [dependency]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if dependency not in state:
                visit(dependency, trail + [dependency])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def reachable(graph: dict[str, set[str]], module: str) -> set[str]:
    """Every project module ``module`` imports at module level, directly or through others."""
    seen, todo = set(), [module]
    while todo:
        for dependency in graph[todo.pop()] - seen:
            seen.add(dependency)
            todo.append(dependency)
    return seen


RUN_LAYER = "eqxzoo.run"


def test_only_the_run_layer_reaches_the_zoo():
    """Every module of `eqxzoo` outside `eqxzoo.run` (the trainer, data, parallel code, `nn`)
    knows models by the contract (`eqxzoo.nn`), not even through another module; the zoo
    never reaches the trainer, and nothing below the commands reaches `pipelines`."""
    graph = import_graph()
    below_the_run = [m for m in graph if m.startswith("eqxzoo") and not m.startswith(RUN_LAYER)]
    assert len(below_the_run) > 40, "the check sees every module"
    for name in below_the_run:
        zoo = sorted(
            m for m in reachable(graph, name) if m.split(".")[0] in ("models", "pipelines")
        )
        assert not zoo, f"{name} reaches {zoo}"
    for name in (m for m in graph if m.startswith("models")):
        above = sorted(
            m
            for m in reachable(graph, name)
            if m.startswith(("pipelines", RUN_LAYER, "eqxzoo.train", "eqxzoo.data", "eqxzoo.optim"))
        )
        assert not above, f"{name} reaches {above}"
    assert any(m.startswith("models") for m in reachable(graph, "eqxzoo.run.config")), "it sees"


def test_typed_config_reaches_no_jax_module():
    graph = import_graph()
    assert graph["eqxzoo.typed_config"] <= {"eqxzoo.errors"}

"""The layers: the runtime (the daemon, the plugin, the in-place protocol, the workers'
library, checkpointing) imports and runs without the lab tooling (``elasticd.lab``),
which only the ``elasticd demo`` and ``elasticd chaos`` commands load, when they run."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNTIME = ("elasticd", "trainer", "checkpointing")
LAB = "elasticd.lab"
# The commands that run lab tooling import it inside their own function.
LAB_COMMANDS = {("elasticd/cli.py", "demo"), ("elasticd/cli.py", "chaos")}


def runtime_modules() -> list[Path]:
    files = [p for top in RUNTIME for p in (REPO / top).rglob("*.py")]
    return sorted(p for p in files if not p.relative_to(REPO).as_posix().startswith(
        ("elasticd/lab/", "trainer/examples/")))


def lab_imports(path: Path) -> list[tuple[str, int, str]]:
    """(function or "<module>", line, module) of each import of the lab in ``path``."""
    found: list[tuple[str, int, str]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else where
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module:
                targets = [child.module] + [f"{child.module}.{a.name}" for a in child.names]
            for target in targets:
                if target == LAB or target.startswith(LAB + "."):
                    found.append((where, child.lineno, target))
                    break
            visit(child, name)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def test_no_runtime_module_imports_the_lab_but_its_commands():
    stray = [(p.relative_to(REPO).as_posix(), where, line, target)
             for p in runtime_modules() for where, line, target in lab_imports(p)
             if (p.relative_to(REPO).as_posix(), where) not in LAB_COMMANDS]
    assert stray == [], f"runtime modules import {LAB}: {stray}"


def test_the_scan_sees_a_lab_import(tmp_path):
    # The check above is only as good as its parser: a module-level and a nested import
    # of the lab are both found.
    sample = tmp_path / "sample.py"
    sample.write_text("from elasticd.lab import netlab\n"
                      "def f():\n    import elasticd.lab.chaos.run\n"
                      "from elasticd import lab\n")
    assert [(w, t) for w, _, t in lab_imports(sample)] == [
        ("<module>", "elasticd.lab"), ("f", "elasticd.lab.chaos.run"), ("<module>", "elasticd.lab")]


def test_the_runtime_imports_with_the_lab_absent():
    modules = [".".join(p.relative_to(REPO).with_suffix("").parts) for p in runtime_modules()]
    modules = [m.removesuffix(".__init__") for m in modules if not m.endswith("__main__")]
    # A finder first on sys.meta_path makes the lab unimportable, as in an install without it.
    code = (
        "import importlib, importlib.abc, sys\n"
        "class NoLab(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {LAB!r} or name.startswith({LAB + '.'!r}):\n"
        "            raise ModuleNotFoundError(f'no module named {name!r} (lab absent)')\n"
        "sys.meta_path.insert(0, NoLab())\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        f"print(len({modules!r}), [m for m in sys.modules if m.startswith({LAB!r})])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split(" ", 1) == [str(len(modules)), "[]\n"], done.stdout


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports (at any depth; ``from X import y`` counts as X)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if node.module == "elasticd"}
    return found


# What the workers' side may take from elasticd: the contract, and torch_compat (the one
# definition of which reconfigure API the installed torch has, shared with the plugin).
WORKER_SIDE_ALLOWED = ("elasticd.contract", "elasticd.rendezvous.torch_compat")


def test_trainer_and_checkpointing_import_only_the_contract_of_elasticd():
    stray = sorted(
        (p.relative_to(REPO).as_posix(), m)
        for top in ("trainer", "checkpointing") for p in (REPO / top).rglob("*.py")
        if "examples" not in p.parts
        for m in imports_of(p)
        if (m == "elasticd" or m.startswith("elasticd."))
        and not any(m == a or m.startswith(a + ".") for a in WORKER_SIDE_ALLOWED))
    assert stray == [], f"the workers' side imports elasticd beyond its contract: {stray}"


def test_the_contract_is_a_leaf_and_torch_free():
    contract = sorted((REPO / "elasticd" / "contract").glob("*.py"))
    stray = sorted((p.name, m) for p in contract for m in imports_of(p)
                   if m.startswith(("elasticd", "trainer", "checkpointing", "torch"))
                   and not m.startswith("elasticd.contract"))
    assert stray == [], f"elasticd.contract imports beyond itself: {stray}"
    names = ", ".join(f"elasticd.contract.{p.stem}" for p in contract if p.stem != "__init__")
    code = f"import sys, {names}; print([m for m in sys.modules if m.split('.')[0] in " \
           "('torch', 'trainer', 'checkpointing') or (m.startswith('elasticd.') " \
           "and not m.startswith('elasticd.contract'))])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_only_the_command_line_imports_the_operators_commands():
    # The loop and the plugin stay free of what status, timeline and doctor pull in.
    stray = sorted((p.relative_to(REPO).as_posix(), m) for p in runtime_modules()
                   if not p.relative_to(REPO).as_posix().startswith("elasticd/ops/")
                   and p.name != "cli.py"
                   for m in imports_of(p) if m == "elasticd.ops" or m.startswith("elasticd.ops."))
    assert stray == [], f"runtime modules import elasticd.ops: {stray}"


# The daemon's policy decides from a Snapshot alone: it imports nothing that does I/O,
# reads a clock or logs (elasticd.supervisor's docstring; its tests need no process).
POLICY_MAY_IMPORT = ("__future__", "collections", "dataclasses", "enum", "statistics", "types",
                     "typing", "elasticd.actions", "elasticd.contract", "elasticd.inplace.loss",
                     "elasticd.inplace.agreement", "elasticd.quorum", "elasticd.supervisor")


def test_the_policy_imports_nothing_that_does_io_or_reads_a_clock():
    found = []
    for path in sorted((REPO / "elasticd" / "supervisor").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):   # from elasticd import quorum: elasticd.quorum
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            found += [(path.name, n) for n in names
                      if not any(n == ok or n.startswith(ok + ".") for ok in POLICY_MAY_IMPORT)]
    assert found == []


def test_what_elasticd_run_does_before_the_daemon_import_is_torch_free():
    # elasticd.prestart starts the warm-start server before the daemon imports torch, so
    # the server's imports run beside the daemon's (a newcomer's workers wait for them).
    code = "import sys, elasticd.cli, elasticd.logs, elasticd.prestart, elasticd.ops.doctor; " \
           "print([m for m in sys.modules if m.split('.')[0] == 'torch'])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_elasticd_run_starts_the_warm_start_server_before_torch_is_imported(tmp_path):
    config, run, ckpt = tmp_path / "node.toml", tmp_path / "run", tmp_path / "ckpt"
    config.write_text('[job]\nid = "j"\nentrypoint = ["trainer/examples/mlp.py"]\n'
                      '[etcd]\nendpoints = ["127.0.0.1:9"]\n'
                      f'[node]\nid = "n0"\nrun_dir = "{run}"\n'
                      f'[checkpoint]\ndir = "{ckpt}"\n')
    code = ("import sys, elasticd.warmstart as w\n"
            "def start(self, env):\n"
            "    print('warm start; torch imported:', 'torch' in sys.modules, self.socket_path)\n"
            "    sys.exit(0)\n"
            "w.WarmHost.start = start\n"
            "from elasticd.cli import main\n"
            f"main(['run', '--config', {str(config)!r}])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    expected = f"warm start; torch imported: False {run / 'warm.sock'}"
    assert done.stdout.strip() == expected, done.stdout + done.stderr

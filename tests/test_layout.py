"""The repository's layout rules (docs/ARCHITECTURE.md): kernels import nothing from the library, the map in
WORKSPACE.md is the tree, the contract the code cites is in the repository, modules and functions stay short."""

from __future__ import annotations

import ast
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNELS = ROOT / "pallas_kernels"
THIRD_PARTY = {"jax", "jaxlib", "numpy", "ml_dtypes"}
# Kernel bodies are exempt from the function length rule (one traced body is one kernel); the kernel modules carry
# their design notes in their docstrings.
KERNEL_BODIES = {"_kernel", "_kernel_body", "_ws_kernel", "_simple_kernel"}
MAX_MODULE_LINES = {"default": 520, "kernels": 600}
MAX_FUNCTION_LINES = 80


def _python_files(*folders):
  for folder in folders:
    yield from sorted((ROOT / folder).rglob("*.py"))


def _imports(path: pathlib.Path):
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield alias.name, 0
    elif isinstance(node, ast.ImportFrom):
      yield node.module or "", node.level


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.py")), ids=lambda p: p.name)
def test_kernels_import_nothing_from_the_library(path):
  for module, level in _imports(path):
    top = module.split(".")[0]
    if level:  # a sibling in pallas_kernels
      continue
    assert top != "jaxfp8", f"{path.name} imports {module}: kernels import nothing from the library"
    assert top in THIRD_PARTY or top in sys.stdlib_module_names, f"{path.name} imports {module}"


_STANDALONE = r"""
import importlib, sys

class RefuseLibrary:
  def find_spec(self, name, path=None, target=None):
    if name == "jaxfp8" or name.startswith("jaxfp8."):
      raise ImportError(f"the kernels imported {name}")
    return None

sys.meta_path.insert(0, RefuseLibrary())
sys.path.insert(0, sys.argv[1])
for name in sys.argv[2:]:
  importlib.import_module(f"standalone_kernels.{name}")
print("imported", len(sys.argv) - 2)
"""


def test_kernels_import_standalone(tmp_path):
  """The kernel folder copied out of the package imports with `jaxfp8` unimportable."""
  shutil.copytree(KERNELS, tmp_path / "standalone_kernels", ignore=shutil.ignore_patterns("__pycache__"))
  names = sorted(p.stem for p in KERNELS.glob("*.py") if p.stem != "__init__")
  proc = subprocess.run([sys.executable, "-c", _STANDALONE, str(tmp_path), *names], capture_output=True, text=True,
                        timeout=300, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
  assert proc.returncode == 0 and f"imported {len(names)}" in proc.stdout, proc.stderr[-3000:]


def _layout_paths() -> list[str]:
  text = (ROOT / "WORKSPACE.md").read_text()
  section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)


def test_workspace_layout_table_is_the_tree():
  paths = _layout_paths()
  assert paths, "WORKSPACE.md has no layout table"
  for path in paths:
    assert (ROOT / path.rstrip("/")).exists(), f"WORKSPACE.md lists {path}, which does not exist"
  listed = {p.rstrip("/") for p in paths}
  package = ROOT / "jaxfp8"
  for entry in sorted(package.iterdir()):
    if entry.name.startswith("__") or entry.name in ("data",) or entry.suffix not in ("", ".py"):
      continue
    relative = str(entry.relative_to(ROOT))
    assert relative in listed, f"{relative} is not in WORKSPACE.md's layout table"
  for top in ("docs", "tests", "benchmarks", "scripts", "notebooks", "examples"):
    assert top in listed or f"{top}/" in paths, f"{top}/ is not in WORKSPACE.md's layout table"


def test_the_contract_cited_is_the_repositorys():
  cited = []
  for path in [*(p for p in _python_files("jaxfp8", "tests", "scripts", "examples", "notebooks")
                 if p.name != "test_layout.py"), ROOT / "README.md",
               ROOT / "WORKSPACE.md", ROOT / "benchmarks" / "README.md"]:
    for number, line in enumerate(path.read_text().splitlines(), 1):
      if re.search(r"\bSPEC(\.md)?\b|PALLAS_NOTES", line):
        cited.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
  assert not cited, "cite docs/CONTRACT.md, not files outside the repository:\n" + "\n".join(cited[:20])
  assert (ROOT / "docs" / "CONTRACT.md").is_file()


def test_library_comments_say_why_not_when():
  found = []
  for path in _python_files("jaxfp8"):
    for number, line in enumerate(path.read_text().splitlines(), 1):
      if re.search(r"\b[Ss]ession \d|\b[Ss]essions \d|\b20\d\d-\d\d-\d\d\b", line):
        found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
  assert not found, "history belongs in git and the results index:\n" + "\n".join(found[:20])


def test_modules_and_functions_stay_short():
  long = []
  for path in _python_files("jaxfp8", "pallas_kernels"):
    lines = len(path.read_text().splitlines())
    limit = MAX_MODULE_LINES["kernels" if path.parent == KERNELS else "default"]
    if lines > limit:
      long.append(f"{path.relative_to(ROOT)}: {lines} lines > {limit}")
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in KERNEL_BODIES:
        length = node.end_lineno - node.lineno + 1
        if length > MAX_FUNCTION_LINES:
          long.append(f"{path.relative_to(ROOT)}: {node.name} has {length} lines > {MAX_FUNCTION_LINES}")
  assert not long, "\n".join(long)

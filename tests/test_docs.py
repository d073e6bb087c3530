"""The documentation site: `mkdocs build --strict` passes, and every public name is in the API reference.

The strict build turns every MkDocs, mkdocstrings and griffe warning (a broken link, a docstring that
renders wrongly, an API page naming a module that is gone) into a failure.  The coverage check reads
the inventory the build writes (`objects.inv`: every object the API reference rendered) and asks for
each name in the `__all__` of every offrl module, found by walking the package, so a new module or a
new public name fails here until docs/api/ shows it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import pkgutil
import subprocess
import sys
import types
import zlib
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
HAVE_MKDOCS = importlib.util.find_spec("mkdocs") is not None
needs_mkdocs = pytest.mark.skipif(
    not HAVE_MKDOCS, reason="mkdocs is not installed; install the documentation tools with pip install -e '.[dev]'")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    """One strict build of the site into a temporary folder (the source tree is not written to)."""
    site_dir = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2 (not a build warning)
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir), "--config-file",
         str(ROOT / "mkdocs.yml")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    return proc, site_dir


@needs_mkdocs
def test_strict_build_passes(site: tuple[subprocess.CompletedProcess, Path]) -> None:
    proc, site_dir = site
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0, f"mkdocs build --strict failed (exit {proc.returncode}):\n{output[-6000:]}"
    for page in ("index.html", "getting-started/index.html", "datasets/index.html", "algorithms/iql/index.html",
                 "ope/intervals/index.html", "sweeps/index.html", "api/ope/index.html"):
        assert (site_dir / page).is_file(), f"the build wrote no {page}"


def read_inventory(path: Path) -> dict[str, str]:
    """Rendered objects of a Sphinx v2 inventory (`objects.inv`): name -> role, primary entries only.

    mkdocstrings also lists, at priority 2, every other path an object is reachable under (imports
    included); those are cross-reference aliases of a rendered object, not documentation of it.
    """
    raw = path.read_bytes()
    header, sep, body = raw.partition(b"zlib.\n")
    assert sep and header.startswith(b"# Sphinx inventory version 2"), f"{path} is not a Sphinx v2 inventory"
    rendered = {}
    for line in zlib.decompress(body).decode().splitlines():
        name, role, priority, *_ = line.split(" ")
        if priority == "1":
            rendered[name] = role
    return rendered


def public_modules() -> dict[str, types.ModuleType]:
    """Every importable offrl module whose dotted name has no part starting with '_'."""
    import offrl

    names = ["offrl"] + [m.name for m in pkgutil.walk_packages(offrl.__path__, "offrl.")]
    return {name: importlib.import_module(name) for name in sorted(names)
            if not any(part.startswith("_") for part in name.split("."))}


def public_names(module: types.ModuleType) -> list[str]:
    """`__all__`, or for a module without one the public functions and classes it defines."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [name for name, value in vars(module).items()
            if not name.startswith("_") and (inspect.isfunction(value) or inspect.isclass(value))
            and value.__module__ == module.__name__]


def documented_as(module_name: str, name: str, value: Any, modules: dict[str, types.ModuleType]) -> set[str]:
    """The paths under which `module_name.name` may appear in the API reference.

    Its own path; for a function, class or module its defining path (re-exports are documented once,
    where they are defined); and the path in any other public module whose `__all__` holds the same
    object (re-exported constants).
    """
    paths = {f"{module_name}.{name}"}
    if isinstance(value, types.ModuleType):
        paths.add(value.__name__)
    elif getattr(value, "__module__", None) and getattr(value, "__qualname__", None):
        paths.add(f"{value.__module__}.{value.__qualname__}")
    for other_name, other in modules.items():
        if name in getattr(other, "__all__", ()) and getattr(other, name, None) is value:
            paths.add(f"{other_name}.{name}")
    return paths


@needs_mkdocs
def test_every_public_name_is_in_the_api_reference(site: tuple[subprocess.CompletedProcess, Path]) -> None:
    proc, site_dir = site
    if proc.returncode != 0:
        pytest.fail("the strict build failed (see test_strict_build_passes), so there is no API reference to check")
    rendered = read_inventory(site_dir / "objects.inv")
    modules = public_modules()
    assert len(modules) > 20 and "offrl.ope.episodic" in modules, f"walking offrl found only {sorted(modules)}"

    missing_modules = [name for name in modules if rendered.get(name) != "py:module"]
    assert not missing_modules, (
        f"modules missing from the API reference: {missing_modules}; add a `::: <module>` directive for each "
        "to the matching page under docs/api/")

    missing = []
    checked = 0
    for module_name, module in modules.items():
        for name in public_names(module):
            value = getattr(module, name)
            checked += 1
            if not documented_as(module_name, name, value, modules) & rendered.keys():
                missing.append(f"{module_name}.{name}")
    assert checked > 200, f"only {checked} public names found; is __all__ being read?"
    assert not missing, (
        f"public names missing from the API reference: {missing}. A name in a module's __all__ is rendered by "
        "that module's `::: <module>` directive under docs/api/; a package that re-exports it shows it where "
        "it is defined, and a package-level directive with an explicit `members:` list must list its own names.")


def _load_extension() -> Any:
    spec = importlib.util.spec_from_file_location("offrl_griffe", ROOT / "docs" / "_ext" / "offrl_griffe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_mkdocs
def test_plain_docstrings_become_markdown() -> None:
    """The API reference's docstring rewrite: informal parameter lists and subscripts in prose."""
    to_markdown = _load_extension().plain_to_markdown
    text = ("How an agent learns.\n\nParameters\n----------\nwarmup_steps : environment steps before the first\n"
            "    update.\nbatch_size, gamma : the usual.\n\nOverride `sample` for other recipes.")
    assert to_markdown(text) == (
        "How an agent learns.\n\n**Parameters**\n\n- `warmup_steps`: environment steps before the first update.\n"
        "- `batch_size`, `gamma`: the usual.\n\nOverride `sample` for other recipes.")
    # A subscript would be a Markdown reference link to a missing target; in a code span or block it stays.
    assert to_markdown("results[policy][estimator] -> value") == "`results[policy][estimator]` -> value"
    assert to_markdown("see `x[i][j]` and [a link](page.md)") == "see `x[i][j]` and [a link](page.md)"
    assert to_markdown("Example:\n\n    q[0][1] = 2") == "Example:\n\n    q[0][1] = 2"
    # reStructuredText's literal-block marker.
    assert to_markdown("The layout::\n\n    a/b/c") == "The layout:\n\n    a/b/c"
    assert to_markdown("Not code::\nplain") == "Not code::\nplain"
    # An underlined heading without `name : text` entries keeps its body as written.
    assert to_markdown("Notes\n-----\nPlain text.") == "**Notes**\n\nPlain text."

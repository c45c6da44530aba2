"""The install story: pins agree between pip and conda, and CI runs exactly the README's test command."""
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def requirement_map(lines) -> dict[str, str]:
    out = {}
    for line in lines:
        match = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*)$", line)
        if match and not line.startswith("-"):
            out[match.group(1).lower().replace("_", "-")] = match.group(2).replace(" ", "")
    return out


def pyproject_requirements() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return requirement_map(project["dependencies"] + project["optional-dependencies"]["test"])


def conda_requirements() -> dict[str, str]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    return requirement_map(pip_section)


def test_environment_yml_carries_the_same_pins_as_pyproject():
    assert conda_requirements() == pyproject_requirements()


def test_the_two_pins_that_matter_are_exact():
    reqs = pyproject_requirements()
    assert reqs["torch"] == "==2.13.0"
    assert reqs["megatron-core"] == "==0.16.1"
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert "python=3.11" in env["dependencies"]


def test_requirement_map_sees_a_changed_pin():
    # Guards the comparison above: a drifted pin must show up as a difference.
    assert requirement_map(["torch==2.13.0"]) != requirement_map(["torch==2.12.0"])
    assert requirement_map(["torch==2.13.0", "-e ."]) == {"torch": "==2.13.0"}


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and "make lab" in readme
    commands = [line.strip() for line in ci.splitlines() if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert commands == ["make test"]


def test_design_card_layout_exists():
    for name in ("notebooks", "labkit", "data", "slurm", "images", "tests", "environment.yml", "README.md",
                 "pyproject.toml", "Makefile"):
        assert (ROOT / name).exists(), name

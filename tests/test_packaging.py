"""The install story: the base install plans and the extras add training and the labs, pins agree between pip and
conda, the conda environment is CPU-only, CI runs exactly `make test`, the package finds its data wherever it is
installed, and the command line starts without reading it or importing pandas."""
import contextlib
import dataclasses
import importlib.util
import io
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jinja2
import pytest
import yaml

from labkit import __version__, catalog, cli, extras, lab, paths

ROOT = Path(__file__).resolve().parent.parent


def requirement_map(lines) -> dict[str, str]:
    """name -> version specifier, with a local version label (+cpu) dropped; option lines are skipped."""
    out = {}
    for line in lines:
        match = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*)$", line)
        if match and not line.startswith("-"):
            out[match.group(1).lower().replace("_", "-")] = re.sub(r"\+\w+$", "", match.group(2).replace(" ", ""))
    return out


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def pyproject_requirements() -> dict[str, str]:
    """Every distribution the package names, in its base install and its extras ("all" names the other extras)."""
    project = pyproject()
    extras = project["optional-dependencies"]
    return requirement_map(project["dependencies"] + [r for name, reqs in extras.items() if name != "all" for r in reqs])


def conda_environment() -> tuple[list[str], list[str]]:
    """(conda dependencies, pip lines) of environment.yml."""
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    return [d for d in env["dependencies"] if isinstance(d, str)], pip_section


def constraints() -> dict[str, str]:
    """constraints.txt: the exact versions make and CI install."""
    return requirement_map(line for line in (ROOT / "constraints.txt").read_text().splitlines()
                           if line.strip() and not line.startswith("#"))


def test_environment_yml_carries_the_same_pins_as_pyproject_under_the_constraints():
    assert requirement_map(conda_environment()[1]) == {**pyproject_requirements(), **constraints()}


def test_the_two_pins_that_matter_are_exact_for_make_and_ci():
    assert constraints() == {"torch": "==2.13.0", "megatron-core": "==0.16.1", "deepspeed": "==0.19.8",
                             "transformers": "==5.24.0", "safetensors": "==0.8.0"}
    makefile = (ROOT / "Makefile").read_text()
    assert makefile.count("-c constraints.txt") == 2  # torch first, then labkit with its dependencies
    # make lab and make test: training, the labs and DeepSpeed's engine (whose tests then run)
    assert "-c constraints.txt -e '.[all,deepspeed,test]'" in makefile
    assert "-e '.[all,deepspeed,test]'" in (ROOT / "tests" / "other_pythons.sh").read_text()


def test_the_base_install_plans_and_the_extras_train_and_run_the_labs():
    """The base install is what validate, estimate, plan, render and submit import (tests/wheel_check.sh runs them
    in an environment with nothing else); torch and megatron-core come with labkit[train], Jupyter with labkit[lab]."""
    project = pyproject()
    base = set(requirement_map(project["dependencies"]))
    assert base == {"numpy", "pandas", "jinja2", "pyyaml", "termcolor", "tqdm", "tokenizers", "sentencepiece"}
    extras = {name: set(requirement_map(reqs)) for name, reqs in project["optional-dependencies"].items()}
    assert {"torch", "megatron-core"} <= extras["train"] and {"jupyterlab", "papermill"} <= extras["lab"]
    assert {"wandb", "mlflow-skinny"} == extras["tracking"]
    assert project["optional-dependencies"]["all"] == ["labkit[train,lab,tracking]"]


def test_each_extra_distribution_has_its_module_in_the_hint_table():
    """labkit.extras.MODULES names the extra to install for a missing module: every distribution of an extra is there
    under that extra (by its import name)."""
    import_name = {"megatron-core": "megatron", "mlflow-skinny": "mlflow"}
    for extra in ("train", "lab", "tracking", "deepspeed", "hf"):
        for dist in requirement_map(pyproject()["optional-dependencies"][extra]):
            module = import_name.get(dist, dist.replace("-", "_"))
            assert extras.MODULES.get(module) == extra, dist
    assert set(extras.MODULES.values()) == {"train", "lab", "tracking", "deepspeed", "hf"}


def test_a_missing_extra_is_named_with_its_pip_command(monkeypatch, capsys, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real_find_spec(name, *a))
    spec = tmp_path / "tiny.yaml"
    spec.write_text("name: t\nmodel: {preset: tiny}\nbatch: {micro: 2, global: 4}\ntrain: {iters: 2, log_interval: 1}\n")
    assert cli.main(["run", str(spec), "--backend", "local", "--runs-dir", str(tmp_path / "runs")]) == 1
    assert capsys.readouterr().err == ("labkit run needs torch, which the base install leaves out: "
                                       "pip install 'labkit[train]'\n")
    assert not (tmp_path / "runs").exists()  # refused before anything was recorded
    assert extras.install_hint("labkit lab", "nbformat.v4") == ("labkit lab needs nbformat, which the base install "
                                                               "leaves out: pip install 'labkit[lab]'")
    assert extras.install_hint("labkit plan", "yaml") is None  # a base dependency missing is a broken install


def test_license_file_is_the_apache_text_the_metadata_names():
    assert pyproject()["license"] == "Apache-2.0" and pyproject()["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"] and "END OF TERMS AND CONDITIONS" in text


def test_the_package_is_typed():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["labkit"] and (ROOT / "labkit" / "py.typed").is_file()
    for script in ("wheel_check.sh", "other_pythons.sh"):
        assert '-c "$repo/constraints.txt" torch' in (ROOT / "tests" / script).read_text()


def test_the_package_admits_the_torch_a_gpu_machine_brings():
    """megatron-core 0.16.1 needs torch>=2.6; labkit[train] asks no more, so it installs beside a cluster's own CUDA
    PyTorch. megatron-core itself stays exact: the CPU compatibility layer patches its private names."""
    reqs = requirement_map(pyproject()["optional-dependencies"]["train"])
    assert reqs["torch"] == ">=2.6"
    assert reqs["megatron-core"] == "==0.16.1"


def test_conda_environment_is_cpu_only_and_admits_the_same_pythons():
    conda, pip_lines = conda_environment()
    assert "torch==2.13.0+cpu" in pip_lines
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in pip_lines
    python = next(d for d in conda if d.startswith("python"))
    assert python.removeprefix("python") == pyproject()["requires-python"]


def test_requirement_map_sees_a_changed_pin():
    # Guards the comparison above: a drifted pin must show up as a difference.
    assert requirement_map(["torch==2.13.0"]) != requirement_map(["torch==2.12.0"])
    assert requirement_map(["torch==2.13.0+cpu", "-e ."]) == {"torch": "==2.13.0"}


def test_supported_pythons_are_311_to_313():
    assert pyproject()["requires-python"] == ">=3.11,<3.14"


def test_ci_runs_exactly_make_test():
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in ci.splitlines() if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert commands == ["make test"]


def test_help_reads_no_catalog(monkeypatch):
    def refuse(name):
        raise AssertionError(f"--help read {name}")

    for cached in (catalog.gpus, catalog.models, catalog.clusters):
        cached.cache_clear()
    monkeypatch.setattr(catalog, "_load", refuse)
    with pytest.raises(SystemExit) as done, contextlib.redirect_stdout(io.StringIO()) as out:
        cli.main(["--help"])
    assert done.value.code == 0 and "validate" in out.getvalue()
    for cached in (catalog.gpus, catalog.models, catalog.clusters):
        cached.cache_clear()


def test_help_imports_neither_pandas_nor_numpy_nor_torch():
    """`labkit --help` builds every command's parser: none of them may import the heavy libraries, which the commands
    load when they run (pandas and numpy took two thirds of the help's 1.2 s)."""
    code = ("import contextlib, io, sys\nfrom labkit import cli\nwith contextlib.redirect_stdout(io.StringIO()):\n"
            "    try: cli.main(['--help'])\n    except SystemExit: pass\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'pandas', 'numpy', 'torch', 'megatron', 'plotly', 'jinja2'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_version_comes_from_the_installed_metadata():
    out = subprocess.run([sys.executable, "-m", "labkit", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"labkit {__version__}" and __version__ == pyproject()["version"]


def test_package_data_is_inside_the_package():
    assert paths.DATA_DIR.parent == Path(lab.__file__).parent
    for name in ("gpus.yaml", "models.yaml", "clusters.yaml", "published_runs.yaml"):
        assert paths.data_file(name).is_file(), name
    assert paths.data_file("tokenizer", "vocab.json").is_file()
    assert paths.data_file("corpus", "corpus_text_document.idx").is_file()
    assert "multinode.sbatch.j2" in jinja2.PackageLoader("labkit", "templates").list_templates()


def test_profiles_measured_here_go_to_the_user_directory(monkeypatch, tmp_path):
    from labkit.estimate import profiles

    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    mine = dataclasses.replace(profiles.find_profile("gpt2-xl", "A10", 1), source="measured here")
    written = profiles.save_profile(mine)
    assert written.parent == tmp_path / "profiles"
    assert profiles.find_profile("gpt2-xl", "A10", 1).source == "measured here"  # the user's measurement wins
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path / "nobody"))
    assert profiles.find_profile("gpt2-xl", "A10", 1).source != "measured here"


def test_workspace_copies_the_course_and_keeps_what_is_there(tmp_path):
    written = lab.copy_workspace(tmp_path)
    names = {p.relative_to(tmp_path).as_posix() for p in written}
    labs = sorted(p.name for p in paths.course_dir("notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert {f"notebooks/{n}" for n in labs} <= names and {f"notebooks/solutions/{n}" for n in labs} <= names
    assert {f"notebooks/ko/{n}" for n in labs} <= names and {f"notebooks/ko/solutions/{n}" for n in labs} <= names
    assert "examples/tiny-cpu.yaml" in names and not any(n.endswith(".py") for n in names)
    edited = tmp_path / "notebooks" / labs[0]
    edited.write_text("my work")
    assert lab.copy_workspace(tmp_path) == [] and edited.read_text() == "my work"


def test_lab_runs_go_where_labkit_runs_dir_says(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "elsewhere"))
    assert lab.new_run_directory().parent == tmp_path / "elsewhere"

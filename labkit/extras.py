"""The optional parts of an install. The base install plans and submits (spec, estimate, plan, render, submit, status,
logs); `labkit[train]` adds the megatron-core driver that trains here, `labkit[lab]` the Jupyter stack the notebooks
run in, `labkit[tracking]` Weights & Biases and MLflow, and `labkit[all]` all three; `labkit[deepspeed]` adds
DeepSpeed's ZeRO engine for optimizer.zero_backend deepspeed, and `labkit[hf]` transformers and safetensors for
`labkit checkpoint import-hf` and `export-hf`. A command that reaches a module of an extra that is not installed says
which extra to install instead of ending in a traceback.
"""
from __future__ import annotations

import importlib.util

# Importable top-level module -> the extra (pyproject.toml's [project.optional-dependencies]) that installs it.
# tests/test_packaging.py checks that every distribution an extra lists is here under that extra.
MODULES = {
    "torch": "train", "megatron": "train", "psutil": "train", "tensorboard": "train", "wandb": "tracking",
    "mlflow": "tracking",
    "plotly": "lab", "jupyterlab": "lab", "ipywidgets": "lab", "ipykernel": "lab", "IPython": "lab",
    "papermill": "lab", "nbformat": "lab", "nbconvert": "lab", "nbclient": "lab", "jupytext": "lab",
    "jupyter_server_mathjax": "lab", "deepspeed": "deepspeed", "transformers": "hf", "safetensors": "hf",
}


class MissingExtra(ModuleNotFoundError):
    """A module of an extra that is not installed; the message names the pip command that installs it."""


def install_hint(what: str, module: str) -> str | None:
    """'WHAT needs MODULE: pip install 'labkit[EXTRA]'' for a module an extra installs, else None."""
    extra = MODULES.get(module.partition(".")[0])
    if extra is None:
        return None
    return f"{what} needs {module.partition('.')[0]}, which the base install leaves out: pip install 'labkit[{extra}]'"


def require(what: str, *modules: str) -> None:
    """Raise MissingExtra naming the extra when one of `modules` is not installed: for a command whose work another
    process does (the local backend's torchrun imports torch and megatron-core there, where a missing one would only
    show in the job's log), or before a traceback would name it."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise MissingExtra(install_hint(what, module), name=module)

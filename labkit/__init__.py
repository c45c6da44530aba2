"""labkit: plan, launch and read distributed GPT training runs with Megatron on Slurm, from notebooks or a terminal.

Data flows one way, and each module imports only from the rows above it (tests/test_architecture.py holds this):

    paths          where files are: package data, course files, runs, the user's directory
    megatron/      Megatron's own rules, below everything else: flags (every Megatron-LM flag labkit writes or reads;
                   the driver's parser is built from it) and sizes (derived sizes, pipeline splits and layouts)
    net            a free TCP port for rendezvous
    extras         which optional extra (labkit[train], labkit[lab]) installs a missing module, for the message
    catalog        GPUs, model presets, clusters and the calibration, read from labkit/data/
    spec/          the run spec: schema (dataclasses), load (presets under the user's values), checks (every rule,
                   job checks included), layout (Megatron's rank order, stage -> ranks -> GPUs)
    megatron_args  spec -> Megatron-LM flags
    estimate/      params, FLOPs, memory, calibration, timing (the one 1F1B / interleaved schedule), topology, views
    logs/          parse (the one Megatron log parser), job_info (the keys job scripts print), derive, views
    train/         the megatron-core driver (and its CPU compatibility layer)
    profiling/     torch.profiler traces and TensorBoard scalars
    plan/          partition, placement, search over layouts ranked by the estimate, Pareto front, profiler
    diagrams       SVGs drawn from estimate's schedule and activation bookkeeping
    jobs/          state, render (jinja2 templates), diagnose, record, watcher, job (Job, Backend), local and slurm
                   backends, report, dashboard, sweep
    lab, cli,      the course runner (papermill, HTML index, `labkit workspace`), the command line and its shell
    completion     completion script
"""
__all__ = ["RunSpec", "SpecError", "load_spec", "__version__"]


def __getattr__(name: str):
    """The package's names, imported when first asked for (PEP 562): `import labkit` stays cheap, so that the `labkit`
    command is inside its Ctrl-C handler (labkit.cli.main) before the library loads."""
    if name in ("RunSpec", "SpecError", "load_spec"):
        from labkit import spec

        return getattr(spec, name)
    if name == "__version__":
        return _version()
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("labkit")
    except PackageNotFoundError:  # a source checkout on PYTHONPATH, as benchmarks/gpu_check.sh runs it without PyPI
        import tomllib

        from labkit.paths import source_tree

        return tomllib.loads((source_tree() / "pyproject.toml").read_text())["project"]["version"]

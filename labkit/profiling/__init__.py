"""Profiling: TensorBoard scalars and torch.profiler traces of a training run, as DataFrames and plotly figures.

The driver writes both into the run (`--tensorboard-dir`, `--profile --profile-step-start N --profile-step-end M
--profile-ranks R...`); a lab reads them back:

    from labkit.profiling import tensorboard, trace, views
    traces = trace.load_traces(run_dir)             # one per profiled rank
    trace.breakdown(traces[0])                      # matmul / attention / elementwise / ... shares
    trace.compute_communication(traces)             # computation, overlapping, communication, other per rank
    trace.communication_by_group(traces)            # tp / dp / pp time per rank
    trace.memory_per_step(traces[0])                # peak and memory saved for backward
    views.comparison_figure({"fp32": run_a, "bf16": run_b})
    tensorboard.read_scalars(run_dir); print(tensorboard.tensorboard_command(run_dir))

Nsight Systems captures of a spec's profile.nsys ranks (the run's logs/nsys/rankR.sqlite) read the same way:

    from labkit.profiling import nsys
    reports = nsys.load_reports(run_dir / "logs" / "nsys")
    nsys.kernel_time(reports); nsys.overlap(reports); nsys.steps(reports); nsys.figure(reports)
"""

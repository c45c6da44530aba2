"""Profiling: TensorBoard scalars and torch.profiler traces of a training run, as DataFrames and plotly figures."""

"""Megatron training logs: parse (every variant into DataFrames), derive (steady state, throughput, MFU), views
(plotly figures and the run comparison table). They know nothing of jobs: the run dashboard over them is
labkit.jobs.dashboard."""
__all__ = ["ParsedLog", "parse_log", "parse_text"]


def __getattr__(name: str):
    """The parser (numpy and pandas) loads on first use: the command line imports this package (for labkit.logs.cli)
    to build its parser, and `labkit --help` needs none of it."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from labkit.logs.parse import ParsedLog, parse_log, parse_text

    return locals()[name]

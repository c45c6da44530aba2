"""Megatron training logs: parse (every variant into DataFrames), derive (steady state, throughput, MFU), views
(plotly figures and the run comparison table). They know nothing of jobs: the run dashboard over them is
labkit.jobs.dashboard."""
from labkit.logs.parse import ParsedLog, parse_log, parse_text

__all__ = ["ParsedLog", "parse_log", "parse_text"]

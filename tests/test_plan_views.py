import pytest

from labkit.estimate import Pipeline, estimate, pipeline_time
from labkit.plan.pareto import composition, pareto_flags, sweep
from labkit.plan.search import search
from labkit.plan.views import pareto_figure, ranked_table, schedule_events, schedule_figure
from labkit.spec import load_spec


def test_schedule_of_equal_stages_takes_m_plus_p_minus_one_steps():
    p, m, t = 4, 6, 3.0
    events = schedule_events(Pipeline((t,) * p, (0.0,) * (p - 1), m))
    assert len(events) == 2 * p * m
    assert events["end_s"].max() == pytest.approx((m + p - 1) * t)
    # 1F1B: the first stage never holds more than p micro-batches between their forward and backward
    first = events[events["stage"] == 0].sort_values("start_s")
    in_flight = peak = 0
    for op in first["op"]:
        in_flight += 1 if op == "forward" else -1
        peak = max(peak, in_flight)
    assert peak == p


def test_schedule_drawn_is_the_one_the_estimator_times():
    pipeline = Pipeline((2.0, 5.0, 3.0), (0.5, 0.25), 8)
    events = schedule_events(pipeline)
    assert events["end_s"].max() == pytest.approx(pipeline_time([2.0, 5.0, 3.0], [0.5, 0.25], 8).total_s)
    # a stage never runs two operations at once
    for _, ops in events.sort_values("start_s").groupby("stage"):
        assert (ops["start_s"].to_numpy()[1:] >= ops["end_s"].to_numpy()[:-1] - 1e-12).all()
    fig = schedule_figure(pipeline, stage_labels=["A100", "A10", "A10"])
    assert {trace.name for trace in fig.data} == {"forward", "backward"}


def test_an_estimates_schedule_ends_where_its_pipeline_time_does():
    # recompute changes each stage's backward share and the sends are not free: a drawing made from stage times
    # alone (default 2:1 split, no sends) would end elsewhere
    spec = load_spec({"model": {"preset": "gpt2-medium"}, "parallel": {"pipeline": 4},
                      "batch": {"micro": 2, "global": 32},
                      "precision": "bf16", "recompute": {"granularity": "full", "method": "uniform", "num_layers": 1},
                      "cluster": {"nodes": [{"gpu": "A10", "count": 2, "gpus_per_node": 2, "inter_node_gbps": 1}]}})
    est = estimate(spec)
    pipeline_s = sum(est.breakdown[k] for k in ("compute", "bubble", "tp_comm", "pp_comm"))
    assert schedule_events(est.pipeline)["end_s"].max() == pytest.approx(pipeline_s)
    assert min(est.pipeline.boundary_times_s) > 0
    bare = Pipeline(est.pipeline.stage_times_s, (0.0,) * 3, est.pipeline.num_micro_batches)
    assert schedule_events(bare)["end_s"].max() < pipeline_s * 0.99


def test_plan_rows_carry_the_schedule_they_were_timed_with():
    base = load_spec({"model": {"preset": "gpt2-medium"}, "batch": {"micro": 1, "global": 32}, "precision": "fp16",
                      "cluster": "local-slurm"})
    row = next(r for r in search(base, top=20).rows if r.pp > 1 and r.virtual_stages == 1)
    assert schedule_events(row.pipeline)["end_s"].max() == pytest.approx(row.pipeline_s)
    assert "pipeline" not in row.to_dict()


def test_interleaved_schedules_are_drawn_from_the_same_events():
    pipeline = Pipeline((1.0, 1.5), (0.1,), 4, virtual_stages=2, wrap_time_s=0.2)
    events = schedule_events(pipeline)
    assert list(events.columns) == ["stage", "chunk", "micro_batch", "op", "start_s", "end_s"]
    assert len(events) == 2 * 2 * 4 * 2 and set(events["chunk"]) == {0, 1}
    assert events["end_s"].max() == pytest.approx(pipeline.time().total_s)
    fig = schedule_figure(pipeline)
    assert "interleaved" in fig.layout.title.text


def test_ranked_table_has_fasops_columns():
    base = load_spec({"model": {"preset": "gpt2-medium"}, "batch": {"micro": 1, "global": 32}, "precision": "fp16",
                      "cluster": "local-slurm"})
    table = ranked_table(search(base, top=4), top=4)
    for column in ("micro", "tp", "dp", "pp", "placement", "partition", "s/step", "pipeline s", "DP all-reduce s",
                   "embedding all-reduce s", "USD/step", "oom", "max GB/stage"):
        assert column in table.columns
    assert len(table) == 4
    assert table["partition"].str.count("-").tolist() == [pp - 1 for pp in table["pp"]]


def test_pareto_flags():
    assert pareto_flags([1, 2, 3, 2], [3, 2, 1, 3]) == [True, True, True, False]


def test_sweep_and_figure_mark_cluster_types():
    base = load_spec({"model": {"preset": "gpt2-small"}, "batch": {"micro": 1, "global": 16}, "precision": "fp16",
                      "cluster": {"nodes": [{"gpu": "A10", "count": 1, "gpus_per_node": 4}]}})
    df = sweep(base, "A100-40GB", "A10", max_nodes=1)
    assert sorted(zip(df["nodes_a"], df["nodes_b"])) == [(0, 1), (1, 0), (1, 1)]
    assert set(df["marker"]) == {"square", "circle", "triangle-up"}
    assert df["pareto"].any()
    assert composition("A100-40GB", 2, "A10", 0).nodes[0].gpus_per_node == 8
    fig = pareto_figure(df)
    assert {t.marker.symbol for t in fig.data if t.mode == "markers"} == {"square", "circle", "triangle-up"}

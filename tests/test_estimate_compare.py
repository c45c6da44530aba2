"""Specs estimated side by side: each row is estimate(spec) of that spec, on its own GPUs or on a chosen one."""
import pytest

from labkit.estimate import estimate
from labkit.estimate.compare import compare, on_gpu
from labkit.estimate.estimator import GIB
from labkit.spec import load_spec


@pytest.fixture(scope="module")
def tiny():
    return load_spec("examples/tiny-cpu.yaml")


def test_each_row_is_that_specs_estimate(tiny):
    specs = {"fp32": tiny, "bf16": tiny.replace(precision="bf16")}
    table = compare(specs)
    assert list(table.index) == ["fp32", "bf16"]
    for name, spec in specs.items():
        est = estimate(spec)
        assert table.loc[name, "iteration_ms"] == pytest.approx(est.iteration_time_s * 1e3)
        assert table.loc[name, "total_mib"] == pytest.approx(max(est.memory_gb_per_stage) * GIB / 2 ** 20)
        assert table.loc[name, "samples_per_s"] == pytest.approx(8 / est.iteration_time_s)
    # mixed precision: 2-byte weights and activations, but an fp32 master copy and fp32 gradients (bf16) in Adam
    assert table.loc["fp32", "bytes_per_param"] == 16 and table.loc["bf16", "bytes_per_param"] == 18
    assert table.loc["bf16", "weights_mib"] == pytest.approx(table.loc["fp32", "weights_mib"] / 2)
    assert table.loc["bf16", "optimizer_mib"] > table.loc["fp32", "optimizer_mib"]
    assert table.loc["bf16", "activations_mib"] < table.loc["fp32", "activations_mib"]
    assert table.loc["fp32", "num_micro_batches"] == 2 and table.loc["fp32", "dp"] == 2


def test_a_chosen_gpu_replaces_every_node_groups_gpu(tiny):
    hetero = load_spec("examples/gpt2-xl-hetero.yaml")
    moved = on_gpu(hetero, "H100-SXM")
    assert [g.gpu for g in moved.cluster.nodes] == ["H100-SXM"] * len(hetero.cluster.nodes)
    assert [g.count for g in moved.cluster.nodes] == [g.count for g in hetero.cluster.nodes]
    assert moved.world_size == hetero.world_size
    gpt2 = tiny.replace(model={"preset": "gpt2-small"})
    on_a100 = compare({"fp32": gpt2, "bf16": gpt2.replace(precision="bf16")}, gpu="A100-80GB")
    assert set(on_a100["gpu"]) == {"A100-80GB"}
    # tensor cores: bf16's peak is 16x fp32's on an A100, so the same step is predicted several times faster
    assert on_a100.loc["fp32", "iteration_ms"] > 5 * on_a100.loc["bf16", "iteration_ms"]


def test_no_specs_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        compare({})

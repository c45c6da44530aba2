"""The GPU catalog's Blackwell entries, NVLink domains larger than a node (GB200/GB300 NVL72), and the user's own
GPU catalog (~/.labkit/gpus.yaml, $LABKIT_HOME/gpus.yaml)."""
from __future__ import annotations

import pytest

from labkit import catalog, cli
from labkit.estimate import estimate
from labkit.estimate.calibration import default_calibration
from labkit.estimate.topology import Topology
from labkit.spec import load_spec


def spec_on(gpu: str, count: int, gpus_per_node: int, **parallel):
    return load_spec({"model": {"preset": "llama2-7b"}, "batch": {"micro": 1, "global": 288}, "precision": "bf16",
                      "cluster": {"nodes": [{"gpu": gpu, "count": count, "gpus_per_node": gpus_per_node}]},
                      "parallel": parallel})


# name or alias -> canonical name, dense BF16, FP8 and FP4 TFLOP/s, memory GB, node network Gbit/s, NVLink domain
BLACKWELL = [
    ("B200", "B200", 2250, 4500, 9000, 180, 3200, None),
    ("HGX B200", "B200", 2250, 4500, 9000, 180, 3200, None),
    ("GB200", "GB200", 2500, 5000, 10000, 186, 1600, 72),
    ("GB200 NVL72", "GB200", 2500, 5000, 10000, 186, 1600, 72),
    ("GB300", "GB300", 2500, 5000, 15000, 288, 3200, 72),
    ("nvidia gb300", "GB300", 2500, 5000, 15000, 288, 3200, 72),
]


@pytest.mark.parametrize("spelling,name,bf16,fp8,fp4,memory,network,domain", BLACKWELL)
def test_blackwell_gpus_resolve_with_their_datasheet_figures(spelling, name, bf16, fp8, fp4, memory, network, domain):
    assert catalog.resolve_gpu_name(spelling) == name
    gpu = catalog.gpu(spelling)
    assert (gpu.peak("bf16"), gpu.peak("fp16"), gpu.peak("fp8"), gpu.peak("fp4")) == (bf16, bf16, fp8, fp4)
    assert gpu.fp8 and gpu.fp4
    # block-scaled formats run at their element type's peak
    assert (gpu.peak("mxfp8"), gpu.peak("nvfp4")) == (fp8, fp4)
    assert (gpu.memory_gb, gpu.memory_bw_gb_s) == (memory, 8000)
    assert gpu.intra_node_gbps == 7200 == 2 * catalog.gpu("H100-SXM").intra_node_gbps  # NVLink5 doubles NVLink4
    assert (gpu.inter_node_gbps, gpu.nvlink_domain_gpus) == (network, domain)
    assert gpu.gpus_per_node == (8 if name == "B200" else 4)


def test_only_blackwell_has_fp4_and_the_block_scaled_formats():
    h100 = catalog.gpu("H100")
    assert h100.fp8 and not h100.fp4 and h100.nvlink_domain_gpus is None
    assert [g for g in catalog.gpus() if catalog.gpu(g).fp4] == ["B200", "GB200", "GB300"]
    with pytest.raises(KeyError, match="block-scaled nvfp4"):
        h100.peak("nvfp4")
    with pytest.raises(KeyError, match="block-scaled mxfp8"):
        h100.peak("mxfp8")
    assert h100.peak("fp8") == pytest.approx(1978.9)


def test_a_gb200_nvl72_rack_of_18_trays_estimates():
    spec = load_spec({"model": {"preset": "llama2-7b"}, "batch": {"micro": 1, "global": 288}, "precision": "bf16",
                      "cluster": {"nodes": [{"gpu": "GB200", "count": 18, "gpus_per_node": 4}]}})
    assert spec.world_size == 72
    result = estimate(spec)
    assert result.iteration_time_s > 0 and result.breakdown["compute"] > 0
    # the same run on 72 H100s takes longer: GB200's peak is 2.5x H100's
    h100 = estimate(load_spec({**spec.to_dict(), "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 9,
                                                                            "gpus_per_node": 8}]}}))
    assert result.breakdown["compute"] < h100.breakdown["compute"] / 2


def test_a_tensor_group_across_trays_of_one_nvl72_runs_over_nvlink_and_across_h100_nodes_over_the_network():
    cal = default_calibration()
    nvlink = cal.bus_gbps(7200, inter_node=False)
    rack = Topology(spec_on("GB200", 18, 4, tensor=8))         # ranks 0-7: trays 0 and 1 of the rack
    tp = rack.layout.group(0, "tp")
    assert rack.crosses_nodes(tp) and not rack.crosses_network(tp)
    assert rack.group_link(tp).kind == "nvlink" and rack.group_link(tp).link_gbps == 7200
    assert rack.tp_gbps(0) == nvlink
    h100 = Topology(spec_on("H100-SXM", 2, 8, tensor=16))      # ranks 0-15: two H100 nodes
    tp = h100.layout.group(0, "tp")
    assert h100.crosses_network(tp) and h100.group_link(tp).kind == "network"
    assert h100.tp_gbps(0) == cal.bus_gbps(3200, inter_node=True) < nvlink
    assert h100.group_link(range(8)).kind == "node"           # one H100 node: its own NVLink
    assert h100.group_link(range(8)).bus_gbps == cal.bus_gbps(3600, inter_node=False)


def test_pipeline_and_data_traffic_between_trays_of_a_rack_runs_over_nvlink_and_between_racks_over_the_network():
    cal = default_calibration()
    nvlink = cal.bus_gbps(7200, inter_node=False)
    one_rack = Topology(spec_on("GB200", 18, 4, tensor=4, pipeline=2))  # stage 0: trays 0-8, stage 1: trays 9-17
    assert one_rack.pair_gbps(0, 1) == nvlink
    assert one_rack.dp_gbps(0) == nvlink                      # a data ring over 9 trays, each its own NVLink ports
    two_racks = Topology(spec_on("GB200", 36, 4, tensor=4, pipeline=2))  # stage 0: rack 0, stage 1: rack 1
    assert one_rack.group_link(range(72)).kind == "nvlink" and two_racks.group_link(range(144)).kind == "network"
    # 4 pairs leave each tray at once over its 1600 Gbit/s network
    assert two_racks.pair_gbps(0, 1) == pytest.approx(cal.bus_gbps(1600, inter_node=True) / 4)
    assert two_racks.dp_gbps(0) == nvlink                      # each stage's data ring stays in its rack
    h100 = Topology(spec_on("H100-SXM", 18, 4, tensor=4, pipeline=2))  # the same shape on H100 nodes of 4
    assert h100.pair_gbps(0, 1) < nvlink and h100.dp_gbps(0) < nvlink


@pytest.fixture
def labkit_home(tmp_path, monkeypatch):
    """LABKIT_HOME at an empty directory; the catalogs and the default calibration read again before and after."""
    def forget():
        catalog.reload()
        default_calibration.cache_clear()

    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    forget()
    yield tmp_path
    monkeypatch.undo()
    forget()


ACME = """\
gpus:
  X1000:
    aliases: ["Acme X1000", "X-1000"]
    peak_tflops: {fp32: 50, bf16: 400, fp16: 400}
    memory_gb: 64
    memory_bw_gb_s: 2000
    bf16: true
    fp16: true
    intra_node_gbps: 3600
    inter_node_gbps: 400
    gpus_per_node: 8
    efficiency: 0.55
"""


def test_a_gpu_of_the_users_catalog_is_usable_in_a_spec(labkit_home):
    assert catalog.resolve_gpu_name("Acme X1000") is None
    (labkit_home / "gpus.yaml").write_text(ACME)
    catalog.reload()
    assert catalog.resolve_gpu_name("acme x1000") == catalog.resolve_gpu_name("NVIDIA X-1000") == "X1000"
    x = catalog.gpu("X1000")
    assert (x.peak("bf16"), x.memory_gb, x.gpus_per_node) == (400, 64, 8) and str(labkit_home) in x.source
    assert "H100-SXM" in catalog.gpus()                       # merged over the shipped catalog
    spec = load_spec({"model": {"preset": "llama2-7b"}, "precision": "bf16",
                      "cluster": {"nodes": [{"gpu": "Acme X1000", "count": 1, "gpus_per_node": 8}]}})
    assert spec.stage_gpus == ["X1000"]
    assert default_calibration().efficiency["X1000"] == 0.55  # the entry's own efficiency
    assert estimate(spec).iteration_time_s > 0


def test_a_user_entry_without_efficiency_is_estimated_at_the_assumed_one(labkit_home):
    (labkit_home / "gpus.yaml").write_text(ACME.replace("    efficiency: 0.55\n", ""))
    assert default_calibration().efficiency["X1000"] == catalog.USER_EFFICIENCY
    assert set(catalog.gpus()) <= set(default_calibration().efficiency)


def test_a_user_entry_with_a_shipped_name_replaces_it(labkit_home):
    (labkit_home / "gpus.yaml").write_text(ACME.replace("X1000:", "H100-SXM:").replace("memory_gb: 64",
                                                                                         "memory_gb: 96"))
    assert catalog.resolve_gpu_name("H100") is None          # the shipped aliases went with the shipped entry
    h100 = catalog.gpu("H100-SXM")
    assert (h100.memory_gb, h100.peak("bf16"), h100.fp8) == (96, 400, False)
    assert default_calibration().efficiency["H100-SXM"] == 0.55


def test_an_unknown_gpu_names_the_users_catalog(labkit_home):
    with pytest.raises(KeyError) as err:
        catalog.gpu("X1000")
    assert str(labkit_home / "gpus.yaml") in str(err.value)


MALFORMED = """\
gpus:
  X1000:
    peak_tflops: {fp32: 50, bf16: -3, fp16: 400, nvfp4: 800}
    memory_bw_gb_s: 0
    bf16: true
    fp16: true
    intra_node_gbps: 3600
    inter_node_gbps: 400
"""


def test_a_malformed_user_catalog_names_the_file_the_gpu_and_the_field(labkit_home):
    path = labkit_home / "gpus.yaml"
    path.write_text(MALFORMED)
    with pytest.raises(catalog.CatalogError) as err:
        catalog.gpus()
    assert err.value.path == path
    assert err.value.errors == [
        "GPU X1000: memory_gb: missing; add the GPU's memory in GB, e.g. memory_gb: 80",
        "GPU X1000: peak_tflops.bf16: must be a number of dense TFLOP/s, 0 or more, got -3",
        "GPU X1000: peak_tflops.nvfp4: unknown precision; write fp4 (nvfp4 runs at its peak)",
        "GPU X1000: memory_bw_gb_s: must be a positive number, got 0; give its memory bandwidth in GB/s, "
        "e.g. memory_bw_gb_s: 3350"]
    assert str(err.value).startswith(f"{path}: 4 error(s)")


def test_a_malformed_user_catalog_is_reported_by_the_command_line_without_a_traceback(labkit_home, tmp_path, capsys):
    (labkit_home / "gpus.yaml").write_text(MALFORMED.replace("memory_bw_gb_s: 0", "memory_bw_gb_s: 2000")
                                           .replace("bf16: -3", "bf16: 400").replace(", nvfp4: 800", ""))
    spec = tmp_path / "run.yaml"
    spec.write_text("model: {preset: llama2-7b}\ncluster: {nodes: [{gpu: H100, count: 1, gpus_per_node: 8}]}\n")
    assert cli.main(["validate", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err == (f"{labkit_home / 'gpus.yaml'}: 1 error(s) in this GPU catalog (the layout of "
                   f"labkit/data/gpus.yaml)\n  - GPU X1000: memory_gb: missing; add the GPU's memory in GB, "
                   f"e.g. memory_gb: 80\n")


@pytest.mark.parametrize("text,error", [
    ("gpus: [X1000]\n", "expected a mapping `gpus:`"),
    ("gpus:\n  X1000: {peak_tflops: {fp32: 1}\n", "cannot be read as YAML"),
    (ACME.replace("    gpus_per_node: 8", "    gpus_per_node: 2.5"), "gpus_per_node: must be a positive whole"),
    (ACME.replace("    gpus_per_node: 8", "    memory: 64"), "X1000: memory: unknown field"),
    (ACME.replace("bf16: true", "bf16: yes please"), "X1000: bf16: must be true or false"),
    (ACME.replace("efficiency: 0.55", "efficiency: 55"), "efficiency: must be a fraction of peak in (0, 1]"),
    (ACME.replace("{fp32: 50, bf16: 400, fp16: 400}", "{fp32: 50, fp16: 400}"), "peak_tflops.bf16: missing"),
])
def test_each_malformed_user_entry_is_named(labkit_home, text, error):
    (labkit_home / "gpus.yaml").write_text(text)
    with pytest.raises(catalog.CatalogError, match=error.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        catalog.resolve_gpu_name("X1000")


def test_the_shipped_catalog_passes_the_checks_the_users_gets():
    shipped = catalog._load("gpus.yaml")
    assert catalog._checked_entries(shipped, catalog.DATA_DIR / "gpus.yaml", user=False).keys() == shipped["gpus"].keys()
    broken = {"gpus": {**shipped["gpus"], "B200": {**shipped["gpus"]["B200"], "memory_gb": -180}}}
    with pytest.raises(catalog.CatalogError, match="GPU B200: memory_gb: must be a positive number"):
        catalog._checked_entries(broken, catalog.DATA_DIR / "gpus.yaml", user=False)

"""NVIDIA's published Llama-3-70B FP8 recipe on 64 H100 (Megatron-Bridge's performance summary, the
megatron-bridge-h100 rows of labkit/data/published_runs.yaml): tensor 4, pipeline 8, 5 virtual stages, micro-batch 1, no
recompute, the distributed optimizer and sequence parallelism, global batch 128 of 8192-token sequences. The planner
must not rule out the layout NVIDIA runs."""
import json

import pytest
import yaml

from labkit.cli import main
from labkit.estimate import estimate
from labkit.spec import load_spec

TOP = 10
KERNELS = {"attention_backend": "auto", "overlap_grad_reduce": True, "overlap_param_gather": True,
           "tp_comm_overlap": True}
SPEC = {"name": "llama3-70b-fp8", "model": {"preset": "llama3-70b"}, "batch": {"global": 128}, "precision": "fp8",
        "kernels": KERNELS, "job": {"entrypoint": "megatron-lm", "megatron_lm": "/opt/megatron-lm"},
        "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 8, "gpus_per_node": 8}]}}
NVIDIA = {"tp": 4, "pp": 8, "virtual_stages": 5, "mbs": 1, "cp": 1, "recompute": False,
          "distributed_optimizer": True, "sequence_parallel": True}


def nvidia_spec():
    return load_spec({**SPEC, "batch": {"micro": 1, "global": 128}, "recompute": None,
                      "optimizer": {"distributed": True},
                      "parallel": {"tensor": 4, "pipeline": 8, "virtual_stages": 5, "sequence_parallel": True}})


def test_nvidias_layout_fits_on_80_gb_h100s():
    est = estimate(nvidia_spec())
    # what stage 0 holds, in the failure message: the figure to compare with Megatron's memory report
    assert est.fits_in_memory, f"stage 0: {est.memory_gb_per_stage[0]:.1f} GiB of {est.memory_limit_gb_per_stage[0]}"


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason="the ranking: tensor 4, context 2, pipeline 4 layouts are estimated 7% faster "
                                        "(10.76 s) than NVIDIA's 11.49 s (10.27 s at the megatron-bridge stack; "
                                        "measured 10.12 s on Megatron-Bridge 25.09); NeMo 24.12's run of the "
                                        "context-2 layout reads 1.0% fast, and the only Bridge FP8 context-parallel "
                                        "rows (Llama 3.1 405B, context across nodes) read 9-12% fast: no measurement "
                                        "ranks it behind")
def test_nvidias_llama3_70b_fp8_layout_is_among_the_plans_top_rows(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    assert main(["plan", str(path), "--top", str(TOP), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert all(not r["oom"] for r in rows) and len(rows) == TOP
    ranked = [{key: r[key] for key in NVIDIA} for r in rows]
    assert NVIDIA in ranked, [f"tp{r['tp']} cp{r['cp']} pp{r['pp']} vp{r['virtual_stages']} {r['estimated_s']:.2f} s"
                              for r in rows]

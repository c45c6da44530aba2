"""The comparison table and the figures, checked against the numbers the logs print."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from labkit import catalog
from labkit.cli import main
from labkit.estimate.flops import flops_72
from labkit.logs import parse_log, parse_text
from labkit.logs.views import (comparison_table, iteration_time_figure, loss_figure, memory_figure,
                               timeline_figure, timer_breakdown_figure)

FIXTURES = Path(__file__).parent / "fixtures" / "logs"


def megatron_log(*, precision="fp32", recompute=None, micro_batches=1, global_batch=8, times=(900.0, 500.0, 500.0),
                 max_allocated=1000.0, forward=200.0, backward=250.0) -> str:
    """A small log in Megatron-LM's format: arguments, world line, interval lines, memory, timer blocks."""
    args = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 128,
            "global_batch_size": global_batch, "micro_batch_size": global_batch // micro_batches,
            "fp16": precision == "fp16", "bf16": precision == "bf16",
            "recompute_granularity": recompute, "recompute_method": "uniform" if recompute else None}
    lines = ["------------------------ arguments ------------------------"]
    lines += [f"  {k} {'.' * (48 - len(k))} {v}" for k, v in args.items()]
    lines += ["-------------------- end of arguments ---------------------",
              "using world size: 2, data-parallel size: 2, context-parallel size: 1, tensor-model-parallel size: 1, "
              "pipeline-model-parallel size: 1 ",
              f"setting number of micro-batches to constant {micro_batches}"]
    for k, ms in enumerate(times, start=1):
        lines.append(f" iteration {5 * k:8d}/      15 | consumed samples: {5 * k * global_batch:12d} | elapsed time "
                     f"per iteration (ms): {ms:.1f} | learning rate: 1.000000E-04 | global batch size: "
                     f"{global_batch:5d} | lm loss: {8.0 - k:.6E} | loss scale: 1.0 | number of skipped iterations:   "
                     f"0 | number of nan iterations:   0 |")
        for rank in (0, 1):
            lines.append(f"[Rank {rank}] (after {5 * k} iterations) memory (MB) | allocated: 100.0 | max allocated: "
                         f"{max_allocated + rank} | reserved: 1200.0 | max reserved: 1200.0")
        lines += ["(min, max) time across ranks (ms):",
                  f"    forward-backward ...............................: ({forward + backward:.2f}, "
                  f"{forward + backward + 5:.2f})",
                  f"    forward-compute ................................: ({forward - 10:.2f}, {forward:.2f})",
                  f"    backward-compute ...............................: ({backward - 10:.2f}, {backward:.2f})",
                  "    optimizer ......................................: (20.00, 25.00)"]
    lines.append(" validation loss at iteration 15 | lm loss value: 5.500000E+00 | lm loss PPL: 2.446919E+02 | ")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def runs():
    return {
        "baseline": parse_text(megatron_log(times=(900.0, 500.0, 500.0), max_allocated=1000.0)),
        "fp16": parse_text(megatron_log(precision="fp16", times=(900.0, 250.0, 250.0), max_allocated=700.0)),
        "recompute": parse_text(megatron_log(recompute="full", times=(900.0, 625.0, 625.0), max_allocated=400.0)),
        "grad accumulation": parse_text(megatron_log(micro_batches=4, global_batch=32, times=(1900.0, 1600.0, 1600.0),
                                                     max_allocated=1000.0)),
    }


def test_comparison_table(runs):
    table = comparison_table(runs, baseline="baseline", gpu="A100-80GB")
    assert list(table.index) == ["baseline", "fp16", "recompute", "grad accumulation"]
    assert table.loc["baseline", "iteration_ms"] == 500.0 and table.loc["baseline", "speedup"] == 1.0
    assert table.loc["fp16", "speedup"] == pytest.approx(2.0)
    assert table.loc["recompute", "speedup"] == pytest.approx(0.8)
    # four times the samples in 3.2 times the time
    assert table.loc["grad accumulation", "speedup"] == pytest.approx(4 / 3.2)
    assert table.loc["grad accumulation", "num_micro_batches"] == 4
    assert table.loc["recompute", "max_allocated_mb"] == 401.0 and table.loc["fp16", "max_allocated_mb"] == 701.0
    assert table.loc["fp16", "precision"] == "fp16" and table.loc["recompute", "recompute"] == "full (uniform)"
    assert table.loc["baseline", "warmup_excluded"] == [5]
    tflops = flops_72(8, 32, 2, 64, 128) / 0.5 / 2 / 1e12  # two GPUs
    assert table.loc["baseline", "tflops_per_gpu"] == pytest.approx(tflops)
    assert table.loc["baseline", "mfu"] == pytest.approx(tflops / catalog.gpu("A100-80GB").peak("fp32"))
    assert table.loc["fp16", "mfu"] == pytest.approx(2 * tflops / catalog.gpu("A100-80GB").peak("fp16"))
    with pytest.raises(KeyError, match="baseline"):
        comparison_table(runs, baseline="nope")
    # a run that has not logged an interval yet, and runs whose logs print no batch size
    empty = comparison_table({"queued": parse_text("starting\n"), **runs})
    assert empty["speedup"].isna().all()
    no_batch = comparison_table({"a": parse_text(" iteration 10/ 20 | elapsed time per iteration (ms): 200.0 |\n"),
                                 "b": parse_text(" iteration 10/ 20 | elapsed time per iteration (ms): 100.0 |\n")})
    assert no_batch["speedup"].tolist() == [1.0, 2.0]


def test_loss_figure(runs):
    fig = loss_figure(runs)
    names = [t.name for t in fig.data]
    assert names[:2] == ["baseline", "baseline (validation)"] and len(fig.data) == 8
    assert list(fig.data[0].y) == [7.0, 6.0, 5.0] and list(fig.data[1].y) == [5.5]


def test_iteration_time_figure_marks_warmup(runs):
    fig = iteration_time_figure({"fp16": runs["fp16"]})
    points, steady = fig.data
    assert list(points.y) == [900.0, 250.0, 250.0] and list(points.marker.symbol) == ["x", "circle", "circle"]
    assert list(steady.y) == [250.0, 250.0]


def test_memory_figure_per_rank():
    p = parse_log(FIXTURES / "05-megads-2026-pdsh-2node-tp4dp2.log")
    fig = memory_figure(p, gpu="A100-40GB")
    assert list(fig.data[0].x) == [f"rank {r} (localhost)" for r in range(4)]
    assert list(fig.data[1].y) == [pytest.approx(20653.21923828125)] * 4
    assert fig.layout.shapes[0].y0 == pytest.approx(catalog.gpu("A100-40GB").memory_limit_gb * 1024)


def test_timer_breakdown_stacks_leaf_phases(runs):
    fig = timer_breakdown_figure(runs)
    phases = [t.name for t in fig.data]
    assert phases == ["forward-compute", "backward-compute", "optimizer"]  # forward-backward holds the other two
    by_phase = {t.name: dict(zip(t.x, t.y)) for t in fig.data}
    assert by_phase["forward-compute"]["baseline"] == 200.0 and by_phase["optimizer"]["fp16"] == 25.0
    single = timer_breakdown_figure(runs["baseline"])
    assert list(single.data[0].x) == ["5", "10", "15"]


def test_timeline_lays_phases_end_to_end():
    text = (" iteration 10/ 100 | elapsed time per iteration (ms): 100.0 |\ntimes across ranks (ms):\n"
            "  forward-compute:\n     rank  0: 40.00\n     rank  1: 44.00\n"
            "  backward-compute:\n     rank  0: 50.00\n     rank  1: 56.00\n")
    fig = timeline_figure(parse_text(text))
    forward, backward = fig.data
    assert list(forward.y) == ["rank 0", "rank 1"] and list(forward.x) == [40.0, 44.0]
    assert list(backward.base) == [40.0, 44.0] and list(backward.x) == [50.0, 56.0]


def test_cli_json_and_summary(capsys):
    log = FIXTURES / "02-bert-vega-srun.log"
    assert main(["logs", "parse", str(log), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"iterations", "memory", "timers", "arguments", "parallel", "events", "summary"} <= set(out)
    first = out["iterations"][0]
    assert (first["iteration"], first["lm_loss"], first["tflops_per_gpu"], first["rank"], first["task"]) == \
        (100, 9.483988, None, None, 3)
    assert out["summary"]["last_iteration"] == 1500 and out["memory"][0]["max_allocated_mb"] == 19087.2451171875
    assert main(["logs", "parse", str(log)]) == 0
    text = capsys.readouterr().out
    assert "iterations: 100..1500 of 100000" in text and "steady iteration time" in text
    assert main(["logs", "parse", str(FIXTURES / "missing.log")]) == 2
    assert "no such log file" in capsys.readouterr().err


def test_cli_uses_the_spec_for_mfu(capsys):
    spec = Path(__file__).parent.parent / "examples" / "gpt2-xl-hetero.yaml"
    log = FIXTURES / "fasop-get-result.txt"
    assert main(["logs", "parse", str(log), "--spec", str(spec), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["tflops_source"] == "model FLOPs" and 0 < summary["mfu"] < 1
    assert main(["logs", "parse", str(log)]) == 0
    assert "MFU" not in capsys.readouterr().out  # no GPU known without the spec


def test_a_profiled_iteration_does_not_squash_the_steady_ones_and_is_named():
    spiky = parse_text(megatron_log(times=(900.0, 500.0, 500.0, 6000.0, 500.0, 500.0)))
    fig = iteration_time_figure({"profiled": spiky})
    assert fig.layout.yaxis.range[1] < 6000.0
    assert "off the scale: profiled" in fig.layout.title.text and "6,000 ms" in fig.layout.title.text
    plain = iteration_time_figure({"plain": parse_text(megatron_log(times=(500.0, 500.0, 510.0, 505.0)))})
    assert "off the scale" not in plain.layout.title.text


def test_timer_breakdown_stacks_a_timer_one_run_lacks_as_zero():
    # A NaN bar restarts plotly's stack, hiding the phases above it: a timer a layout lacks stacks as 0 ms.
    synced = megatron_log().replace("    optimizer ....", "    all-grads-sync .................................: "
                                                         "(7.00, 9.00)\n    optimizer ....")
    fig = timer_breakdown_figure({"dp2": parse_text(synced), "tp2": parse_text(megatron_log())})
    by_phase = {t.name: dict(zip(t.x, t.y)) for t in fig.data}
    assert by_phase["all-grads-sync"] == {"dp2": 9.0, "tp2": 0.0}
    assert sum(phase["tp2"] for phase in by_phase.values()) == 200.0 + 250.0 + 25.0

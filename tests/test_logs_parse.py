"""The log parser against real logs of every era and launcher, and the examples printed by FASOP's Megatron-LM
scripts, the NVIDIA DLI workshop "Model Parallelism" and aws-samples/awsome-distributed-training.

Expected values were read off the log text by eye (each assertion quotes what the line prints)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pandas as pd
import pytest

from labkit.logs import parse_log, parse_text

FIXTURES = Path(__file__).parent / "fixtures" / "logs"


def row(parsed, iteration):
    rows = parsed.iterations[parsed.iterations["iteration"] == iteration]
    assert len(rows) == 1, f"expected one row for iteration {iteration}, got {len(rows)}"
    return rows.iloc[0]


@pytest.fixture(scope="module")
def logs():
    return {path.name[:2]: parse_log(path) for path in sorted(FIXTURES.glob("0*.log"))}


def test_v1_colonless_lines(logs):
    p = logs["01"]
    assert p.iterations["iteration"].tolist() == [100, 200, 300, 400, 500, 600]
    # "s iteration      100/     600 | elapsed time per iteration (ms): 810.9 | learning rate 1.444E-04 |
    #  lm loss 5.023855E+00 | loss scale 8192.0 |"  (stray 's' before it)
    r = row(p, 100)
    assert r["train_iters"] == 600
    assert r["elapsed_ms"] == pytest.approx(810.9)
    assert r["lr"] == pytest.approx(1.444e-4)
    assert r["lm_loss"] == pytest.approx(5.023855)
    assert r["loss_scale"] == 8192.0
    assert pd.isna(r["grad_norm"]) and pd.isna(r["global_batch_size"])
    assert row(p, 600)["lm_loss"] == pytest.approx(6.003926e-4)
    # "after 100 iterations memory (MB) | allocated: 3447.24365234375 | max allocated: 6237.830078125 | cached: 7890.0"
    m = p.memory.iloc[0]
    assert (m["iteration"], m["allocated_mb"], m["max_allocated_mb"], m["reserved_mb"]) == \
        (100, pytest.approx(3447.24365234375), pytest.approx(6237.830078125), 7890.0)
    # "time (ms) | forward: 252.44 | backward: 550.96 | allreduce: 12.11 | ..." after iteration 100
    t = p.timers[p.timers["iteration"] == 100].set_index("phase")["ms"]
    assert t["forward"] == pytest.approx(252.44) and t["backward"] == pytest.approx(550.96)
    assert t["data loader"] == pytest.approx(6.35)
    # "using world size: 2 and model-parallel size: 2"; "> number of parameters on model parallel rank 0: 178100224"
    assert p.parallel["world_size"] == 2 and p.parallel["tensor"] == 2 and p.parallel["data"] == 1
    assert p.parallel["parameters_per_rank"]["0,0"] == 178100224
    # old "arguments:" block
    assert p.arguments["num_layers"] == 24 and p.arguments["hidden_size"] == 1024
    assert p.arguments["fp16"] is True and p.arguments["train_data"] == ["webtext"]
    assert p.arguments["dynamic_loss_scale"] is True and p.arguments["train_data_path"] == ""
    # "validation loss at the end of training for val data | LM loss: 1.231077E+01 | LM PPL: 2.220759E+05"
    v = p.validation.set_index("split")
    assert v.loc["val", "lm_loss"] == pytest.approx(12.31077) and v.loc["test", "lm_loss"] == pytest.approx(12.15604)
    assert v.loc["val", "lm_ppl"] == pytest.approx(2.220759e5)
    # line 127: "WARNING: could not find the metadata file checkpoints/gpt2_345m_mp2/latest_checkpointed_iteration.txt"
    warn = p.events[p.events["message"].str.startswith("WARNING: could not find")]
    assert warn["line"].tolist() == [127] and warn["level"].tolist() == ["warning"]
    assert (p.events["level"] == "error").sum() == 0


def test_srun_labels_bert_and_skipped_with_loss(logs):
    p = logs["02"]
    assert p.iterations["iteration"].tolist() == list(range(100, 1600, 100))
    # "3:  iteration 100/ 100000 | consumed samples: 204800 | elapsed time per iteration (ms): 1456.7 |
    #  learning rate: 5.670E-05 | global batch size: 2048 | lm loss: 9.483988E+00 | sop loss: 5.839754E-01 |
    #  loss scale: 16384.0 | grad norm: 2.940 | number of skipped iterations: 19 | number of nan iterations: 0 |"
    r = row(p, 100)
    assert (r["consumed_samples"], r["global_batch_size"], r["skipped"], r["nan"], r["task"]) == \
        (204800, 2048, 19, 0, 3)
    assert r["elapsed_ms"] == pytest.approx(1456.7) and r["lr"] == pytest.approx(5.670e-5)
    assert r["lm_loss"] == pytest.approx(9.483988) and r["sop_loss"] == pytest.approx(0.5839754)
    assert r["grad_norm"] == pytest.approx(2.940)
    assert row(p, 1100)["loss_scale"] == 32768.0
    assert row(p, 1500)["lm_loss"] == pytest.approx(2.521821)
    # "0: [Rank 0] (after 100 iterations) memory (MB) | ... | max allocated: 19087.2451171875 | reserved: 24738.0"
    m = p.memory.iloc[0]
    assert (m["rank"], m["task"], m["iteration"]) == (0, 0, 100)
    assert m["max_allocated_mb"] == pytest.approx(19087.2451171875) and m["reserved_mb"] == 24738.0
    t = p.timers[p.timers["iteration"] == 100].set_index("phase")["ms"]
    assert t["forward-compute"] == pytest.approx(993.38) and t["batch-generator"] == pytest.approx(15.86)
    assert len(p.timers) == 15 * 10
    # "validation loss at iteration 1000 | lm loss value: 4.328599E+00 | lm loss PPL: 7.583796E+01 | sop loss value: .."
    v = p.validation.iloc[0]
    assert (v["iteration"], v["split"]) == (1000, "valid")
    assert v["lm_loss"] == pytest.approx(4.328599) and v["lm_ppl"] == pytest.approx(75.83796)
    assert v["sop_loss"] == pytest.approx(0.1302275)


def test_megatron_2025_timestamps_skips_and_arguments(logs):
    p = logs["03"]
    assert p.iterations["iteration"].tolist() == list(range(10, 270, 10))
    # iteration 10 is all skipped: no lm loss, no grad norm
    r = row(p, 10)
    assert pd.isna(r["lm_loss"]) and pd.isna(r["grad_norm"])
    assert (r["skipped"], r["loss_scale"], r["lr"], r["elapsed_ms"]) == (10, 8388608.0, 0.0, pytest.approx(1147.6))
    assert r["timestamp"] == pd.Timestamp("2025-04-13 23:41:12")
    # "lm loss: 1.072453E+01 | loss scale: 131072.0 | grad norm: 3.874 | num zeros: 71.0 | ... skipped iterations: 6"
    r = row(p, 20)
    assert r["lm_loss"] == pytest.approx(10.72453) and r["grad_norm"] == pytest.approx(3.874)
    assert r["num_zeros"] == 71.0 and r["skipped"] == 6 and r["lr"] == pytest.approx(4.0e-5)
    assert pd.isna(row(p, 30)["grad_norm"]) and row(p, 30)["skipped"] == 5
    assert row(p, 260)["lm_loss"] == pytest.approx(6.939181) and row(p, 260)["elapsed_ms"] == pytest.approx(973.8)
    assert row(p, 260)["consumed_samples"] == 4160 and row(p, 260)["line"] == 764
    # "[Rank 0] (after 10 iterations) memory (MB) | allocated: 1464.33154296875 | ... | max reserved: 1576.0"
    m = p.memory.iloc[0]
    assert (m["rank"], m["iteration"], m["max_reserved_mb"]) == (0, 10, 1576.0)
    assert m["allocated_mb"] == pytest.approx(1464.33154296875)
    # (min, max) blocks: set-up before training, evaluate and save-checkpoint after intervals
    t = p.timers
    setup = t[t["phase"] == "model-and-optimizer-setup"].iloc[0]
    assert pd.isna(setup["iteration"]) and setup["min_ms"] == pytest.approx(123.15)
    ev = t[(t["phase"] == "evaluate") & (t["iteration"] == 50)].iloc[0]
    assert ev["max_ms"] == pytest.approx(3274.73) and ev["style"] == "minmax"
    assert t[(t["phase"] == "save-checkpoint") & (t["iteration"] == 100)]["ms"].tolist() == [pytest.approx(3413.14)]
    v = p.validation.set_index("iteration")
    assert v.loc[250, "lm_loss"] == pytest.approx(7.083469) and v.loc[50, "lm_ppl"] == pytest.approx(7255.679)
    # "using world size: 1, data-parallel size: 1, context-parallel size: 1, hierarchical context-parallel sizes:
    #  Nonetensor-model-parallel size: 1, ..."; "setting number of microbatches to constant 16"
    assert {k: p.parallel[k] for k in ("world_size", "data", "tensor", "pipeline", "context")} == \
        {"world_size": 1, "data": 1, "tensor": 1, "pipeline": 1, "context": 1}
    assert p.parallel["num_micro_batches"] == 16
    assert p.parallel["parameters_per_rank"] == {"0,0": 124082688}
    a = p.arguments
    assert (a["hidden_size"], a["global_batch_size"], a["micro_batch_size"], a["lr"]) == (768, 16, 1, 0.0001)
    assert a["fp16"] is True and a["bf16"] is False and a["fp8"] is None
    assert a["data_path"] == ["/root/workspace/data/oscar-en-10k-meg-gpt_text_document"]
    assert a["padded_vocab_size"] == 50304  # "> padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)"
    w = p.events[p.events["line"] == 4].iloc[0]
    assert w["level"] == "warning" and w["message"].startswith("WARNING: Setting args.check_for_nan_in_loss")


def test_core_r080_throughput_per_gpu(logs):
    p = logs["04"]
    assert p.iterations["iteration"].tolist() == list(range(10, 110, 10))
    r = row(p, 10)  # fully skipped: "loss scale: 8388608.0 | number of skipped iterations:  10"
    assert r["tflops_per_gpu"] == pytest.approx(748.3) and r["elapsed_ms"] == pytest.approx(15210.6)
    assert pd.isna(r["lm_loss"]) and r["skipped"] == 10 and r["train_iters"] == 500000
    r = row(p, 100)
    assert r["tflops_per_gpu"] == pytest.approx(799.6) and r["lm_loss"] == pytest.approx(5.806238)
    assert r["grad_norm"] == pytest.approx(7.296) and r["lr"] == pytest.approx(1.186047e-5)
    assert r["consumed_samples"] == 102400 and r["timestamp"] == pd.Timestamp("2024-09-03 16:59:56")
    assert p.memory.iloc[0]["max_allocated_mb"] == pytest.approx(70522.5751953125)


def test_megatron_deepspeed_pdsh_hosts(logs):
    p = logs["05"]
    # DeepSpeed's own "steps: 1 loss: 12.6347 iter time (s): 72.465" lines are not interval lines
    assert p.iterations["iteration"].tolist() == list(range(1, 15))
    r = row(p, 1)
    assert (r["consumed_samples"], r["consumed_tokens"], r["seq_length"], r["train_iters"]) == (8, 16384, 2048, 20)
    assert r["elapsed_ms"] == pytest.approx(72710.8) and r["tflops_per_gpu"] == pytest.approx(1.66)
    assert r["tokens_per_gpu_per_s"] == pytest.approx(28.166) and r["samples_per_s"] == pytest.approx(0.110)
    assert r["lm_loss"] == pytest.approx(12.63473) and r["loss_scale"] == 1.0 and r["lr"] == pytest.approx(5.263e-7)
    assert r["node"] == "192.168.205.202"
    assert row(p, 14)["elapsed_ms"] == pytest.approx(117907.8) and row(p, 14)["tflops_per_gpu"] == pytest.approx(1.03)
    mem = p.memory
    assert sorted(mem["rank"].tolist()) == [0, 1, 2, 3] and set(mem["node"]) == {"localhost"}
    assert mem["max_allocated_mb"].eq(20653.21923828125).all()
    setup = p.timers[p.timers["phase"] == "model-and-optimizer-setup"].iloc[0]
    assert (setup["min_ms"], setup["max_ms"], setup["node"]) == (36314.52, 36395.01, "192.168.205.202")
    # "Using topology: {ProcessCoord(pipe=0, data=0, model=0): 0, ... (pipe=0, data=1, model=3): 7}"
    assert (p.parallel["tensor"], p.parallel["data"], p.parallel["pipeline"], p.parallel["world_size"]) == (4, 2, 1, 8)
    assert p.parallel["parameters_per_rank"]["3,0"] == 1904025088
    assert p.events["line"].tolist()[:2] == [1, 2] and set(p.events["level"]) == {"warning"}


def test_torchrun_prefix_seconds_and_truncated_last_line(logs):
    p = logs["06"]
    # the 50th iteration's line stops at "lm loss: 8." : left out and reported
    assert p.iterations["iteration"].tolist() == [10, 20, 30, 40]
    r = row(p, 10)
    assert r["elapsed_ms"] == pytest.approx(35865.1)  # "elapsed time per iteration (s): 35.8651"
    assert r["tflops_per_gpu"] == pytest.approx(199.03) and r["samples_per_s"] == pytest.approx(28.551)
    assert r["lm_loss"] == pytest.approx(13.32803) and r["local_rank"] == 3 and r["lr"] == pytest.approx(4.734e-6)
    assert row(p, 40)["grad_norm"] == pytest.approx(3.441)
    assert p.partial_lines["line"].tolist() == [5]
    assert p.partial_lines["text"].iloc[0].endswith("lm loss: 8.")


def test_key_value_fork_with_quoted_lines(logs):
    p = logs["07"]
    assert p.iterations["iteration"].tolist() == list(range(1, 10))
    r = row(p, 1)
    assert (r["consumed_samples"], r["consumed_tokens"], r["global_batch_size"], r["seq_length"]) == \
        (256, 1048576, 256, 4096)
    assert r["elapsed_ms"] == pytest.approx(17711.7) and r["lr"] == 0.0 and r["lm_loss"] == pytest.approx(11.208768)
    assert r["tflops_per_gpu"] == pytest.approx(144.87) and r["tokens_per_gpu_per_s"] == pytest.approx(7400.298)
    assert r["loss_scale"] == 65536.0 and r["timestamp"] == pd.Timestamp("2024-04-21 02:45:08")
    assert row(p, 9)["lm_loss"] == pytest.approx(11.146455) and row(p, 9)["tflops_per_gpu"] == pytest.approx(158.60)
    assert sorted(p.memory["rank"].tolist()) == [0, 1]
    # DeepSpeed prints step 2's timers just before Megatron's "iteration= 2" line
    ds = p.timers[(p.timers["iteration"] == 2) & (p.timers["phase"] == "fwd_microstep")].iloc[0]
    assert ds["ms"] == pytest.approx(3859.38) and ds["rank"] == 0
    assert (p.parallel["world_size"], p.parallel["data"], p.parallel["tensor"]) == (8, 4, 2)


def test_nemo2_zero_based_iterations(logs):
    p = logs["08"]
    # "Training epoch 0, iteration 28/99 | lr: 5.6e-06 | global_batch_size: 32 | ... | reduced_train_loss: 2.778 |
    #  train_step_timing in s: 0.189 | consumed_samples: 928": the numbers stay as printed, 0-based
    assert p.iterations["iteration"].tolist() == list(range(28, 35))
    r = row(p, 28)
    assert (r["train_iters"], r["epoch"], r["global_batch_size"], r["consumed_samples"], r["task"]) == \
        (99, 0, 32, 928, 0)
    assert r["global_step"] == 28
    assert r["lm_loss"] == pytest.approx(2.778) and r["elapsed_ms"] == pytest.approx(189.0)
    assert r["lr"] == pytest.approx(5.6e-6)
    assert row(p, 34)["lm_loss"] == pytest.approx(2.788)


# --- the course sources' examples (FASOP, the NVIDIA DLI workshop, awsome-distributed-training) -----------------------

def test_fasop_get_result_output():
    p = parse_log(FIXTURES / "fasop-get-result.txt")
    # interval lines under "==> ../log2/10932251/n067.out <==" and the script's own "iteration 10 : 4.5416 s" summary
    assert p.iterations["iteration"].tolist() == [10, 20, 30, 40, 50]
    assert row(p, 10)["elapsed_ms"] == pytest.approx(4541.6)
    r = row(p, 30)
    assert r["node"] == "n067" and r["elapsed_ms"] == pytest.approx(1423.8) and r["lm_loss"] == pytest.approx(10.17721)
    assert row(p, 50)["grad_norm"] == pytest.approx(2.932)
    # rank 0's memory line is cut off after "| max " by the terminal: reported, not parsed
    assert p.memory["rank"].tolist() == [24]
    assert p.partial_lines["text"].iloc[0].startswith("[Rank 0] (after 20 iterations) memory (MB)")
    assert (p.parallel["world_size"], p.parallel["data"], p.parallel["pipeline"], p.parallel["tensor"]) == (32, 4, 8, 1)
    assert p.parallel["partition"] == "0-11-8-8-8-8-5-0" and p.parallel["nodes"] == 8


def test_fasop_job_directory_of_node_files(tmp_path):
    job = FIXTURES / "fasop-job" / "10932251"
    p = parse_log(job)
    assert [Path(s).name for s in p.sources] == ["n060.err", "n060.out", "n066.out", "n067.err", "n067.out"]
    assert p.iterations["iteration"].tolist() == [30, 40, 50]
    assert set(p.iterations["node"]) == {"n067"}
    m = p.memory.iloc[0]
    assert (m["node"], m["rank"], m["iteration"]) == ("n066", 24, 20)
    assert m["max_allocated_mb"] == pytest.approx(3869.255859375)
    # n060.out's last line has no newline yet: still being written
    part = p.partial_lines.iloc[0]
    assert Path(part["source"]).name == "n060.out" and part["line"] == 2
    # a run directory: the batch script's slurm-JOBID.out beside the per-node files names no node
    run = tmp_path / "run" / "logs"
    shutil.copytree(job, run / "10932251")
    (run / "slurm-10932251.out").write_text(line(10) + "\n")
    r = parse_log(tmp_path / "run")
    assert r.iterations["iteration"].tolist() == [10, 30, 40, 50]
    assert r.iterations["node"].tolist()[0] is None and r.iterations["node"].tolist()[1] == "n067"
    # the same files named one by one give the same table
    files = parse_log([job / "n067.out", job / "n066.out"])
    pd.testing.assert_series_equal(files.iterations["lm_loss"], p.iterations["lm_loss"])


def test_dli_workshop_grep_lines():
    p = parse_log(FIXTURES / "dli-workshop-grep-elapsed.txt")
    assert p.iterations["iteration"].tolist() == [10, 20, 30]
    assert pd.isna(row(p, 10)["lm_loss"]) and row(p, 10)["skipped"] == 10
    assert row(p, 20)["lm_loss"] == pytest.approx(10.70710) and row(p, 30)["loss_scale"] == 65536.0
    assert p.partial_lines["line"].tolist() == [4]


def test_dli_workshop_world_and_micro_batches():
    p = parse_text("    using world size: 4, data-parallel-size: 4, tensor-model-parallel size: 1, "
                   "pipeline-model-parallel size: 1 \n    using torch.float16 for parameters ...\n"
                   "setting number of micro-batches to constant 4\n")
    assert p.parallel == {"world_size": 4, "data": 4, "tensor": 1, "pipeline": 1, "num_micro_batches": 4}


def test_awsome_srun_and_sample_log():
    p = parse_log(FIXTURES / "awsome-srun.log")
    assert p.iterations["iteration"].tolist() == [25, 26, 27]
    r = row(p, 25)
    assert (r["task"], r["train_iters"], r["consumed_samples"], r["global_batch_size"]) == (1, 73242187, 50, 2)
    assert r["elapsed_ms"] == pytest.approx(87.0) and r["loss_scale"] == 4294967296.0 and r["grad_norm"] == 0.0
    k = parse_log(FIXTURES / "awsome-kubectl.log")
    assert k.iterations["iteration"].tolist() == [1, 2, 3]
    assert k.iterations["lm_loss"].isna().all() and k.iterations["skipped"].tolist() == [1, 1, 1]
    assert row(k, 2)["loss_scale"] == 2147483648.0 and row(k, 1)["elapsed_ms"] == pytest.approx(255940.5)
    assert k.arguments["adam_beta2"] == 0.95 and k.arguments["accumulate_allreduce_grads_in_fp32"] is False
    assert k.parallel["num_micro_batches"] == 288 and k.parallel["parameters_per_rank"] == {"4,0": 941594624}
    assert k.arguments["padded_vocab_size"] == 51200


# --- variants -----------------------------------------------------------------------------------------------------

LINE = (" iteration {i:8d}/     100 | consumed samples: {s:12d} | elapsed time per iteration (ms): {ms:.1f} | "
        "learning rate: 1.000000E-04 | global batch size:     8 | lm loss: {loss:.6E} | loss scale: 1.0 | "
        "grad norm: 1.000 | number of skipped iterations:   0 | number of nan iterations:   0 |")


def line(i, ms=100.0, loss=5.0):
    return LINE.format(i=i, s=8 * i, ms=ms, loss=loss)


def test_ansi_colours_and_carriage_returns():
    text = ("Processed 10 docs\rProcessed 20 docs\r" + line(10).replace("lm loss:", "\x1b[1;32mlm loss\x1b[0m:")
            + "\n\x1b[33mWARNING\x1b[0m: low disk\r\n" + line(20, loss=4.5) + "\n")
    p = parse_text(text)
    assert p.iterations["iteration"].tolist() == [10, 20]
    assert p.iterations["lm_loss"].tolist() == [pytest.approx(5.0), pytest.approx(4.5)]
    assert p.events["line"].tolist() == [2]  # line numbers stay the file's own


def test_several_ranks_interleaved_in_one_file():
    timers = ["(min, max) time across ranks (ms):",
              "    forward-compute ................................: (10.00, 12.50)",
              "    backward-compute ...............................: (20.00, 21.00)"]
    lines = []
    for i in (10, 20):
        for rank in (0, 1):
            lines.append(f"{rank}: " + line(i, ms=100.0 + rank))
        lines.append("1: " + timers[0])
        lines.append("0: some other rank's output")
        lines += ["1: " + t for t in timers[1:]]
    p = parse_text("\n".join(lines) + "\n")
    assert p.iterations["iteration"].tolist() == [10, 20]
    assert p.iterations["elapsed_ms"].tolist() == [100.0, 100.0]  # the first printed wins
    t = p.timers[p.timers["iteration"] == 20].set_index("phase")
    assert t.loc["forward-compute", "min_ms"] == 10.0 and t.loc["backward-compute", "max_ms"] == 21.0
    assert set(t["task"]) == {1}


def test_restart_keeps_the_rerun():
    text = "\n".join([line(10), line(20, loss=4.0), line(30, loss=3.0), "resuming from checkpoint at 20",
                      line(30, loss=3.5), line(40, loss=3.2)]) + "\n"
    p = parse_text(text)
    assert p.iterations["iteration"].tolist() == [10, 20, 30, 40]
    assert row(p, 30)["lm_loss"] == pytest.approx(3.5) and p.restarts == 1


def test_broken_line_from_interleaving_is_reported():
    broken = line(20)[:60] + line(30, loss=3.0)
    p = parse_text(line(10) + "\n" + broken + "\n" + line(40) + "\n")
    # the spliced line ends like a full line, but its first record is cut: reported; the second is read
    assert p.iterations["iteration"].tolist() == [10, 30, 40]
    assert row(p, 30)["lm_loss"] == 3.0 and row(p, 30)["line"] == 2
    assert p.partial_lines["line"].tolist() == [2]
    cut = parse_text(line(10) + "\n" + line(20)[:80] + "\n" + line(30) + "\n")
    assert cut.iterations["iteration"].tolist() == [10, 30] and cut.partial_lines["line"].tolist() == [2]


def test_timer_styles_max_and_all_ranks():
    text = "\n".join([
        line(10),
        "max time across ranks (ms):",
        "    forward-backward ...............................: 95.12",
        "    optimizer ......................................: 4.50",
        "times across ranks (ms):",
        "  forward-compute:",
        "     rank  0: 40.10",
        "     rank  1: 42.30",
        "  backward-compute:",
        "     rank  0: 50.00",
        "     rank  1: 51.00",
        "after the block",
    ]) + "\n"
    t = parse_text(text).timers
    mx = t[t["style"] == "max"].set_index("phase")
    assert mx.loc["forward-backward", "ms"] == 95.12 and pd.isna(mx.loc["optimizer", "min_ms"])
    every = t[t["style"] == "all"]
    assert every[["phase", "rank", "ms"]].values.tolist() == [
        ["forward-compute", 0, 40.10], ["forward-compute", 1, 42.30],
        ["backward-compute", 0, 50.0], ["backward-compute", 1, 51.0]]
    assert set(t["iteration"]) == {10}


def test_validation_lines_of_every_era():
    text = (" validation loss at iteration 10 | lm loss value: 6.010339E+00 | lm loss PPL: 4.076217E+02 | \n"
            " validation loss at iteration 20 on validation set | lm loss value: 5.762235E+00 | lm loss PPL: 3.1E+02 | \n"
            " validation loss at iteration 20 on test set | lm loss value: 5.726602E+00 | lm loss PPL: 3.069246E+02 | \n"
            " validation loss at the end of training for test data | LM loss: 1.215604E+01 | LM PPL: 1.902403E+05\n")
    v = parse_text(text).validation
    assert v["split"].tolist() == ["valid", "validation", "test", "test"]
    assert v["iteration"].tolist()[:3] == [10, 20, 20] and pd.isna(v["iteration"].iloc[3])
    assert v["lm_loss"].tolist() == [6.010339, 5.762235, 5.726602, 12.15604]


def test_skipped_samples_and_consumed_tokens_fields():
    text = (" [2025-01-02 03:04:05] iteration       10/     100 | consumed samples:          80 | skipped samples: 3 |"
            " consumed tokens: 81920 | elapsed time per iteration (ms): 12.5 | throughput per GPU (TFLOP/s/GPU): 1.5 |"
            " learning rate: 1.000000E-04 | global batch size:     8 | lm loss: 7.000000E+00 | mtp_1 loss: 7.5 |"
            " loss scale: 1.0 | number of skipped iterations:   0 | number of nan iterations:   1 |\n")
    r = parse_text(text).iterations.iloc[0]
    assert (r["skipped_samples"], r["consumed_tokens"], r["nan"]) == (3, 81920, 1)
    assert r["tflops_per_gpu"] == 1.5 and r["mtp_1_loss"] == 7.5


def test_labkit_driver_memory_line_and_errors():
    text = ("[Rank 1] (after 5 iterations) memory (MB) | allocated: 812.5 | max allocated: 900.25 | reserved: 812.5 |"
            " max reserved: 900.25 | measured as: cpu process resident memory\n"
            "Traceback (most recent call last):\n"
            "ERROR: NaN loss at iteration 7 (lm loss nan)\n")
    p = parse_text(text)
    m = p.memory.iloc[0]
    assert (m["rank"], m["max_allocated_mb"], m["measured_as"]) == (1, 900.25, "cpu process resident memory")
    assert p.events[["line", "level"]].values.tolist() == [[2, "error"], [3, "error"]]


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such log file"):
        parse_log(tmp_path / "nope.log")
    with pytest.raises(FileNotFoundError, match="no \\*.out"):
        parse_log(tmp_path)


def test_json_rows_use_null_for_missing_fields(logs):
    out = logs["03"].to_json()
    first = out["iterations"][0]
    for key in ("iteration", "train_iters", "elapsed_ms", "lm_loss", "lr", "global_batch_size", "loss_scale",
                "grad_norm", "tflops_per_gpu", "skipped", "nan", "rank", "node"):
        assert key in first
    assert first["lm_loss"] is None and first["iteration"] == 10 and first["timestamp"] == "2025-04-13T23:41:12"
    assert out["arguments"]["hidden_size"] == 768 and out["parallel"]["num_micro_batches"] == 16


def test_labkit_driver_log():
    """labkit's own driver (`torchrun --nproc-per-node 2 -m labkit.train ... --mock-data`, CPU): Megatron's format."""
    p = parse_log(FIXTURES / "labkit-driver-dp2-cpu.log")
    assert p.iterations["iteration"].tolist() == [3, 6, 9, 12]
    r = row(p, 3)
    assert (r["consumed_samples"], r["global_batch_size"], r["train_iters"], r["line"]) == (24, 8, 12, 157)
    assert r["elapsed_ms"] == pytest.approx(85.9) and r["tflops_per_gpu"] == 0.0 and r["lr"] == pytest.approx(7.5e-4)
    assert r["lm_loss"] == pytest.approx(6.220268) and r["grad_norm"] == pytest.approx(1.020) and r["loss_scale"] == 1.0
    assert row(p, 12)["lm_loss"] == pytest.approx(5.939541) and row(p, 12)["elapsed_ms"] == pytest.approx(42.4)
    m = p.memory.iloc[0]
    assert (m["rank"], m["iteration"], m["allocated_mb"]) == (0, 3, 430.78125)
    assert m["measured_as"] == "cpu process resident memory"
    t = p.timers[p.timers["iteration"] == 6].set_index("phase")
    assert (t.loc["forward-compute", "min_ms"], t.loc["forward-compute", "max_ms"]) == (12.46, 13.35)
    assert t.loc["evaluate", "max_ms"] == 17.62  # printed after iteration 6's validation
    v = p.validation.set_index("iteration")
    assert v.loc[6, "lm_loss"] == pytest.approx(5.992454) and v.loc[12, "lm_ppl"] == pytest.approx(367.4417)
    assert {k: p.parallel[k] for k in ("world_size", "data", "tensor", "pipeline", "num_micro_batches")} == \
        {"world_size": 2, "data": 2, "tensor": 1, "pipeline": 1, "num_micro_batches": 2}
    assert p.parallel["parameters_per_rank"] == {"0,0": 136960}
    assert (p.arguments["num_layers"], p.arguments["hidden_size"], p.arguments["seq_length"]) == (2, 64, 64)
    assert p.arguments["log_throughput"] is True and p.arguments["padded_vocab_size"] == 512


def test_labkit_driver_sample_from_its_tests():
    """The driver's own data-parallel-2 sample, which its test suite rewrites when the driver's output changes: every
    interval, memory, timer and validation line in it is read, with the values a plain grep finds."""
    import re

    text = (FIXTURES / "labkit-driver-dp2.log").read_text()
    p = parse_log(FIXTURES / "labkit-driver-dp2.log")
    grep = [(int(m.group(1)), int(m.group(2)), float(m.group(3)), float(m.group(4)))
            for m in re.finditer(r"iteration +(\d+)/ +\d+ \| consumed samples: +(\d+) \| elapsed time per "
                                 r"iteration \(ms\): ([\d.]+) \|.*? lm loss: ([\d.E+-]+) \|", text)]
    assert len(grep) >= 2
    assert p.iterations[["iteration", "consumed_samples", "elapsed_ms", "lm_loss"]].values.tolist() == \
        [list(g) for g in grep]
    assert len(p.memory) == text.count("memory (MB)") and p.memory["allocated_mb"].gt(0).all()
    assert len(p.timers) == len(re.findall(r"\.\.\.: \(", text)) and set(p.timers["style"]) == {"minmax"}
    assert len(p.validation) == text.count("validation loss at iteration")
    # since 2024 Megatron-LM ends with "validation loss at iteration 20 on validation set |" and "... on test set |"
    assert set(p.validation["split"]) <= {"valid", "validation", "test"}
    assert p.parallel["world_size"] == 2 and p.parallel["data"] == 2 and len(p.arguments) > 20


def test_event_scan_in_a_forked_child_finds_what_the_inline_scan_finds(monkeypatch):
    from labkit.logs import parse as parse_module

    path = FIXTURES / "03-mlm2025-gpt2-fp16-autodl.log"
    inline = parse_log(path).events
    assert len(inline) > 0
    monkeypatch.setattr(parse_module, "_BACKGROUND_SCAN_BYTES", 0)
    monkeypatch.setattr(parse_module, "_can_fork_a_scanner", lambda: True)  # the suite's own threads aside
    parent, scan = os.getpid(), parse_module._event_hits

    def scan_in_child_only(buf):
        assert os.getpid() != parent, "the event scan ran in the parsing process"
        return scan(buf)
    monkeypatch.setattr(parse_module, "_event_hits", scan_in_child_only)
    pd.testing.assert_frame_equal(parse_log(path).events, inline)


def test_event_scan_runs_in_line_when_no_child_can_be_started(monkeypatch):
    import multiprocessing

    from labkit.logs import parse as parse_module

    path = FIXTURES / "03-mlm2025-gpt2-fp16-autodl.log"
    inline = parse_log(path).events
    monkeypatch.setattr(parse_module, "_BACKGROUND_SCAN_BYTES", 0)
    monkeypatch.setattr(parse_module, "_can_fork_a_scanner", lambda: True)

    def no_fork(self):
        raise OSError(11, "Resource temporarily unavailable")
    monkeypatch.setattr(multiprocessing.get_context("fork").Process, "start", no_fork)
    pd.testing.assert_frame_equal(parse_log(path).events, inline)


def test_ctrl_c_in_a_parse_stops_its_forked_scanner_with_it(monkeypatch):
    import multiprocessing

    from labkit.logs import parse as parse_module

    monkeypatch.setattr(parse_module, "_BACKGROUND_SCAN_BYTES", 0)
    monkeypatch.setattr(parse_module, "_can_fork_a_scanner", lambda: True)
    started = []
    start = multiprocessing.get_context("fork").Process.start

    def counted(self):
        started.append(self)
        start(self)
    monkeypatch.setattr(multiprocessing.get_context("fork").Process, "start", counted)

    def interrupted(s):
        raise KeyboardInterrupt
    monkeypatch.setattr(parse_module, "_iterations", interrupted)
    with pytest.raises(KeyboardInterrupt):
        parse_log(FIXTURES / "03-mlm2025-gpt2-fp16-autodl.log")
    assert started and not any(child.is_alive() for child in started)  # not left to run on unheard


def test_rank_zeros_memory_report_glued_to_the_first_iteration_line_keeps_both():
    """The last rank prints the iteration, rank 0 its memory report after the first one; on a shared stdout the report
    can land before the iteration line's line break (seen in a local two-rank run)."""
    iteration = (" [2026-11-29 03:05:26] iteration        1/       3 | consumed samples:            8 | elapsed time "
                 "per iteration (ms): 88.3 | learning rate: 1.150000E-04 | global batch size:     8 | lm loss: "
                 "6.946862E+00 | loss scale: 1.0 | grad norm: 0.880 | number of skipped iterations:   0 | number of "
                 "nan iterations:   0 |")
    memory = ("[Rank 0] (after 1 iterations) memory (MB) | allocated: 384.9 | max allocated: 384.9 | reserved: 384.9 | "
              "max reserved: 384.9")
    p = parse_text(iteration + memory + "\n\n" + iteration.replace("1/", "2/").replace("6.946862", "6.950731") + "\n")
    assert p.iterations["iteration"].tolist() == [1, 2]
    assert p.iterations["lm_loss"].tolist() == [6.946862, 6.950731]
    assert p.memory["allocated_mb"].tolist() == [384.9] and p.partial_lines.empty

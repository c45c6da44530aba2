"""The training driver end to end on CPU: tiny models, real processes (torchrun, gloo), Megatron-format logs.

All runs start together once per module (they are independent; the resume run waits for the run it resumes), then
each test reads the logs and files they left. Comparisons that must be exact use dropout 0 or identical seeds.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit.megatron_args import pipeline_layout
from labkit.net import free_port
from labkit.train.arguments import ArgumentError, build_parser, finish

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "labkit" / "data" / "corpus" / "corpus_text_document"
FIXTURE_LOG = ROOT / "tests" / "fixtures" / "logs" / "labkit-driver-dp2.log"
MODEL = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64".split()
MOCK = "--mock-data --vocab-size 1023".split()  # and the end-of-document id: 1024 tokens, as Megatron-LM counts
NO_DROPOUT = "--hidden-dropout 0 --attention-dropout 0".split()
# fp32, no dropout, global batch 8 as 4 micro-batches of 2: the reference the exact comparisons are made against.
EXACT = [*MODEL, *MOCK, *NO_DROPOUT, "--lr", "1e-3", "--train-iters", "6", "--log-interval", "1", "--eval-iters", "0"]
CORPUS_RUN = [*MODEL, "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4",
              "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.1", "--train-iters", "50", "--log-interval", "5",
              "--eval-interval", "25", "--eval-iters", "2", "--log-throughput", "--data-path", str(CORPUS),
              "--split", "90,5,5", "--bf16", "--use-distributed-optimizer", "--timing-log-level", "2"]
PP_UNEVEN = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64", *MOCK,
             "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--train-iters", "6",
             "--log-interval", "1", "--eval-iters", "0", "--pipeline-model-parallel-size", "2",
             "--pipeline-model-parallel-layout", pipeline_layout([0, 3])]
RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()

ITERATION = re.compile(r" iteration +(\d+)/ *(\d+) \|(.*)")


class Run:
    def __init__(self, directory: Path, processes: int, flags: list[str]):
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={processes}",
                     f"--master-port={free_port()}"] if processes > 1 else [sys.executable])
        self.cmd = [*launcher, "-m", "labkit.train", *flags]
        self.log_file = directory / "train.log"
        with open(self.log_file, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=directory,
                                         env=dict(os.environ, OMP_NUM_THREADS="1"))

    def wait(self) -> "Run":
        self.proc.wait(timeout=600)
        self.text = self.log_file.read_text()
        self.returncode = self.proc.returncode
        return self

    def ok(self) -> "Run":
        assert self.returncode == 0, f"{' '.join(self.cmd)}\n{self.text[-4000:]}"
        return self

    def iterations(self) -> dict[int, dict[str, float]]:
        """Iteration number -> the numeric fields of its log line."""
        found = {}
        for line in self.text.splitlines():
            match = ITERATION.search(line)
            if match:
                fields = {}
                for part in match.group(3).split("|"):
                    if ":" in part:
                        key, value = part.rsplit(":", 1)
                        try:
                            fields[key.strip()] = float(value)
                        except ValueError:
                            pass
                found[int(match.group(1))] = fields
        return found

    def losses(self) -> dict[int, float]:
        return {i: f["lm loss"] for i, f in self.iterations().items() if "lm loss" in f}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("driver")
    cache = ["--data-cache-path", str(root / "dataset-cache")]
    started = {
        "corpus_dp2": Run(root / "corpus_dp2", 2, [
            *CORPUS_RUN, *cache, "--save", str(root / "corpus_dp2" / "ckpt"), "--save-interval", "40",
            "--tensorboard-dir", str(root / "corpus_dp2" / "tb"), "--log-timers-to-tensorboard",
            "--log-memory-to-tensorboard", "--log-validation-ppl-to-tensorboard",
            "--profile", "--profile-step-start", "2", "--profile-step-end", "4", "--profile-ranks", "0", "1"]),
        "micro2x4": Run(root / "micro2x4", 1, [*EXACT, "--micro-batch-size", "2", "--global-batch-size", "8"]),
        "micro8x1": Run(root / "micro8x1", 1, [*EXACT, "--micro-batch-size", "8", "--global-batch-size", "8"]),
        "tp2": Run(root / "tp2", 2, [*EXACT, "--micro-batch-size", "2", "--global-batch-size", "8",
                                     "--tensor-model-parallel-size", "2"]),
        "dp2": Run(root / "dp2", 2, [*EXACT, "--micro-batch-size", "2", "--global-batch-size", "8",
                                     "--use-distributed-optimizer"]),
        "dp2_overlap": Run(root / "dp2_overlap", 2, [*EXACT, "--micro-batch-size", "2", "--global-batch-size", "8",
                                                     "--use-distributed-optimizer", "--overlap-grad-reduce",
                                                     "--overlap-param-gather", "--save", str(root / "overlap_ckpt"),
                                                     "--save-interval", "3"]),
        "pp2": Run(root / "pp2", 2, PP_UNEVEN),
        "pp2_recompute": Run(root / "pp2_recompute", 2, [*PP_UNEVEN, *RECOMPUTE]),
        "vpp": Run(root / "vpp", 2, ["--num-layers", "4", *MODEL[2:], *MOCK, "--micro-batch-size", "2",
                                     "--global-batch-size", "8", "--lr", "1e-3", "--train-iters", "6",
                                     "--log-interval", "1", "--eval-iters", "0", "--pipeline-model-parallel-size", "2",
                                     "--num-layers-per-virtual-pipeline-stage", "1"]),
        "fp16": Run(root / "fp16", 1, [*MODEL, *MOCK, "--micro-batch-size", "2", "--global-batch-size", "8",
                                       "--lr", "1e-3", "--train-iters", "30", "--log-interval", "5",
                                       "--eval-iters", "0", "--fp16"]),
        "nan": Run(root / "nan", 1, [*MODEL, *MOCK, "--lr", "1e-3", "--train-iters", "3", "--log-interval", "1",
                                     "--eval-iters", "0", "--init-method-std", "1e30"]),
        "unknown_flag": Run(root / "unknown_flag", 1, [*MODEL, *MOCK, "--lr", "1e-3", "--train-iters", "3",
                                                       "--no-such-flag", "7"]),
        "bad_data": Run(root / "bad_data", 1, [*MODEL, "--lr", "1e-3", "--train-iters", "3",
                                               "--data-path", str(root / "missing" / "corpus_text_document")]),
    }
    started["dp2_overlap"].wait()
    started["dp2_overlap_resumed"] = Run(root / "dp2_overlap_resumed", 2, [
        *EXACT, "--micro-batch-size", "2", "--global-batch-size", "8", "--use-distributed-optimizer",
        "--overlap-grad-reduce", "--overlap-param-gather", "--load", str(root / "overlap_ckpt"), "--ckpt-step", "3"])
    started["corpus_dp2"].wait().ok()
    started["resumed"] = Run(root / "resumed", 2, [*CORPUS_RUN, *cache, "--load", str(root / "corpus_dp2" / "ckpt"),
                                                   "--ckpt-step", "40"])
    return {name: run.wait() for name, run in started.items()}


def test_loss_falls_over_50_iterations_on_the_shipped_corpus_in_bf16_data_parallel(runs):
    run = runs["corpus_dp2"].ok()
    losses = run.losses()
    assert sorted(losses) == list(range(5, 51, 5))
    assert losses[50] < losses[5] - 1.0, losses
    assert "using world size: 2, data-parallel size: 2, context-parallel size: 1, tensor-model-parallel size: 1, " \
           "pipeline-model-parallel size: 1 " in run.text
    assert "setting number of micro-batches to constant 2" in run.text
    assert " validation loss at iteration 50 | lm loss value: " in run.text


def test_one_iteration_line_per_interval_and_megatron_fields_in_order(runs):
    text = runs["corpus_dp2"].ok().text
    lines = [line for line in text.splitlines() if ITERATION.search(line)]
    assert len(lines) == 10  # two processes, printed once
    fields = [part.split(":")[0].strip() for part in lines[-1].split("|")[1:-1]]
    assert fields == ["consumed samples", "elapsed time per iteration (ms)", "throughput per GPU (TFLOP/s/GPU)",
                      "learning rate", "global batch size", "lm loss", "loss scale", "grad norm",
                      "number of skipped iterations", "number of nan iterations"]
    memory = [line for line in text.splitlines() if "memory (MB)" in line]
    assert len(memory) == 1  # data-parallel rank 0 of each model-parallel rank, after the first interval
    assert re.match(r"\[Rank 0\] \(after 5 iterations\) memory \(MB\) \| allocated: [\d.]+ \| max allocated: [\d.]+ "
                    r"\| reserved: [\d.]+ \| max reserved: [\d.]+ \| measured as: cpu process resident memory$",
                    memory[0])
    block = text.split("(min, max) time across ranks (ms):\n", 1)[1].split("\n [")[0]
    for timer in ("forward-compute", "backward-compute", "all-grads-sync", "optimizer"):
        assert re.search(rf"^    {timer} \.+: \([\d.]+, [\d.]+\)$", block, re.M), block
    assert len(re.findall(r"number of parameters on \(tensor, pipeline\) model parallel rank \(0, 0\): \d+", text)) == 1


def test_resume_from_checkpoint_reproduces_the_next_losses(runs):
    full, resumed = runs["corpus_dp2"].ok(), runs["resumed"].ok()
    assert "successfully loaded checkpoint from" in resumed.text and "at iteration 40" in resumed.text
    assert sorted(resumed.losses()) == [45, 50]
    for i in (45, 50):
        assert resumed.losses()[i] == full.losses()[i]
        assert resumed.iterations()[i]["grad norm"] == full.iterations()[i]["grad norm"]


def test_gradient_accumulation_matches_one_large_micro_batch(runs):
    four, one = runs["micro2x4"].ok(), runs["micro8x1"].ok()
    assert "setting number of micro-batches to constant 4" in four.text
    assert "setting number of micro-batches to constant 1" in one.text
    for i in range(1, 7):
        assert abs(four.losses()[i] - one.losses()[i]) <= 1e-5, (four.losses(), one.losses())


def test_tensor_parallel_matches_one_process(runs):
    tp2, ref = runs["tp2"].ok(), runs["micro2x4"].ok()
    assert "tensor-model-parallel size: 2" in tp2.text
    assert len(re.findall(r"model parallel rank \([01], 0\)", tp2.text)) == 2
    for i in range(1, 7):
        assert abs(tp2.losses()[i] - ref.losses()[i]) <= 1e-4, (tp2.losses(), ref.losses())
    assert tp2.losses()[6] < tp2.losses()[1]


def test_uneven_pipeline_with_an_empty_stage_trains_and_recompute_gives_the_same_loss(runs):
    plain, recompute = runs["pp2"].ok(), runs["pp2_recompute"].ok()
    assert "pipeline-model-parallel size: 2" in plain.text
    # layout E|t*3,L (FASOP's PARTITION 0-3): stage 0 holds only the embeddings, stage 1 all 3 layers and the output
    assert "pipeline_model_parallel_layout .................. E|t*3,L" in plain.text
    params = {int(k): int(v) for k, v in re.findall(r"model parallel rank \(0, (\d)\): (\d+)", plain.text)}
    h, vocab, seq = 64, 1024, 64
    layer = 12 * h * h + 13 * h
    assert params == {0: vocab * h + seq * h, 1: 3 * layer + 2 * h + vocab * h}  # stage 1 keeps a tied output copy
    assert plain.losses()[6] < plain.losses()[1]
    assert recompute.losses() == plain.losses()  # bit-identical: dropout masks replay on recomputation
    assert "recompute_granularity ........................... full" in recompute.text


def test_interleaved_pipeline_trains(runs):
    run = runs["vpp"].ok()
    iterations = run.iterations()
    assert "num_layers_per_virtual_pipeline_stage ........... 1" in run.text
    # activations and gradients crossing in one gloo batch once swapped; the gradient norm then grew tenfold
    assert all(f["grad norm"] < 3 for f in iterations.values()), iterations
    assert run.losses()[6] < run.losses()[1]


def test_fp16_loss_scale_falls_then_trains(runs):
    run = runs["fp16"].ok()
    iterations = run.iterations()
    assert iterations[5]["loss scale"] < 2 ** 32 and iterations[5]["number of skipped iterations"] > 0
    assert "lm loss" not in iterations[5]  # every iteration of the first interval overflowed and was skipped
    trained = run.losses()
    assert trained[30] < trained[min(trained)], trained
    assert iterations[30]["number of skipped iterations"] < 5


def test_nan_loss_stops_with_a_clear_error(runs):
    run = runs["nan"]
    assert run.returncode == 1
    assert "ERROR: NaN loss at iteration 1" in run.text


def test_out_of_memory_is_recognised_on_gpu_and_cpu():
    import torch

    from labkit.train.training import out_of_memory

    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                                      "allocate memory: you tried to allocate 400000000000000 bytes."))
    assert out_of_memory(MemoryError())
    assert not out_of_memory(RuntimeError("shape mismatch"))


def test_unsupported_flag_is_named(runs):
    run = runs["unknown_flag"]
    assert run.returncode == 2
    assert "unrecognized arguments: --no-such-flag 7" in run.text
    assert "does not support it" in run.text


def test_bad_data_path_is_named_before_training(runs):
    run = runs["bad_data"]
    assert run.returncode == 2
    assert "--data-path: " in run.text and "missing/corpus_text_document" in run.text
    assert "labkit data prepare" in run.text
    assert "building GPT model" not in run.text


def test_tensorboard_scalars_are_written(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = runs["corpus_dp2"].ok().dir / "tb"
    events = list(tb.glob("events.out.tfevents.*"))
    assert len(events) == 1  # one writer: the rank that prints the iteration lines
    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("lm loss", "learning-rate", "loss-scale", "grad-norm", "batch-size", "iteration-time", "throughput",
                "mem-allocated-bytes", "forward-compute-time", "optimizer-time", "lm loss validation",
                "lm loss validation ppl"):
        assert tag in tags, sorted(tags)
    loss = acc.Scalars("lm loss")
    assert [e.step for e in loss] == list(range(1, 51))
    assert loss[-1].value < loss[0].value
    logged = runs["corpus_dp2"].losses()
    window = [e.value for e in loss if 46 <= e.step <= 50]
    assert abs(sum(window) / 5 - logged[50]) < 1e-5


def test_profiler_trace_covers_the_chosen_steps_on_each_rank(runs):
    tb = runs["corpus_dp2"].ok().dir / "tb"
    for rank in (0, 1):
        trace = json.loads((tb / f"rank{rank}_steps3-4.pt.trace.json").read_text())
        names = [e.get("name", "") for e in trace["traceEvents"]]
        steps = {n for n in names if n.startswith("ProfilerStep#")}
        assert len(steps) == 2, steps
        assert any("all_reduce" in n or "allreduce" in n or "reduce_scatter" in n for n in names)
        # the allocator's events, from which a memory curve can always be drawn
        assert any(e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {}) for e in trace["traceEvents"])
        # torch's own memory timeline is best effort: its analysis sometimes rejects a step, and the driver says so
        assert (tb / f"rank{rank}_steps3-4.memory_timeline.json").is_file() or \
            f"WARNING: no memory timeline from torch.profiler on rank {rank}" in runs["corpus_dp2"].text


def test_fixture_log_has_the_current_line_shapes(runs):
    """tests/fixtures/logs/labkit-driver-dp2.log feeds the log parser's tests; it must look like today's output."""
    def shapes(text: str) -> set[str]:
        kept = set()
        for line in text.splitlines():
            if line.startswith("  ") and " ..." in line:
                continue  # argument values
            shape = re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", "T", line)
            shape = re.sub(r"[-+]?\d+(\.\d+)?([eE][-+]?\d+)?", "N", shape)
            shape = re.sub(r" +", " ", shape)
            if ITERATION.search(line) or "memory (MB)" in line or "time across ranks" in line \
                    or "validation loss" in line or line.startswith(("using world", "setting number", " > number")):
                kept.add(shape.strip())
        return kept
    current = shapes(runs["corpus_dp2"].ok().text)
    fixture = shapes(FIXTURE_LOG.read_text())  # its first line is the command that wrote it
    assert fixture and fixture <= current, fixture - current


def test_overlapped_gradient_reduce_and_parameter_gather_compute_the_same_steps(runs):
    """megatron-core's DDP with --overlap-grad-reduce and --overlap-param-gather (the distributed optimizer's shards
    gathered during the next forward) gives the losses of the same run without overlap, bit for bit."""
    plain, overlapped = runs["dp2"].ok(), runs["dp2_overlap"].ok()
    assert len(plain.losses()) == 6 and overlapped.losses() == plain.losses()
    assert re.search(r" overlap_grad_reduce \.+ True\n", overlapped.text)


def test_a_checkpoint_saved_with_overlapped_parameter_gather_resumes_exactly(runs):
    """The step updates only this rank's shard and the gather waits for the next forward: the save must gather first
    (as Megatron-LM's force_param_sync does), or the checkpoint holds the other shards' stale weights."""
    full, resumed = runs["dp2_overlap"].ok(), runs["dp2_overlap_resumed"].ok()
    assert "at iteration 3" in resumed.text and sorted(resumed.losses()) == [4, 5, 6]
    for i in (4, 5, 6):
        assert resumed.losses()[i] == full.losses()[i]


@pytest.mark.parametrize("flags, named", [(["--bf16", "--fp8-format", "hybrid"], "--fp8-format"),
                                           (["--attention-backend", "flash"], "--attention-backend")])
def test_the_cpu_driver_refuses_what_needs_transformer_engine_naming_the_flag(flags, named):
    args = build_parser().parse_args([*MODEL, *MOCK, "--lr", "1e-3", "--train-iters", "2", *flags])
    with pytest.raises(ArgumentError, match=f"^{named}: needs Transformer Engine on GPUs"):
        finish(args, world_size=4, rank=0, cuda=False)


def test_sigterm_saves_a_checkpoint_and_the_next_attempt_resumes_from_it(tmp_path):
    """What a requeued Slurm job goes through: SIGTERM to torchrun mid-run, then the same command again."""
    flags = [*EXACT[:-6], "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "100000",
             "--log-interval", "1", "--eval-iters", "0", "--save", str(tmp_path / "ckpt"), "--load",
             str(tmp_path / "ckpt"), "--exit-signal-handler"]
    first = Run(tmp_path / "first", 2, flags)
    deadline = time.monotonic() + 300
    while not re.search(r" iteration +3/", first.log_file.read_text()):
        assert first.proc.poll() is None and time.monotonic() < deadline, first.log_file.read_text()[-3000:]
        time.sleep(0.2)
    first.proc.send_signal(signal.SIGTERM)
    first.wait()
    stopped = max(first.iterations())
    assert "exiting program after receiving SIGTERM." in first.text, first.text[-3000:]
    assert f"successfully saved checkpoint from iteration {stopped:7d}" in first.text
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == str(stopped)
    assert "after training is done" not in first.text  # stopped, not finished

    second = Run(tmp_path / "second", 2, [*flags[:flags.index("--train-iters") + 1], str(stopped + 2),
                                          *flags[flags.index("--train-iters") + 2:]]).wait().ok()
    assert f"successfully loaded checkpoint from {tmp_path / 'ckpt'}" in second.text
    assert f"at iteration {stopped}" in second.text
    assert sorted(second.iterations()) == [stopped + 1, stopped + 2]

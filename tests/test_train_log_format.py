"""labkit's log lines against lines Megatron-LM printed (tests/fixtures/logs/03-*, 04-*): same values in, same text
out."""
from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import pytest

from labkit.train import megatron_log

LOGS = Path(__file__).resolve().parent / "fixtures" / "logs"
MLM_2024 = (LOGS / "04-mlm-core080-7b-2node-throughput.log").read_text().splitlines()
MLM_2025 = (LOGS / "03-mlm2025-gpt2-fp16-autodl.log").read_text().splitlines()


def _after_timestamp(line: str) -> str:
    return line.split("] ", 1)[1]


def test_iteration_line_is_megatrons():
    theirs = next(line for line in MLM_2024 if "iteration       20/" in line)
    ours = megatron_log.iteration_line(
        iteration=20, train_iters=500000, consumed_samples=20480, elapsed_ms=14351.0, throughput=793.1,
        learning_rate=6.976744e-07, global_batch_size=1024, losses={"lm loss": 1.062389e01}, loss_scale=262144.0,
        grad_norm=46.226, skipped=5, nan=0)
    assert re.match(r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration", ours)
    assert _after_timestamp(ours) == _after_timestamp(theirs)


def test_fully_skipped_interval_has_no_loss_or_grad_norm_like_megatrons():
    theirs = next(line for line in MLM_2024 if "iteration       10/" in line)
    ours = megatron_log.iteration_line(
        iteration=10, train_iters=500000, consumed_samples=10240, elapsed_ms=15210.6, throughput=748.3,
        learning_rate=0.0, global_batch_size=1024, losses={}, loss_scale=8388608.0, grad_norm=None, skipped=10, nan=0)
    assert _after_timestamp(ours) == _after_timestamp(theirs)


def test_validation_block_is_megatrons():
    i = MLM_2025.index(" validation loss at iteration 50 | lm loss value: 8.889540E+00 | lm loss PPL: 7.255679E+03 | ")
    ours = megatron_log.validation_lines("iteration 50", {"lm loss": math.log(7.255679e03)})
    assert ours.splitlines() == MLM_2025[i - 1:i + 2]


def test_memory_line_is_megatrons_and_says_where_cpu_figures_come_from(monkeypatch):
    theirs = next(line for line in MLM_2024 if "memory (MB)" in line)
    figures = {"allocated": 42358.798828125, "max allocated": 70522.5751953125, "reserved": 71202.0,
               "max reserved": 71202.0}
    monkeypatch.setattr(megatron_log.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(megatron_log, "memory_figures", lambda: (figures, None))
    assert megatron_log.memory_line("(after 20 iterations)") == theirs
    monkeypatch.setattr(megatron_log, "memory_figures", lambda: (figures, "cpu process resident memory"))
    assert megatron_log.memory_line("(after 20 iterations)") == theirs + " | measured as: cpu process resident memory"


def test_cpu_memory_figures_are_the_process_resident_memory():
    import psutil

    figures, label = megatron_log.memory_figures()
    rss = psutil.Process().memory_info().rss / megatron_log.MB
    assert label == "cpu process resident memory"
    assert figures["allocated"] == pytest.approx(rss, rel=0.2)
    assert figures["max allocated"] >= figures["allocated"]


def test_arguments_block_is_megatrons():
    block = megatron_log.arguments_block(argparse.Namespace(micro_batch_size=1, adam_beta1=0.9)).splitlines()
    assert block[0] == MLM_2025[MLM_2025.index("------------------------ arguments ------------------------")]
    assert block[1] == "  adam_beta1 ...................................... 0.9" in MLM_2025
    assert block[2] == "  micro_batch_size ................................ 1" in MLM_2025
    assert block[3] == "-------------------- end of arguments ---------------------" in MLM_2025


def test_throughput_numerator_is_megatrons_model_flops():
    from labkit.train.training import num_floating_point_operations

    args = argparse.Namespace(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=1024,
                              padded_vocab_size=50304, num_query_groups=None, ffn_hidden_size=4096, swiglu=False,
                              untie_embeddings_and_output_weights=False)
    B, s, l, h, V = 8, 1024, 24, 1024, 50304
    classic = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))  # Korthikanti et al., causal mask ignored
    causal_saving = 3 * l * 2 * B * s * 2 * s * h / 2
    assert num_floating_point_operations(args, B) == pytest.approx(classic - causal_saving, rel=1e-12)

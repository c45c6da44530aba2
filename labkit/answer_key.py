"""The labs' answer key: what each exercise's check compares an answer with. A check cell names its exercise
(`check("02.1", answer_1)`), so the notebook never shows the answer; notebooks/solutions/ hold the worked answers.
Where the answer depends on what the lab computed (its plan, its spec, its corpus), the check cell passes that in.
"""
from __future__ import annotations

from typing import Any, Callable

from labkit.exercises import check_choice, check_number, check_spec


def _lab02_skipped(answer):
    from labkit.logs.loss_scale import skipped_until
    check_number(answer, skipped_until(2 ** 32, 131072), name="Exercise 1 (skipped iterations)", rel_tol=0.0,
                 hint="count the halvings from 2^32 down to 131072, plus the one overflow hysteresis absorbs")


def _lab02_bytes(answer):
    from labkit.estimate.memory import bytes_per_param
    check_number(answer, sum(bytes_per_param("fp16", data_parallel=8, distributed_optimizer=True)),
                 name="Exercise 3 (bytes per parameter)", rel_tol=0.0,
                 hint="the 16-bit weight and gradient stay on every GPU; the 16 bytes of fp32 state are split 8 ways")


def _lab03_layers(answer, spec):
    from labkit.estimate.recompute import recompute_cost
    expected = recompute_cost(spec.replace(recompute={"granularity": "full", "method": "block", "num_layers": 4}))
    check_number(answer, expected.recomputed_layers, name="Exercise 1 (layers recomputed)", rel_tol=0.0)


def _lab05_params(answer):
    from labkit.estimate import gpt_params
    check_number(answer, gpt_params(12, 768, 1024, 50257), name="Exercise 1 (GPT-2 small parameters)", rel_tol=1e-3)


def _lab05_tflops(answer):
    from labkit.estimate import achieved_tflops, flops_72
    check_number(answer, achieved_tflops(flops_72(16, 1024, 12, 768, 50257), 0.3119, 4),
                 name="Exercise 2 (TFLOP/s per GPU)", rel_tol=0.01,
                 hint="no recomputation: the 72 B s l h^2 count; B is the global batch, the time is in seconds")


def _lab05_gpus(answer):
    from labkit.estimate import gpt_params, training_days
    params, tflops = gpt_params(40, 6144, 1048, 50257), 157.7296879710454  # the 18B model of SC21's table
    needed = next(n for n in range(1, 100_000) if training_days(300e9, params, n, tflops) <= 30)
    check_number(answer, needed, name="Exercise 3 (GPUs for 30 days)", rel_tol=0.0,
                 hint="training days scale as 1/n: solve training_days(...) <= 30 for n")


def _lab07_bubble(answer):
    from labkit.diagrams import pipeline_schedule
    from labkit.estimate.timing import bubble_fraction
    check_number(answer, bubble_fraction(pipeline_schedule(8, 16)), name="Exercise 3 (pipeline bubble)",
                 rel_tol=0.01,
                 hint="the bubble's share of the whole iteration: (p - 1) / (m + p - 1), not SC21's (p - 1) / m")


def _lab09_sequence_parallel(answer):
    from labkit.estimate.memory import activation_bytes_per_layer
    from labkit.estimate import Shape
    from labkit.spec import load_spec

    gpt3 = Shape.of(load_spec({"model": {"num_layers": 96, "hidden_size": 12288, "num_attention_heads": 96,
                                         "seq_length": 2048, "vocab_size": 51200}}).model)
    without, with_sp = (activation_bytes_per_layer(gpt3, 1, tensor=8, sequence_parallel=sp) for sp in (False, True))
    check_number(answer, without / with_sp, name="Exercise 3 (sequence parallelism)", rel_tol=0.01,
                 hint="(10 + 24/t + 5as/(ht)) / ((34 + 5as/h) / t): the s b h cancels")


def _lab10_active(answer):
    from labkit.estimate.params import active_params
    from labkit.megatron.shape import Shape
    from labkit.spec import load_spec

    shape = Shape.of(load_spec({"model": {"preset": "mixtral-8x22b"}}).model)
    check_number(answer, active_params(shape) / 1e9, name="Exercise 1 (Mixtral-8x22B active parameters, B)",
                 rel_tol=0.01, hint="every layer's attention and router, 2 of the 8 experts, the embeddings and output")


def _lab10_expert_share(answer):
    from labkit.estimate.params import mlp_params, total_params
    from labkit.megatron.shape import Shape
    from labkit.spec import load_spec

    shape = Shape.of(load_spec({"model": {"preset": "mixtral-8x7b"}}).model)
    experts = len(shape.moe_layers) * shape.experts * mlp_params(shape, shape.expert_ffn_size)
    check_number(answer, experts / total_params(shape), name="Exercise 2 (expert weights' share)", rel_tol=0.01,
                 hint="32 layers x 8 experts x 3 x 4096 x 14336 SwiGLU weights, over the 46.7 B")


def _lab00_gres(answer):
    written = answer.strip().lower().removeprefix("--gres=") if isinstance(answer, str) else answer
    check_choice(written, "gpu:a100:2", name="Exercise 3 (two A100s per node)",
                 choices=[written] if isinstance(written, str) else ["a string such as gpu:TYPE:N"],
                 hint="generic resources are NAME:TYPE:COUNT per node; sinfo's GRES column names the type")


KEY: dict[str, Callable[..., None]] = {
    "00.1": lambda a: check_choice(a, "slurm", name="Exercise 1 (default backend)", choices=["local", "slurm"],
                                   hint="see labkit.jobs.default_backend"),
    "00.2": lambda a: check_choice(a, "PENDING", name="Exercise 2 (waiting for GPUs)",
                                   choices=["PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"],
                                   hint="the state squeue showed for the second job in 0.6, beside the reason"),
    "00.3": _lab00_gres,
    "01.1": lambda a: check_spec(a, name="Exercise 1 (global batch 16)", batch__global_=16, batch__micro=2,
                                 num_micro_batches=4),
    "02.1": _lab02_skipped,
    "02.2": lambda a: check_choice(a, "bf16", name="Exercise 2 (no loss scale)", choices=["fp16", "bf16"],
                                   hint="which one has fp32's 8 exponent bits?"),
    "02.3": _lab02_bytes,
    "03.1": _lab03_layers,
    "03.2": lambda a: check_spec(a, name="Exercise 2 (block recompute)", recompute__granularity="full",
                                 recompute__method="block", recompute__num_layers=2),
    "03.3": lambda a, table: check_number(
        a, table.loc["selective", "saved_mib"], name="Exercise 3 (selective saving)", rel_tol=0.01,
        hint="5 * 12 * 1024 / 768 bytes per token and hidden unit, times s * b * h, times 12 layers"),
    "04.1": lambda a: check_spec(a, name="Exercise 1 (the DLI workshop's accumulation)", batch__micro=4,
                                 batch__global_=64, data_parallel=4, num_micro_batches=4),
    "04.2": lambda a: check_number(a, 16 * 10, name="Exercise 2 (consumed samples)", rel_tol=0.0),
    "04.3": lambda a: check_choice(a, "time per iteration", name="Exercise 3 (what accumulation costs)",
                                   choices=["activation memory", "time per iteration"],
                                   hint="look at 4.5's memory curves again"),
    "05.1": _lab05_params,
    "05.2": _lab05_tflops,
    "05.3": _lab05_gpus,
    "06.1": lambda a, plan: check_number(a, plan.best.pp, name="Exercise 1 (pipeline stages of the best layout)",
                                         rel_tol=0.0),
    "07.1": lambda a, spec: check_number(a, spec.data_parallel, name="Exercise 1 (data-parallel size)", rel_tol=0.0,
                                         hint="world size / (tensor x pipeline)"),
    "07.2": lambda a: check_choice(a, "dp", name="Exercise 2 (gradient all-reduce)", choices=["tp", "pp", "dp"],
                                   hint="which group does dp2's gradient all-reduce use in 7.6? "
                                        "(its `world` line is the timers')"),
    "07.3": _lab07_bubble,
    "08.1": lambda a, tokens, seq_length: check_number(a, (tokens - 1) // seq_length,
                                                       name="Exercise 1 (sequences per epoch)", rel_tol=0.01),
    "08.2": lambda a: check_number(None if a is ... else len(a), 3, name="Exercise 2 (your own corpus)", rel_tol=0.0),
    "09.1": lambda a: check_number(a, 16 / 64, name="Exercise 1 (ZeRO-3 bytes per parameter)", rel_tol=0.01,
                                   hint="stage 3 splits all 16 bytes over the data-parallel GPUs"),
    "09.2": lambda a: check_number(a, (2 + 14 / 64) * 7.5, name="Exercise 2 (ZeRO-2, 7.5B on 64 GPUs)", rel_tol=0.01,
                                   hint="stage 2 keeps the 2-byte weights whole and splits the other 14 bytes"),
    "09.3": _lab09_sequence_parallel,
    "10.1": _lab10_active,
    "10.2": _lab10_expert_share,
    "10.3": lambda a: check_number(a, 4096 * 1 * 2 // 8, name="Exercise 3 (token rows per expert)", rel_tol=0.0,
                                   hint="every token fills k = 2 slots, spread evenly over the 8 experts"),
}


def check(exercise: str, answer: Any, **lab_values: Any) -> None:
    """Check `answer` to lab exercise `exercise` ("LAB.N") against the key; `lab_values` are what the lab computed
    that the answer depends on.

    Taught in labs 00, 01, 02, 03, 04, 05, 06, 07, 08, 09 and 10.
    """
    if exercise not in KEY:
        raise KeyError(f"no exercise {exercise!r}; the labs' exercises are {', '.join(KEY)}")
    KEY[exercise](answer, **lab_values)

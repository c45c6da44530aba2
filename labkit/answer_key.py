"""The labs' answer key: what each exercise's check compares an answer with. A check cell names its exercise
(`check("02.1", answer_1)`), so the notebook never shows the answer; notebooks/solutions/ hold the worked answers.
Where the answer depends on what the lab computed (its plan, its spec, its corpus), the check cell passes that in.
"""
from __future__ import annotations

from typing import Any, Callable

from labkit.exercises import check_choice, check_number, check_spec
from labkit.messages import say


def _lab02_skipped(answer):
    from labkit.logs.loss_scale import skipped_until
    check_number(answer, skipped_until(2 ** 32, 131072), name=say("exercise.02.1"), rel_tol=0.0,
                 hint=say("hint.02.1"))


def _lab02_bytes(answer):
    from labkit.estimate.memory import bytes_per_param
    check_number(answer, sum(bytes_per_param("fp16", data_parallel=8, distributed_optimizer=True)),
                 name=say("exercise.02.3"), rel_tol=0.0,
                 hint=say("hint.02.3"))


def _lab03_layers(answer, spec):
    from labkit.estimate.recompute import recompute_cost
    expected = recompute_cost(spec.replace(recompute={"granularity": "full", "method": "block", "num_layers": 4}))
    check_number(answer, expected.recomputed_layers, name=say("exercise.03.1"), rel_tol=0.0)


def _lab05_params(answer):
    from labkit.estimate import gpt_params
    check_number(answer, gpt_params(12, 768, 1024, 50257), name=say("exercise.05.1"), rel_tol=1e-3)


def _lab05_tflops(answer):
    from labkit.estimate import achieved_tflops, flops_72
    check_number(answer, achieved_tflops(flops_72(16, 1024, 12, 768, 50257), 0.3119, 4),
                 name=say("exercise.05.2"), rel_tol=0.01,
                 hint=say("hint.05.2"))


def _lab05_gpus(answer):
    from labkit.estimate import gpt_params, training_days
    params, tflops = gpt_params(40, 6144, 1048, 50257), 157.7296879710454  # the 18B model of SC21's table
    needed = next(n for n in range(1, 100_000) if training_days(300e9, params, n, tflops) <= 30)
    check_number(answer, needed, name=say("exercise.05.3"), rel_tol=0.0,
                 hint=say("hint.05.3"))


def _lab07_bubble(answer):
    from labkit.diagrams import pipeline_schedule
    from labkit.estimate.timing import bubble_fraction
    check_number(answer, bubble_fraction(pipeline_schedule(8, 16)), name=say("exercise.07.3"),
                 rel_tol=0.01,
                 hint=say("hint.07.3"))


def _lab09_sequence_parallel(answer):
    from labkit.estimate.memory import activation_bytes_per_layer
    from labkit.estimate import Shape
    from labkit.spec import load_spec

    gpt3 = Shape.of(load_spec({"model": {"num_layers": 96, "hidden_size": 12288, "num_attention_heads": 96,
                                         "seq_length": 2048, "vocab_size": 51200}}).model)
    without, with_sp = (activation_bytes_per_layer(gpt3, 1, tensor=8, sequence_parallel=sp) for sp in (False, True))
    check_number(answer, without / with_sp, name=say("exercise.09.3"), rel_tol=0.01,
                 hint=say("hint.09.3"))


def _lab10_active(answer):
    from labkit.estimate.params import active_params
    from labkit.megatron.shape import Shape
    from labkit.spec import load_spec

    shape = Shape.of(load_spec({"model": {"preset": "mixtral-8x22b"}}).model)
    check_number(answer, active_params(shape) / 1e9, name=say("exercise.10.1"),
                 rel_tol=0.01, hint=say("hint.10.1"))


def _lab10_expert_share(answer):
    from labkit.estimate.params import mlp_params, total_params
    from labkit.megatron.shape import Shape
    from labkit.spec import load_spec

    shape = Shape.of(load_spec({"model": {"preset": "mixtral-8x7b"}}).model)
    experts = len(shape.moe_layers) * shape.experts * mlp_params(shape, shape.expert_ffn_size)
    check_number(answer, experts / total_params(shape), name=say("exercise.10.2"), rel_tol=0.01,
                 hint=say("hint.10.2"))


def _lab00_gres(answer):
    written = answer.strip().lower().removeprefix("--gres=") if isinstance(answer, str) else answer
    check_choice(written, "gpu:a100:2", name=say("exercise.00.3"),
                 choices=[written] if isinstance(written, str) else [say("choice.00.3")],
                 hint=say("hint.00.3"))


KEY: dict[str, Callable[..., None]] = {
    "00.1": lambda a: check_choice(a, "slurm", name=say("exercise.00.1"), choices=["local", "slurm"],
                                   hint=say("hint.00.1")),
    "00.2": lambda a: check_choice(a, "PENDING", name=say("exercise.00.2"),
                                   choices=["PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"],
                                   hint=say("hint.00.2")),
    "00.3": _lab00_gres,
    "01.1": lambda a: check_spec(a, name=say("exercise.01.1"), batch__global_=16, batch__micro=2,
                                 num_micro_batches=4),
    "02.1": _lab02_skipped,
    "02.2": lambda a: check_choice(a, "bf16", name=say("exercise.02.2"), choices=["fp16", "bf16"],
                                   hint=say("hint.02.2")),
    "02.3": _lab02_bytes,
    "03.1": _lab03_layers,
    "03.2": lambda a: check_spec(a, name=say("exercise.03.2"), recompute__granularity="full",
                                 recompute__method="block", recompute__num_layers=2),
    "03.3": lambda a, table: check_number(
        a, table.loc["selective", "saved_mib"], name=say("exercise.03.3"), rel_tol=0.01,
        hint=say("hint.03.3")),
    "04.1": lambda a: check_spec(a, name=say("exercise.04.1"), batch__micro=4,
                                 batch__global_=64, data_parallel=4, num_micro_batches=4),
    "04.2": lambda a: check_number(a, 16 * 10, name=say("exercise.04.2"), rel_tol=0.0),
    "04.3": lambda a: check_choice(a, "time per iteration", name=say("exercise.04.3"),
                                   choices=["activation memory", "time per iteration"],
                                   hint=say("hint.04.3")),
    "05.1": _lab05_params,
    "05.2": _lab05_tflops,
    "05.3": _lab05_gpus,
    "06.1": lambda a, plan: check_number(a, plan.best.pp, name=say("exercise.06.1"),
                                         rel_tol=0.0),
    "07.1": lambda a, spec: check_number(a, spec.data_parallel, name=say("exercise.07.1"), rel_tol=0.0,
                                         hint=say("hint.07.1")),
    "07.2": lambda a: check_choice(a, "dp", name=say("exercise.07.2"), choices=["tp", "pp", "dp"],
                                   hint=say("hint.07.2")),
    "07.3": _lab07_bubble,
    "08.1": lambda a, tokens, seq_length: check_number(a, (tokens - 1) // seq_length,
                                                       name=say("exercise.08.1"), rel_tol=0.01),
    "08.2": lambda a: check_number(None if a is ... else len(a), 3, name=say("exercise.08.2"), rel_tol=0.0),
    "09.1": lambda a: check_number(a, 16 / 64, name=say("exercise.09.1"), rel_tol=0.01,
                                   hint=say("hint.09.1")),
    "09.2": lambda a: check_number(a, (2 + 14 / 64) * 7.5, name=say("exercise.09.2"), rel_tol=0.01,
                                   hint=say("hint.09.2")),
    "09.3": _lab09_sequence_parallel,
    "09.4": lambda a: check_number(a, 2 + 4 + 6 / 8, name=say("exercise.09.4"), rel_tol=0.01,
                                   hint=say("hint.09.4")),
    "10.1": _lab10_active,
    "10.2": _lab10_expert_share,
    "10.3": lambda a: check_number(a, 4096 * 1 * 2 // 8, name=say("exercise.10.3"), rel_tol=0.0,
                                   hint=say("hint.10.3")),
}


def check(exercise: str, answer: Any, **lab_values: Any) -> None:
    """Check `answer` to lab exercise `exercise` ("LAB.N") against the key; `lab_values` are what the lab computed
    that the answer depends on.

    Taught in labs 00, 01, 02, 03, 04, 05, 06, 07, 08, 09 and 10.
    """
    if exercise not in KEY:
        raise KeyError(f"no exercise {exercise!r}; the labs' exercises are {', '.join(KEY)}")
    KEY[exercise](answer, **lab_values)

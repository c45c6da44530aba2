"""Uneven interleaved pipelines: the embedding and loss counted as layers (parallel.account_for_*) or every chunk's
layers written out (parallel.pipeline_layout), as megatron-core builds them, through validate, estimate, render and
the CPU driver."""
from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from labkit.estimate import estimate
from labkit.estimate.timing import pipeline_lower_bound, pipeline_time, schedule_1f1b
from labkit.megatron import sizes
from labkit.megatron_args import megatron_args
from labkit.spec import SpecError, load_spec

ROOT = Path(__file__).resolve().parent.parent
LLAMA_405B = ROOT / "examples" / "llama3.1-405b-interleaved.yaml"
ACCOUNT_FOR = {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True}
PARAMETERS = re.compile(r"number of parameters on \(tensor, pipeline\) model parallel rank \((\d+), (\d+)\): (\d+)")


def megatron_core_chunks(monkeypatch, num_layers, pipeline, virtual, embedding=False, loss=False, layout=None):
    """[stage][chunk] (layers to build, first layer) from megatron-core's TransformerConfig, get_num_layers_to_build
    and get_transformer_layer_offset, with the pipeline rank and virtual size set as parallel_state would hold them."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=2,
                               pipeline_model_parallel_size=pipeline, pipeline_dtype=torch.float32,
                               virtual_pipeline_model_parallel_size=virtual if virtual > 1 and not layout else None,
                               account_for_embedding_in_pipeline_split=embedding,
                               account_for_loss_in_pipeline_split=loss, pipeline_model_parallel_layout=layout)
    chunks = config.virtual_pipeline_model_parallel_size
    monkeypatch.setattr(parallel_state, "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", chunks)
    out = []
    for rank in range(pipeline):
        monkeypatch.setattr(parallel_state, "_MPU_PIPELINE_MODEL_PARALLEL_RANK", rank)
        out.append([(get_num_layers_to_build(config, vp_stage=c if chunks else None, pp_rank=rank),
                     get_transformer_layer_offset(config, vp_stage=c if chunks else None, pp_rank=rank))
                    for c in range(chunks or 1)])
    return out


def first_layers(chunks: list[list[int]]) -> list[list[int]]:
    """Each chunk's first layer in the order the estimator walks them (virtual stage u = chunk x p + stage)."""
    p, v = len(chunks), len(chunks[0])
    out, start = [[0] * v for _ in range(p)], 0
    for u in range(p * v):
        out[u % p][u // p] = start
        start += chunks[u % p][u // p]
    return out


GRID = [(layers, p, v, e, l) for layers, p, v in itertools.product((6, 7, 14, 30, 126), (2, 4, 16), (1, 2, 4, 8))
        for e, l in itertools.product((False, True), repeat=2) if layers + e + l >= p * v]


@pytest.mark.parametrize("layers,p,v,embedding,loss", GRID)
def test_chunk_layers_are_megatron_cores_or_refused_where_it_refuses(monkeypatch, layers, p, v, embedding, loss):
    try:
        expected = megatron_core_chunks(monkeypatch, layers, p, v, embedding, loss)
    except (ValueError, AssertionError):
        with pytest.raises(sizes.SizeError):
            sizes.chunk_layers(layers, p, v, account_for_embedding=embedding, account_for_loss=loss)
        return
    got = sizes.chunk_layers(layers, p, v, account_for_embedding=embedding, account_for_loss=loss)
    assert got == [[n for n, _ in row] for row in expected]
    assert first_layers(got) == [[offset for _, offset in row] for row in expected]


LAYOUTS = [("Et*3|(tt|)*2,t*3L", 10, 2), ("Et*3|(tt|)*2,t*3L", 10, 4), ("E|(t|)*126,L", 126, 16),
           ("Et*3|t*4|t*4|t*3,L", 14, 4), ("Et*3|t*4|t*4|t*3,L", 14, 2), ("E|t*3|t*2|t,L", 6, 2), ("Et|t|t|tL", 4, 4)]


@pytest.mark.parametrize("layout,layers,p", LAYOUTS)
def test_a_layouts_chunks_are_megatron_cores(monkeypatch, layout, layers, p):
    expected = megatron_core_chunks(monkeypatch, layers, p, 1, layout=layout)
    got = sizes.chunk_layers(layers, p, layout=layout)
    assert got == [[n for n, _ in row] for row in expected]
    assert first_layers(got) == [[offset for _, offset in row] for row in expected]
    assert sizes.layout_virtual_stages(layout, p) == len(expected[0])


@pytest.mark.parametrize("layout,layers,p,problem", [
    ("Et*3|t*3L", 7, 2, "places 6 transformer layers"),   # megatron-core: the decoder count must match
    ("t*3|Et*3L", 6, 2, "embedding (E)"),                  # the first layer must be the embedding
    ("Et*3|t*3", 6, 2, "loss (L)"),
    ("Et*2|t*2|t*2L", 6, 2, "not a multiple of pipeline 2"),
    ("Et*3|x*3L", 6, 2, "unknown layer letter 'x'"),
])
def test_layouts_megatron_core_refuses_are_refused_with_the_reason(monkeypatch, layout, layers, p, problem):
    with pytest.raises((ValueError, AssertionError)):
        megatron_core_chunks(monkeypatch, layers, p, 1, layout=layout)
    assert problem in " ".join(sizes.layout_problems(layout, layers, p))


def test_llama_405b_validates_interleaved_with_one_layer_fewer_on_the_first_and_last_stage():
    spec = load_spec(LLAMA_405B)
    assert spec.parallel.virtual_stages == 8 and spec.world_size == 16384
    assert spec.chunk_partition[0] == [0] + [1] * 7 and spec.chunk_partition[-1] == [1] * 7 + [0]
    assert spec.layer_partition == [7] + [8] * 14 + [7]
    same = spec.replace(**{f"parallel.{key}": False for key in ACCOUNT_FOR}, **{"parallel.pipeline_layout":
                                                                                 "E|(t|)*126,L"})
    assert same.chunk_partition == spec.chunk_partition


def test_llama_405b_interleaved_has_a_fraction_of_plain_1f1bs_bubble():
    interleaved = load_spec(LLAMA_405B)
    plain = interleaved.replace(**{f"parallel.{key}": False for key in ACCOUNT_FOR},
                                **{"parallel.virtual_stages": 1, "parallel.partition": [7] + [8] * 14 + [7]})
    fast, slow = estimate(interleaved), estimate(plain)
    assert fast.params_per_stage == slow.params_per_stage
    assert fast.breakdown["bubble"] < slow.breakdown["bubble"] / 4
    assert fast.iteration_time_s < 0.75 * slow.iteration_time_s
    # the schedule plays each chunk's own work: stage 0's first chunk has no transformer layer, its second has one
    events = [e for e in fast.pipeline.events() if e.stage == 0 and e.op == "forward" and e.micro_batch == 0]
    durations = {e.chunk: e.end_s - e.start_s for e in events}
    assert durations[0] < durations[1] / 10


def spec_errors(parallel: dict, layers: int = 126, gpus: int = 64, micro_batches: int = 16) -> str:
    with pytest.raises(SpecError) as info:
        load_spec({"model": {"preset": "llama3.1-405b", "num_layers": layers}, "parallel": {"tensor": 1, **parallel},
                   "batch": {"micro": 1, "global": micro_batches * gpus // parallel.get("pipeline", 1)},
                   "precision": "bf16", "cluster": {"nodes": [{"gpu": "H100-SXM", "count": gpus // 8,
                                                               "gpus_per_node": 8}]}})
    return str(info.value)


@pytest.mark.parametrize("parallel,layers,expected", [
    ({"pipeline": 16}, 126, "parallel.pipeline: 126 layers (model.num_layers) do not split evenly over 16 pipeline "
                            "stages; set parallel.partition (layers per stage, e.g. [8, 8, 8, 8, 8, 8, 8, 8, ...]), "
                            "set parallel.account_for_embedding_in_pipeline_split and parallel.account_for_loss_in_"
                            "pipeline_split (then 126 + 2 split evenly)"),
    ({"pipeline": 16, **ACCOUNT_FOR}, 125, "parallel.pipeline: 125 layers + 2 for the embedding and the loss = 127 "
                                           "do not split evenly over 16 pipeline stages"),
    ({"pipeline": 16, "virtual_stages": 3, **ACCOUNT_FOR}, 126, "parallel.virtual_stages: 3 does not divide the 8 "
                                                                "layers per stage"),
    ({"pipeline": 16, "partition": [7] + [8] * 14 + [7], "account_for_loss_in_pipeline_split": True}, 126,
     "parallel.account_for_loss_in_pipeline_split: cannot be combined with parallel.partition"),
    ({"pipeline": 1, "account_for_embedding_in_pipeline_split": True}, 126,
     "parallel.account_for_embedding_in_pipeline_split: only moves layers between pipeline stages"),
    ({"pipeline": 2, "pipeline_layout": "Et*3|t*3L", "account_for_loss_in_pipeline_split": True}, 6,
     "parallel.account_for_loss_in_pipeline_split: cannot be combined with parallel.pipeline_layout"),
    ({"pipeline": 2, "pipeline_layout": "Et*3|t*3L", "partition": [3, 3]}, 6,
     "parallel.pipeline_layout: cannot be combined with parallel.partition"),
    ({"pipeline": 2, "pipeline_layout": "Et*3|t*2L"}, 6, "parallel.pipeline_layout: 'Et*3|t*2L' places 5 "
                                                         "transformer layers (t) but the model has 6"),
    ({"pipeline": 2, "pipeline_layout": "Et*99999999999|tL"}, 6, "parallel.pipeline_layout: 'Et*99999999999|tL' "
                                                                 "repeats beyond 1,000,000 letters"),
    ({"pipeline": 2, "pipeline_layout": "Et*3|t*3x"}, 6, "parallel.pipeline_layout: 'Et*3|t*3x' has an unknown layer "
                                                         "letter 'x' in stage 'tttx'; the letters are E (embedding)"),
    ({"pipeline": 2, "pipeline_layout": "Et|t*2|t*2|tL"}, 6, "parallel.virtual_stages: is 1 but "
                                                             "parallel.pipeline_layout has 4 stages = pipeline 2 x 2 "
                                                             "model chunks; set parallel.virtual_stages to 2"),
    ({"pipeline": 2, "partition": [3, 3], "virtual_stages": 2}, 6, "write each model chunk's layers as "
                                                                   "parallel.pipeline_layout"),
])
def test_bad_pipeline_splits_name_the_field_and_the_fix(parallel, layers, expected):
    assert expected in spec_errors(parallel, layers)


def test_an_uneven_chunk_takes_its_own_share_of_its_stages_time():
    stages, sends = [1.0, 1.0], [0.0]
    shares = [[0.25, 0.75], [0.5, 0.5]]
    events = schedule_1f1b(stages, sends, 4, virtual_stages=2, chunk_shares=shares)
    for e in events:
        assert e.end_s - e.start_s == pytest.approx(shares[e.stage][e.chunk] * (1 / 3 if e.op == "forward" else 2 / 3))
    even = pipeline_time(stages, sends, 4, 2, chunk_shares=[[0.5, 0.5]] * 2).total_s
    assert even == pipeline_time(stages, sends, 4, 2).total_s


@pytest.mark.parametrize("m", [6, 24, 60])
def test_a_long_steps_shortcut_is_the_whole_uneven_schedule_played_out(m):
    stages, sends, shares = [1.0, 1.2, 0.9], [0.05, 0.02], [[0.0, 0.5, 0.5], [0.3, 0.3, 0.4], [0.4, 0.4, 0.2]]
    full = schedule_1f1b(stages, sends, m, 1, None, 3, 0.03, shares)[-1].end_s
    assert pipeline_time(stages, sends, m, 3, wrap_time=0.03, chunk_shares=shares).total_s == pytest.approx(full)


@pytest.mark.parametrize("shares", [[[0.1, 0.9], [0.5, 0.5], [0.9, 0.1]], [[0.0, 1.0], [0.5, 0.5], [1.0, 0.0]]])
def test_the_planners_bound_stays_below_the_uneven_schedule(shares):
    stages, sends = [1.0, 1.2, 0.9], [0.05, 0.05]
    bound = pipeline_lower_bound(stages, sends, 6, 2, chunk_shares=shares)
    assert bound <= pipeline_time(stages, sends, 6, 2, chunk_shares=shares).total_s * (1 + 1e-9)


@pytest.mark.parametrize("form", ["account-for", "layout"])
def test_the_driver_derives_the_virtual_stages_megatron_lm_does(form):
    from labkit.train.arguments import build_parser, finish

    spec = load_spec({"model": {"preset": "llama3.1-405b"}, "parallel": {"tensor": 8, "pipeline": 16,
                      **(ACCOUNT_FOR if form == "account-for" else {"pipeline_layout": "E|(t|)*126,L"}),
                      "virtual_stages": 8}, "batch": {"micro": 1, "global": 16}, "precision": "bf16",
                      "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 16, "gpus_per_node": 8}]}})
    args = finish(build_parser().parse_args([str(a) for a in megatron_args(spec)]), world_size=128, rank=0,
                  cuda=False)
    assert args.virtual_pipeline_model_parallel_size == 8


@pytest.mark.parametrize("flags,refusal", [
    (["--account-for-loss-in-pipeline-split", "--pipeline-model-parallel-layout", "Et|tL"], "cannot be combined"),
    (["--account-for-loss-in-pipeline-split"], "5 layers with the embedding and loss counted do not split evenly"),
    (["--pipeline-model-parallel-layout", "Et|t*2L"], "places 3 transformer layers (t) but the model has 4"),
])
def test_the_driver_refuses_what_megatron_lm_refuses_naming_the_flag(flags, refusal):
    from labkit.train.arguments import ArgumentError, build_parser, finish

    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--mock-data", "--vocab-size", "1023", "--lr", "1e-3", "--train-iters", "1",
            "--pipeline-model-parallel-size", "2", *flags]
    with pytest.raises(ArgumentError, match=re.escape(refusal)):
        finish(build_parser().parse_args(argv), world_size=2, rank=0, cuda=False)


FORMS = {
    "account-for": {"pipeline": 2, "virtual_stages": 2, **ACCOUNT_FOR},   # 6 + 2 over 2 x 2 chunks: [[1, 2], [2, 1]]
    "layout": {"pipeline": 2, "virtual_stages": 2, "pipeline_layout": "E|t*3|t*2|t,L"},  # [[0, 2], [3, 1]]
}


@pytest.fixture(scope="module")
def trained(train_in_parallel):
    """A 6-layer tiny-llama for 2 iterations in each form, two gloo processes each, started together."""
    return train_in_parallel({name: load_spec({"model": {"preset": "tiny-llama", "num_layers": 6}, "precision": "fp32",
                                               "parallel": parallel, "batch": {"micro": 2, "global": 8},
                                               "train": {"iters": 2, "log_interval": 1},
                                               "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 2}]}})
                              for name, parallel in FORMS.items()})


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FORMS))
def test_each_ranks_logged_parameters_are_the_estimates_per_stage(trained, name):
    spec, text = trained[name]
    logged = {int(p): int(n) for t, p, n in PARAMETERS.findall(text)}
    assert logged == {p: round(n) for p, n in enumerate(estimate(spec).params_per_stage)}
    assert len(re.findall(r"lm loss: ([0-9.E+-]+)", text)) == 2


@pytest.mark.parametrize("layers,accounted", [(30, True), (32, False)])
def test_the_planner_counts_the_embedding_and_loss_only_where_the_layers_alone_do_not_interleave(layers, accounted):
    from labkit.plan.inputs import Constraints
    from labkit.plan.search import search

    base = load_spec({"model": {"preset": "llama3-8b", "num_layers": layers}, "precision": "bf16",
                      "batch": {"micro": 1, "global": 64},
                      "cluster": {"nodes": [{"gpu": "H100-SXM", "count": 4, "gpus_per_node": 8}]}})
    plan = search(base, constraints=Constraints(tensor=2, pipeline=4, context=1, micro_batch=1,
                                                sequence_parallel=True, recompute=None, distributed_optimizer=True))
    interleaved = [r for r in plan.rows if r.virtual_stages > 1]
    assert {r.virtual_stages for r in interleaved} == {2, 4, 8}  # every even split of 32 chunks of layers
    for row in interleaved:
        par = row.spec.parallel
        assert par.account_for_embedding_in_pipeline_split is par.account_for_loss_in_pipeline_split is accounted
        assert row.partition == ([7, 8, 8, 7] if accounted else [8] * 4)
        assert estimate(row.spec).iteration_time_s == pytest.approx(row.estimated_s)

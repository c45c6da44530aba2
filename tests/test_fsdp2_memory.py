"""PyTorch FSDP2's bytes on labkit's driver, counted by hand for a small model whose rows do not divide over the ranks;
Megatron-FSDP's for a spec that runs on Megatron-LM; what the estimate says it assumed."""
import pytest

from labkit.estimate.cli import render
from labkit.estimate.estimator import estimate
from labkit.estimate.memory import GIB, fsdp_model_state_bytes, model_state_bytes, torch_fsdp2_model_state_bytes
from labkit.estimate.params import Shape
from labkit.spec import load_spec

# hidden 30 over 4 ranks: 8 rows each, 2 of the 32 padding; QKV's 90 rows: 23 each; the vocabulary, padded to 1024,
# and the MLP's 120 rows divide. Four layers, so that stage 2's gathered layers outweigh stage 3's two.
MODEL = {"num_layers": 4, "hidden_size": 30, "num_attention_heads": 3, "seq_length": 16, "vocab_size": 1000,
         "untie_embeddings": True}

# Each unit as (elements gathered, its rows padded to a multiple of 4 ranks; elements):
EMBEDDING = (1024 * 30 + 16 * 30,) * 2  # word (1024 rows) and position (16 rows) embeddings: no padding
LAYER = (11_564, 11_190)
#   norm weight and bias 2 x 30 (padded 2 x 32), projection 30 x 30 + 30 (32 x 30 + 32), QKV 90 x 30 + 90
#   (92 x 30 + 92), MLP norm 2 x 30 (2 x 32), fc1 120 x 30 + 120, fc2 30 x 120 + 30 (32 x 120 + 32)
ROOT = (2 * 32 + 1024 * 30, 2 * 30 + 1024 * 30)  # the final norm and, with the local layers, the output layer
SHARD = (EMBEDDING[0] + 4 * LAYER[0] + ROOT[0]) // 4  # 27,060 elements on each rank


def state(zero_stage, precision="fp32", **options):
    return model_state_bytes(Shape.of(load_spec({"model": MODEL}).model), [4], data_parallel=4, precision=precision,
                             zero_stage=zero_stage, **options)


def test_fsdp2_shards_each_parameters_rows_padded_to_whole_rows_per_rank():
    assert SHARD == 27_060
    for stage in (2, 3):
        # stage 2 (ZeRO-2) also holds every unit's whole parameters, padded, between steps
        whole = (ROOT[0] + EMBEDDING[0] + 4 * LAYER[0]) if stage == 2 else 0
        s = state(stage)
        # fp32: the shards of the weights and their gradients, Adam's two moments (no main copies)
        assert (s.weights - s.weights_working, s.gradients - s.gradients_working, s.optimizer) == \
            (4 * (SHARD + whole), 4 * SHARD, 8 * SHARD)
        s = state(stage, "bf16")
        # bf16: 16-bit shards and gradients (FSDP2 reduces in the parameters' dtype), fp32 main copies, their fp32
        # gradients and the moments
        assert (s.weights - s.weights_working, s.gradients - s.gradients_working, s.optimizer) == \
            (2 * (SHARD + whole), 2 * SHARD, 16 * SHARD)
        # of which the fp32 gradients are the step's alone: zero_grad frees them before the next forward
        assert (s.step_only, state(stage).step_only) == (4 * SHARD, 0)


def test_fsdp2_working_buffers_are_the_backwards_peak_unit_by_unit():
    """The most FSDP2 holds unsharded in the backward. On labkit's driver `benchmarks/bench_zero_memory.py --data 4
    --layers 4 --hidden 30 --heads 3 --seq-length 16` counts these figures to the byte (bf16: half)."""
    # stage 2 keeps every unit gathered, held between steps (above): its working buffers are gradients only, the most
    # at the embedding's backward: the root's and the embedding's, and the first layer's reduce-scatter input
    s2 = state(2)
    assert (s2.weights_working, s2.gradients_working) == (0, 4 * (ROOT[1] + EMBEDDING[1] + LAYER[0]))
    assert 4 * (ROOT[0] + EMBEDDING[0] + 4 * LAYER[0]) + s2.gradients_working == 727_136
    # stage 3 at the embedding's backward: the root and the embedding gathered, their gradients, and the first layer's
    # reduce-scatter input still held (padded)
    s3 = state(3)
    assert (s3.weights_working, s3.gradients_working) == \
        (4 * (ROOT[0] + EMBEDDING[0]), 4 * (ROOT[1] + EMBEDDING[1] + LAYER[0]))
    assert s3.weights_working + s3.gradients_working == 542_112
    half = state(3, "bf16")
    assert (half.weights_working, half.gradients_working) == (s3.weights_working // 2, s3.gradients_working // 2)


def test_with_transformer_engine_the_output_layer_is_a_unit_of_its_own():
    """megatron-core wraps the output layer (a ColumnParallelLinear) except with the local layers: then it leaves the
    root, and at stage 3's peak neither it nor its gradient is held any more."""
    local, te = state(3), state(3, transformer_impl="transformer_engine")
    assert (te.weights - te.weights_working, te.optimizer) == (local.weights - local.weights_working, local.optimizer)
    output = 1024 * 30 * 4
    assert (local.weights_working - te.weights_working, local.gradients_working - te.gradients_working) == \
        (output, output)


def test_megatron_lm_keeps_megatron_fsdps_bytes():
    shape = Shape.of(load_spec({"model": MODEL}).model)
    for stage in (2, 3):
        on_megatron_lm = state(stage, "bf16", entrypoint="megatron-lm")
        assert on_megatron_lm == fsdp_model_state_bytes(shape, [4], stage, data_parallel=4, precision="bf16")
        assert on_megatron_lm != torch_fsdp2_model_state_bytes(shape, [4], stage, data_parallel=4, precision="bf16")
    # and so does the estimate of a spec that runs there
    data = {"model": MODEL, "precision": "bf16", "parallel": {"data": 4}, "batch": {"micro": 1, "global": 16},
            "optimizer": {"zero_stage": 3},
            "cluster": {"nodes": [{"gpu": "A100-80GB", "count": 1, "gpus_per_node": 4}]}}
    spec = load_spec({**data, "job": {"entrypoint": "megatron-lm", "megatron_lm": "/opt/m"}})
    expected = fsdp_model_state_bytes(shape, [4], 3, data_parallel=4, precision="bf16")
    detail = estimate(spec).memory_detail[0]
    assert (detail["weights"], detail["gradients"], detail["optimizer"]) == pytest.approx(
        (expected.weights / GIB, expected.gradients / GIB, expected.optimizer / GIB))
    on_driver = estimate(load_spec(data)).memory_detail[0]
    expected = torch_fsdp2_model_state_bytes(shape, [4], 3, data_parallel=4, precision="bf16",
                                             transformer_impl="transformer_engine")
    assert on_driver["weights"] == pytest.approx(expected.weights / GIB)


def test_the_estimate_says_fsdp2_gathers_in_every_micro_batch_and_what_that_moves():
    spec = load_spec({"model": MODEL, "precision": "fp32", "parallel": {"data": 4}, "batch": {"micro": 1, "global": 16},
                      "optimizer": {"zero_stage": 3}})
    est = estimate(spec)
    gathered_gb = (EMBEDDING[1] + 4 * LAYER[1] + ROOT[1]) * 4 / 1e9
    line = [a for a in est.assumptions if a.startswith("the parameters are all-gathered")]
    assert len(line) == 1
    assert line[0].startswith("the parameters are all-gathered in each of the 4 micro-batches, in its forward and "
                              f"again in its backward: 8 all-gathers of {gathered_gb:.3g} GB per step")
    assert "ZeRO stage 3 as PyTorch FSDP2 (labkit's): gathered unit by unit, each transformer layer and the " \
        "embedding (the final norm and the output layer with the root)" in est.assumptions  # on CPUs: local layers
    text = render(spec, est)
    assert text.index("  assumed") < text.index(line[0])
    # one micro-batch per step gathers once per step, and stage 2 (ZeRO-2) always does: nothing to warn of
    for once in (spec.replace(**{"batch.global": 4}), spec.replace(**{"optimizer.zero_stage": 2})):
        assert not [a for a in estimate(once).assumptions if a.startswith("the parameters are all-gathered")]


def test_pytorchs_own_fsdp2_keeps_fp32_shards_as_the_master_weights():
    """The pytorch-native stack's FSDP2 (Stack.fsdp_master_shards, torchtitan's defaults): fp32 shards stepped by a
    plain AdamW, gathered in bf16, gradients reduced into fp32 shards: 16 bytes an element where megatron-core's
    wrapper keeps 20."""
    for stage in (2, 3):
        whole = (ROOT[0] + EMBEDDING[0] + 4 * LAYER[0]) if stage == 2 else 0
        s = state(stage, "bf16", fsdp_master_shards=True)
        assert (s.weights - s.weights_working, s.gradients - s.gradients_working, s.optimizer, s.step_only) == \
            (4 * SHARD + 2 * whole, 4 * SHARD, 8 * SHARD, 0)
        megatron = state(stage, "bf16")
        assert (s.weights + s.gradients + s.optimizer) - (s.weights_working + s.gradients_working) < \
            (megatron.weights + megatron.gradients + megatron.optimizer) - (megatron.weights_working +
                                                                          megatron.gradients_working)
    # gathered in bf16; the unsharded gradients at the fp32 of the reduce-scatter's input
    s3 = state(3, "bf16", fsdp_master_shards=True)
    assert (s3.weights_working, s3.gradients_working) == (2 * (ROOT[0] + EMBEDDING[0]),
                                                          4 * (ROOT[1] + EMBEDDING[1] + LAYER[0]))
    assert state(3, "fp32", fsdp_master_shards=True) == state(3, "fp32")  # nothing mixed: the same bytes


@pytest.mark.slow
def test_pytorchs_own_fsdp2_holds_what_the_estimate_counts():
    """torch's fully_shard with MixedPrecisionPolicy(bf16 parameters, fp32 reduction) on fp32 megatron-core layers, unit
    by unit as labkit counts them (the embedding, each layer, the root), stepped by torch's AdamW on 4 gloo ranks: the
    shards, their gradients and AdamW's moments each rank holds equal the estimate's to the byte."""
    from labkit.train.model_state import held_bytes, on_driver_ranks

    def measure(args):
        from types import SimpleNamespace

        import torch
        from megatron.core.models.gpt import GPTModel
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from labkit.train.model import layer_spec, transformer_config

        config = transformer_config(args)
        gpt = GPTModel(config=config, transformer_layer_spec=layer_spec(args, config, None),
                       vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                       share_embeddings_and_output_weights=False, position_embedding_type=args.position_embedding_type)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for unit in (gpt.embedding, *gpt.decoder.layers, gpt):
            fully_shard(unit, mp_policy=policy)
        adamw = torch.optim.AdamW(gpt.parameters())
        for p in gpt.parameters():
            p.grad = torch.zeros_like(p)
        adamw.step()
        return held_bytes([gpt], SimpleNamespace(optimizer=adamw))

    spec = load_spec({"model": MODEL, "precision": "fp32", "batch": {"micro": 1, "global": 4},
                      "cluster": {"nodes": [{"gpu": "cpu", "count": 1, "gpus_per_node": 4}]}})
    held = on_driver_ranks([spec], measure)[0]
    s = state(3, "bf16", fsdp_master_shards=True)
    assert held[0] == [s.weights - s.weights_working, s.gradients - s.gradients_working, s.optimizer]

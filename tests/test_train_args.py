"""The driver's command line: every flag the run spec renders is accepted and means what the spec says; flags it
cannot honour are errors that name them (exit 2)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from labkit.megatron_args import megatron_args
from labkit.spec import load_spec
from labkit.train.arguments import build_parser, parse_args

ROOT = Path(__file__).resolve().parent.parent
CORPUS = str(ROOT / "labkit" / "data" / "corpus" / "corpus_text_document")
TINY = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --lr 1e-3 --train-iters 2".split()


def spec(example: str, **overrides):
    data = yaml.safe_load((ROOT / "examples" / example).read_text())
    data.update(overrides)
    return load_spec(data)


SPECS = {
    "tiny-cpu": spec("tiny-cpu.yaml"),
    "gpt2-xl-hetero": spec("gpt2-xl-hetero.yaml"),
    "corpus-fp16-selective": spec("tiny-cpu.yaml", precision="fp16", recompute={"granularity": "selective"},
                                  data={"path": CORPUS, "mock": False}, batch={"micro": 2, "global": 16},
                                  train={"iters": 30, "log_interval": 5, "eval_interval": 10, "eval_iters": 2,
                                         "save": "/tmp/ckpt", "save_interval": 10, "load": "/tmp/ckpt"}),
    "llama-gqa-interleaved": spec("tiny-cpu.yaml", model={"preset": "llama2-7b", "num_query_groups": 8},
                                  parallel={"tensor": 2, "pipeline": 4, "virtual_stages": 2},
                                  precision="bf16", optimizer={"distributed": True, "loss_scale": 1024.0},
                                  batch={"micro": 1, "global": 32},
                                  cluster={"nodes": [{"gpu": "H100-SXM", "count": 2, "gpus_per_node": 8}]}),
    "sgd-block-recompute": spec("tiny-cpu.yaml", optimizer={"name": "sgd"},
                                recompute={"granularity": "full", "method": "block", "num_layers": 1},
                                model={"preset": "tiny", "swiglu": True, "untie_embeddings": True}),
}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("legacy", [False, True])
def test_every_rendered_flag_is_accepted_and_keeps_its_meaning(name, legacy):
    s = SPECS[name]
    args = parse_args(megatron_args(s, legacy=legacy), world_size=s.world_size, rank=0, cuda=False)
    m, par = s.model, s.parallel
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length) == \
           (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size) == \
           (par.tensor, par.pipeline, s.data_parallel)
    assert args.global_batch_size // (args.micro_batch_size * args.data_parallel_size) == s.num_micro_batches
    assert args.fp16 == (s.precision == "fp16") and args.bf16 == (s.precision == "bf16")
    r = s.recompute
    assert args.recompute_granularity == (r.granularity if r else None)
    if r and r.granularity == "full":
        assert (args.recompute_method, args.recompute_num_layers) == (r.method, r.num_layers)
    assert args.optimizer == s.optimizer.name and args.use_distributed_optimizer == s.optimizer.distributed
    assert args.num_query_groups == (m.num_query_groups if m.query_groups != m.num_attention_heads else None)
    assert args.swiglu == m.swiglu and args.untie_embeddings_and_output_weights == m.untie_embeddings
    assert args.train_iters == s.train.iters and args.seed == s.train.seed
    assert args.mock_data == (s.data.mock or not s.data.path)
    if par.partition:
        assert args.pipeline_model_parallel_layout.count("|") == par.pipeline - 1
    assert args.virtual_pipeline_model_parallel_size == (par.virtual_stages if par.virtual_stages > 1 else None)


def test_uneven_partition_with_empty_first_and_last_stages_is_kept_as_a_layout():
    s = SPECS["gpt2-xl-hetero"]
    args = parse_args(megatron_args(s), world_size=s.world_size, rank=0, cuda=False)
    assert args.pipeline_model_parallel_layout == "E|t*11|t*8|t*8|t*8|t*8|t*5|L"


def test_sequence_parallel_without_transformer_engine_names_the_flag(capsys):
    s = SPECS["llama-gqa-interleaved"].replace(**{"parallel.sequence_parallel": True})
    with pytest.raises(SystemExit) as exit_:
        parse_args(megatron_args(s), world_size=s.world_size, rank=0, cuda=False)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--sequence-parallel:" in err and "Transformer Engine" in err


@pytest.mark.parametrize("extra, message", [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--num-lay", "2"], "unrecognized arguments: --num-lay"),  # no silent abbreviations
    (["--mock-data", "--vocab-size", "64", "--fp16", "--bf16"], "--fp16: conflicts with --bf16; choose one precision"),
    (["--mock-data", "--vocab-size", "64", "--micro-batch-size", "3", "--global-batch-size", "8"],
     "--global-batch-size: 8 is not divisible by --micro-batch-size 3 x data-parallel 1"),
    (["--data-path", "/nonexistent/corpus_text_document"],
     "--data-path: /nonexistent/corpus_text_document has no /nonexistent/corpus_text_document.bin"),
    ([], "--data-path: missing"),
    (["--mock-data", "--tokenizer-type", "NullTokenizer"], "--vocab-size: needed"),
    (["--mock-data", "--vocab-size", "64", "--pipeline-model-parallel-layout", "E|t*2|L"],
     "--pipeline-model-parallel-layout: needs --pipeline-model-parallel-size > 1"),
    (["--mock-data", "--vocab-size", "64", "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
      "E,t|t*2,L"], "--pipeline-model-parallel-layout: places 3 transformer layers (t) but the model has 2"),
    (["--mock-data", "--vocab-size", "64", "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
      "E|t|t,L"], "--pipeline-model-parallel-layout: has 3 stages, not a multiple of pipeline 2"),
    (["--mock-data", "--vocab-size", "64", "--activations-checkpoint-method", "uniform"],
     "--activations-checkpoint-method: needs --checkpoint-activations"),
    (["--mock-data", "--vocab-size", "64", "--distributed-backend", "nccl"], "--distributed-backend: nccl needs GPUs"),
    (["--mock-data", "--vocab-size", "64", "--log-timers-to-tensorboard"],
     "--log-timers-to-tensorboard: needs --tensorboard-dir"),
    (["--mock-data", "--vocab-size", "64", "--profile", "--profile-ranks", "3"], "--profile-ranks: [3] outside"),
])
def test_flags_that_cannot_be_honoured_exit_2_naming_the_flag(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args([*TINY, *extra], world_size=2 if "--pipeline-model-parallel-size" in extra else 1, rank=0,
                   cuda=False)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_legacy_recompute_flags_map_to_todays():
    args = parse_args([*TINY, "--mock-data", "--vocab-size", "64", "--checkpoint-activations",
                       "--activations-checkpoint-method", "block", "--activations-checkpoint-num-layers", "2"],
                      world_size=1, rank=0, cuda=False)
    assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == ("full", "block", 2)
    args = parse_args([*TINY, "--mock-data", "--vocab-size", "64", "--recompute-activations"],
                      world_size=1, rank=0, cuda=False)
    assert args.recompute_granularity == "selective"


def test_derived_values_follow_megatron():
    args = parse_args([*TINY, "--mock-data", "--vocab-size", "64", "--micro-batch-size", "2", "--global-batch-size",
                       "16", "--lr-warmup-fraction", "0.5", "--tensor-model-parallel-size", "2"],
                      world_size=4, rank=0, cuda=False)
    assert args.data_parallel_size == 2 and args.lr_warmup_iters == 1 and args.max_position_embeddings == 64
    assert args.distributed_backend == "gloo" and args.transformer_impl == "local"
    assert args.data_weights is None


def test_weighted_data_blend(tmp_path):
    args = parse_args([*TINY, "--data-path", "0.3", CORPUS, "0.7", CORPUS], world_size=1, rank=0, cuda=False)
    assert args.data_prefixes == [CORPUS, CORPUS] and args.data_weights == [0.3, 0.7]


def test_help_lists_megatron_flag_names():
    text = build_parser().format_help()
    for flag in ("--pipeline-model-parallel-layout", "--num-layers-per-virtual-pipeline-stage",
                 "--use-distributed-optimizer", "--checkpoint-activations", "--tensorboard-dir", "--profile-ranks",
                 "--mock-data", "--log-throughput"):
        assert flag in text


def test_a_command_line_argparse_refuses_is_refused_before_torch_loads():
    code = ("import sys\nfrom labkit.train.__main__ import main\n"
            "try:\n    main(['--num-layers', '2', '--no-such-flag', '7'])\n"
            "except SystemExit as done:\n    print(done.code, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.splitlines()[-1].split() == ["2", "False"], done.stdout + done.stderr[-2000:]
    assert "the following arguments are required: --hidden-size" in done.stderr


def test_wandb_is_left_out_only_while_megatron_loads_and_only_when_no_run_logs_to_it(monkeypatch):
    from labkit.train.__main__ import wandb_left_out

    monkeypatch.delitem(sys.modules, "wandb", raising=False)  # as in a fresh driver process
    with wandb_left_out(True):
        with pytest.raises(ImportError):
            import wandb  # noqa: F401
    assert "wandb" not in sys.modules  # nothing left behind: a later `import wandb` loads it
    with wandb_left_out(False):
        assert "wandb" not in sys.modules


def test_the_entrypoint_leaves_with_mains_code_and_its_output_flushed():
    """`python -m labkit.train` ends by os._exit: main's exit status, and what it printed to a pipe (block-buffered)
    still arrives."""
    code = ("import labkit.train.__main__ as driver\n"
            "driver.main = lambda: (print('last line, no newline', end=''), 3)[1]\n"
            "driver.entrypoint()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (3, "last line, no newline"), done.stderr[-2000:]

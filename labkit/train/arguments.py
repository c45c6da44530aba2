"""The driver's command line: Megatron-LM's flag names for everything labkit's driver supports, nothing else.

An unknown flag is an error naming it (exit 2). A flag that exists but cannot work in this environment (for example
--sequence-parallel without Transformer Engine) is an error naming the flag and the reason. `parse_args` also derives
what Megatron derives (data-parallel size, padded sizes, warm-up steps) so the arguments block prints like theirs.

`labkit validate` checks job.extra_args against this parser (`flag_errors`), so this module imports nothing heavier
than the standard library and labkit.paths: validating a spec must not load torch.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from labkit.megatron import sizes
from labkit.paths import data_file

DEFAULT_VOCAB = data_file("tokenizer", "vocab.json")
DEFAULT_MERGES = data_file("tokenizer", "merges.txt")


NORMALIZATIONS = ("LayerNorm", "RMSNorm")
"""--normalization values (Megatron-LM's names); the spec's model.normalization takes the same."""
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
"""--position-embedding-type values the driver builds (Megatron-LM also has mrope and relative)."""
TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer", "NullTokenizer")
"""--tokenizer-type values the driver reads (Megatron-LM's names)."""


class ArgumentError(Exception):
    """A flag that cannot be honoured; the message starts with the flag."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        if not self.exit_on_error:
            raise ArgumentError(message)
        self.print_usage(sys.stderr)
        hint = " (labkit's driver does not support it; `python -m labkit.train --help` lists the flags it takes)" \
            if "unrecognized arguments" in message else ""
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
"""Megatron-LM's --attention-backend choices."""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m labkit.train", allow_abbrev=False,
                usage="%(prog)s [Megatron-LM flags; --help lists them]",
                description="Train a GPT with megatron-core (CPU/gloo or GPU/NCCL), logging like Megatron-LM.")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden (8/3 x hidden with --swiglu)")
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default --seq-length")
    g.add_argument("--vocab-size", type=int, default=None, help="with --mock-data: the vocabulary to draw from")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--normalization", choices=NORMALIZATIONS, default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--position-embedding-type", choices=POSITION_EMBEDDING_TYPES, default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000, help="with --position-embedding-type rope")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                   help="no biases in the linear layers (Llama)")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default=None,
                   help="default: transformer_engine when it is importable and a GPU is present, else local")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved 1F1B schedule")
    g.add_argument("--pipeline-model-parallel-layout", default=None,
                   help='per-stage layout, e.g. "E|t*11|t*8|t*5|L" (uneven stages, zero-layer first/last stages)')
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="count the embedding as a layer in the split: the first chunk holds a transformer layer fewer")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="count the loss as a layer in the split: the last chunk holds a transformer layer fewer")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="split the sequence over ranks, K/V exchanged in a ring (Transformer Engine on GPUs)")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="reduce gradient buckets while the backward pass goes on (megatron-core's DDP)")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="all-gather parameter buckets during the next forward (needs --use-distributed-optimizer)")
    g.add_argument("--tp-comm-overlap", action="store_true",
                   help="overlap tensor-parallel communication with GEMMs (Transformer Engine userbuffers on GPUs)")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="auto picks what megatron-core would (flash or fused with Transformer Engine, else local)")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with GPUs, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="how long a collective may wait for the other ranks before the run fails (Megatron-LM's 10)")
    g.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm",
                   help="interleaved schedule: batch each step's pipeline sends and receives instead of overlapping "
                        "them (needs --pipeline-model-parallel-size > 2)")

    g = p.add_argument_group("fused kernels (Megatron-LM's names; each is on where this environment has its kernel)")
    g.add_argument("--no-masked-softmax-fusion", action="store_false", dest="masked_softmax_fusion",
                   help="scale-mask-softmax in one kernel (needs Apex's or Megatron's scaled_masked_softmax_cuda)")
    g.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion",
                   help="bias + GeLU in one kernel (torch.compile on a GPU; needs biases)")
    g.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion",
                   help="bias + SwiGLU in one kernel (torch.compile on a GPU)")
    g.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion",
                   help="bias + dropout + residual add in one kernel (torch.compile on a GPU)")
    g.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion",
                   help="rotary embedding in one kernel (Transformer Engine)")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion",
                   help="weight gradients accumulated into the fp32 main gradient inside the GEMM (Transformer "
                        "Engine, or Apex's fused_weight_gradient_mlp_cuda)")

    g = p.add_argument_group("batch")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None, help="default micro x data-parallel")

    g = p.add_argument_group("precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--grad-reduce-in-bf16", action="store_true", help="with --bf16: bf16 gradient buffers (else fp32)")
    g.add_argument("--fp8-format", choices=["hybrid", "e4m3"], default=None,
                   help="FP8 GEMMs through Transformer Engine (with --bf16); needs FP8 tensor cores")
    g.add_argument("--loss-scale", type=float, default=None, help="fixed fp16 loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)

    g = p.add_argument_group("activation recomputation")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-activations", action="store_true", help="legacy spelling of selective recompute")
    g.add_argument("--checkpoint-activations", action="store_true", help="legacy spelling of full recompute")
    g.add_argument("--activations-checkpoint-method", choices=["uniform", "block"], default=None)
    g.add_argument("--activations-checkpoint-num-layers", type=int, default=1)

    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)

    g = p.add_argument_group("schedule and checkpoints")
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal, save a checkpoint (with --save) at the end of the iteration and exit")
    g.add_argument("--exit-signal", choices=["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"], default="SIGTERM")
    g.add_argument("--seed", type=int, default=1234)

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="PREFIX (from `labkit data prepare`) or WEIGHT PREFIX WEIGHT PREFIX ... for a blend")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--data-cache-path", default=None,
                   help="where dataset indices are cached (default: next to the data)")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="default GPT2BPETokenizer, or NullTokenizer for --mock-data with --vocab-size")
    g.add_argument("--tokenizer-model", default=None,
                   help="HuggingFaceTokenizer: a tokenizer.json; SentencePieceTokenizer: a .model file")
    g.add_argument("--vocab-file", default=None, help=f"default {DEFAULT_VOCAB}")
    g.add_argument("--merge-file", default=None, help=f"default {DEFAULT_MERGES}")

    g = p.add_argument_group("logging and profiling")
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--timing-log-level", type=int, choices=[0, 1, 2], default=0,
                   help="0 (Megatron-LM's default): iteration time only; 1 adds the forward-backward and optimizer "
                        "timers; 2 adds forward/backward compute, pipeline and all-reduce timers, at the price of "
                        "device synchronisations and barriers in every iteration")
    g.add_argument("--timing-log-option", choices=["minmax", "max", "all"], default="minmax")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--profile", action="store_true", help="torch.profiler trace of the steps below")
    g.add_argument("--use-pytorch-profiler", action="store_true", help="accepted: --profile always uses torch.profiler")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0])
    return p


def flag_errors(argv: list[str]) -> list[str]:
    """What the driver's parser refuses in these flags (unknown flags, values outside a flag's choices or type),
    without requiring the flags a whole command line needs; [] when it takes them all."""
    parser = build_parser()
    parser.exit_on_error = False
    for action in parser._actions:
        action.required = False
    try:
        parser.parse_args(argv)
    except (ArgumentError, argparse.ArgumentError) as exc:
        return [str(exc)]
    return []


def _te_importable() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def _data_blend(paths: list[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's --data-path: `P` or `P1 P2` (equal weights) or `W1 P1 W2 P2`."""
    def is_number(s):
        try:
            float(s)
            return True
        except ValueError:
            return False
    if len(paths) % 2 == 0 and all(is_number(w) for w in paths[0::2]):
        return list(paths[1::2]), [float(w) for w in paths[0::2]]
    return list(paths), None


def finish(args: argparse.Namespace, world_size: int, rank: int, cuda: bool) -> argparse.Namespace:
    """Check flag combinations and derive Megatron's derived arguments. Raises ArgumentError naming the flag."""
    args.world_size, args.rank = world_size, rank
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "train_iters",
                 "tensor_model_parallel_size", "pipeline_model_parallel_size", "log_interval"):
        if getattr(args, flag) <= 0:
            raise ArgumentError(f"--{flag.replace('_', '-')}: must be positive, got {getattr(args, flag)}")
    if world_size % (tp * pp):
        raise ArgumentError(f"--tensor-model-parallel-size/--pipeline-model-parallel-size: world size {world_size} "
                            f"is not divisible by tensor {tp} x pipeline {pp}; launch {tp * pp} x N processes")
    cp = args.context_parallel_size
    if cp <= 0 or world_size % (tp * cp * pp):
        raise ArgumentError(f"--context-parallel-size: world size {world_size} is not divisible by tensor {tp} x "
                            f"context {cp} x pipeline {pp}")
    args.data_parallel_size = sizes.data_parallel_size(world_size, tp, cp, pp)
    dp = args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ArgumentError(f"--global-batch-size: {args.global_batch_size} is not divisible by micro-batch "
                            f"{args.micro_batch_size} x data-parallel {dp}")
    if args.num_attention_heads % tp:
        raise ArgumentError(f"--num-attention-heads: {args.num_attention_heads} heads do not split over "
                            f"--tensor-model-parallel-size {tp}")
    if args.hidden_size % args.num_attention_heads:
        raise ArgumentError(f"--hidden-size: {args.hidden_size} is not divisible by --num-attention-heads "
                            f"{args.num_attention_heads}")
    if not args.group_query_attention:
        if args.num_query_groups not in (None, args.num_attention_heads):
            raise ArgumentError("--num-query-groups: needs --group-query-attention")
        args.num_query_groups = None
    elif args.num_query_groups is None or args.num_attention_heads % args.num_query_groups \
            or args.num_query_groups % tp:
        raise ArgumentError(f"--num-query-groups: {args.num_query_groups} must divide --num-attention-heads "
                            f"{args.num_attention_heads} and be divisible by --tensor-model-parallel-size {tp}")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise ArgumentError(f"--seq-length: {args.seq_length} exceeds --max-position-embeddings "
                            f"{args.max_position_embeddings}")

    if args.fp16 and args.bf16:
        raise ArgumentError("--fp16/--bf16: choose one precision")
    args.params_dtype = "torch.float16" if args.fp16 else "torch.bfloat16" if args.bf16 else "torch.float32"

    # Recomputation: the legacy spellings map onto today's flags.
    if args.checkpoint_activations:
        if args.recompute_granularity not in (None, "full"):
            raise ArgumentError("--checkpoint-activations: conflicts with --recompute-granularity selective")
        args.recompute_granularity = "full"
        args.recompute_method = args.recompute_method or args.activations_checkpoint_method or "uniform"
        if args.recompute_num_layers is None:
            args.recompute_num_layers = args.activations_checkpoint_num_layers
    elif args.activations_checkpoint_method:
        raise ArgumentError("--activations-checkpoint-method: needs --checkpoint-activations")
    if args.recompute_activations:
        if args.recompute_granularity == "full":
            raise ArgumentError("--recompute-activations: conflicts with --recompute-granularity full")
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full":
        if args.recompute_method is None:
            raise ArgumentError("--recompute-method: needed with --recompute-granularity full (uniform or block)")
        if args.recompute_num_layers is None:
            args.recompute_num_layers = 1
    elif args.recompute_method or args.recompute_num_layers is not None:
        raise ArgumentError("--recompute-method/--recompute-num-layers: only apply to --recompute-granularity full")

    # Pipeline: interleaving and uneven layouts.
    args.virtual_pipeline_model_parallel_size = None
    accounted = args.account_for_embedding_in_pipeline_split or args.account_for_loss_in_pipeline_split
    # the layers split over the chunks: the embedding and the loss count as one each where asked (validate_args)
    counted = sizes.split_layers(args.num_layers, args.account_for_embedding_in_pipeline_split,
                                 args.account_for_loss_in_pipeline_split)
    if accounted and args.pipeline_model_parallel_layout:
        raise ArgumentError("--account-for-embedding/loss-in-pipeline-split: cannot be combined with "
                            "--pipeline-model-parallel-layout (the layout places the embedding and loss itself)")
    if args.num_layers_per_virtual_pipeline_stage is not None:
        if pp == 1:
            raise ArgumentError("--num-layers-per-virtual-pipeline-stage: needs --pipeline-model-parallel-size > 1")
        if args.pipeline_model_parallel_layout:
            raise ArgumentError("--num-layers-per-virtual-pipeline-stage: cannot be combined with "
                                "--pipeline-model-parallel-layout (the layout sets the virtual stages)")
        per_stage = counted // pp
        if counted % pp or per_stage % args.num_layers_per_virtual_pipeline_stage:
            raise ArgumentError(f"--num-layers-per-virtual-pipeline-stage: {args.num_layers_per_virtual_pipeline_stage}"
                                f" does not divide the {counted}/{pp} layers per pipeline stage"
                                + (" (embedding and loss counted as asked)" if accounted else ""))
        args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage
    elif accounted and counted % pp:
        raise ArgumentError(f"--account-for-embedding/loss-in-pipeline-split: {counted} layers with the embedding and "
                            f"loss counted do not split evenly over --pipeline-model-parallel-size {pp}")
    if args.pipeline_model_parallel_layout:
        if pp == 1:
            raise ArgumentError("--pipeline-model-parallel-layout: needs --pipeline-model-parallel-size > 1")
        problems = sizes.layout_problems(args.pipeline_model_parallel_layout, args.num_layers, pp)
        if problems:
            raise ArgumentError("--pipeline-model-parallel-layout: " + "; ".join(problems))
        chunks = sizes.layout_virtual_stages(args.pipeline_model_parallel_layout, pp)
        if chunks > 1:
            args.virtual_pipeline_model_parallel_size = chunks
    if args.virtual_pipeline_model_parallel_size is None:
        args.overlap_p2p_comm = False  # only the interleaved schedule overlaps its sends and receives
    elif not args.overlap_p2p_comm and pp == 2:
        # Batched sends and receives with two stages put both directions between the same two ranks in one batch;
        # NCCL matches them in posting order and a stage can receive a gradient as its activation (Megatron-LM's
        # arguments.py refuses this combination too).
        raise ArgumentError("--no-overlap-p2p-communication: the interleaved schedule with "
                            "--pipeline-model-parallel-size 2 needs overlapped sends and receives; leave the flag out "
                            "or use more than 2 pipeline stages")
    num_micro = args.global_batch_size // (args.micro_batch_size * dp)
    if args.virtual_pipeline_model_parallel_size and num_micro % pp:
        raise ArgumentError(f"--global-batch-size: the interleaved schedule needs the {num_micro} micro-batches to be "
                            f"a multiple of --pipeline-model-parallel-size {pp}")

    # Implementation and backend.
    te = _te_importable()
    if args.transformer_impl is None:
        args.transformer_impl = "transformer_engine" if te and cuda else "local"
    elif args.transformer_impl == "transformer_engine" and not (te and cuda):
        raise ArgumentError("--transformer-impl transformer_engine: Transformer Engine needs a GPU and the "
                            "transformer_engine package; use --transformer-impl local")
    # What labkit's driver does not set up on any machine: refused, never accepted and ignored.
    if args.tp_comm_overlap:
        raise ArgumentError("--tp-comm-overlap: labkit's driver does not start Transformer Engine's userbuffers, "
                            "which it needs; leave it out, or run Megatron-LM's pretrain_gpt.py (job.entrypoint: "
                            "megatron-lm)")
    if cp > 1:
        raise ArgumentError("--context-parallel-size: labkit's driver does not split sequences over context-parallel "
                            "ranks (the batch slicing and loss reduction are Megatron-LM's); use 1, or run Megatron-LM's "
                            "pretrain_gpt.py (job.entrypoint: megatron-lm)")
    gpu_only = {"--fp8-format": args.fp8_format is not None,
                "--attention-backend": args.attention_backend in ("flash", "fused")}
    for flag, given in gpu_only.items():
        if given and args.transformer_impl != "transformer_engine":
            raise ArgumentError(f"{flag}: needs Transformer Engine on a GPU, which this run does not have "
                                "(the CPU driver runs megatron-core's local layers); leave it out on CPU")
    if args.distributed_timeout_minutes <= 0:
        raise ArgumentError(f"--distributed-timeout-minutes: must be positive, got {args.distributed_timeout_minutes}")
    if args.fp8_format and not args.bf16:
        raise ArgumentError("--fp8-format: FP8 GEMMs run inside a bf16 model; add --bf16")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ArgumentError("--overlap-param-gather: gathers the distributed optimizer's parameter shards; add "
                            "--use-distributed-optimizer")
    if args.sequence_parallel:
        if tp == 1:
            raise ArgumentError("--sequence-parallel: needs --tensor-model-parallel-size > 1")
        if args.transformer_impl != "transformer_engine":
            raise ArgumentError("--sequence-parallel: megatron-core's local layers use torch LayerNorm, which sequence "
                                "parallelism does not support; it needs Transformer Engine on a GPU "
                                "(--transformer-impl transformer_engine)")
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda else "gloo"
    elif args.distributed_backend == "nccl" and not cuda:
        raise ArgumentError("--distributed-backend nccl: needs GPUs; use gloo on CPU")
    if args.use_distributed_optimizer and args.optimizer != "adam":
        raise ArgumentError("--use-distributed-optimizer: megatron-core's distributed optimizer needs --optimizer adam")

    # Data.
    if args.mock_data and args.data_path:
        raise ArgumentError("--mock-data: conflicts with --data-path; give one of them")
    if not args.mock_data and not args.data_path:
        raise ArgumentError("--data-path: missing; give a prefix from `labkit data prepare`, or --mock-data")
    if args.data_path:
        args.data_prefixes, args.data_weights = _data_blend(args.data_path)
        for prefix in args.data_prefixes:
            missing = [s for s in (".bin", ".idx") if not Path(prefix + s).is_file()]
            if missing:
                raise ArgumentError(f"--data-path: {prefix} has no {' or '.join(prefix + s for s in missing)}; "
                                    "create it with `labkit data prepare INPUT.jsonl --output-prefix P` and pass "
                                    "P_text_document")
        args.tokenizer_type = args.tokenizer_type or "GPT2BPETokenizer"
    else:
        args.data_prefixes, args.data_weights = [], None
        mock_tokenizer = "GPT2BPETokenizer" if args.vocab_size is None else "NullTokenizer"
        args.tokenizer_type = args.tokenizer_type or mock_tokenizer
    if args.tokenizer_type == "GPT2BPETokenizer":
        args.vocab_file = args.vocab_file or str(DEFAULT_VOCAB)
        args.merge_file = args.merge_file or str(DEFAULT_MERGES)
        for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
            if not Path(path).is_file():
                raise ArgumentError(f"{flag}: no such file {path}")
    elif args.tokenizer_type in ("HuggingFaceTokenizer", "SentencePieceTokenizer"):
        if args.tokenizer_model is None:
            raise ArgumentError(f"--tokenizer-model: needed with --tokenizer-type {args.tokenizer_type}")
        if not Path(args.tokenizer_model).is_file():
            raise ArgumentError(f"--tokenizer-model: no such file {args.tokenizer_model}")
    elif args.vocab_size is None:
        raise ArgumentError("--vocab-size: needed with --tokenizer-type NullTokenizer")
    if args.tokenizer_model is not None and args.tokenizer_type not in ("HuggingFaceTokenizer",
                                                                         "SentencePieceTokenizer"):
        raise ArgumentError(f"--tokenizer-model: --tokenizer-type {args.tokenizer_type} does not read one; "
                            "use HuggingFaceTokenizer or SentencePieceTokenizer")
    split = args.split.replace("/", ",").split(",")
    try:
        if len(split) > 3 or sum(float(s) for s in split) <= 0:
            raise ValueError
    except ValueError:
        raise ArgumentError(f"--split: {args.split!r} is not like 969,30,1 (train, validation, test weights)") from None

    # Schedule.
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.save_interval is not None and not args.save:
        raise ArgumentError("--save-interval: needs --save DIR")
    if args.profile:
        if not 0 <= args.profile_step_start < args.profile_step_end:
            raise ArgumentError("--profile-step-start/--profile-step-end: need 0 <= start < end")
        bad = [r for r in args.profile_ranks if not 0 <= r < world_size]
        if bad:
            raise ArgumentError(f"--profile-ranks: {bad} outside the world of {world_size} processes")
    for flag in ("log_timers_to_tensorboard", "log_memory_to_tensorboard", "log_validation_ppl_to_tensorboard"):
        if getattr(args, flag) and not args.tensorboard_dir:
            raise ArgumentError(f"--{flag.replace('_', '-')}: needs --tensorboard-dir DIR")
    args.consumed_train_samples = 0
    args.iteration = 0
    return args


def parse_args(argv: list[str] | None = None, world_size: int | None = None, rank: int | None = None,
               cuda: bool | None = None) -> argparse.Namespace:
    """Parse and check the flags; exits 2 with a message naming the flag when one cannot be honoured."""
    import torch

    parser = build_parser()
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    cuda = torch.cuda.is_available() if cuda is None else cuda
    try:
        return finish(args, world_size, rank, cuda)
    except ArgumentError as exc:
        parser.error(str(exc))

"""Every Megatron-LM flag labkit writes (labkit.megatron_args, labkit.jobs.sweep) or reads (the training driver): its
name, type, choices and default, in one table. The driver's command line is built from it (`build_parser`), so a flag
labkit renders is one its driver parses, and `labkit validate` checks `job.extra_args` against the same table
(`flag_errors`) without importing torch.

Names, types and defaults follow Megatron-LM core_v0.16.1's megatron/training/arguments.py, with three kinds of
difference, each said in the flag's help: flags the driver requires that Megatron-LM can infer (--num-layers and the
model's shape), defaults labkit chooses where Megatron-LM has none (--distributed-backend, --transformer-impl, chosen
from the machine), and choices narrowed to what the driver builds (--position-embedding-type, --tokenizer-type).
Code elsewhere names a flag as `FLAG.<name in snake case>` (FLAG.num_layers is "--num-layers"); the architecture test
fails on a Megatron flag spelled as a string anywhere else in labkit.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from types import SimpleNamespace

from labkit.paths import data_file

DEFAULT_VOCAB = data_file("tokenizer", "vocab.json")
"""The GPT-2 vocabulary shipped with labkit: --vocab-file's default with GPT2BPETokenizer."""
DEFAULT_MERGES = data_file("tokenizer", "merges.txt")
"""The GPT-2 merges shipped with labkit: --merge-file's default."""

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
"""--normalization values (Megatron-LM's names); the spec's model.normalization takes the same."""
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
"""--position-embedding-type values the driver builds (Megatron-LM also has mrope and relative)."""
TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer", "NullTokenizer")
"""--tokenizer-type values the driver reads (Megatron-LM's names)."""
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
"""Megatron-LM's --attention-backend choices."""
DRIVER_ATTENTION_BACKENDS = ("sdpa",)
"""Attention backends labkit's driver adds to Megatron-LM's (kernels.attention_backend): sdpa, attention's core through
torch.nn.functional.scaled_dot_product_attention in megatron-core's layers (--sdpa-attention)."""
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
"""Megatron-LM's --moe-router-load-balancing-type choices: GShard's auxiliary loss per batch, per sequence
(DeepSeek-V2), over the global batch, S-BASE's Sinkhorn routing, or none."""
MOE_TOKEN_DISPATCHERS = ("allgather", "alltoall", "flex")
"""Megatron-LM's --moe-token-dispatcher-type choices."""
MOE_FLEX_BACKENDS = ("deepep", "hybridep")
"""Megatron-LM's --moe-flex-dispatcher-backend choices: the kernels the flex dispatcher runs, DeepEP's or HybridEP's."""
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe", "moe_act", "shared_experts", "mla_up_proj")
"""Megatron-LM's --recompute-modules choices (megatron-core 0.16.1's TransformerConfig.recompute_modules): attention's
core, the dense MLP, the two norms, the MoE layer, its experts' activation function, its shared experts, and
multi-latent attention's up projection."""
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine")
"""Megatron-LM's --cuda-graph-impl choices: no graphs, megatron-core's own CudaGraphManager (and the whole iteration),
or Transformer Engine's make_graphed_callables per layer."""
CUDA_GRAPH_SCOPES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "full_iteration")
"""--cuda-graph-scope's choices for labkit's models (megatron-core 0.16.1's CudaGraphScope without mamba): attention,
a dense layer's MLP, an MoE layer's MLP side, its router (with the shared experts), the dispatch's preprocessing, and
the whole training iteration."""
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""Megatron-LM's --data-parallel-sharding-strategy choices, ZeRO stages 0 to 3 in Megatron-FSDP's names."""
OPTIMIZER_DTYPES = {"main_grads_dtype": ("fp32", "bf16"), "main_params_dtype": ("fp32", "fp16"),
                    "exp_avg_dtype": ("fp32", "fp16", "bf16", "fp8"), "exp_avg_sq_dtype": ("fp32", "fp16", "bf16", "fp8")}
"""The precision-aware optimizer's dtypes and Megatron-LM's choices for each (--main-grads-dtype, --main-params-dtype,
--exp-avg-dtype, --exp-avg-sq-dtype; fp32 the default of all four)."""


@dataclass(frozen=True)
class Flag:
    """One Megatron-LM command-line flag as labkit writes and parses it."""
    name: str
    """As written on the command line, e.g. --num-layers."""
    type: type | None = None
    """The value's type (int, float, str when None); switches take no value."""
    action: str | None = None
    """store_true or store_false for a switch; None for a flag that takes a value."""
    choices: tuple | None = None
    """The values the flag accepts, or None for any value of its type."""
    default: object = None
    """The value when the flag is left out (Megatron-LM's, unless its help says otherwise)."""
    dest: str | None = None
    """The argument's attribute when it is not the name in snake case (--disable-bias-linear sets add_bias_linear)."""
    nargs: str | None = None
    """'+' for a flag that takes one or more values."""
    required: bool = False
    """The driver needs it on every command line."""
    help: str = ""
    """What it does, for `python -m labkit.train --help`."""
    group: str = ""
    """The --help section it is listed in."""
    legacy: bool = False
    """A flag of Megatron-LM before 2022 (the NVIDIA workshop's spelling), gone from core_v0.16.1: the driver maps it
    onto today's flags, and megatron_args writes it only when asked for the legacy spelling."""
    megatron_deepspeed: bool = False
    """A flag of Megatron-DeepSpeed (github microsoft/Megatron-DeepSpeed, megatron/arguments.py: its --zero-stage, and
    the --deepspeed and --deepspeed_config that deepspeed.add_config_arguments adds), not of Megatron-LM: rendered
    for optimizer.zero_backend deepspeed on labkit's driver only."""
    driver_only: bool = False
    """A flag of labkit's driver alone, which neither Megatron-LM nor Megatron-DeepSpeed has: rendered only for
    job.entrypoint labkit (--sdpa-attention)."""

    def __str__(self) -> str:
        return self.name

    @property
    def value_when_absent(self) -> object:
        """What the parsed argument holds when the flag is left out: a switch's opposite, else the default."""
        return {"store_true": False, "store_false": True}.get(self.action, self.default)

    @property
    def key(self) -> str:
        """The name in snake case, the flag's attribute in FLAG: --no-rope-fusion -> no_rope_fusion."""
        return self.name[2:].replace("-", "_")


MOE = "mixture of experts"
MODEL, PARALLEL, FUSED, BATCH, PRECISION = ("model", "parallelism", "fused kernels (each is on where this environment "
                                            "has its kernel)", "batch", "precision")
RECOMPUTE, OPTIMIZER, SCHEDULE, DATA, LOGGING = ("activation recomputation", "optimizer and learning rate",
                                                 "schedule and checkpoints", "data", "logging and profiling")

FLAGS: tuple[Flag, ...] = (
    Flag("--num-layers", type=int, required=True, group=MODEL),
    Flag("--hidden-size", type=int, required=True, group=MODEL),
    Flag("--num-attention-heads", type=int, required=True, group=MODEL),
    Flag("--group-query-attention", action="store_true", group=MODEL),
    Flag("--num-query-groups", type=int, group=MODEL),
    Flag("--ffn-hidden-size", type=int, help="default 4 x hidden (8/3 x hidden with --swiglu)", group=MODEL),
    Flag("--seq-length", type=int, required=True, group=MODEL),
    Flag("--max-position-embeddings", type=int, help="default --seq-length", group=MODEL),
    Flag("--vocab-size", type=int, help="with --mock-data: the vocabulary to draw from", group=MODEL),
    Flag("--make-vocab-size-divisible-by", type=int, default=128, group=MODEL),
    Flag("--swiglu", action="store_true", group=MODEL),
    Flag("--untie-embeddings-and-output-weights", action="store_true", group=MODEL),
    Flag("--normalization", choices=NORMALIZATIONS, default="LayerNorm", group=MODEL),
    Flag("--norm-epsilon", type=float, default=1e-05, group=MODEL),
    Flag("--position-embedding-type", choices=POSITION_EMBEDDING_TYPES, default="learned_absolute", group=MODEL),
    Flag("--rotary-base", type=int, default=10000, help="with --position-embedding-type rope", group=MODEL),
    Flag("--disable-bias-linear", action="store_false", dest="add_bias_linear",
         help="no biases in the linear layers (Llama)", group=MODEL),
    Flag("--hidden-dropout", type=float, default=0.1, group=MODEL),
    Flag("--attention-dropout", type=float, default=0.1, group=MODEL),
    Flag("--init-method-std", type=float, default=0.02, group=MODEL),
    Flag("--kv-channels", type=int, help="width of one attention head; default --hidden-size / --num-attention-heads",
         group=MODEL),
    Flag("--qk-layernorm", action="store_true", help="normalise queries and keys per head (Qwen3, OLMo 2)",
         group=MODEL),

    Flag("--num-experts", type=int, help="routed experts in each MoE layer; default: a dense model", group=MOE),
    Flag("--moe-router-topk", type=int, default=2, help="experts each token is routed to", group=MOE),
    Flag("--moe-ffn-hidden-size", type=int, help="MLP width of one expert; default --ffn-hidden-size", group=MOE),
    Flag("--moe-shared-expert-intermediate-size", type=int,
         help="MLP width of the shared experts every token passes through (their count x each one's width)",
         group=MOE),
    Flag("--moe-layer-freq", default=1,
         help="which layers are MoE: N (one in N) or a pattern such as \"([0]+[1]*23)\" (0 dense, 1 MoE)",
         group=MOE),
    Flag("--moe-router-load-balancing-type", choices=MOE_LOAD_BALANCING_TYPES, default="aux_loss", group=MOE),
    Flag("--moe-aux-loss-coeff", type=float, default=0.0, help="weight of the load-balancing loss (1e-2 is usual)",
         group=MOE),
    Flag("--moe-router-pre-softmax", action="store_true",
         help="softmax over all experts before the top-k (needed at top-1)", group=MOE),
    Flag("--moe-token-dispatcher-type", choices=MOE_TOKEN_DISPATCHERS, default="allgather",
         help="how tokens reach their experts' ranks", group=MOE),
    Flag("--moe-flex-dispatcher-backend", choices=MOE_FLEX_BACKENDS, default="deepep",
         help="the flex dispatcher's kernels: DeepEP's or HybridEP's (GPUs only)", group=MOE),
    Flag("--moe-grouped-gemm", action="store_true", help="one grouped GEMM for a rank's experts (GPUs only)",
         group=MOE),
    Flag("--overlap-moe-expert-parallel-comm", action="store_true",
         help="hide the experts' all-to-all behind another micro-batch's compute (megatron-core's combined 1F1B "
              "schedule; needs --expert-model-parallel-size > 1, the alltoall or flex dispatcher, and with a pipeline "
              "the interleaved schedule)", group=MOE),
    Flag("--moe-pad-experts-for-cuda-graph-inference", action="store_true",
         help="inference only: pad experts' inputs so that a CUDA graph holds no host sync; Megatron-LM asks for it "
              "beside --cuda-graph-impl local with expert parallelism", group=MOE),
    Flag("--transformer-impl", choices=("local", "transformer_engine"),
         help="default: transformer_engine when it is importable and a GPU is present, else local", group=MODEL),

    Flag("--tensor-model-parallel-size", type=int, default=1, group=PARALLEL),
    Flag("--pipeline-model-parallel-size", type=int, default=1, group=PARALLEL),
    Flag("--num-layers-per-virtual-pipeline-stage", type=int, help="interleaved 1F1B schedule", group=PARALLEL),
    Flag("--pipeline-model-parallel-layout",
         help="per-stage layout, e.g. \"E|t*11|t*8|t*5|L\" (uneven stages, zero-layer first/last stages)",
         group=PARALLEL),
    Flag("--account-for-embedding-in-pipeline-split", action="store_true",
         help="count the embedding as a layer in the split: the first chunk holds a transformer layer fewer",
         group=PARALLEL),
    Flag("--account-for-loss-in-pipeline-split", action="store_true",
         help="count the loss as a layer in the split: the last chunk holds a transformer layer fewer", group=PARALLEL),
    Flag("--context-parallel-size", type=int, default=1,
         help="split the sequence over ranks, K/V exchanged in a ring (Transformer Engine on GPUs)", group=PARALLEL),
    Flag("--sequence-parallel", action="store_true", group=PARALLEL),
    Flag("--expert-model-parallel-size", type=int, default=1, help="ranks the experts of each MoE layer split over",
         group=PARALLEL),
    Flag("--expert-tensor-parallel-size", type=int,
         help="tensor ranks of each expert; default --tensor-model-parallel-size", group=PARALLEL),
    Flag("--use-distributed-optimizer", action="store_true", group=PARALLEL),
    Flag("--use-megatron-fsdp", action="store_true",
         help="wrap the model in Megatron-FSDP (megatron-core's fully sharded data parallelism; CUDA only)",
         group=PARALLEL),
    Flag("--data-parallel-sharding-strategy", choices=SHARDING_STRATEGIES, default="no_shard",
         help="with --use-megatron-fsdp, what the data-parallel ranks shard: optim (ZeRO-1), optim_grads (ZeRO-2), "
              "optim_grads_params (ZeRO-3)", group=PARALLEL),
    Flag("--use-torch-fsdp2", action="store_true",
         help="wrap the model in PyTorch FSDP2 through megatron-core (TorchFullyShardedDataParallel): parameters, "
              "gradients and optimizer states sharded over the data-parallel ranks (ZeRO-3); runs on CPU with gloo",
         group=PARALLEL),
    Flag("--torch-fsdp2-no-reshard-after-forward", action="store_false", dest="torch_fsdp2_reshard_after_forward",
         help="with --use-torch-fsdp2, keep each layer's gathered parameters from its forward to its backward "
              "(ZeRO-2's memory at the peak, one all-gather per micro-batch)", group=PARALLEL),
    Flag("--deepspeed", action="store_true", megatron_deepspeed=True,
         help="train with DeepSpeed's ZeRO engine (deepspeed.initialize) as Megatron-DeepSpeed does; needs "
              "--deepspeed_config and the deepspeed package (tensor and pipeline parallel size 1)", group=PARALLEL),
    Flag("--deepspeed_config", megatron_deepspeed=True,
         help="with --deepspeed, DeepSpeed's JSON config (batch sizes, ZeRO stage, precision, gradient clipping): "
              "the ds_config.json `labkit run` renders", group=PARALLEL),
    Flag("--zero-stage", type=int, choices=(0, 1, 2, 3), megatron_deepspeed=True,
         help="with --deepspeed, the ZeRO stage (0 nothing sharded, 1 optimizer states, 2 and gradients, 3 and "
              "parameters); must agree with the config's zero_optimization.stage", group=PARALLEL),
    Flag("--overlap-grad-reduce", action="store_true",
         help="reduce gradient buckets while the backward pass goes on (megatron-core's DDP)", group=PARALLEL),
    Flag("--overlap-param-gather", action="store_true",
         help="all-gather parameter buckets during the next forward (needs --use-distributed-optimizer)",
         group=PARALLEL),
    Flag("--tp-comm-overlap", action="store_true",
         help="overlap tensor-parallel communication with GEMMs (Transformer Engine userbuffers on GPUs)",
         group=PARALLEL),
    Flag("--cuda-graph-impl", choices=CUDA_GRAPH_IMPLS, default="none",
         help="capture kernels in CUDA graphs, replayed without the host launching each: transformer_engine "
              "(per-layer graphs of --cuda-graph-scope) or local (megatron-core's, and the whole iteration)",
         group=PARALLEL),
    Flag("--cuda-graph-scope", nargs="+", choices=CUDA_GRAPH_SCOPES, default=(),
         help="what a CUDA graph captures; default the whole transformer layer (Megatron-LM also has mamba, which "
              "labkit's models lack)", group=PARALLEL),
    Flag("--no-check-for-nan-in-loss-and-grad", action="store_false", dest="check_for_nan_in_loss_and_grad",
         help="do not stop on a NaN loss or gradient (Megatron-LM requires it of a whole-iteration CUDA graph, "
              "which cannot stop midway)", group=PARALLEL),
    Flag("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
         help="auto picks what megatron-core would (flash or fused with Transformer Engine); on GPUs without it, "
              "labkit's driver takes --sdpa-attention, on CPUs megatron-core's local attention", group=PARALLEL),
    Flag("--sdpa-attention", action="store_true", driver_only=True,
         help="labkit's driver only: attention's core through torch.nn.functional.scaled_dot_product_attention "
              "(flash or memory-efficient kernels on GPUs, math or flash on CPUs) in megatron-core's layers "
              "(labkit/train/attention.py); the default under --attention-backend auto on GPUs without Transformer "
              "Engine", group=PARALLEL),
    Flag("--distributed-backend", choices=("nccl", "gloo"),
         help="default: nccl with GPUs, gloo without", group=PARALLEL),
    Flag("--distributed-timeout-minutes", type=int, default=10,
         help="how long a collective may wait for the other ranks before the run fails (Megatron-LM's 10)",
         group=PARALLEL),
    Flag("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm",
         help="interleaved schedule: batch each step's pipeline sends and receives instead of overlapping them (needs "
              "--pipeline-model-parallel-size > 2)", group=PARALLEL),

    Flag("--no-masked-softmax-fusion", action="store_false", dest="masked_softmax_fusion",
         help="scale-mask-softmax in one kernel (needs Apex's or Megatron's scaled_masked_softmax_cuda)", group=FUSED),
    Flag("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion",
         help="bias + GeLU in one kernel (torch.compile on a GPU; needs biases)", group=FUSED),
    Flag("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion",
         help="bias + SwiGLU in one kernel (torch.compile on a GPU)", group=FUSED),
    Flag("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion",
         help="bias + dropout + residual add in one kernel (torch.compile on a GPU)", group=FUSED),
    Flag("--no-rope-fusion", action="store_false", dest="apply_rope_fusion",
         help="rotary embedding in one kernel (Transformer Engine)", group=FUSED),
    Flag("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion",
         help="weight gradients accumulated into the fp32 main gradient inside the GEMM (Transformer Engine, or Apex's "
              "fused_weight_gradient_mlp_cuda)", group=FUSED),

    Flag("--micro-batch-size", type=int, default=1, group=BATCH),
    Flag("--global-batch-size", type=int, help="default micro x data-parallel", group=BATCH),

    Flag("--fp16", action="store_true", group=PRECISION),
    Flag("--bf16", action="store_true", group=PRECISION),
    Flag("--grad-reduce-in-bf16", action="store_true",
         help="with --bf16: bf16 gradient buffers (else fp32)", group=PRECISION),
    Flag("--fp8-recipe", choices=("tensorwise", "delayed", "mxfp8", "blockwise"), default="delayed",
         help="how FP8 tensors are scaled; mxfp8 (32-element blocks) needs Blackwell", group=PRECISION),
    Flag("--fp8-param-gather", action="store_true",
         help="keep the linear layers' weights in FP8 and all-gather them so (with --fp8-format and the distributed "
              "optimizer or Megatron-FSDP)", group=PRECISION),
    Flag("--reuse-grad-buf-for-mxfp8-param-ag", action="store_true",
         help="with --fp8-param-gather under MXFP8: all-gather the bf16 weights in the gradient buffer",
         group=PRECISION),
    Flag("--fp4-format", choices=("e2m1",), help="FP4 GEMMs through Transformer Engine (with --bf16); needs Blackwell",
         group=PRECISION),
    Flag("--fp4-recipe", choices=("nvfp4",), default="nvfp4", help="NVFP4's 16-element block scaling",
         group=PRECISION),
    Flag("--fp8-format", choices=("hybrid", "e4m3"),
         help="FP8 GEMMs through Transformer Engine (with --bf16); needs FP8 tensor cores", group=PRECISION),
    Flag("--loss-scale", type=float, help="fixed fp16 loss scale (default: dynamic)", group=PRECISION),
    Flag("--initial-loss-scale", type=float, default=4294967296, group=PRECISION),
    Flag("--min-loss-scale", type=float, default=1.0, group=PRECISION),
    Flag("--loss-scale-window", type=int, default=1000, group=PRECISION),
    Flag("--hysteresis", type=int, default=2, group=PRECISION),

    Flag("--recompute-granularity", choices=("full", "selective"), group=RECOMPUTE),
    Flag("--recompute-method", choices=("uniform", "block"), group=RECOMPUTE),
    Flag("--recompute-num-layers", type=int, group=RECOMPUTE),
    Flag("--recompute-modules", nargs="+", choices=RECOMPUTE_MODULES,
         help="with --recompute-granularity selective: the modules recomputed (default core_attn)", group=RECOMPUTE),
    Flag("--recompute-activations", action="store_true",
         help="legacy spelling of selective recompute", group=RECOMPUTE),
    Flag("--checkpoint-activations", action="store_true", help="legacy spelling of full recompute", group=RECOMPUTE),
    Flag("--activations-checkpoint-method", choices=("uniform", "block"), group=RECOMPUTE, legacy=True),
    Flag("--activations-checkpoint-num-layers", type=int, default=1, group=RECOMPUTE, legacy=True),

    Flag("--optimizer", choices=("adam", "sgd"), default="adam", group=OPTIMIZER),
    Flag("--lr", type=float, required=True, group=OPTIMIZER),
    Flag("--min-lr", type=float, default=0.0, group=OPTIMIZER),
    Flag("--lr-decay-style", choices=("constant", "linear", "cosine"), default="linear", group=OPTIMIZER),
    Flag("--lr-decay-iters", type=int, help="default --train-iters", group=OPTIMIZER),
    Flag("--lr-warmup-fraction", type=float, group=OPTIMIZER),
    Flag("--lr-warmup-iters", type=int, default=0, group=OPTIMIZER),
    Flag("--weight-decay", type=float, default=0.01, group=OPTIMIZER),
    Flag("--clip-grad", type=float, default=1.0, group=OPTIMIZER),
    Flag("--adam-beta1", type=float, default=0.9, group=OPTIMIZER),
    Flag("--adam-beta2", type=float, default=0.999, group=OPTIMIZER),
    Flag("--adam-eps", type=float, default=1e-08, group=OPTIMIZER),
    Flag("--sgd-momentum", type=float, default=0.9, group=OPTIMIZER),
    Flag("--use-precision-aware-optimizer", action="store_true",
         help="Transformer Engine's FusedAdam keeps the master weights and Adam's moments in the dtypes below (with "
              "--use-distributed-optimizer; GPUs)", group=OPTIMIZER),
    Flag("--main-grads-dtype", choices=OPTIMIZER_DTYPES["main_grads_dtype"], default="fp32",
         help="the gradient buffer the precision-aware optimizer reads", group=OPTIMIZER),
    Flag("--main-params-dtype", choices=OPTIMIZER_DTYPES["main_params_dtype"], default="fp32",
         help="the precision-aware optimizer's master weights", group=OPTIMIZER),
    Flag("--exp-avg-dtype", choices=OPTIMIZER_DTYPES["exp_avg_dtype"], default="fp32",
         help="Adam's first moment as the precision-aware optimizer stores it", group=OPTIMIZER),
    Flag("--exp-avg-sq-dtype", choices=OPTIMIZER_DTYPES["exp_avg_sq_dtype"], default="fp32",
         help="Adam's second moment as the precision-aware optimizer stores it", group=OPTIMIZER),

    Flag("--train-iters", type=int, required=True, group=SCHEDULE),
    Flag("--log-interval", type=int, default=100, group=SCHEDULE),
    Flag("--eval-interval", type=int, default=1000, group=SCHEDULE),
    Flag("--eval-iters", type=int, default=100, group=SCHEDULE),
    Flag("--save", group=SCHEDULE),
    Flag("--dist-ckpt-optim-fully-reshardable", action="store_true",
         help="save the distributed optimizer's state reshardable under any layout (Megatron-LM's default ties it to "
              "the tensor/pipeline layout); labkit's driver always does",
         group=SCHEDULE),
    Flag("--ckpt-format", choices=("torch", "torch_dist", "torch_dcp", "fsdp_dtensor"),
         help="Megatron-LM's checkpoint format (default torch_dist; Megatron-FSDP saves only fsdp_dtensor); labkit's "
              "driver writes torch (its default) and torch_dist, which resumes under another tensor/pipeline layout",
         group=SCHEDULE),
    Flag("--save-interval", type=int, group=SCHEDULE),
    Flag("--load", group=SCHEDULE),
    Flag("--ckpt-step", type=int, help="load this iteration instead of the latest", group=SCHEDULE),
    Flag("--exit-signal-handler", action="store_true",
         help="on --exit-signal, save a checkpoint (with --save) at the end of the iteration and exit", group=SCHEDULE),
    Flag("--exit-signal", choices=("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"), default="SIGTERM", group=SCHEDULE),
    Flag("--seed", type=int, default=1234, group=SCHEDULE),

    Flag("--data-path", nargs="+",
         help="PREFIX (from `labkit data prepare`) or WEIGHT PREFIX WEIGHT PREFIX ... for a blend", group=DATA),
    Flag("--split", default="969,30,1", group=DATA),
    Flag("--data-cache-path", help="where dataset indices are cached (default: next to the data)", group=DATA),
    Flag("--mock-data", action="store_true", group=DATA),
    Flag("--tokenizer-type", choices=TOKENIZER_TYPES,
         help="default GPT2BPETokenizer, or NullTokenizer for --mock-data with --vocab-size", group=DATA),
    Flag("--tokenizer-model",
         help="HuggingFaceTokenizer: a tokenizer.json; SentencePieceTokenizer: a .model file", group=DATA),
    Flag("--vocab-file",
         help="default: the GPT-2 vocabulary shipped with labkit (labkit/data/tokenizer/vocab.json)", group=DATA),
    Flag("--merge-file",
         help="default: the GPT-2 merges shipped with labkit (labkit/data/tokenizer/merges.txt)", group=DATA),

    Flag("--log-throughput", action="store_true", group=LOGGING),
    Flag("--timing-log-level", type=int, choices=(0, 1, 2), default=0,
         help="0 (Megatron-LM's default): iteration time only; 1 adds the forward-backward and optimizer timers; 2 adds"
              " forward/backward compute, pipeline and all-reduce timers, at the price of device synchronisations and "
              "barriers in every iteration", group=LOGGING),
    Flag("--timing-log-option", choices=("minmax", "max", "all"), default="minmax", group=LOGGING),
    Flag("--tensorboard-dir", group=LOGGING),
    Flag("--tensorboard-log-interval", type=int, default=1, group=LOGGING),
    Flag("--log-timers-to-tensorboard", action="store_true", group=LOGGING),
    Flag("--log-memory-to-tensorboard", action="store_true", group=LOGGING),
    Flag("--log-validation-ppl-to-tensorboard", action="store_true", group=LOGGING),
    Flag("--wandb-project", help="log the TensorBoard scalars to this Weights & Biases project too (needs the wandb "
                                 "package; WANDB_MODE=offline keeps the run on disk); Megatron-LM logs its loss, "
                                 "learning rate and grad norm there only beside --tensorboard-dir", group=LOGGING),
    Flag("--wandb-exp-name", help="the W&B run's name", group=LOGGING),
    Flag("--wandb-save-dir", help="where W&B keeps its run files (default: --save's wandb/)", group=LOGGING),
    Flag("--profile", action="store_true",
         help="as Megatron-LM: on GPUs, the CUDA profiler's capture range (cudaProfilerStart/Stop) over the steps "
              "below, which `nsys profile --capture-range=cudaProfilerApi` and `ncu --profile-from-start off` record; "
              "with --use-pytorch-profiler, or on CPUs (no CUDA profiler), a torch.profiler trace", group=LOGGING),
    Flag("--use-pytorch-profiler", action="store_true",
         help="with --profile: a torch.profiler trace (into --tensorboard-dir) instead of the CUDA profiler's range",
         group=LOGGING),
    Flag("--profile-step-start", type=int, default=10,
         help="the range opens before this 0-based step (iteration N+1 of the log)", group=LOGGING),
    Flag("--profile-step-end", type=int, default=12, help="and closes after iteration N", group=LOGGING),
    Flag("--profile-ranks", type=int, default=[0], nargs="+", group=LOGGING),
)

FLAG = SimpleNamespace(**{flag.key: flag for flag in FLAGS})
"""Each flag by its name in snake case: FLAG.num_layers is the --num-layers Flag (str() gives the name)."""


class ArgumentError(Exception):
    """A flag that cannot be honoured; the message starts with the flag."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        if not self.exit_on_error:
            raise ArgumentError(message)
        self.print_usage()
        hint = " (labkit's driver does not support it; `python -m labkit.train --help` lists the flags it takes)" \
            if "unrecognized arguments" in message else ""
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


def build_parser() -> argparse.ArgumentParser:
    """The training driver's command line: every flag in FLAGS, in its --help section, and nothing else."""
    parser = _Parser(prog="python -m labkit.train", allow_abbrev=False,
                     usage="%(prog)s [Megatron-LM flags; --help lists them]",
                     description="Train a GPT with megatron-core (CPU/gloo or GPU/NCCL), logging like Megatron-LM.")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in FLAGS:
        group = groups.get(flag.group) or groups.setdefault(flag.group, parser.add_argument_group(flag.group))
        options = {"help": flag.help or None, "dest": flag.dest or flag.key}
        if flag.action:
            options["action"] = flag.action
        else:
            options.update(type=flag.type, choices=flag.choices, default=flag.default, nargs=flag.nargs,
                           required=flag.required)
        group.add_argument(flag.name, **{k: v for k, v in options.items() if v is not None})
    return parser


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

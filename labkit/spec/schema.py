"""The run spec's dataclasses: one description of a training run, with the figures derived from it.

Field names follow labkit's YAML keys; each field's docstring names the Megatron-LM flag it becomes (labkit.megatron_args
writes them). Build a spec from YAML, JSON or a mapping with `load_spec`, or in Python (`RunSpec(...)`) and pass it to
`load_spec` to fill presets and check it; `replace` makes a checked copy with changes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import PurePosixPath

import yaml

from labkit.megatron import sizes
from labkit.spec import checks, layout
from labkit.spec.load import DEFAULT_PRESET, build, read_source, to_plain, with_changes


@dataclass
class ModelSpec:
    """The model's shape. A preset fills every field the spec does not set; a field the spec sets wins, whatever its
    value. null (None) means not set, in YAML as in a Python-built ModelSpec: the preset's value stands."""
    preset: str | None = None
    """A model preset from labkit/data/models.yaml (tiny, gpt2-xl, llama2-7b, ...)."""
    num_layers: int | None = None
    """Transformer layers (--num-layers)."""
    hidden_size: int | None = None
    """Hidden size h (--hidden-size)."""
    num_attention_heads: int | None = None
    """Attention heads (--num-attention-heads)."""
    num_query_groups: int | None = None
    """Key/value head groups for grouped-query attention (--num-query-groups); None: one per head."""
    ffn_hidden_size: int | None = None
    """MLP hidden size (--ffn-hidden-size); None: Megatron-LM's default, 4 x hidden_size, or with swiglu 8/3 x
    hidden_size rounded down to a multiple of 64 (labkit.megatron.sizes.ffn_hidden_size)."""
    seq_length: int | None = None
    """Sequence length in tokens (--seq-length, and --max-position-embeddings)."""
    vocab_size: int | None = None
    """Vocabulary size of the mock data and the embedding (--vocab-size)."""
    swiglu: bool | None = None
    """SwiGLU MLP instead of GELU (--swiglu); None: the preset's choice, else false."""
    untie_embeddings: bool | None = None
    """Separate output-layer weights (--untie-embeddings-and-output-weights); None: the preset's choice, else false."""
    normalization: str | None = None
    """LayerNorm or RMSNorm (--normalization); None: the preset's choice, else LayerNorm."""
    position_embedding_type: str | None = None
    """learned_absolute (a learned position table), rope (rotary positions) or none (--position-embedding-type);
    None: the preset's choice, else learned_absolute."""
    rotary_base: int | None = None
    """Base of the rotary frequencies, with position_embedding_type rope only (--rotary-base); None: the preset's
    choice, else 10000 under rope (Llama 3 uses 500000)."""
    add_bias_linear: bool | None = None
    """Biases in the linear layers (false: --disable-bias-linear); None: the preset's choice, else true."""
    make_vocab_size_divisible_by: int | None = None
    """Megatron pads the vocabulary to a multiple of this times the tensor size (--make-vocab-size-divisible-by);
    None: the preset's choice, else 128."""
    hidden_dropout: float | None = None
    """Dropout after attention and MLP (--hidden-dropout); None: the preset's choice, else Megatron-LM's 0.1."""
    attention_dropout: float | None = None
    """Dropout of the attention probabilities (--attention-dropout); None: the preset's choice, else 0.1."""
    kv_channels: int | None = None
    """Width of one attention head (--kv-channels); None: the preset's choice, else hidden_size /
    num_attention_heads. Qwen3 sets it apart: 32 heads of 128 over a hidden size of 2048."""
    qk_layernorm: bool | None = None
    """Normalise queries and keys per head before attention (--qk-layernorm); None: the preset's choice, else false."""
    num_experts: int | None = None
    """Routed experts in each MoE layer (--num-experts); None: the preset's choice, else a dense model. A
    mixture-of-experts layer replaces the MLP by this many expert MLPs and a router (Shazeer et al. 2017, GShard:
    arXiv:2006.16668); megatron-core's MoE layer, docs at megatron/core/transformer/moe/README.md."""
    moe_router_topk: int | None = None
    """Experts each token is routed to (--moe-router-topk); None: the preset's choice, else Megatron's 2."""
    moe_ffn_hidden_size: int | None = None
    """MLP width of one expert (--moe-ffn-hidden-size); None: the preset's choice, else ffn_hidden_size."""
    moe_shared_expert_intermediate_size: int | None = None
    """MLP width of the shared experts every token passes through, their count times each one's width
    (--moe-shared-expert-intermediate-size; DeepSeekMoE: arXiv:2401.06066); None: the preset's choice, else none."""
    moe_layer_freq: str | None = None
    """Which layers are MoE (--moe-layer-freq): N, one MoE layer in every N (layer i is MoE when i % N == 0), or a
    pattern with one entry per layer, 1 for MoE and 0 for dense, such as "([0]*1+[1]*27)"; None: the preset's choice,
    else every layer. Kept as written."""
    moe_router_load_balancing_type: str | None = None
    """aux_loss (GShard's, per micro-batch), seq_aux_loss (per sequence, DeepSeek-V2), global_aux_loss, sinkhorn or
    none (--moe-router-load-balancing-type); None: the preset's choice, else aux_loss."""
    moe_aux_loss_coeff: float | None = None
    """Weight of the load-balancing loss added to the language-model loss (--moe-aux-loss-coeff); None: the
    preset's choice, else 0 (Megatron's default; 1e-2 is the usual start)."""
    moe_token_dispatcher_type: str | None = None
    """How tokens reach the ranks of their experts (--moe-token-dispatcher-type): allgather, alltoall or flex
    (DeepEP/HybridEP, GPUs only); None: the preset's choice, else allgather. The flex dispatcher sends a token once
    to each rank holding some of its experts, and once over the network to each other node (DeepEP) or NVLink domain
    (HybridEP), fanning it out there over NVLink; the alltoall sends one copy per expert
    (labkit.estimate.topology.Topology.alltoall_gbps)."""
    moe_flex_dispatcher_backend: str | None = None
    """The flex dispatcher's kernels (--moe-flex-dispatcher-backend): deepep or hybridep (NVIDIA's Megatron-Bridge
    recipes run hybridep); only with moe_token_dispatcher_type flex. None: megatron-core's default, deepep. DeepEP
    forwards over NVLink inside a node only, so that on a multi-node NVLink rack (GB200, GB300 NVL72) its tokens
    cross trays over the network; HybridEP uses the rack's NVLink."""
    moe_grouped_gemm: bool | None = None
    """Run a rank's experts as one grouped GEMM (--moe-grouped-gemm; GPUs only); None: the preset's choice, else
    false."""

    @property
    def moe(self) -> bool:
        """A mixture-of-experts model."""
        return bool(self.num_experts)

    @property
    def query_groups(self) -> int:
        """Key/value groups in effect: num_query_groups, or one per head."""
        return sizes.query_groups(self.num_attention_heads, self.num_query_groups)

    @property
    def ffn_size(self) -> int:
        """MLP hidden size in effect: ffn_hidden_size, or Megatron-LM's default for the MLP (4h, or about 8h/3 with
        SwiGLU)."""
        return sizes.ffn_hidden_size(self.hidden_size, bool(self.swiglu), self.ffn_hidden_size)


@dataclass
class ParallelSpec:
    """How the model is split over ranks (labkit.spec.layout places the ranks)."""
    tensor: int = 1
    """Tensor-parallel size (--tensor-model-parallel-size)."""
    pipeline: int = 1
    """Pipeline-parallel size (--pipeline-model-parallel-size); must divide model.num_layers unless `partition`,
    `pipeline_layout` or an account_for key sets the split."""
    data: int | None = None
    """Data-parallel size; None: the rest of the world size (Megatron derives it the same way)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank for the interleaved schedule (--num-layers-per-virtual-pipeline-stage); with
    `pipeline_layout`, its stage count over `pipeline`."""
    partition: list[int] | None = None
    """Transformer layers per pipeline stage, e.g. [0, 11, 8, 8, 8, 8, 5, 0] (--pipeline-model-parallel-layout);
    None: the even split. Not interleaved: for uneven model chunks write `pipeline_layout`."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as one more layer when the layers split evenly over pipeline x virtual_stages chunks: the
    first stage's first chunk holds one transformer layer fewer (--account-for-embedding-in-pipeline-split)."""
    account_for_loss_in_pipeline_split: bool = False
    """Count the loss (with the output layer) as one more layer in the split: the last stage's last chunk holds one
    transformer layer fewer (--account-for-loss-in-pipeline-split). With both keys Llama 3.1 405B's 126 layers split
    as 128 over 16 stages x 8 chunks."""
    pipeline_layout: str | None = None
    """The layers of every (virtual) stage, Megatron-LM's --pipeline-model-parallel-layout, e.g. "Et*3|t*4|t*4|t*3,L":
    stages split by "|", E the embedding, t a transformer layer, L the loss, x*n and (...)*n repeat; the first
    pipeline x 1 stages are every rank's first chunk, the next its second, and so on. None: the even split."""
    sequence_parallel: bool = False
    """Split layer-norm and dropout activations over tensor ranks (--sequence-parallel)."""
    context: int = 1
    """Context-parallel size (--context-parallel-size): each sequence split over this many ranks, which pass their
    keys and values round a ring in every attention layer; world = tensor x context x data x pipeline. Needs
    Transformer Engine on GPUs."""
    expert: int = 1
    """Expert-parallel size (--expert-model-parallel-size): each MoE layer's experts split over this many ranks, which
    exchange tokens before and after the experts. The expert layers fold their own grid over the same ranks:
    expert_tensor x expert x expert-data x pipeline = world, so expert_tensor x expert divides tensor x context x
    data."""
    expert_tensor: int | None = None
    """Tensor-parallel size inside each expert (--expert-tensor-parallel-size); None: parallel.tensor, as Megatron-LM
    defaults it. 1 keeps every expert whole, as most MoE recipes do."""


@dataclass
class KernelsSpec:
    """Which kernels and overlaps megatron-core uses (Megatron-LM's flags); they change time and memory, not the
    model."""
    attention_backend: str = "auto"
    """auto, flash, fused, unfused, local (--attention-backend) or sdpa. auto is what megatron-core picks with
    Transformer Engine on that GPU (flash or fused attention, which never keep the s x s scores), and on labkit's
    driver without Transformer Engine on GPUs sdpa; unfused and local reproduce the 2021-22 stack, which keeps them
    (on CPUs auto is local). sdpa is labkit's driver's own (--sdpa-attention, refused under job.entrypoint
    megatron-lm): attention's core through PyTorch's scaled_dot_product_attention in megatron-core's layers
    (labkit/train/attention.py), flash or memory-efficient kernels on GPUs."""
    overlap_grad_reduce: bool = False
    """Reduce gradient buckets while the backward pass goes on (--overlap-grad-reduce)."""
    overlap_param_gather: bool = False
    """All-gather the distributed optimizer's parameter shards during the next forward (--overlap-param-gather);
    needs optimizer.distributed."""
    tp_comm_overlap: bool = False
    """Overlap tensor-parallel all-gathers and reduce-scatters with the GEMMs (--tp-comm-overlap); needs sequence
    parallelism and Transformer Engine on GPUs."""
    overlap_moe_expert_parallel_comm: bool = False
    """Hide a mixture-of-experts model's token all-to-all behind another micro-batch's compute
    (--overlap-moe-expert-parallel-comm): megatron-core's combined 1F1B schedule runs one micro-batch's forward beside
    the previous one's backward, each one's dispatch and combine under the other's GEMMs. Needs parallel.expert > 1,
    the alltoall or flex dispatcher, no full recompute, and with a pipeline the interleaved schedule; Megatron-LM
    only (labkit's driver runs the plain 1F1B schedule)."""
    cuda_graph_impl: str = "none"
    """Capture kernels in CUDA graphs, replayed without the host launching each kernel (--cuda-graph-impl): none,
    transformer_engine (Transformer Engine's graphs of each layer's `cuda_graph_scope`) or local (megatron-core's own,
    the only one that captures the whole iteration). A graph replays with the host idle: the estimate drops the host's
    launch cost that an MoE layer pays per expert when the whole iteration is captured. Megatron-LM only (labkit's
    driver captures no graph)."""
    cuda_graph_scope: list[str] | None = None
    """What each graph captures (--cuda-graph-scope): attn, mlp (a dense layer's MLP), moe (an MoE layer's MLP side,
    drop-and-pad MoE only), moe_router (the router and shared experts), moe_preprocess (the dispatch's preprocessing,
    with moe_router) or full_iteration (the whole forward and backward of a step, cuda_graph_impl local); None: the
    whole transformer layer. A whole-iteration graph cannot stop midway, so with it labkit renders
    --no-check-for-nan-in-loss-and-grad as Megatron-LM requires (and, with expert parallelism,
    --moe-pad-experts-for-cuda-graph-inference, which changes inference only). NVIDIA's Megatron-Bridge recipes graph
    [moe_router, moe_preprocess] (with attn on GB200) and, from release 26.06, Qwen3 30B-A3B's whole iteration."""
    stack: str | None = None
    """The training software the estimate charges for: a stack of labkit/data/calibration.yaml (megatron-core;
    megatron-bridge for NVIDIA Megatron-Bridge's tuned 2025-26 recipes, which ran faster than the default's constants
    predict; pytorch-native for PyTorch's own stack as torchtitan-style trainers run it, FSDP2 and DTensor tensor
    parallelism under torch.compile; or deepspeed-megatron-2020 for DeepSpeed's pipeline engine on Megatron-LM
    v1.1.5, as MT-NLG and AMP ran); None: the calibration's default_stack (megatron-core). It changes the estimate
    only: no Megatron-LM flag."""


@dataclass
class BatchSpec:
    """Sequences per step."""
    micro: int = 1
    """Sequences per micro-batch on one data-parallel rank (--micro-batch-size)."""
    global_: int = 8
    """Sequences per optimizer step, YAML key `global` (--global-batch-size)."""


@dataclass
class RecomputeSpec:
    """Activation recomputation (absent, or `recompute: none`, to keep every activation)."""
    granularity: str = "full"
    """full (whole layers) or selective (the modules in `modules`, attention's core by default)
    (--recompute-granularity)."""
    method: str | None = "uniform"
    """uniform or block, with granularity full (--recompute-method)."""
    num_layers: int = 1
    """Layers per recomputed chunk (uniform) or recomputed per stage (block) (--recompute-num-layers)."""
    modules: list[str] | None = None
    """With granularity selective, the modules each layer recomputes in its backward pass instead of keeping their
    activations (--recompute-modules): core_attn (attention's scores and softmax), mlp (the dense MLP), layernorm
    (the two norms), moe (the whole MoE layer), moe_act (its experts' activation function, with grouped GEMM),
    shared_experts; None: megatron-core's default, core_attn."""


@dataclass
class OptimizerSpec:
    """The optimizer and its learning-rate schedule."""
    name: str = "adam"
    """adam or sgd (--optimizer)."""
    distributed: bool = False
    """Shard optimizer state over data-parallel ranks (--use-distributed-optimizer): ZeRO stage 1's other spelling,
    true exactly when zero_stage is 1 or more (a spec may write either, or both when they agree)."""
    zero_stage: int = 0
    """What the data-parallel ranks shard (ZeRO, Rajbhandari et al. arXiv:1910.02054): 0 nothing, 1 optimizer states,
    2 and gradients, 3 and parameters. With zero_backend megatron: 1 is megatron-core's distributed optimizer; 2 and
    3 are Megatron-FSDP under job.entrypoint megatron-lm (--use-megatron-fsdp --data-parallel-sharding-strategy
    optim_grads / optim_grads_params) and PyTorch FSDP2 through megatron-core on labkit's driver (--use-torch-fsdp2:
    Megatron-FSDP needs CUDA streams). The estimate counts Megatron-FSDP's working buffers either way."""
    zero_backend: str = "megatron"
    """megatron (megatron-core's distributed optimizer and Megatron-FSDP) or deepspeed (DeepSpeed's ZeRO engine, as
    Megatron-DeepSpeed runs it: labkit's driver wraps the GPT with deepspeed.initialize and the job writes the
    ds_config.json it reads; tensor and pipeline size 1): which implementation shards, and so what the estimate
    counts."""
    lr: float = 1.5e-4
    """Peak learning rate (--lr); above 0 and at most 1."""
    min_lr: float = 1.0e-5
    """Learning rate at the end of the decay (--min-lr)."""
    lr_decay_style: str = "cosine"
    """constant, linear or cosine (--lr-decay-style)."""
    lr_warmup_fraction: float = 0.01
    """Fraction of the iterations spent warming up (--lr-warmup-fraction)."""
    weight_decay: float = 0.01
    """Weight decay (--weight-decay)."""
    clip_grad: float = 1.0
    """Gradient-norm clipping (--clip-grad)."""
    adam_beta1: float = 0.9
    """Adam's beta1 (--adam-beta1)."""
    adam_beta2: float = 0.95
    """Adam's beta2 (--adam-beta2)."""
    initial_loss_scale: float = 4294967296.0
    """First dynamic fp16 loss scale, 2**32 as Megatron's default (--initial-loss-scale)."""
    loss_scale: float | None = None
    """A fixed fp16 loss scale instead of the dynamic one (--loss-scale)."""
    grad_reduce_in_bf16: bool = False
    """Keep and reduce gradients in bf16 rather than fp32 (--grad-reduce-in-bf16; precision bf16, fp8, mxfp8 or
    nvfp4, all of which train under --bf16): half the gradient buffer and its data-parallel traffic, while the
    optimizer step makes fp32 copies of its shard."""
    fp8_param_gather: bool | None = None
    """Keep the linear layers' weights in FP8 (--fp8-param-gather; precision fp8 or mxfp8, with the distributed
    optimizer or Megatron-FSDP): the optimizer's fp32 master weights are cast to FP8 after each step, and no bf16
    copy is kept beside Transformer Engine's FP8 one (1 byte a weight on Blackwell, 2 with Hopper's transpose, about
    2 under MXFP8's two block layouts, against 2 + those bytes without it). FP8 weights are all-gathered in FP8;
    under mxfp8 with the distributed optimizer the bf16 values are gathered in the gradient buffer and quantized
    after (--reuse-grad-buf-for-mxfp8-param-ag, which it also renders, as NVIDIA's recipes pair them). None: on
    wherever Megatron-LM runs it and the precision-aware optimizer is off, as NVIDIA's FP8 and MXFP8 recipes set it
    (labkit.megatron.sharding.fp8_param_gather); false keeps bf16 weights with Transformer Engine's cached FP8
    copies."""
    precision_aware: bool = False
    """Megatron's precision-aware optimizer (--use-precision-aware-optimizer): Transformer Engine's FusedAdam keeps
    the master weights and Adam's moments in the four dtypes below, and steps on the gradient buffer itself (no fp32
    copies). Adam with the distributed optimizer, on GPUs with Transformer Engine. Megatron's MoE recipes store the
    moments in bf16 this way, 4 bytes per parameter instead of 8, before sharding."""
    main_grads_dtype: str = "fp32"
    """fp32 or bf16 (--main-grads-dtype; with precision_aware and a precision under --bf16): the gradient buffer the
    optimizer reads; bf16 halves it and its data-parallel traffic, as grad_reduce_in_bf16 does."""
    main_params_dtype: str = "fp32"
    """fp32 or fp16 (--main-params-dtype; with precision_aware): the master weights. fp32 beside bf16 weights is kept
    as the 16 bits bf16 lacks (Transformer Engine's store_param_remainders, on by default): 2 bytes a parameter."""
    exp_avg_dtype: str = "fp32"
    """fp32, fp16, bf16 or fp8 (--exp-avg-dtype; with precision_aware): Adam's first moment as stored; the kernel
    computes in fp32."""
    exp_avg_sq_dtype: str = "fp32"
    """fp32, fp16, bf16 or fp8 (--exp-avg-sq-dtype; with precision_aware): Adam's second moment as stored."""

    @property
    def bf16_gradients(self) -> bool:
        """The gradient buffer is bf16 (with training under --bf16): grad_reduce_in_bf16, or the precision-aware
        optimizer's main_grads_dtype bf16."""
        return self.grad_reduce_in_bf16 or (self.precision_aware and self.main_grads_dtype == "bf16")


@dataclass
class WandbSpec:
    """A Weights & Biases run beside the log (the `wandb` package: pip install 'labkit[tracking]'). Set WANDB_MODE=offline
    (job.env) to keep it on disk and `wandb sync` it later."""
    project: str = ""
    """The W&B project (--wandb-project); required."""
    exp_name: str | None = None
    """The W&B run's name (--wandb-exp-name); None: the spec's name."""
    save_dir: str | None = None
    """Where W&B writes its run files (--wandb-save-dir), relative to the run directory unless absolute; None:
    train.save's wandb/ (Megatron-LM's default), or wandb/ without train.save."""


@dataclass
class TrainSpec:
    """How long to train, and checkpoints."""
    iters: int = 50
    """Optimizer steps (--train-iters)."""
    log_interval: int = 10
    """Steps between log lines (--log-interval); at most train.iters, or no iteration is logged."""
    eval_interval: int | None = None
    """Steps between evaluations (--eval-interval); None: no evaluation."""
    eval_iters: int = 0
    """Batches per evaluation (--eval-iters)."""
    seed: int = 1234
    """Random seed (--seed)."""
    save: str | None = None
    """Checkpoint directory to write (--save)."""
    load: str | None = None
    """Checkpoint directory to resume from (--load)."""
    save_interval: int | None = None
    """Steps between checkpoints (--save-interval)."""
    ckpt_format: str | None = None
    """Checkpoint format (--ckpt-format): torch (Megatron-LM's legacy per-rank files, resumed only under the same
    tensor/pipeline layout) or torch_dist (megatron-core's distributed checkpoints, resumable under another layout:
    the distributed optimizer's state is saved fully reshardable, which labkit's driver always does and Megatron-LM
    is told with --dist-ckpt-optim-fully-reshardable); None: each entrypoint's default, torch on labkit's driver and
    torch_dist on Megatron-LM."""
    timing_log_level: int = 0
    """Megatron's timers in the log (--timing-log-level): 0 (Megatron-LM's default) the iteration time only; 1 adds
    forward-backward and optimizer; 2 adds forward/backward compute, pipeline and all-reduce timers, paid for with
    device synchronisations and barriers in every iteration (on a GPU it slows the run it measures)."""
    tensorboard_dir: str | None = None
    """TensorBoard event files (--tensorboard-dir, with --log-timers-to-tensorboard so iteration time and throughput
    are there too), relative to the run directory unless absolute; None: none, or tensorboard/ with train.wandb
    (Megatron-LM's training_log sends loss, learning rate and grad norm to W&B only where it has a TensorBoard
    writer)."""
    wandb: WandbSpec | None = None
    """Log the same scalars to Weights & Biases (--wandb-project, --wandb-exp-name, --wandb-save-dir); None: no W&B."""


@dataclass
class TokenizerSpec:
    """The tokenizer that made the dataset, as Megatron-LM names it."""
    type: str = "GPT2BPETokenizer"
    """GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer or NullTokenizer (--tokenizer-type)."""
    model: str | None = None
    """The tokenizer file: a HuggingFace tokenizer.json or a SentencePiece .model (--tokenizer-model); None with
    GPT2BPETokenizer (which reads data.vocab_file and data.merge_file) and NullTokenizer."""


@dataclass
class DataSpec:
    """Training data: mock tokens, or a Megatron-format dataset."""
    path: str | None = None
    """Dataset prefix of the .bin/.idx pair (--data-path)."""
    mock: bool | None = None
    """Random tokens instead of a dataset (--mock-data); None: mock tokens when data.path is not given; false needs
    data.path."""
    split: str = "90,5,5"
    """Train, validation and test shares (--split): up to three numbers separated by commas, with a positive sum."""
    vocab_file: str | None = None
    """GPT-2 BPE vocabulary (--vocab-file); None: the one shipped in labkit/data/tokenizer."""
    merge_file: str | None = None
    """GPT-2 BPE merges (--merge-file); None: the one shipped in labkit/data/tokenizer."""
    tokenizer: TokenizerSpec | None = None
    """The tokenizer (--tokenizer-type, --tokenizer-model); None: GPT-2 BPE. The model's vocabulary comes from it
    unless model.vocab_size is set."""


@dataclass
class NodeGroup:
    """Nodes of one kind; ranks fill the groups in the order listed."""
    gpu: str = "cpu"
    """GPU type, a catalog name or a vendor spelling (A100-SXM4-40GB); cpu for CPU processes."""
    count: int = 1
    """Number of such nodes."""
    gpus_per_node: int = 1
    """GPUs (processes) per node (torchrun --nproc-per-node)."""
    inter_node_gbps: float | None = None
    """Network link rate in Gbit/s; None: the cluster's, else the GPU catalog's."""
    constraint: str | None = None
    """Slurm node features this group needs (--constraint), e.g. a100-80gb when the GPU family's gres type covers
    several memory sizes."""
    gres: str | None = None
    """The group's generic resources as the cluster names them (--gres, e.g. gpu:a100_80g:8); None: gpu:FAMILY:N."""
    price_per_gpu_hour: float | None = None
    """What one of these GPUs costs per hour, in USD (the planner's cost); None: the catalog's cloud price."""
    intra_node_gbps: float | None = None
    """Link rate between GPUs of one node in Gbit/s; None: the cluster's, else the GPU catalog's."""
    cpus_per_node: int | None = None
    """CPUs of one node as Slurm counts them; the default job.cpus_per_task (one torchrun task per node gets them
    all). None: unknown; a Slurm job then needs job.cpus_per_task or job.exclusive when the group runs several
    processes per node, which Slurm's default of one CPU per task would leave sharing one CPU."""


@dataclass
class ClusterSpec:
    """The machines: node groups, or a named cluster from labkit/data/clusters.yaml."""
    nodes: list[NodeGroup] = field(default_factory=list)
    """Node groups in placement order."""
    inter_node_gbps: float | None = None
    """Network link rate in Gbit/s for every group that names none."""
    intra_node_gbps: float | None = None
    """Intra-node link rate in Gbit/s for every group that names none."""
    login: str | None = None
    """The cluster's login node as user@host (or a Host of your ~/.ssh/config): the Slurm backend sends the job there
    and runs sbatch, squeue, sacct and scancel over ssh, with your own ssh config and agent (labkit.jobs.remote);
    None: Slurm runs on this host."""
    remote_dir: str | None = None
    """With login: where run directories go on the cluster, absolute or under your home there; None: labkit-runs."""


@dataclass
class ContainerSpec:
    """The container each task runs in (labkit/spec/containers.py says which images each runtime takes)."""
    image: str | None = None
    """pyxis and enroot: a registry image (nvcr.io#nvidia/pytorch:24.01-py3) or a .sqsh file; apptainer: a .sif file
    or a docker://, oras:// or library:// reference; slurm: the path of an OCI bundle directory on every node. A file
    under job.cluster_paths is looked for when the job starts."""
    mounts: list[str] = field(default_factory=list)
    """SRC:DST[:FLAGS] mounts (apptainer: FLAGS ro or rw); the run's log directory is added. With runtime slurm the
    bundle's config.json lists the mounts, the log directory's too, and this stays empty."""
    runtime: str = "pyxis"
    """pyxis (srun --container-image), enroot (enroot create/start, as aws-samples/awsome-distributed-training does),
    apptainer (apptainer exec --nv in each task, https://apptainer.org/docs/user/main/gpu.html) or slurm (Slurm's own
    srun --container, 23.02+, https://slurm.schedmd.com/containers.html)."""


@dataclass
class K8sVolume:
    """A volume every pod of a Kubernetes job mounts: a PersistentVolumeClaim or a directory of the node."""
    name: str = ""
    """The volume's name in the pod, a DNS label (lower-case letters, digits and '-', at most 63)."""
    mount_path: str = ""
    """Where the training container sees it, an absolute path."""
    pvc: str | None = None
    """The PersistentVolumeClaim to mount (in the job's namespace); give this or host_path."""
    host_path: str | None = None
    """A directory of the node to mount (the same on every node, as a shared filesystem's mount); give this or pvc."""
    read_only: bool = False
    """Mount it read-only."""


@dataclass
class K8sSpec:
    """How a run is written for Kubernetes (--backend k8s); the other backends ignore it."""
    kind: str = "TrainJob"
    """TrainJob (Kubeflow Trainer v2, trainer.kubeflow.org/v1alpha1) or PyTorchJob (the training operator v1's
    kubeflow.org/v1)."""
    runtime: str = "torch-distributed"
    """With kind TrainJob: the ClusterTrainingRuntime the TrainJob refers to (Kubeflow Trainer installs
    torch-distributed)."""
    volumes: list[K8sVolume] = field(default_factory=list)
    """Volumes every pod mounts, each {name, mount_path, pvc} or {name, mount_path, host_path}; job.container.mounts
    add hostPath volumes of their own."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """Node labels a pod's node must carry (the pod's nodeSelector), e.g. node.kubernetes.io/instance-type:
    p5.48xlarge."""
    tolerations: list[dict] = field(default_factory=list)
    """Kubernetes toleration objects ({key, operator, value, effect, tolerationSeconds}) letting the pods onto tainted
    nodes, e.g. {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}."""
    image_pull_secrets: list[str] = field(default_factory=list)
    """Names of the Secrets the kubelet pulls job.container.image with (the pod's imagePullSecrets)."""
    queue: str | None = None
    """A Kueue LocalQueue: the job carries the label kueue.x-k8s.io/queue-name and Kueue admits all of its pods at
    once, when the queue's quota holds them (gang scheduling); None: the cluster's scheduler places each pod."""
    devices: dict[str, int] = field(default_factory=dict)
    """Devices each pod asks for besides its GPUs, resource name -> count (e.g. vpc.amazonaws.com/efa: 16); they
    override the counts job.env_preset asks for (labkit/data/clusters.yaml, env_presets.NAME.k8s.devices)."""
    patch: dict | None = None
    """A patch laid over the rendered manifest last, written as the manifest is: a mapping merges into the mapping it
    names, key by key; null deletes the key; a list whose items all have a name (containers, env, volumes,
    volumeMounts, replicatedJobs) or all a manager (a TrainJob's runtimePatches) merges item by item with the items
    of the same name or manager, appending new ones, as Kubernetes' strategic merge patch does; any other list
    (command, args, tolerations) replaces the list."""

    def __post_init__(self):
        self.tolerations, self.patch = _plain_data(self.tolerations), _plain_data(self.patch)


def _plain_data(value):
    """Data as written in a manifest: a number read from a spec file forgets the text it was written as (only plain
    numbers are written back to YAML)."""
    if isinstance(value, dict):
        return {_plain_data(key): _plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain_data(item) for item in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    return float(value) if isinstance(value, float) else value


@dataclass
class JobSpec:
    """How the job is placed on a scheduler; the local backend ignores what has no meaning there."""
    partition: str | None = None
    """Slurm partition (--partition)."""
    account: str | None = None
    """Slurm account (--account)."""
    time_limit: str | None = None
    """Slurm time limit (--time): minutes, H:MM:SS, D-HH or UNLIMITED."""
    cpus_per_task: int | None = None
    """CPUs per task (--cpus-per-task); None: each node group's cpus_per_node divided by the one torchrun task that
    runs on each node; where a group does not say how many CPUs it has, every CPU with job.exclusive, else Slurm's
    own default of one CPU, accepted only for a group of one process per node."""
    exclusive: bool = False
    """Whole nodes only (--exclusive)."""
    mem: str | None = None
    """Memory per node in Slurm's form (--mem): 0 (all of it), or a number with an optional K, M, G or T."""
    gpus_per_node_flag: str = "gres"
    """How GPUs are requested: gres (--gres=gpu:TYPE:N) or gpus-per-node (--gpus-per-node=TYPE:N)."""
    sbatch: list[str] = field(default_factory=list)
    """Extra #SBATCH options as written, each starting with -- (e.g. --qos=high, --reservation=r1)."""
    rendezvous: str = "static"
    """How torchrun's nodes meet: static (--master_addr, --node_rank) or c10d (--rdzv-backend c10d, ranks assigned
    at start, as on clusters that restart nodes)."""
    env_preset: str | None = None
    """A named set of NCCL / EFA / InfiniBand variables from labkit/data/clusters.yaml (env_presets); job.env wins
    over it."""
    entrypoint: str = "labkit"
    """What torchrun starts: labkit (python -m labkit.train) or megatron-lm (job.megatron_lm/pretrain_gpt.py, with
    the same flags)."""
    megatron_lm: str | None = None
    """With entrypoint megatron-lm: the Megatron-LM checkout (the container's copy, e.g. /workspace/megatron-lm, or a
    path on the nodes) whose pretrain_gpt.py runs."""
    container: ContainerSpec | None = None
    """Run inside a container; None: on the host."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables set for training."""
    extra_args: list[str] = field(default_factory=list)
    """Flags appended to the training command as written."""
    master_port: int | None = None
    """torchrun's rendezvous port; None: one derived from the job id, so jobs sharing a node do not collide."""
    gpu_monitor_interval_s: int = 10
    """Seconds between GPU utilisation samples."""
    requeue: bool | None = None
    """true: the job may be requeued (#SBATCH --requeue), warns itself before its time limit, saves a checkpoint
    (train.save) at the end of the iteration, requeues itself and resumes from the latest checkpoint on its next
    attempt; false: never requeued (--no-requeue); None: the cluster's default (JobRequeue), with nothing to resume
    from."""
    requeue_signal_s: int = 120
    """With requeue: seconds before the time limit at which Slurm signals the batch script (--signal=B:USR1@N),
    which passes the signal on to the training processes and requeues the job once they have saved and exited; leave
    time for one iteration and a checkpoint."""
    cluster_paths: list[str] = field(default_factory=list)
    """Absolute prefixes of paths that exist only on the cluster (e.g. /fsx, /lustre/datasets): a dataset, tokenizer
    or container image under one is not looked for on the machine that validates the spec (`labkit validate` lists
    it as not checked there); the job script checks it when the job starts and stops naming the spec field."""
    k8s: K8sSpec = field(default_factory=K8sSpec)
    """With --backend k8s: the kind of job, volumes, node selection, tolerations, pull secrets, queue, devices and a
    patch of the manifest."""

    def on_cluster_only(self, path) -> bool:
        """Whether `path` lies under one of cluster_paths (whole path components: /fsx covers /fsx/a, not /fsx2)."""
        where = PurePosixPath(os.path.normpath(str(path)))
        return any(where.is_relative_to(os.path.normpath(prefix)) for prefix in self.cluster_paths if prefix)


@dataclass
class NsysSpec:
    """Nsight Systems over chosen ranks: the job starts each of those processes under `nsys profile
    --capture-range=cudaProfilerApi`, and the training program opens and closes the capture range around the steps
    (--profile --profile-step-start --profile-step-end --profile-ranks, as Megatron-LM). GPUs only."""
    ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks profiled, each its own report (--profile-ranks)."""
    start_step: int = 10
    """The range opens before this 0-based step, so iteration start_step + 1 of the log is the first captured
    (--profile-step-start; Megatron-LM's default)."""
    end_step: int = 12
    """The range closes after iteration end_step of the log (--profile-step-end); at most train.iters."""
    trace: list[str] = field(default_factory=lambda: ["cuda", "nvtx"])
    """What nsys traces (nsys profile --trace): the CUDA API and kernels, and NVTX ranges (the driver's forward,
    backward, optimizer and `iteration N`), as NVIDIA's NeMo guide profiles Megatron; add cublas, cudnn, osrt, ..."""
    extra_args: list[str] = field(default_factory=list)
    """More `nsys profile` options as written, e.g. ["--cuda-memory-usage=true", "--gpu-metrics-devices=all"];
    not the ones labkit sets (capture range, trace, output, export)."""


@dataclass
class NcuSpec:
    """Nsight Compute over chosen ranks: the job starts each of those processes under `ncu --profile-from-start off`,
    which measures the matching kernels inside the same capture range as profile.nsys (its steps, else
    Megatron-LM's default steps 10 to 12). GPUs only; a rank is under nsys or ncu, not both."""
    ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks measured, each its own report (--profile-ranks with profile.nsys.ranks)."""
    kernel_regex: str | None = None
    """Which kernels (ncu --kernel-name regex:...), e.g. "gemm|flash"; None: every kernel. ncu replays each kernel it
    measures, and an NCCL kernel replayed on one rank waits for peers that are not replaying it: in a world of more
    than one process, name kernels that are not NCCL's."""
    launch_count: int = 10
    """How many matching kernel launches are measured (ncu --launch-count): each one replays its kernel many times."""
    sections: list[str] = field(default_factory=list)
    """ncu's section identifiers (--section), e.g. ["SpeedOfLight", "MemoryWorkloadAnalysis"]; empty: ncu's default
    set."""


@dataclass
class ProfileSpec:
    """Nsight Systems and Nsight Compute captures of chosen ranks; reports go to the run's logs/nsys/ and logs/ncu/
    (rankN.nsys-rep with its rankN.sqlite export, rankN.ncu-rep). `labkit profile nsys logs/nsys` reads them."""
    nsys: NsysSpec | None = None
    """An Nsight Systems timeline of the chosen ranks; None: none."""
    ncu: NcuSpec | None = None
    """Nsight Compute kernel measurements of the chosen ranks; None: none."""
    output_dir: str | None = None
    """Where the nsys/ and ncu/ report directories go, an absolute path on the nodes; None: the run's logs/ (Slurm and
    local). A pod's files end with it, so on Kubernetes write a directory under a job.container.mounts destination."""


@dataclass
class RunSpec:
    """One training run."""
    name: str = "run"
    """The run's name: job name, run directory prefix."""
    model: ModelSpec = field(default_factory=lambda: ModelSpec(preset=DEFAULT_PRESET))
    """The model's shape."""
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    """Tensor, pipeline and data parallelism."""
    batch: BatchSpec = field(default_factory=BatchSpec)
    """Micro and global batch sizes."""
    precision: str = "fp32"
    """fp32, fp16 (--fp16), bf16 (--bf16) or fp8 (--bf16 --fp8-format hybrid: FP8 GEMMs, bf16 elsewhere; only on
    GPUs with FP8 tensor cores)."""
    recompute: RecomputeSpec | None = None
    """Activation recomputation; None: none."""
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    """Optimizer and learning-rate schedule."""
    train: TrainSpec = field(default_factory=TrainSpec)
    """Iterations, logging and checkpoints."""
    data: DataSpec = field(default_factory=DataSpec)
    """Training data."""
    cluster: ClusterSpec | None = None
    """The machines; None: one CPU host with exactly the processes the layout needs."""
    job: JobSpec = field(default_factory=JobSpec)
    """Scheduler options."""
    kernels: KernelsSpec = field(default_factory=KernelsSpec)
    """Attention kernels and communication overlap."""
    profile: ProfileSpec | None = None
    """Nsight Systems / Nsight Compute captures of chosen ranks; None: none."""

    # Derived figures.
    @property
    def world_size(self) -> int:
        return sum(g.count * g.gpus_per_node for g in self.cluster_or_default().nodes)

    @property
    def data_parallel(self) -> int:
        if self.parallel.data is not None:
            return self.parallel.data
        try:
            return sizes.data_parallel_size(self.world_size, self.parallel.tensor, self.parallel.context,
                                            self.parallel.pipeline)
        except sizes.SizeError:
            return 1  # a world the sizes do not divide: labkit.spec.checks reports it

    @property
    def num_micro_batches(self) -> int:
        return self.batch.global_ // (self.batch.micro * self.data_parallel)

    @property
    def layer_partition(self) -> list[int]:
        """Transformer layers per pipeline stage, all its model chunks together."""
        return [sum(chunks) for chunks in self.chunk_partition]

    @property
    def chunk_partition(self) -> list[list[int]]:
        """Transformer layers of each model chunk, [stage][chunk]: the partition (one chunk per stage), or as
        megatron-core splits them (labkit.megatron.sizes.chunk_layers; the checks require a split it accepts)."""
        par = self.parallel
        if par.partition:
            return [[n] for n in par.partition]
        return sizes.chunk_layers(self.model.num_layers, par.pipeline, par.virtual_stages,
                                  account_for_embedding=par.account_for_embedding_in_pipeline_split,
                                  account_for_loss=par.account_for_loss_in_pipeline_split, layout=par.pipeline_layout)

    @property
    def partition_string(self) -> str:
        """FASOP's PARTITION form (github AvatarHwang/FASOP), e.g. 0-11-8-8-8-8-5-0."""
        return "-".join(str(n) for n in self.layer_partition)

    @property
    def stage_gpus(self) -> list[str]:
        """Catalog GPU name of each pipeline stage; a stage on several types runs at its slowest (labkit.spec.layout)."""
        return layout.stage_gpus(self.cluster_or_default().nodes, layout.layout_of(self))

    def cluster_or_default(self) -> ClusterSpec:
        """The cluster, or one CPU host with exactly the processes the layout needs."""
        if self.cluster is not None and self.cluster.nodes:
            return self.cluster
        procs = self.parallel.tensor * self.parallel.context * self.parallel.pipeline * (self.parallel.data or 1)
        return ClusterSpec(nodes=[NodeGroup(gpu="cpu", count=1, gpus_per_node=procs)])

    def to_dict(self) -> dict:
        return to_plain(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, **changes) -> RunSpec:
        """A checked copy with dotted-path changes, e.g. spec.replace(precision="bf16", **{"batch.micro": 2}).

        Model fields this spec took from its preset, Megatron's defaults or its tokenizer are derived again for the
        copy: a new preset brings its own sizes, a new tokenizer its own vocabulary."""
        data = self.to_dict()
        for key in self.derived_model_keys:
            data["model"].pop(key, None)
        changed = {k.replace("__", ".") for k in changes}
        for one, other in (("zero_stage", "distributed"), ("distributed", "zero_stage")):
            if f"optimizer.{one}" in changed and f"optimizer.{other}" not in changed:
                data["optimizer"].pop(other)  # two spellings of one setting: a change to one follows in the other
        return load_spec(with_changes(data, **changes))

    @property
    def derived_model_keys(self) -> frozenset[str]:
        """The model keys the spec did not write (set by load_spec); empty for a spec built in Python and unchecked."""
        return getattr(self, "_derived_model_keys", frozenset())


def load_spec(source) -> RunSpec:
    """Read a spec (a YAML or JSON path, a mapping or a RunSpec) with its model preset merged under the values it sets,
    and check it. Raises SpecError with every problem, each naming its field and the fix.

    Taught in labs 00, 01, 02, 03, 04, 05, 06, 07, 08, 09 and 10.
    """
    data, errors, derived = read_source(source)
    spec = build(RunSpec, data, "", errors)
    errors += checks.validate(spec, raise_errors=False)
    if errors:
        raise checks.SpecError(errors)
    spec._derived_model_keys = derived
    return spec


def resolved_summary(spec: RunSpec) -> dict:
    """What `labkit validate` prints next to the spec: the figures derived from it."""
    return {
        "world_size": spec.world_size,
        "tensor": spec.parallel.tensor,
        "pipeline": spec.parallel.pipeline,
        "data": spec.data_parallel,
        "num_micro_batches": spec.num_micro_batches,
        "partition": spec.partition_string,
        "stage_gpus": spec.stage_gpus,
        "tokens_per_iteration": spec.batch.global_ * spec.model.seq_length,
    }

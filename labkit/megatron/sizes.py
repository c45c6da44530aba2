"""The sizes Megatron derives from the ones it is given, each written once.

The spec, the estimator, the driver, the diagrams and the trace reader all call these functions rather than repeat the
arithmetic, so that labkit's count of a model and Megatron's cannot drift apart. Each function names the place in
Megatron-LM (megatron/training/, tag core_v0.16.1) or megatron-core 0.16.1 (megatron/core/) whose rule it follows;
tests/test_megatron_sizes.py checks each against megatron-core's own objects where one exists.

Every function is pure integer arithmetic on sizes; a size that Megatron would refuse raises SizeError (a ValueError)
saying which sizes disagree.
"""
from __future__ import annotations

import ast
import re

# Megatron-LM keeps the SwiGLU MLP width a multiple of this (megatron/training/arguments.py, validate_args), so that
# each tensor-parallel shard of it stays a multiple of 64 / tensor.
SWIGLU_FFN_MULTIPLE = 64


class SizeError(ValueError):
    """Sizes Megatron would refuse: the message names the sizes that disagree."""


def ffn_hidden_size(hidden: int, swiglu: bool, written: int | None = None) -> int:
    """The MLP's hidden width: `written` (--ffn-hidden-size) when given, else Megatron-LM's default.

    Megatron-LM's validate_args (megatron/training/arguments.py) sets 4h, or with --swiglu two thirds of that, rounded
    down to a multiple of 64: SwiGLU's first projection is two matrices of that width, which keeps the MLP's
    parameters near those of a 4h GELU MLP. Megatron writes it `int((4 * h * 2 / 3) / 64) * 64`; 8h // 192 * 64 is
    the same number in integers (8h/3 is never within a rounding error of a whole number). megatron-core's
    TransformerConfig.__post_init__ knows only the 4h default: Megatron-LM decides before it builds the config.
    """
    if written is not None:
        return written
    if swiglu:
        return 8 * hidden // (3 * SWIGLU_FFN_MULTIPLE) * SWIGLU_FFN_MULTIPLE
    return 4 * hidden


def query_groups(heads: int, written: int | None = None) -> int:
    """Key/value head groups in effect: `written` (--num-query-groups) when given, else one per attention head
    (multi-head attention), as megatron-core's TransformerConfig.__post_init__ sets it."""
    return heads if written is None else written


def padded_vocab_size(vocab: int, divisible_by: int = 128, tensor: int = 1) -> int:
    """The rows of Megatron's word embedding: the vocabulary rounded up to a multiple of divisible_by x tensor, so
    that each tensor-parallel shard has a multiple of `divisible_by` rows (Megatron-LM's _vocab_size_with_padding,
    megatron/training/tokenizer/tokenizer.py; --make-vocab-size-divisible-by, default 128). The padded rows are
    parameters the model holds and never uses."""
    if vocab <= 0 or divisible_by <= 0 or tensor <= 0:
        raise SizeError(f"vocabulary {vocab}, divisible_by {divisible_by} and tensor {tensor} must be positive")
    multiple = divisible_by * tensor
    return -(-vocab // multiple) * multiple


def model_parallel_size(tensor: int = 1, context: int = 1, pipeline: int = 1) -> int:
    """Ranks that hold one copy of the model between them: tensor x context x pipeline (Megatron-LM's
    `total_model_size` in validate_args)."""
    if min(tensor, context, pipeline) <= 0:
        raise SizeError(f"tensor {tensor}, context {context} and pipeline {pipeline} must be positive")
    return tensor * context * pipeline


def data_parallel_size(world: int, tensor: int = 1, context: int = 1, pipeline: int = 1) -> int:
    """Model replicas: world / (tensor x context x pipeline), as Megatron-LM's validate_args derives
    args.data_parallel_size and megatron-core's parallel_state.initialize_model_parallel sizes its data-parallel
    groups. Context-parallel ranks share a sequence, not a replica, so they are not data-parallel ranks.
    Raises SizeError when the world does not divide."""
    split = model_parallel_size(tensor, context, pipeline)
    if world <= 0 or world % split:
        raise SizeError(f"world size {world} is not divisible by tensor {tensor} x context {context} x pipeline "
                        f"{pipeline} = {split}")
    return world // split


def layers_per_stage(num_layers: int, pipeline: int) -> int:
    """Transformer layers on each pipeline stage of the even split: num_layers / pipeline (megatron-core's
    get_num_layers_to_build, megatron/core/transformer/transformer_block.py, without a layout or uneven first and
    last stages). Raises SizeError when the layers do not split evenly, as megatron-core does."""
    if pipeline <= 0 or num_layers % pipeline:
        raise SizeError(f"{num_layers} layers do not split evenly over {pipeline} pipeline stages")
    return num_layers // pipeline


def layers_per_virtual_stage(num_layers: int, pipeline: int, virtual_stages: int) -> int:
    """Transformer layers in each model chunk of the interleaved schedule: the layers of a stage shared by its
    `virtual_stages` chunks (get_num_layers_to_build again; Megatron-LM's --num-layers-per-virtual-pipeline-stage is
    this number). Raises SizeError when a stage's layers do not split evenly into its chunks."""
    per_stage = layers_per_stage(num_layers, pipeline)
    if virtual_stages <= 0 or per_stage % virtual_stages:
        raise SizeError(f"the {per_stage} layers of each pipeline stage ({num_layers}/{pipeline}) do not split evenly "
                        f"into {virtual_stages} virtual stages")
    return per_stage // virtual_stages


# Layer letters of Megatron-LM's --pipeline-model-parallel-layout (megatron-core's PipelineParallelLayerLayout,
# megatron/core/transformer/pipeline_parallel_layer_layout.py): the embedding, a transformer (decoder) layer, the
# loss with the output layer, and a multi-token-prediction layer.
LAYOUT_LETTERS = {"E": "embedding", "t": "transformer layer", "L": "loss", "m": "multi-token prediction"}
# No model has this many layers: a longer layout is a typo, refused before it fills memory.
LAYOUT_MAX_LETTERS = 1_000_000


def parse_pipeline_layout(layout: str) -> list[str]:
    """A --pipeline-model-parallel-layout string -> the layer letters of each virtual stage, in megatron-core's order
    (virtual stage u = chunk x pipeline + stage: every stage's first chunk, then every stage's second, ...).

    The grammar of PipelineParallelLayerLayout.parse_str_to_list: stages are split by "|", commas are cosmetic,
    "x*n" repeats one letter and "(...)*n" a group (which may hold "|"), e.g. "Et*3|(tt|)*2,t*3L" ->
    ["Ettt", "tt", "tt", "tttL"]. Raises SizeError (its message follows the layout's quote) naming a letter that is
    not E, t, L or m, or a repeat that would write more than LAYOUT_MAX_LETTERS letters."""
    written = [0]  # letters the repeats of one pass have written so far

    def repeat(match: re.Match) -> str:
        written[0] += len(match.group(1)) * int(match.group(2))
        if written[0] > LAYOUT_MAX_LETTERS:
            raise SizeError(f"repeats beyond {LAYOUT_MAX_LETTERS:,} letters")
        return match.group(1) * int(match.group(2))

    text = layout.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        written[0] = len(text)
        text = re.sub(pattern, repeat, text)
    stages = text.split("|")
    for stage in stages:
        unknown = sorted(set(stage) - set(LAYOUT_LETTERS))
        if unknown:
            raise SizeError(f"has an unknown layer letter {unknown[0]!r} in stage {stage!r}; the letters are "
                            + ", ".join(f"{k} ({v})" for k, v in LAYOUT_LETTERS.items()))
    return stages


def layout_virtual_stages(layout: str, pipeline: int) -> int:
    """Model chunks per pipeline stage that a layout describes: its stage count over the pipeline size (Megatron-LM's
    validate_args sets --virtual-pipeline-model-parallel-size so). Raises SizeError when it is not a multiple."""
    stages = len(parse_pipeline_layout(layout))
    if pipeline <= 0 or stages % pipeline:
        raise SizeError(f"layout {layout!r} has {stages} stages, not a multiple of pipeline {pipeline}")
    return stages // pipeline


def layout_problems(layout: str, num_layers: int, pipeline: int) -> list[str]:
    """What megatron-core's PipelineParallelLayerLayout (its constructor and validate_layer_layout) would refuse in a
    layout for this model and pipeline, each with its fix; empty when it builds. Stricter in one place: the embedding
    must be in the first virtual stage and the loss in the last, where GPTModel builds them (pre_process and
    post_process follow the pipeline rank, not the layout). Multi-token prediction (m) is not supported."""
    try:
        stages = parse_pipeline_layout(layout)
    except SizeError as exc:
        return [str(exc)]
    problems = []
    if pipeline <= 0 or len(stages) % pipeline:
        problems.append(f"has {len(stages)} stages, not a multiple of pipeline {pipeline}; give pipeline x virtual "
                        f"stages of them, separated by '|'")
    letters = "".join(stages)
    if letters.count("E") != 1 or "E" not in stages[0]:
        problems.append("needs the embedding (E) exactly once, in the first stage, e.g. 'Et*3|...'")
    if letters.count("L") != 1 or "L" not in stages[-1]:
        problems.append("needs the loss (L) exactly once, in the last stage, e.g. '...|t*3L'")
    if "m" in letters:
        problems.append("multi-token prediction layers (m) are not supported; remove them")
    if letters.count("t") != num_layers:
        problems.append(f"places {letters.count('t')} transformer layers (t) but the model has {num_layers}; "
                        f"adjust the counts so they add up to {num_layers}")
    return problems


def split_layers(num_layers: int, account_for_embedding: bool = False, account_for_loss: bool = False) -> int:
    """The layers Megatron splits over the pipeline's chunks: the transformer layers, plus one for the embedding under
    --account-for-embedding-in-pipeline-split and one for the loss under --account-for-loss-in-pipeline-split
    (Megatron-LM's validate_args derives --num-layers-per-virtual-pipeline-stage's virtual size from this count)."""
    return num_layers + int(account_for_embedding) + int(account_for_loss)


def chunk_layers(num_layers: int, pipeline: int, virtual_stages: int = 1, *, account_for_embedding: bool = False,
                 account_for_loss: bool = False, layout: str | None = None) -> list[list[int]]:
    """Transformer layers in each model chunk, [stage][chunk], as megatron-core builds them (get_num_layers_to_build,
    megatron/core/transformer/transformer_block.py); one chunk per stage without interleaving.

    With a `layout`, each chunk's count of t (its virtual stages follow from it). Otherwise the layers split evenly
    over pipeline x virtual_stages chunks, where --account-for-embedding-in-pipeline-split counts the embedding, and
    --account-for-loss-in-pipeline-split the loss, as one more layer: the first chunk of the first stage then builds
    one transformer layer fewer, and the last chunk of the last stage one fewer (Llama 3.1 405B: 126 + 2 = 128 layers
    over 16 x 8 chunks of one, the first and the last chunk without a transformer layer). Raises SizeError where
    megatron-core's TransformerConfig does."""
    if layout is not None:
        problems = layout_problems(layout, num_layers, pipeline)
        if problems:
            raise SizeError(f"layout {layout!r}: " + "; ".join(problems))
        stages = parse_pipeline_layout(layout)
        chunks = len(stages) // pipeline
        return [[stages[c * pipeline + i].count("t") for c in range(chunks)] for i in range(pipeline)]
    counted = split_layers(num_layers, account_for_embedding, account_for_loss)
    extra = f" ({num_layers} + {counted - num_layers} counting the embedding and loss)" if counted > num_layers else ""
    if pipeline <= 0 or counted % pipeline:
        raise SizeError(f"{counted} layers{extra} do not split evenly over {pipeline} pipeline stages")
    if virtual_stages <= 0 or counted // pipeline % virtual_stages:
        raise SizeError(f"the {counted // pipeline} layers{extra and ' counted'} of each pipeline stage do not split "
                        f"evenly into {virtual_stages} virtual stages")
    per_chunk = counted // (pipeline * virtual_stages)
    counts = [[per_chunk] * virtual_stages for _ in range(pipeline)]
    if account_for_embedding:
        counts[0][0] -= 1
    if account_for_loss:
        counts[-1][-1] -= 1
    return counts


def virtual_stage_counts(num_layers: int, pipeline: int) -> list[int]:
    """1 and every virtual-stage count whose model chunks split `num_layers` evenly over `pipeline` stages, with or
    without the embedding and the loss counted as layers (`split_layers`): NVIDIA's recipes go down to one layer per
    chunk (Llama 2 70B: 80 layers, pipeline 4, 20 virtual stages)."""
    if pipeline == 1:
        return [1]
    counts = {1}
    for total in (num_layers, split_layers(num_layers, True, True)):
        if total % pipeline == 0:
            per_stage = total // pipeline
            counts.update(v for v in range(1, per_stage + 1) if per_stage % v == 0)
    return sorted(counts)


# --- mixture of experts ----------------------------------------------------------------------------------------------

_PATTERN = re.compile(r"[\[\]\d\s,+*()]+")


def moe_layer_pattern(freq: int | str | None, num_layers: int) -> list[int]:
    """Which layers are MoE (1) and which dense (0), from --moe-layer-freq as megatron-core reads it
    (get_gpt_decoder_block_spec, megatron/core/models/gpt/gpt_layer_specs.py): an integer N makes layer i MoE when
    i % N == 0; a pattern such as "([0]+[1]*23)" is Megatron-LM's Python list expression of lists, +, * and integers,
    with one 0 or 1 per layer. Megatron-LM evaluates the pattern with eval; here only that grammar is read. Raises
    SizeError on anything else."""
    text = "1" if freq is None else str(freq).strip()
    if text.isdigit():
        n = int(text)
        if n <= 0:
            raise SizeError(f"moe_layer_freq {n} must be a positive number of layers")
        return [1 if i % n == 0 else 0 for i in range(num_layers)]
    if not _PATTERN.fullmatch(text) or "[" not in text:
        raise SizeError(f"moe_layer_freq {text!r} is neither a number nor a pattern of lists like \"([0]+[1]*23)\"")
    pattern = _list_expression(text)
    if len(pattern) != num_layers or any(v not in (0, 1) for v in pattern):
        raise SizeError(f"moe_layer_freq {text!r} gives {len(pattern)} entries of 0 and 1, the model has {num_layers} "
                        "layers")
    return pattern


def _list_expression(text: str) -> list[int]:
    """A list expression of list literals, +, * and integers, evaluated on its syntax tree (never eval)."""
    def value(node):
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
                return left + right
            if isinstance(node.op, ast.Mult) and isinstance(left, list) and isinstance(right, int) and right < 10**5:
                return left * right
        raise SizeError(f"moe_layer_freq {text!r}: only lists of 0 and 1 joined by + and repeated by * are read")

    try:
        result = value(ast.parse(text, mode="eval").body)
    except SyntaxError:
        raise SizeError(f"moe_layer_freq {text!r} is not a list expression like \"([0]+[1]*23)\"") from None
    if not isinstance(result, list) or any(isinstance(v, list) for v in result):
        raise SizeError(f"moe_layer_freq {text!r} must give one flat list")
    return result


def moe_ffn_hidden_size(ffn_hidden_size: int, written: int | None = None) -> int:
    """One expert's MLP width: `written` (--moe-ffn-hidden-size) when given, else the dense MLP's
    (Megatron-LM's validate_args and TransformerConfig.__post_init__)."""
    return written if written is not None else ffn_hidden_size


def expert_tensor_size(tensor: int, expert_tensor: int | None) -> int:
    """Tensor ranks of each expert: --expert-tensor-parallel-size, else --tensor-model-parallel-size (Megatron-LM's
    validate_args)."""
    return tensor if expert_tensor is None else expert_tensor


def expert_data_parallel_size(world: int, expert: int = 1, expert_tensor: int = 1, pipeline: int = 1) -> int:
    """Replicas of each expert: world / (expert_tensor x expert x pipeline), as megatron-core's
    initialize_model_parallel sizes its expert-data-parallel groups (the expert layers' own grid over the same ranks;
    context ranks count as data ranks there). Their gradients reduce over these ranks, not the dense data-parallel
    group. Raises SizeError when the world does not divide."""
    split = expert_tensor * expert * pipeline
    if world <= 0 or split <= 0 or world % split:
        raise SizeError(f"world size {world} is not divisible by expert_tensor {expert_tensor} x expert {expert} x "
                        f"pipeline {pipeline} = {split}")
    return world // split

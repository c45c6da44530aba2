"""Hugging Face `transformers` checkpoints in and out of labkit's driver, for the Llama family and GPT-2.

    labkit checkpoint import-hf HF_DIR --spec SPEC -o CKPT_DIR   config.json, *.safetensors -> torch_dist checkpoint
    labkit checkpoint export-hf CKPT_DIR --spec SPEC -o HF_DIR   torch_dist checkpoint -> config.json, model.safetensors

The imported checkpoint is a Megatron-LM "release" checkpoint (CKPT_DIR/release/ and the tracker file saying
`release`): model weights only, each stored whole through megatron-core's dist_checkpointing, so `train.load` reads it
under any pipeline layout and any tensor size that pads the vocabulary to the same rows as the spec's parallel.tensor
(the embedding is stored padded); the run starts at iteration 0 with a fresh optimizer, as Megatron-LM's
load_checkpoint does for a release checkpoint (megatron/training/checkpointing.py). The weights are written by the
driver's own model (its `sharded_state_dict`), so the keys are the ones the driver asks for.

The names and layouts follow Megatron-LM's converters and Megatron-Bridge's Llama bridge and mappings, and HF's GPT-2:
https://github.com/NVIDIA/Megatron-LM/blob/core_v0.16.1/tools/checkpoint/loader_llama_mistral.py (HF Llama -> Megatron),
https://github.com/NVIDIA/Megatron-LM/blob/core_v0.16.1/tools/checkpoint/saver_base.py (vocabulary padding),
https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/main/src/megatron/bridge/models/llama/llama_bridge.py,
https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/main/src/megatron/bridge/models/conversion/param_mapping.py
(QKVMapping, GatedMLPMapping) and
https://github.com/huggingface/transformers/blob/main/src/transformers/models/gpt2/modeling_gpt2.py (Conv1D, c_attn):

- attention: megatron-core's fused linear_qkv holds, for each key/value group in turn, that group's query heads, then
  its key head, then its value head (megatron/core/transformer/attention.py, get_query_key_value_tensors); HF keeps
  q, k and v apart (Llama) or as three whole blocks [q | k | v] (GPT-2's c_attn). Grouped-query attention is the same
  layout with several query heads per group. Both rotate positions the same way (rotate-half), so Llama's q and k are
  copied as they are.
- SwiGLU: linear_fc1 is [gate; up] stacked (megatron-core's glu splits its output in two halves, silu on the first).
- GPT-2: HF's Conv1D stores weights as (in, out), transposed from a Linear's; its layer norms have biases; positions
  are a learned table (position_embeddings) as long as model.seq_length. OpenAI's GPT-2 computes the tanh GELU
  (activation_function gelu_new), labkit's driver the exact one: such a model is imported with a note saying so, and
  export writes activation_function gelu, what the driver trained.
- vocabulary: Megatron pads the embedding (and an untied output layer) to labkit.megatron.sizes.padded_vocab_size rows
  for the spec's tensor size, repeating the last row as saver_base.py does; export drops the padding.
- tied embeddings: with the output layer tied (GPT-2, model.untie_embeddings false), HF has no lm_head of its own.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from labkit.megatron import sizes

NORM_EPSILON = 1e-5
"""The norm epsilon of labkit's driver: Megatron-LM's --norm-epsilon default, which the spec does not change."""
EXACT_GELU = "gelu"
"""HF's name for the exact (erf) GELU, torch.nn.functional.gelu, which labkit's driver computes."""


class HFCheckpointError(ValueError):
    """A checkpoint or spec that cannot be converted: `problems`, each naming the spec field or file and the fix."""

    def __init__(self, *problems: str):
        super().__init__("; ".join(problems))
        self.problems = list(problems)


def family_of_config(config: dict, where: str) -> str:
    """'llama' or 'gpt2' from an HF config.json's model_type."""
    kind = config.get("model_type")
    if kind not in ("llama", "gpt2"):
        raise HFCheckpointError(f"{where}: model_type {kind!r} is not llama or gpt2, the two families labkit converts")
    return kind


def family_of_model(model) -> str:
    """'llama' or 'gpt2' from a spec's model: the Llama layout (SwiGLU, RMSNorm, rotary) or GPT-2's."""
    if model.swiglu and model.normalization == "RMSNorm" and model.position_embedding_type == "rope":
        return "llama"
    if not model.swiglu and model.normalization == "LayerNorm" and model.position_embedding_type == "learned_absolute":
        return "gpt2"
    raise HFCheckpointError("model: neither the Llama layout (swiglu true, normalization RMSNorm, "
                            "position_embedding_type rope) nor GPT-2's (swiglu false, LayerNorm, learned_absolute); "
                            "start from the tiny-llama, llama* or gpt2* preset")


def _head_dim(model) -> int:
    return model.kv_channels or model.hidden_size // model.num_attention_heads


def _rope(config: dict) -> tuple[float | None, str]:
    """(rope theta, rope type) from an HF Llama config: transformers 5's rope_parameters or the older rope_theta and
    rope_scaling."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return theta, kind


def config_problems(model, config: dict, where: str) -> tuple[list[str], list[str]]:
    """(problems, notes): each problem names the spec field, the HF config key and the fix; notes say what the driver
    computes differently without changing a weight."""
    family = family_of_config(config, where)
    problems, notes = [], []

    def same(field: str, ours, key: str, theirs, wanted=None) -> None:
        """The spec's model.FIELD against the config's KEY; `wanted`, the spec's value for it, when not `theirs`."""
        wanted = theirs if wanted is None else wanted
        if ours != wanted:
            problems.append(f"model.{field}: {json.dumps(ours)} in the spec, {key} {json.dumps(theirs)} in {where}; "
                            f"set model.{field}: {json.dumps(wanted)}")

    def fixed(field: str, ours, theirs) -> None:
        """The spec's model.FIELD against what every model of the family has."""
        if ours != theirs:
            problems.append(f"model.{field}: {json.dumps(ours)} in the spec; {where} is a {family} model, whose "
                            f"{field} is {json.dumps(theirs)}; set model.{field}: {json.dumps(theirs)}")

    heads = config.get("num_attention_heads" if family == "llama" else "n_head")
    hidden = config.get("hidden_size" if family == "llama" else "n_embd")
    if family == "llama":
        same("num_layers", model.num_layers, "num_hidden_layers", config.get("num_hidden_layers"))
        same("hidden_size", model.hidden_size, "hidden_size", hidden)
        same("num_attention_heads", model.num_attention_heads, "num_attention_heads", heads)
        same("num_query_groups", model.query_groups, "num_key_value_heads", config.get("num_key_value_heads", heads))
        same("ffn_hidden_size", model.ffn_size, "intermediate_size", config.get("intermediate_size"))
        same("kv_channels", _head_dim(model), "head_dim", config.get("head_dim") or hidden // heads)
        theta, kind = _rope(config)
        same("rotary_base", model.rotary_base, "rope_theta", int(theta) if float(theta).is_integer() else theta)
        if kind != "default":
            problems.append(f"model.rotary_base: {where} scales rotary positions ({kind}), which labkit's driver does "
                            "not; convert a model without rope scaling")
        tied = config.get("tie_word_embeddings", False)
        same("untie_embeddings", bool(model.untie_embeddings), "tie_word_embeddings", tied, not tied)
        if config.get("hidden_act", "silu") != "silu":
            problems.append(f"model.swiglu: {where} has hidden_act {config['hidden_act']}; labkit's driver gates "
                            "Llama's MLP with SiLU only; convert a model with hidden_act silu")
        fixed("swiglu", bool(model.swiglu), True)
        fixed("normalization", model.normalization, "RMSNorm")
        fixed("position_embedding_type", model.position_embedding_type, "rope")
        if config.get("attention_bias") or config.get("mlp_bias"):
            problems.append(f"model.add_bias_linear: {where} has attention_bias or mlp_bias, which labkit's Llama "
                            "mapping does not carry; convert a model without biases")
        fixed("add_bias_linear", bool(model.add_bias_linear), False)
        eps_key = "rms_norm_eps"
    else:
        same("num_layers", model.num_layers, "n_layer", config.get("n_layer"))
        same("hidden_size", model.hidden_size, "n_embd", hidden)
        same("num_attention_heads", model.num_attention_heads, "n_head", heads)
        same("num_query_groups", model.query_groups, "n_head", heads)
        same("ffn_hidden_size", model.ffn_size, "n_inner", config.get("n_inner") or 4 * hidden)
        same("seq_length", model.seq_length, "n_positions", config.get("n_positions"))
        if not config.get("tie_word_embeddings", True):
            problems.append(f"model.untie_embeddings: {where} has tie_word_embeddings false; GPT-2's layout ties its "
                            "output layer to the embedding; convert a tied model")
        fixed("untie_embeddings", bool(model.untie_embeddings), False)
        fixed("swiglu", bool(model.swiglu), False)
        fixed("normalization", model.normalization, "LayerNorm")
        fixed("position_embedding_type", model.position_embedding_type, "learned_absolute")
        fixed("add_bias_linear", bool(model.add_bias_linear), True)
        for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if config.get(key):
                problems.append(f"model: {where} sets {key}, which megatron-core's attention does not do; convert a "
                                f"model with {key} false")
        act = config.get("activation_function", "gelu_new")
        if act != EXACT_GELU:
            notes.append(f"note: {where} computes activation_function {act}; labkit's driver computes the exact GELU "
                         "(torch's F.gelu), so its logits differ slightly from the HF model's")
        eps_key = "layer_norm_epsilon"
    same("vocab_size", model.vocab_size, "vocab_size", config.get("vocab_size"))
    eps = config.get(eps_key, NORM_EPSILON)
    if eps != NORM_EPSILON:
        problems.append(f"model: {where} normalises with {eps_key} {eps}; labkit's driver uses {NORM_EPSILON} "
                        "(Megatron-LM's --norm-epsilon default); convert a model with that epsilon")
    if model.qk_layernorm or model.num_experts:
        problems.append("model.qk_layernorm, model.num_experts: the Llama and GPT-2 layouts have neither; unset them")
    return problems, notes


def hf_config(model, family: str, dtype: str) -> dict:
    """config.json for the spec's model, as `transformers` writes it for LlamaForCausalLM or GPT2LMHeadModel."""
    if family == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "num_hidden_layers": model.num_layers, "hidden_size": model.hidden_size,
                "num_attention_heads": model.num_attention_heads, "num_key_value_heads": model.query_groups,
                "head_dim": _head_dim(model), "intermediate_size": model.ffn_size, "vocab_size": model.vocab_size,
                "max_position_embeddings": model.seq_length, "rms_norm_eps": NORM_EPSILON, "hidden_act": "silu",
                "rope_parameters": {"rope_type": "default", "rope_theta": float(model.rotary_base)},
                "rope_theta": float(model.rotary_base), "attention_bias": False, "mlp_bias": False,
                "attention_dropout": model.attention_dropout or 0.0,
                "tie_word_embeddings": not model.untie_embeddings, "dtype": dtype}
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": model.num_layers,
            "n_embd": model.hidden_size, "n_head": model.num_attention_heads, "n_inner": model.ffn_size,
            "n_positions": model.seq_length, "vocab_size": model.vocab_size, "layer_norm_epsilon": NORM_EPSILON,
            "activation_function": EXACT_GELU, "resid_pdrop": model.hidden_dropout or 0.0,
            "embd_pdrop": model.hidden_dropout or 0.0, "attn_pdrop": model.attention_dropout or 0.0,
            "scale_attn_weights": True, "tie_word_embeddings": True, "dtype": dtype}


# ---------------------------------------------------------------------------------------------------------------------
# The weights: HF names and layouts <-> megatron-core's (its local layer spec's state_dict, the whole model on one rank)

def _fuse_qkv(q, k, v, heads: int, groups: int):
    """[q; k; v] (each heads x d or groups x d rows) -> megatron-core's per-group [q of the group, k, v] rows."""
    import torch

    d = q.shape[0] // heads
    rest = q.shape[1:]
    per = heads // groups
    return torch.cat([q.reshape(groups, per * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)],
                     dim=1).reshape(-1, *rest)


def _split_qkv(qkv, heads: int, groups: int):
    """The inverse of _fuse_qkv: (q, k, v)."""
    per = heads // groups
    d = qkv.shape[0] // (groups * (per + 2))
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, (per + 2) * d, *rest)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous())


def _pad_vocab(weight, rows: int):
    """The embedding (or output layer) padded to `rows`, the padding repeating the last row (saver_base.py)."""
    import torch

    extra = rows - weight.shape[0]
    return weight if extra == 0 else torch.cat([weight, weight[-1:].expand(extra, -1)])


def to_megatron(hf: dict, model, family: str, padded_vocab: int) -> dict:
    """HF tensors (by HF name) -> megatron-core's state_dict of the whole model."""
    heads, groups = model.num_attention_heads, model.query_groups
    out = {}
    if family == "llama":
        out["embedding.word_embeddings.weight"] = _pad_vocab(hf["model.embed_tokens.weight"], padded_vocab)
        for i in range(model.num_layers):
            h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
            out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
            out[m + "self_attention.linear_qkv.weight"] = _fuse_qkv(
                hf[h + "self_attn.q_proj.weight"], hf[h + "self_attn.k_proj.weight"], hf[h + "self_attn.v_proj.weight"],
                heads, groups)
            out[m + "self_attention.linear_proj.weight"] = hf[h + "self_attn.o_proj.weight"]
            out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
            out[m + "mlp.linear_fc1.weight"] = _cat(hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"])
            out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if model.untie_embeddings:
            out["output_layer.weight"] = _pad_vocab(hf["lm_head.weight"], padded_vocab)
        return out
    out["embedding.word_embeddings.weight"] = _pad_vocab(hf["transformer.wte.weight"], padded_vocab)
    out["embedding.position_embeddings.weight"] = hf["transformer.wpe.weight"]
    for i in range(model.num_layers):
        h, m = f"transformer.h.{i}.", f"decoder.layers.{i}."
        for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            out[m + ours + ".weight"], out[m + ours + ".bias"] = hf[h + theirs + ".weight"], hf[h + theirs + ".bias"]
        qkv_w = hf[h + "attn.c_attn.weight"].t()
        out[m + "self_attention.linear_qkv.weight"] = _fuse_qkv(*qkv_w.chunk(3), heads, heads)
        out[m + "self_attention.linear_qkv.bias"] = _fuse_qkv(*hf[h + "attn.c_attn.bias"].chunk(3), heads, heads)
        for ours, theirs in (("self_attention.linear_proj", "attn.c_proj"), ("mlp.linear_fc1", "mlp.c_fc"),
                             ("mlp.linear_fc2", "mlp.c_proj")):
            out[m + ours + ".weight"] = hf[h + theirs + ".weight"].t()
            out[m + ours + ".bias"] = hf[h + theirs + ".bias"]
    out["decoder.final_layernorm.weight"] = hf["transformer.ln_f.weight"]
    out["decoder.final_layernorm.bias"] = hf["transformer.ln_f.bias"]
    return out


def _cat(*tensors):
    import torch

    return torch.cat(tensors)


def to_hf(mc: dict, model, family: str) -> dict:
    """megatron-core's state_dict of the whole model -> HF tensors by HF name, the vocabulary padding dropped."""
    heads, groups, vocab = model.num_attention_heads, model.query_groups, model.vocab_size
    out = {}
    if family == "llama":
        out["model.embed_tokens.weight"] = mc["embedding.word_embeddings.weight"][:vocab]
        for i in range(model.num_layers):
            h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
            out[h + "input_layernorm.weight"] = mc[m + "input_layernorm.weight"]
            q, k, v = _split_qkv(mc[m + "self_attention.linear_qkv.weight"], heads, groups)
            out[h + "self_attn.q_proj.weight"], out[h + "self_attn.k_proj.weight"] = q, k
            out[h + "self_attn.v_proj.weight"] = v
            out[h + "self_attn.o_proj.weight"] = mc[m + "self_attention.linear_proj.weight"]
            out[h + "post_attention_layernorm.weight"] = mc[m + "pre_mlp_layernorm.weight"]
            gate, up = mc[m + "mlp.linear_fc1.weight"].chunk(2)
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
            out[h + "mlp.down_proj.weight"] = mc[m + "mlp.linear_fc2.weight"]
        out["model.norm.weight"] = mc["decoder.final_layernorm.weight"]
        if model.untie_embeddings:
            out["lm_head.weight"] = mc["output_layer.weight"][:vocab]
    else:
        out["transformer.wte.weight"] = mc["embedding.word_embeddings.weight"][:vocab]
        out["transformer.wpe.weight"] = mc["embedding.position_embeddings.weight"]
        for i in range(model.num_layers):
            h, m = f"transformer.h.{i}.", f"decoder.layers.{i}."
            for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
                for kind in (".weight", ".bias"):
                    out[h + theirs + kind] = mc[m + ours + kind]
            q, k, v = _split_qkv(mc[m + "self_attention.linear_qkv.weight"], heads, heads)
            out[h + "attn.c_attn.weight"] = _cat(q, k, v).t()
            out[h + "attn.c_attn.bias"] = _cat(*_split_qkv(mc[m + "self_attention.linear_qkv.bias"], heads, heads))
            for ours, theirs in (("self_attention.linear_proj", "attn.c_proj"), ("mlp.linear_fc1", "mlp.c_fc"),
                                 ("mlp.linear_fc2", "mlp.c_proj")):
                out[h + theirs + ".weight"] = mc[m + ours + ".weight"].t()
                out[h + theirs + ".bias"] = mc[m + ours + ".bias"]
        out["transformer.ln_f.weight"] = mc["decoder.final_layernorm.weight"]
        out["transformer.ln_f.bias"] = mc["decoder.final_layernorm.bias"]
    return {name: tensor.contiguous() for name, tensor in out.items()}


# ---------------------------------------------------------------------------------------------------------------------
# The commands

def _refuse_existing(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HFCheckpointError(f"-o {out}: exists and is not empty; labkit never overwrites a checkpoint: name a new "
                                "directory")


def _one_rank_spec(spec):
    """The spec's model (and precision) on one CPU rank: the driver's arguments that build the whole model."""
    from labkit.spec import load_spec

    precision = "bf16" if spec.precision not in ("fp32", "fp16") else spec.precision  # FP8 runs keep bf16 weights
    return load_spec({"name": "hf-checkpoint", "model": spec.to_dict()["model"], "precision": precision,
                      "data": {"mock": True}, "batch": {"micro": 1, "global": 1},
                      "train": {"iters": 1, "log_interval": 1}})


def _whole_model(args):
    """The driver's model, all layers on this one rank, unwrapped from DDP."""
    from megatron.core.utils import unwrap_model

    from labkit.train.model import build_model, transformer_config

    return unwrap_model(build_model(args, transformer_config(args)))[0]


def _metadata(common: dict | None) -> dict:
    from megatron.core import dist_checkpointing, parallel_state

    saved = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) if common else None
    return dict(saved or {"singleton_local_shards": False}, dp_cp_group=parallel_state.get_data_parallel_group(
        with_context_parallel=True))


def read_config(hf_dir: Path) -> dict:
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise HFCheckpointError(f"HF_DIR {hf_dir}: no config.json; pass the directory save_pretrained wrote")
    return json.loads(config_path.read_text())


def read_tensors(hf_dir: Path) -> dict:
    """Every tensor of the directory's *.safetensors files (one, or the shards of a large model), by name."""
    from safetensors.torch import load_file

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise HFCheckpointError(f"HF_DIR {hf_dir}: no *.safetensors file; save the model with save_pretrained "
                                "(safe_serialization, transformers' default)")
    tensors = {}
    for path in files:
        tensors.update(load_file(str(path)))
    return tensors


def import_hf(hf_dir, spec, out) -> list[str]:
    """Write the HF model in `hf_dir` as a release checkpoint in `out` for `spec`'s model; returns notes to print.
    Raises HFCheckpointError, with nothing written, when the spec and the HF config disagree."""
    from labkit.extras import require

    hf_dir, out = Path(hf_dir), Path(out)
    _refuse_existing(out)
    require("labkit checkpoint import-hf", "safetensors", "torch", "megatron")
    config = read_config(hf_dir)
    problems, notes = config_problems(spec.model, config, f"{hf_dir}/config.json")
    if problems:
        raise HFCheckpointError(*problems)
    from labkit.train.checkpoint import RELEASE, TRACKER
    family = family_of_config(config, str(hf_dir))
    padded = sizes.padded_vocab_size(spec.model.vocab_size, spec.model.make_vocab_size_divisible_by or 128,
                                     spec.parallel.tensor)
    weights = to_megatron(read_tensors(hf_dir), spec.model, family, padded)

    def save(args):
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

        args.padded_vocab_size = padded
        chunk = _whole_model(args)
        chunk.load_state_dict(weights, strict=True)
        metadata = _metadata(None)
        state = {"model": chunk.sharded_state_dict(metadata=metadata), "checkpoint_version": 3.0}
        (out / RELEASE).mkdir(parents=True)
        dist_checkpointing.save(state, str(out / RELEASE), get_default_save_sharded_strategy("torch_dist"),
                                content_metadata=_clean_metadata_for_serialization(metadata))
        (out / TRACKER).write_text(RELEASE)

    _on_one_rank(spec, save, out)
    return notes


def export_hf(ckpt_dir, spec, out) -> None:
    """Write the torch_dist checkpoint in `ckpt_dir` (its latest iteration, or a release) as config.json and
    model.safetensors in `out`, for `spec`'s model."""
    from labkit.extras import require

    ckpt_dir, out = Path(ckpt_dir), Path(out)
    _refuse_existing(out)
    require("labkit checkpoint export-hf", "safetensors", "torch", "megatron")
    from megatron.core import dist_checkpointing

    from labkit.train.checkpoint import RELEASE, TRACKER, read_sharded

    family = family_of_model(spec.model)
    # what the Llama and GPT-2 mappings carry: a spec's biases, untied GPT-2 output, q/k norms or experts are refused
    # here rather than left out of the written model
    problems, _ = config_problems(spec.model, hf_config(spec.model, family, "float32"), "the exported config.json")
    if problems:
        raise HFCheckpointError(*problems)
    tracker = ckpt_dir / TRACKER
    if not tracker.is_file():
        raise HFCheckpointError(f"CKPT_DIR {ckpt_dir}: no {TRACKER}; pass the directory train.save wrote")
    written = tracker.read_text().strip()
    if written != RELEASE and not written.isdigit():
        raise HFCheckpointError(f"CKPT_DIR {tracker}: holds {written[:40]!r}, neither {RELEASE} nor an iteration; "
                                "pass the directory train.save wrote")
    folder = ckpt_dir / (RELEASE if written == RELEASE else f"iter_{int(written):07d}")
    if not dist_checkpointing.check_is_distributed_checkpoint(str(folder)):
        raise HFCheckpointError(f"CKPT_DIR {folder}: not a torch_dist checkpoint; train with train.ckpt_format: "
                                "torch_dist to export it")

    saved = {key: tuple(t.global_shape) for key, t in dist_checkpointing.load_tensors_metadata(str(folder)).items()}

    def load(args) -> list[str]:
        import torch
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from safetensors.torch import save_file

        args.padded_vocab_size = saved["embedding.word_embeddings.weight"][0]
        chunk = _whole_model(args)
        common = dist_checkpointing.load_common_state_dict(str(folder))
        sharded = {"model": chunk.sharded_state_dict(metadata=_metadata(common))}
        # SwiGLU's fc1 comes as a factory of two halves (megatron-core's apply_swiglu_sharded_factory): its key alone
        asked = {t.key: tuple(t.global_shape) if isinstance(t, ShardedTensor) else saved.get(t.key)
                 for t in nested_values(sharded) if isinstance(t, (ShardedTensor, ShardedTensorFactory))}
        fix = "give the spec the model the checkpoint was trained with"
        problems = [f"model: {folder} has no {key}, which the spec's model has; {fix}" if key not in saved else
                    f"model: {folder} holds {key} of shape {saved[key]}, the spec's model {shape}; {fix}"
                    for key, shape in asked.items() if saved.get(key) != shape]
        problems += [f"model: {folder} holds {key}, which the spec's model has not; {fix}"
                     for key in saved if key not in asked and not key.startswith("optimizer.")]
        if problems:
            return problems
        state = read_sharded(sharded, folder)
        chunk.load_state_dict(state["model"], strict=True)
        weights = to_hf({k: v.detach() for k, v in chunk.state_dict().items() if torch.is_tensor(v)}, spec.model,
                        family)
        dtype = str(next(iter(weights.values())).dtype).removeprefix("torch.")
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(hf_config(spec.model, family, dtype), indent=2) + "\n")
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        return []

    problems = _on_one_rank(spec, load, out)
    if problems:
        raise HFCheckpointError(*problems)


def _on_one_rank(spec, work, out: Path):
    """What `work(args)` returns in one forked driver rank; `out` removed again if it fails there."""
    from labkit.train.model_state import on_driver_ranks

    existed = out.exists()
    try:
        return on_driver_ranks([_one_rank_spec(spec)], work)[0][0]
    except BaseException:
        if not existed:
            shutil.rmtree(out, ignore_errors=True)
        raise

"""LLaMA- and Qwen3-layout weights (Hugging Face's `LlamaForCausalLM`, `Qwen3ForCausalLM`) in and out of
`helpers.GPT`.

Their files name tensors `model.embed_tokens.weight`, `model.layers.{i}.self_attn.q_proj.weight`, ... and store
every linear layer as nn.Linear does, (out, in). Three differences from our layout: Q, K and V are three matrices
(we stack them into one `qkv`), the SwiGLU's gate and up projections are two (we stack them into `fc`, as its
registered type declares, `helpers.model.feed_forward`), and the
architecture (heads, key/value heads, RoPE's θ, the norm's ε) comes from config.json, not from the shapes. The norm
and the position encoding are the ones registered for this layout (`helpers.model.norm`,
`helpers.model.position_encoding`), with their config.json keys.
Qwen3 is LLaMA plus QK-norm (`q_norm`, `k_norm`) and a head width set apart from d_model.

Position scaling beyond plain RoPE (Llama 3.1's "llama3" rope type, YaRN), sliding windows and biased projections
are refused by name: the model would load and then compute something else.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from .config import GPTConfig
from .feed_forward import feed_forward_type, in_layout, part_with_activation
from .gpt import GPT
from .hf_files import WeightsError, check_exported_config, save_with_config
from .loading import tie_weights
from .norm import NORMS, norm_type
from .parts import part_in_layout
from .position_encoding import POSITION_ENCODINGS, position_encoding_type

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",  # model_type -> transformers class
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
# model_type -> the feed-forward layout (helpers.model.feed_forward): Qwen3-MoE is Qwen3 with a Mixture-of-Experts block
LAYOUTS = {"llama": "llama", "qwen3": "llama", "qwen3_moe": "qwen3_moe"}
_PREFIX = "model."
_ATTENTION = ("q_proj", "k_proj", "v_proj")  # stacked, in this order, into our attn.qkv


def hf_groups(config: GPTConfig) -> dict[str, tuple[str, ...]]:
    """Our parameter names -> the Hugging Face tensors (full names) concatenated along dim 0 to make each."""
    norm = norm_type(config).parameter_names(config)

    def norms(ours: str, theirs: str) -> dict[str, tuple[str, ...]]:
        return {f"{ours}.{name}": (f"{theirs}.{name}",) for name in norm}

    groups = {"tok_emb.weight": ("model.embed_tokens.weight",)}
    groups |= {ours: (theirs,) for ours, theirs in position_encoding_type(config).hf_layouts["llama"].items()}
    groups |= norms("ln_f", "model.norm")
    feed_forward = feed_forward_type(config).hf_weights(config, LAYOUTS[model_type_of(config)])
    for i in range(config.n_layers):
        theirs, ours = f"model.layers.{i}.", f"blocks.{i}."
        groups |= norms(ours + "ln1", theirs + "input_layernorm")
        groups |= {
            ours + "attn.qkv.weight": tuple(f"{theirs}self_attn.{p}.weight" for p in _ATTENTION),
            ours + "attn.out_proj.weight": (theirs + "self_attn.o_proj.weight",),
        }
        groups |= norms(ours + "ln2", theirs + "post_attention_layernorm")
        groups |= {f"{ours}mlp.{name}": tuple(f"{theirs}mlp.{p}" for p in parts)
                   for name, parts in feed_forward.items()}
        if config.qk_norm:
            groups |= {ours + "attn.q_norm.weight": (theirs + "self_attn.q_norm.weight",),
                       ours + "attn.k_norm.weight": (theirs + "self_attn.k_norm.weight",)}
    if not config.tie_weights:
        groups["lm_head.weight"] = ("lm_head.weight",)
    return groups


def model_type_of(config: GPTConfig) -> str:
    """"qwen3_moe" for a Mixture-of-Experts config, else "qwen3" for one with QK-norm, "llama" without; refuses
    what none of these layouts holds."""
    held = in_layout("llama") | in_layout("qwen3_moe")
    norm, positions = part_in_layout(NORMS, "llama"), part_in_layout(POSITION_ENCODINGS, "llama")
    problems = [what for what, bad in (
        (f"{norm.__name__} (norm={norm.name!r})", norm_type(config) is not norm),
        (f"{positions.__name__} (position_encoding={positions.name!r})",
         position_encoding_type(config) is not positions),
        (f"a feed-forward it holds (ffn_type in {', '.join(held)})", config.ffn_type not in held),
        ("no biases (bias=False)", config.bias),
        ("QK-norm with experts (qwen3_moe: qk_norm=True)", config.ffn_type in in_layout("qwen3_moe")
         and not config.qk_norm),
    ) if bad]
    if problems:
        raise WeightsError(f"the Llama/Qwen3 layout needs {', '.join(problems)}; GPT-2-style models are saved with "
                           "helpers.model.hf_gpt2")
    if config.ffn_type in in_layout("qwen3_moe"):
        return "qwen3_moe"
    return "qwen3" if config.qk_norm else "llama"


def config_from_hf(hf: Mapping, source: str = "config.json") -> GPTConfig:
    """Our GPTConfig for a Llama or Qwen3 config.json (as a dict); what helpers.GPT cannot compute is refused."""
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise WeightsError(f"{source}: model_type {kind!r} is not one of {', '.join(ARCHITECTURES)}; GPT-2 files load "
                           "with helpers.model.hf_gpt2")
    for key, allowed in (("attention_bias", False), ("mlp_bias", False), ("use_sliding_window", False)):
        if hf.get(key, allowed) != allowed:
            raise WeightsError(f"{source}: {key}={hf[key]!r}, but helpers.GPT computes {key}={allowed!r}; use "
                               "transformers for this model")
    layout = LAYOUTS[kind]
    feed_forward = part_with_activation(layout, hf.get("hidden_act", "silu"))
    if feed_forward is None:
        known = ", ".join(a for part in in_layout(layout).values() for a in part.hf_layouts[layout].activations)
        raise WeightsError(f"{source}: hidden_act={hf['hidden_act']!r}, but helpers.GPT's feed-forward types in this "
                           f"layout compute {known}; use transformers for this model")
    d_model, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d_model // heads
    norm, positions = part_in_layout(NORMS, "llama"), part_in_layout(POSITION_ENCODINGS, "llama")
    norm_layout = norm.hf_layouts["llama"]
    return GPTConfig(
        vocab_size=hf["vocab_size"], context_length=hf["max_position_embeddings"], d_model=d_model, n_heads=heads,
        n_layers=hf["num_hidden_layers"], dropout=float(hf.get("attention_dropout", 0.0)), bias=False,
        tie_weights=bool(hf.get("tie_word_embeddings", False)), ffn_type=feed_forward.name, norm=norm.name,
        norm_eps=float(hf.get(norm_layout.eps_key, norm_layout.default_eps)), position_encoding=positions.name,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_size=None if head_dim * heads == d_model else head_dim, qk_norm=kind in ("qwen3", "qwen3_moe"),
        **{"ffn_hidden": hf["intermediate_size"]} | feed_forward.config_from_hf(hf, layout)
        | positions.config_from_hf(hf, "llama", source),
    )


def hf_config_dict(config: GPTConfig) -> dict:
    """A config.json that transformers reads as the same Llama or Qwen3 model."""
    kind = model_type_of(config)
    feed_forward = feed_forward_type(config)
    return feed_forward.hf_config(config, LAYOUTS[kind]) | dict(
        model_type=kind, architectures=[ARCHITECTURES[kind]], vocab_size=config.vocab_size,
        hidden_size=config.d_model, intermediate_size=feed_forward.hidden_dim(config),
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads, num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim, max_position_embeddings=config.context_length,
        **{norm_type(config).hf_layouts["llama"].eps_key: config.norm_eps},
        **position_encoding_type(config).hf_config(config, "llama"),
        hidden_act=feed_forward.hf_layouts[LAYOUTS[kind]].activations[0], attention_bias=False, mlp_bias=False,
        attention_dropout=config.dropout,
        tie_word_embeddings=config.tie_weights,
    )


def _files(path: Path) -> tuple[list[Path], Path]:
    """The safetensors file(s) of a checkpoint folder (one file, or shards listed by model.safetensors.index.json)
    and its config.json."""
    if not path.is_dir():
        raise WeightsError(f"{path} is not a folder; give the folder with config.json and model.safetensors")
    config = path / "config.json"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [path / "model.safetensors"]
    for file in (config, *files):
        if not file.is_file():
            raise WeightsError(f"{path} has no {file.name}; download the checkpoint's config.json and safetensors "
                               "files (.bin checkpoints: convert them with transformers' save_pretrained first)")
    return files, config


def load_hf_llama(path: str | os.PathLike, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                  attn_implementation: str = "sdpa") -> GPT:
    """A `helpers.GPT` with the weights of a Hugging Face Llama or Qwen3 checkpoint folder.

    The model is built on the meta device; each of our tensors is read (its parts concatenated), cast and placed on
    `device` one at a time. Every tensor of the file must be used and every one of ours found, or it is refused.
    """
    files, config_json = _files(Path(path))
    hf = json.loads(config_json.read_text())
    config = config_from_hf(hf, source=str(config_json))
    handles = [safe_open(file, framework="pt", device="cpu") for file in files]
    check_exported_config(handles[0].metadata(), hf, config_json)
    where = {name: h for h in handles for name in h.keys()}
    if config.tie_weights:
        where.pop("lm_head.weight", None)  # some files store the tied head again
    groups = hf_groups(config)
    wanted = {name for parts in groups.values() for name in parts}
    missing, extra = sorted(wanted - set(where)), sorted(set(where) - wanted)
    if missing or extra:
        what = [f"lacks {len(missing)} tensor(s), e.g. {missing[0]!r}" if missing else "",
                f"has {len(extra)} tensor(s) helpers.GPT does not, e.g. {extra[0]!r}" if extra else ""]
        raise WeightsError(f"{path} {' and '.join(w for w in what if w)}: its config.json does not describe these "
                           "weights (or it is another architecture)")
    with torch.device("meta"):
        model = GPT(config, attn_implementation=attn_implementation)
    expected = model.state_dict()
    for ours, parts in groups.items():
        tensor = torch.cat([where[name].get_tensor(name) for name in parts])
        shape = expected[ours].shape
        rows = shape if len(shape) < 2 else (shape.numel() // shape[-1], shape[-1])  # ours with its rows stacked
        if tuple(tensor.shape) != tuple(rows):
            raise WeightsError(f"{path}: {' + '.join(parts[:3])}{' + ...' if len(parts) > 3 else ''} make shape "
                               f"{tuple(tensor.shape)}, but config.json gives {ours} the shape {tuple(shape)}: the "
                               "files come from different models")
        tensor = tensor.reshape(shape).to(device=device, dtype=dtype or tensor.dtype).contiguous()
        model.load_state_dict({ours: tensor}, strict=False, assign=True)
    tie_weights(model)  # the head shares the embedding loaded above (assign=True gave the embedding a new tensor)
    unfilled = [name for name, parameter in model.named_parameters() if parameter.is_meta]
    if unfilled:
        raise WeightsError(f"no tensor of the layout fills {unfilled[0]}: its feed-forward type's hf_weights must "
                           "name every parameter")
    for name, buffer in list(model.named_buffers()):  # state of our own the layout has no place for: it starts at 0
        if buffer.is_meta:
            owner, _, attribute = name.rpartition(".")
            kind = dtype if dtype is not None and buffer.is_floating_point() else buffer.dtype
            setattr(model.get_submodule(owner), attribute, torch.zeros(buffer.shape, device=device, dtype=kind))
    return model.eval()


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The model's weights under LlamaForCausalLM's (Qwen3ForCausalLM's, Qwen3MoeForCausalLM's) names, Q/K/V,
    gate/up and the experts split apart. Refused when a buffer the layout has no place for (a router's balancing
    bias) is not zero: the loaded model would compute something else."""
    config = model.config
    kind = model_type_of(config)
    q, kv = config.n_heads * config.head_dim, config.kv_heads * config.head_dim
    ours = model.state_dict()
    groups = hf_groups(config)
    unplaced = [name for name, buffer in model.named_buffers() if name not in groups and buffer.any()]
    if unplaced:
        raise WeightsError(f"{unplaced[0]} is not zero, and the {kind} layout has no place for it: a model loaded "
                           "from these files would compute something else (zero it, or keep the course's checkpoint)")
    out = {}
    for name, parts in groups.items():
        tensor = ours[name].detach()
        # Q is wider than K and V under grouped-query attention; other stacked parts are equal (an expert's rows)
        if name.endswith("attn.qkv.weight"):
            pieces = tensor.split([q, kv, kv])
        else:
            rows = tensor if tensor.dim() < 2 else tensor.reshape(-1, tensor.size(-1))
            pieces = rows.chunk(len(parts))
        out |= {part: piece.contiguous() for part, piece in zip(parts, pieces, strict=True)}
    return out


def save_hf_llama(model: GPT, directory: str | os.PathLike) -> Path:
    """Write `model.safetensors` and `config.json` that `AutoModelForCausalLM.from_pretrained(directory)` loads as
    LlamaForCausalLM (or Qwen3ForCausalLM, for a model with QK-norm); an interrupted export is refused on load."""
    return save_with_config(directory, hf_state_dict(model), hf_config_dict(model.config))

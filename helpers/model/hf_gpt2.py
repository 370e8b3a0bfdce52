"""GPT-2 weights in the Hugging Face layout, loaded into (and exported from) `helpers.GPT`.

Hugging Face's GPT-2 files (`model.safetensors` of openai-community/gpt2, gpt2-medium, gpt2-large,
gpt2-xl) name tensors `wte.weight`, `h.{i}.attn.c_attn.weight`, ... -- with a `transformer.` prefix when
saved from `GPT2LMHeadModel` -- and store every linear layer as a `Conv1D`, whose weight is (in, out): the
transpose of `nn.Linear`'s (out, in). Older files also carry the causal-mask buffers `attn.bias` and
`attn.masked_bias`, which our model computes instead. Otherwise the names map one to one (`hf_names`).
The file's header gives every shape without reading the data, so sizes are checked before anything loads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from .config import GPT2_VOCAB_SIZE, PRESETS, GPTConfig
from .feed_forward import feed_forward_type, in_layout, part_with_activation
from .gpt import GPT
from .hf_files import WeightsError, check_exported_config, save_with_config
from .hub import WeightsUnavailable as WeightsUnavailable  # re-exported: what download_gpt2 raises
from .hub import download_files
from .loading import tie_weights
from .norm import NORMS, norm_type
from .parts import part_in_layout
from .position_encoding import POSITION_ENCODINGS, position_encoding_type

HF_PREFIX = "transformer."
HF_BUFFERS = ("attn.bias", "attn.masked_bias")  # causal-mask buffers of old files: recomputed, not loaded
GPT2_REPOSITORY = "openai-community/gpt2"

_ATTENTION = {  # ours, after `blocks.{i}.` -> Hugging Face's, after `h.{i}.`
    "attn.qkv.weight": "attn.c_attn.weight", "attn.qkv.bias": "attn.c_attn.bias",
    "attn.out_proj.weight": "attn.c_proj.weight", "attn.out_proj.bias": "attn.c_proj.bias",
}  # the norms', the position table's and the feed-forward's names come from their registered types


def hf_names(config: GPTConfig) -> dict[str, str]:
    """Our parameter names -> Hugging Face's (without the `transformer.` prefix)."""
    norm = norm_type(config).parameter_names(config)

    def norms(ours: str, theirs: str) -> dict[str, str]:
        return {f"{ours}.{name}": f"{theirs}.{name}" for name in norm}

    block = norms("ln1", "ln_1") | _ATTENTION | norms("ln2", "ln_2")
    for ours, (theirs,) in feed_forward_type(config).hf_weights(config, "gpt2").items():  # Conv1D: one to one
        block[f"mlp.{ours}"] = f"mlp.{theirs}"
    names = {"tok_emb.weight": "wte.weight"} | position_encoding_type(config).hf_layouts["gpt2"] | norms("ln_f", "ln_f")
    for i in range(config.n_layers):
        names.update({f"blocks.{i}.{ours}": f"h.{i}.{theirs}" for ours, theirs in block.items()})
    if not config.tie_weights:
        names["lm_head.weight"] = "lm_head.weight"
    return names


def is_conv1d(hf_name: str) -> bool:
    """True for the weights Hugging Face stores as (in, out), which nn.Linear holds transposed: every layer's in a
    block's attention and MLP."""
    name = hf_name.split(".", 2)[-1] if hf_name.startswith("h.") else ""
    return name.startswith(("attn.", "mlp.")) and name.endswith(".weight")


def expected_hf_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The shape each Hugging Face tensor must have for `config` (computed on the meta device: no memory)."""
    _check_gpt2_architecture(config)
    with torch.device("meta"):
        ours = GPT(config).state_dict()
    return {theirs: tuple(ours[name].shape[::-1] if is_conv1d(theirs) else ours[name].shape)
            for name, theirs in hf_names(config).items()}


def _check_gpt2_architecture(config: GPTConfig) -> None:
    unheld = [f"{field}={part.name!r}" for field, part in (("norm", norm_type(config)),
                                                            ("position_encoding", position_encoding_type(config)))
              if not part.hf_layouts]
    if unheld:
        raise WeightsError(f"no Hugging Face layout has tensor names for {' or '.join(unheld)}; keep this model in "
                           "the course's own checkpoints (helpers.training.checkpoint)")
    if not config.is_gpt2:
        raise WeightsError("GPT-2's layout has LayerNorm, learned positions and multi-head attention; this config "
                           "has chapter 8's options: save it in the Llama layout (helpers.model.hf_llama)")
    if not config.bias:
        raise WeightsError("GPT-2's layout has biases in every linear and LayerNorm layer; use a config with bias=True")
    held = in_layout("gpt2")
    if config.ffn_type not in held:
        raise WeightsError(f"GPT-2's layout holds the feed-forward types {', '.join(held)}, not "
                           f"ffn_type={config.ffn_type!r}; use one of those, or save it in the Llama layout")
    hidden = feed_forward_type(config).hidden_dim(config)
    if hidden != 4 * config.d_model:
        raise WeightsError(f"GPT-2's layout has a feed-forward 4 x d_model = {4 * config.d_model} wide, not {hidden}; "
                           "use ffn_hidden=None")


def _strip(name: str) -> str:
    return name.removeprefix(HF_PREFIX)


def _matching_preset(config: GPTConfig) -> str | None:
    fields = ("vocab_size", "context_length", "d_model", "n_layers")
    return next((name for name, p in PRESETS.items() if name.startswith("gpt2")
                 and all(getattr(p, f) == getattr(config, f) for f in fields)), None)


def config_from_hf(shapes: Mapping[str, tuple[int, ...]], hf_config: Mapping | None = None,
                   n_heads: int | None = None, source: str = "the file") -> GPTConfig:
    """Infer the architecture from tensor shapes (names without prefix) and, when given, the file's config.json.

    The number of heads is not visible in any shape: it comes from config.json (`n_head`), `n_heads`, or the
    GPT-2 size with the same width and depth.
    """
    for name in ("wte.weight", "wpe.weight"):
        if name not in shapes:
            raise WeightsError(f"{source} has no tensor {name!r}: not a GPT-2 checkpoint in the Hugging Face layout")
    hf_config = dict(hf_config or {})
    activation = hf_config.get("activation_function", "gelu_new")
    feed_forward = part_with_activation("gpt2", activation)
    if feed_forward is None:
        known = ", ".join(a for part in in_layout("gpt2").values() for a in part.hf_layouts["gpt2"].activations)
        raise WeightsError(f"{source}: activation_function={activation!r}, but helpers.GPT's feed-forward types in "
                           f"GPT-2's layout compute {known}; use transformers for this model")
    norm, positions = part_in_layout(NORMS, "gpt2"), part_in_layout(POSITION_ENCODINGS, "gpt2")
    norm_layout = norm.hf_layouts["gpt2"]
    eps = hf_config.get(norm_layout.eps_key, norm_layout.default_eps)
    if eps != 1e-5:
        raise WeightsError(f"{source}: {norm_layout.eps_key}={eps}, but helpers.GPT uses 1e-5; use transformers")
    if hf_config.get("scale_attn_by_inverse_layer_idx"):
        raise WeightsError(f"{source}: scale_attn_by_inverse_layer_idx is set, which helpers.GPT does not do")
    vocab_size, d_model = shapes["wte.weight"]
    n_layers = 1 + max((int(name.split(".")[1]) for name in shapes if name.startswith("h.")), default=-1)
    if n_layers == 0:
        raise WeightsError(f"{source} has no transformer blocks (tensors h.0.*): not a GPT-2 checkpoint")
    inner = hf_config.get("n_inner")
    if inner not in (None, 4 * d_model):
        raise WeightsError(f"{source}: n_inner={inner}, but helpers.GPT's MLP is 4 x d_model = {4 * d_model} wide")
    fields = dict(vocab_size=vocab_size, context_length=shapes["wpe.weight"][0], d_model=d_model,
                  n_layers=n_layers, ffn_type=feed_forward.name, norm=norm.name, position_encoding=positions.name,
                  tie_weights=bool(hf_config.get("tie_word_embeddings", "lm_head.weight" not in shapes)))
    if "resid_pdrop" in hf_config:
        fields["dropout"] = float(hf_config["resid_pdrop"])
    heads = hf_config.get("n_head", n_heads)
    if heads is None:
        preset = _matching_preset(GPTConfig(**fields, n_heads=1))
        if preset is None:
            raise WeightsError(f"{source}: the number of heads is not in the tensor shapes and there is no "
                               "config.json beside it; pass n_heads=... (or the matching preset)")
        heads = PRESETS[preset].n_heads
    return GPTConfig(**fields, n_heads=heads)


def check_against(config: GPTConfig, preset: str | GPTConfig, source: str = "the file") -> GPTConfig:
    """Return the preset's config (a name or a GPTConfig) if the file's architecture matches it; else say which
    sizes differ and which preset would fit."""
    wanted = _as_config(preset)
    fields = ("vocab_size", "context_length", "d_model", "n_heads", "n_layers", "ffn_type", "tie_weights")
    diff = [f for f in fields if getattr(config, f) != getattr(wanted, f)]
    if diff:
        found = ", ".join(f"{f} {getattr(config, f)}" for f in diff)
        expected = ", ".join(f"{f} {getattr(wanted, f)}" for f in diff)
        match = _matching_preset(config)
        fix = f"pass preset={match!r}" if match else "pass preset=None"
        name = repr(preset) if isinstance(preset, str) else "the given config"
        raise WeightsError(f"{source} holds a model with {found}, but {name} has {expected}: "
                           f"{fix} (None: use the file's own sizes)")
    return wanted


def _as_config(preset: str | GPTConfig) -> GPTConfig:
    return GPTConfig.from_preset(preset) if isinstance(preset, str) else preset


def check_hf_shapes(shapes: Mapping[str, tuple[int, ...]], config: GPTConfig, source: str = "the file") -> None:
    """Every tensor GPT-2 needs is there with its shape, and nothing else is (mask buffers aside)."""
    expected = expected_hf_shapes(config)
    missing = [name for name in expected if name not in shapes]
    if missing:
        raise WeightsError(f"{source} lacks {len(missing)} tensor(s) of this GPT-2, e.g. {missing[0]!r}: "
                           "it is incomplete or another architecture; re-download it or pass the matching preset")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            layout = " (a Conv1D weight, stored (in, out))" if is_conv1d(name) else ""
            raise WeightsError(f"{source}: tensor {name!r}{layout} has shape {tuple(shapes[name])}, expected {shape} "
                               "for this config; pass the file's preset, or preset=None to infer it from the file")
    extra = [n for n in shapes if n not in expected and not n.endswith(HF_BUFFERS)
             and not (n == "lm_head.weight" and config.tie_weights)]
    if extra:
        raise WeightsError(f"{source} has {len(extra)} tensor(s) GPT-2 does not, e.g. {extra[0]!r}: "
                           "it is another architecture; load it with transformers instead")


def _locate(path: str | os.PathLike) -> tuple[Path, dict | None]:
    path = Path(path)
    file = path / "model.safetensors" if path.is_dir() else path
    if not file.is_file():
        raise WeightsError(f"no safetensors file at {file}; give the model.safetensors file or its folder "
                           "(sharded or .bin checkpoints: convert them with transformers' save_pretrained first)")
    config_json = file.parent / "config.json"
    return file, json.loads(config_json.read_text()) if config_json.is_file() else None


def load_hf_gpt2(path: str | os.PathLike, preset: str | GPTConfig | None = None, *, n_heads: int | None = None,
                 device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 attn_implementation: str = "sdpa") -> GPT:
    """A `helpers.GPT` with the weights of a Hugging Face GPT-2 `model.safetensors` (or the folder holding it).

    preset: check the file against this configuration (a name or a GPTConfig); None infers it from the file.
    The model is built on the meta device and each tensor is read, transposed where needed and placed on
    `device` one at a time, so no random initialisation and no second full copy happen.
    """
    file, hf_config = _locate(path)
    with safe_open(file, framework="pt", device="cpu") as f:
        check_exported_config(f.metadata(), hf_config, file.parent / "config.json")
        stored = {_strip(k): k for k in f.keys()}
        shapes = {name: tuple(f.get_slice(key).get_shape()) for name, key in stored.items()}
        if n_heads is None and preset is not None:
            n_heads = _as_config(preset).n_heads
        config = config_from_hf(shapes, hf_config, n_heads, source=str(file))
        if preset is not None:
            config = check_against(config, preset, source=str(file))
        check_hf_shapes(shapes, config, source=str(file))
        with torch.device("meta"):
            model = GPT(config, attn_implementation=attn_implementation)
        for ours, theirs in hf_names(config).items():
            tensor = f.get_tensor(stored[theirs])
            tensor = tensor.t() if is_conv1d(theirs) else tensor
            tensor = tensor.to(device=device, dtype=dtype or tensor.dtype).contiguous()
            model.load_state_dict({ours: tensor}, strict=False, assign=True)
    return tie_weights(model).eval()


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The model's weights under GPT2LMHeadModel's names and layouts (Conv1D weights transposed)."""
    _check_gpt2_architecture(model.config)
    ours = model.state_dict()
    out = {}
    for name, theirs in hf_names(model.config).items():
        tensor = ours[name].detach()
        prefix = "" if theirs == "lm_head.weight" else HF_PREFIX
        out[prefix + theirs] = (tensor.t() if is_conv1d(theirs) else tensor).contiguous()
    return out


def hf_config_dict(config: GPTConfig) -> dict:
    """A config.json that transformers reads as the same GPT-2."""
    _check_gpt2_architecture(config)
    activation = feed_forward_type(config).hf_layouts["gpt2"].activations[0]
    out = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=config.vocab_size,
               n_positions=config.context_length, n_embd=config.d_model, n_layer=config.n_layers,
               n_head=config.n_heads, n_inner=None, activation_function=activation,
               **{norm_type(config).hf_layouts["gpt2"].eps_key: config.norm_eps},
               resid_pdrop=config.dropout, embd_pdrop=config.dropout, attn_pdrop=config.dropout,
               scale_attn_weights=True, tie_word_embeddings=config.tie_weights)
    special = GPT2_VOCAB_SIZE - 1 if config.vocab_size == GPT2_VOCAB_SIZE else None  # GPT-2's <|endoftext|>
    return out | dict(bos_token_id=special, eos_token_id=special)


def save_hf_gpt2(model: GPT, directory: str | os.PathLike) -> Path:
    """Write `model.safetensors` and `config.json` that `GPT2LMHeadModel.from_pretrained(directory)` loads.

    Each file is replaced atomically, but not the pair: the weights carry a copy of their config.json in the file's
    metadata, so an export interrupted between the two (new weights, the previous config.json) is refused on load
    instead of running the new weights with, say, the old number of heads.
    """
    return save_with_config(directory, hf_state_dict(model), hf_config_dict(model.config))


def download_gpt2(repo_id: str = GPT2_REPOSITORY, cache_dir: str | os.PathLike | None = None,
                  endpoint: str | None = None, timeout: float = 5.0) -> Path:
    """The folder with `model.safetensors` and `config.json` of a GPT-2 on the Hugging Face Hub (cached).

    Offline it fails within `timeout` seconds, unless the files are already cached (`helpers.model.hub`).
    """
    return download_files(repo_id, ("config.json", "model.safetensors"), cache_dir, endpoint, timeout)

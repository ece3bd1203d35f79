"""Conversion between a `Cartridge` and Hugging Face PEFT's CARTRIDGE adapter (peft >= 0.19).

PEFT stores a CARTRIDGE adapter as one tensor, `prompt_embeddings` `[p, num_layers * 2 * kv_heads * head_dim]`:
token t's row is, layer by layer, that layer's key then its value, each `[kv_heads, head_dim]` flattened
(`PeftModel.get_prompt` views it as `[p, 2L, H, D]` and splits keys at even, values at odd indices). Keys are
post-RoPE at positions 0..p-1 and queries continue at p, the convention of `Cartridge`, so the conversion is a
reshape and no rotation. PEFT's `num_frozen_tokens` is the cartridge's `num_frozen` (the attention sink).

- `to_peft(cartridge, model)`: a `PeftModel` wrapping `model` whose adapter holds the cartridge;
- `read_peft_model(peft_model)`: the keys, values and frozen count of a PeftModel's CARTRIDGE adapter;
- `save_adapter(cartridge, model, dir)` / `read_adapter(dir, ...)`: a PEFT adapter directory
  (`adapter_config.json` + `adapter_model.safetensors`) written and read without keeping a wrapper around.

This module works on tensors and on any cartridge object; `Cartridge.from_peft` and `Cartridge.from_peft_adapter`
(cartridges/cache.py) build cartridges from what it reads, so the two modules do not import each other.
"""

import os
from pathlib import Path

import torch

from cartridges.format import CartridgeError, CartridgeFileError
from zoo.atomic import staged_dir


def prompt_embeddings(cartridge) -> torch.Tensor:
    """The cartridge as PEFT's `prompt_embeddings` `[p, L * 2 * H * D]` (detached, the cartridge's dtype)."""
    kv = torch.stack([cartridge.keys().detach(), cartridge.values().detach()], dim=1)  # [L, 2, H, p, D]
    return kv.permute(3, 0, 1, 2, 4).reshape(cartridge.num_tokens, -1)  # [p, L * 2 * H * D]


def kv_from_prompt_embeddings(
    embeddings: torch.Tensor, num_layers: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's `[p, L * 2 * H * D]` -> (keys, values), each `[L, H, p, D]`."""
    width = num_layers * 2 * num_kv_heads * head_dim
    if embeddings.ndim != 2 or embeddings.shape[1] != width:
        raise CartridgeError(
            f"prompt embeddings of shape {tuple(embeddings.shape)} do not fit the model ([p, {width}] expected: "
            f"{num_layers} layers x 2 x {num_kv_heads} kv heads x {head_dim})"
        )
    p = embeddings.shape[0]
    kv = embeddings.reshape(p, num_layers, 2, num_kv_heads, head_dim).permute(1, 2, 3, 0, 4)  # [L, 2, H, p, D]
    return kv[:, 0].contiguous(), kv[:, 1].contiguous()


def peft_config(cartridge):
    from peft import CartridgeConfig

    return CartridgeConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=cartridge.num_tokens, num_frozen_tokens=cartridge.num_frozen
    )


def to_peft(cartridge, model, adapter_name: str = "default"):
    """A `PeftModel` around `model` whose CARTRIDGE adapter holds this cartridge; its logits equal
    `model` reading the cartridge as a prefix cache. The cartridge is checked against `model` first."""
    from peft import get_peft_model

    cartridge.check_model(model, check_model_id=False)
    peft_model = get_peft_model(model, peft_config(cartridge), adapter_name=adapter_name)
    config = peft_model.peft_config[adapter_name]
    expected = cartridge.num_layers * 2 * cartridge.info.model.num_kv_heads * cartridge.info.model.head_dim
    if config.num_layers * 2 * config.token_dim != expected:
        raise CartridgeError(
            f"PEFT laid out {config.num_layers} layers of token_dim {config.token_dim} for this model, the cartridge "
            f"needs {cartridge.num_layers} x {cartridge.info.model.num_kv_heads * cartridge.info.model.head_dim}"
        )
    encoder = peft_model.prompt_encoder[adapter_name]
    encoder.load_prompt_embeddings(prompt_embeddings(cartridge).to(encoder.trainable_embedding.dtype))
    return peft_model


def read_peft_model(
    peft_model, num_layers: int, num_kv_heads: int, head_dim: int, adapter_name: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(keys, values, num_frozen) of a PeftModel's CARTRIDGE adapter (the active one by default): fp32, each
    `[L, H, p, D]`, on the adapter's device."""
    from peft.utils import PeftType

    name = adapter_name or peft_model.active_adapter
    if name not in peft_model.peft_config:
        raise CartridgeError(f"the PeftModel has no adapter {name!r} (has {sorted(peft_model.peft_config)})")
    config = peft_model.peft_config[name]
    if config.peft_type != PeftType.CARTRIDGE:
        raise CartridgeError(f"adapter {name!r} is a {config.peft_type} adapter, not a CARTRIDGE one")
    weight = peft_model.prompt_encoder[name].weight.detach().float()  # [p, L * 2 * H * D]
    keys, values = kv_from_prompt_embeddings(weight, num_layers, num_kv_heads, head_dim)
    return keys, values, config.num_frozen_tokens


def save_adapter(cartridge, model, directory: str | os.PathLike) -> Path:
    """Write `directory` as a PEFT CARTRIDGE adapter that `PeftModel.from_pretrained(model, directory)` loads.

    Written into a temporary sibling and renamed, so a kill leaves the old adapter or the new one."""
    directory = Path(directory)
    with staged_dir(directory) as staging:
        to_peft(cartridge, model).save_pretrained(str(staging))
    return directory


def read_adapter(
    directory: str | os.PathLike, num_layers: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(keys, values, num_frozen) of a PEFT CARTRIDGE adapter directory, fp32 on the CPU, each `[L, H, p, D]`."""
    from peft import PeftConfig
    from peft.utils import PeftType
    from peft.utils.save_and_load import load_peft_weights

    directory = Path(directory)
    if not (directory / "adapter_config.json").is_file():
        raise CartridgeFileError(f"{directory} is not a PEFT adapter directory (no adapter_config.json)")
    try:
        config = PeftConfig.from_pretrained(str(directory))
        weights = load_peft_weights(str(directory), device="cpu")
    except (OSError, ValueError, KeyError) as e:
        raise CartridgeFileError(f"cannot read the PEFT adapter {directory}: {str(e).splitlines()[0]}") from None
    if config.peft_type != PeftType.CARTRIDGE:
        raise CartridgeFileError(f"{directory} holds a {config.peft_type} adapter, not a CARTRIDGE one")
    if "prompt_embeddings" not in weights:
        raise CartridgeFileError(f"{directory}: the adapter weights lack 'prompt_embeddings'")
    embeddings = weights["prompt_embeddings"].float()
    if embeddings.ndim != 2 or embeddings.shape[0] != config.num_virtual_tokens:
        raise CartridgeFileError(
            f"{directory}: prompt_embeddings {tuple(embeddings.shape)} for {config.num_virtual_tokens} virtual tokens"
        )
    keys, values = kv_from_prompt_embeddings(embeddings, num_layers, num_kv_heads, head_dim)
    return keys, values, config.num_frozen_tokens

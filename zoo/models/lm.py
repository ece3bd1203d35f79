"""LanguageModel: token embedding, pre-norm blocks whose mixers follow `ModelConfig.pattern`, final norm, head.

`hidden_states` and `logits` are separate so training can project only the positions that carry a label.
With `max_position_embeddings` > 0 a learned absolute position table is added to the token embeddings
(Zoology's attention baseline); the decode state then ends with one extra entry, {"pos": [] int64}, the
position of the next token.
"""

from __future__ import annotations

import math
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kernels.launch import is_capturing
from zoo.models.block import Block, TanhMLP, make_norm
from zoo.models.mixers import MIXERS, step_state_nbytes

if TYPE_CHECKING:
    # only a type here: zoo.config imports zoo.models.mixers (so zoo.models) to check a ModelConfig's mixers
    from zoo.config import ModelConfig


class LanguageModel(nn.Module):
    """A causal LM over token ids: [B, T] -> logits [B, T, vocab_size].

    The state for decoding is a list with one mixer state per layer (None for stateless mixers).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.embedding = nn.Embedding(config.vocab_size, d)
        self.max_positions = config.max_position_embeddings
        self.position = nn.Embedding(self.max_positions, d) if self.max_positions else None
        self.embed_dropout = nn.Dropout(config.embed_dropout) if config.embed_dropout else None
        self.blocks = nn.ModuleList(
            Block(d, MIXERS[name](d, **config.mixers.get(name, {})), config.mlp, config.mlp_hidden, config.norm,
                  config.rms_eps)
            for name in config.layers()
        )
        self.norm = make_norm(config.final_norm or config.norm, d, config.rms_eps)
        self.head = nn.Linear(d, config.vocab_size, bias=False)
        self.apply(partial(_init_weights, zero_conv_bias=config.init == "default"))
        if config.init == "zoology":
            std = 0.02 / math.sqrt(2 * len(self.blocks))
            for i, block in enumerate(self.blocks):
                if block.mixer.name in ZOOLOGY_OUT_PROJ:
                    nn.init.normal_(block.mixer.out.weight, std=std)
                if isinstance(block.mlp, TanhMLP):  # its `fc2`, the other name Zoology's init rescales
                    nn.init.normal_(block.mlp.fc2.weight, std=std)
                if hasattr(block.mixer, "zoology_init"):  # the rest of a mixer's Zoology init (RWKV-4, Hyena, H3)
                    block.mixer.zoology_init(i)
        for block in self.blocks:  # a mixer with its own scheme (Mamba's) re-initialises its weights after that
            if hasattr(block.mixer, "init_weights"):
                block.mixer.init_weights(n_layers=len(self.blocks))
        if config.tie_embeddings:
            self.head.weight = self.embedding.weight

    def _check_state(self, state: list[Any] | None) -> None:
        expected = len(self.blocks) + (self.position is not None)
        if state is not None and len(state) != expected:
            raise ValueError(
                f"state must hold one entry per layer ({len(self.blocks)}) and, with positions, one for the "
                f"position ({expected} in all), got {len(state)}"
            )

    def _embed(self, input_ids: torch.Tensor, state: list[Any] | None) -> torch.Tensor:
        """input_ids: [B, T] -> [B, T, d]: token embeddings, plus positions, then dropout while training."""
        # contiguous(): a no-op for one model; in a vmapped pack (zoo/steps.py) the embedding's batching rule
        # returns the members interleaved in memory ([B, T, N, d]), and every later elementwise op of the residual
        # stream would read them strided. Contiguous, each member's activations lie together.
        x = self.embedding(input_ids).contiguous()  # [B, T, d]
        if self.position is not None:
            T = input_ids.shape[1]
            if state is None:
                if T > self.max_positions:
                    raise ValueError(f"T={T} exceeds model.max_position_embeddings={self.max_positions}")
                positions = torch.arange(T, device=input_ids.device)
            else:
                pos = state[-1]["pos"]
                if not is_capturing(input_ids) and int(pos) + T > self.max_positions:
                    raise ValueError(
                        f"{int(pos)} + {T} tokens exceed model.max_position_embeddings={self.max_positions}"
                    )
                positions = pos + torch.arange(T, device=input_ids.device)
                pos.add_(T)
            x = x + self.position(positions)  # [B, T, d]
        return x if self.embed_dropout is None else self.embed_dropout(x)

    def hidden_states(self, input_ids: torch.Tensor, state: list[Any] | None = None) -> torch.Tensor:
        """input_ids: [B, T] integer -> final-norm hidden states [B, T, d_model]. A state is continued in place."""
        if input_ids.dim() != 2 or input_ids.is_floating_point():
            raise ValueError(f"input_ids must be integer [B, T], got {input_ids.dtype} {list(input_ids.shape)}")
        self._check_state(state)
        x = self._embed(input_ids, state)  # [B, T, d]
        for i, block in enumerate(self.blocks):
            x = block(x, None if state is None else state[i])
        return self.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [..., d_model] -> [..., vocab_size]."""
        return self.head(h)

    def forward(self, input_ids: torch.Tensor, state: list[Any] | None = None) -> torch.Tensor:
        """input_ids: [B, T] -> logits [B, T, vocab_size]."""
        return self.logits(self.hidden_states(input_ids, state))

    def step(self, input_ids_t: torch.Tensor, state: list[Any]) -> torch.Tensor:
        """input_ids_t: [B] -> logits [B, vocab_size]; advances every layer's state by one token in place."""
        if input_ids_t.dim() != 1 or input_ids_t.is_floating_point():
            raise ValueError(f"input_ids_t must be integer [B], got {input_ids_t.dtype} {list(input_ids_t.shape)}")
        self._check_state(state)
        x = self._embed(input_ids_t[:, None], state)[:, 0]  # [B, d]
        for block, layer_state in zip(self.blocks, state):
            x = block.step(x, layer_state)
        return self.logits(self.norm(x))

    def init_state(
        self, batch_size: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> list[Any]:
        """One preallocated state per layer (on the model's device and dtype unless given), then, with
        positions, {"pos": [] int64}."""
        states = [block.init_state(batch_size, device=device, dtype=dtype) for block in self.blocks]
        if self.position is not None:
            device = device if device is not None else self.embedding.weight.device
            states.append({"pos": torch.zeros((), device=device, dtype=torch.int64)})
        return states

    def state_size(self, seq_len: int) -> int:
        """Recurrent-state elements per sequence after seq_len tokens, summed over layers."""
        return sum(block.state_size(seq_len) for block in self.blocks)

    def step_state_nbytes(self, seq_len: int) -> dict[str, int]:
        """Mixer name -> bytes of recurrent state one decode step reads plus writes per sequence, summed over the
        layers of that mixer, once the state holds seq_len tokens (`zoo.models.mixers.step_state_nbytes`)."""
        out: dict[str, int] = {}
        for block in self.blocks:
            out[block.mixer.name] = out.get(block.mixer.name, 0) + sum(step_state_nbytes(block.mixer, seq_len))
        return out

    def num_parameters(self) -> int:
        """Parameter count, tied weights counted once."""
        return sum(p.numel() for p in self.parameters())


# Mixers whose output projection Zoology names `out_proj`, the name its init rescales (MHA, Hyena, SlidingAttn;
# Based's is `proj_o` and H3's `output_linear`, so theirs keep 0.02; RWKV-4's `zoology_init` resets its four
# projections to PyTorch's init, which Zoology's scripted RWKV mixer keeps).
ZOOLOGY_OUT_PROJ = ("attention", "hyena", "sliding_window")


def _init_weights(module: nn.Module, zero_conv_bias: bool = True) -> None:
    """Normal(0, 0.02) for linear and embedding weights, zero linear biases; norms and conv weights keep their
    defaults, conv biases too unless `zero_conv_bias` (Zoology's init for its TransformerBlock models keeps them).
    Mixers that define `init_weights(n_layers)` redo theirs afterwards."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if zero_conv_bias and isinstance(module, nn.Conv1d) and module.bias is not None:
        nn.init.zeros_(module.bias)

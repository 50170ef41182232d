"""``--module tests.torchtitan_harness --config llama3_debugmodel_cpu``: torchtitan's llama3 debug model
and trainer config with what a CPU run needs: dense causal attention (FlexAttention has no CPU backward
and the dataloader below emits no document positions) and a local token dataset (the debug model's
``c4_test`` files and tokenizer are not in torchtitan's wheel). Everything else is torchtitan's."""

from dataclasses import dataclass

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

VOCAB = 2048  # the debug model's vocabulary


class TokenIds(BaseTokenizer):
    """A tokenizer over the model's vocabulary whose text is token ids written as numbers."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config, *, tokenizer_path: str):
        super().__init__()

    def encode(self, text: str, *args, **kwargs) -> list[int]:
        return [int(word) for word in text.split()]

    def decode(self, ids, *args, **kwargs) -> str:
        return " ".join(str(int(i)) for i in ids)

    def get_vocab_size(self) -> int:
        return VOCAB


class AffineSequences(BaseDataLoader):
    """Batches of sequences ``t[i+1] = (a * t[i] + b) mod VOCAB`` with (a, b, t[0]) drawn from a seeded
    generator: learnable, so the loss falls over a few steps. Each data-parallel rank draws its own rows
    from the same stream, so a run's global batch does not depend on how it is split."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        seed: int = 1234

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: BaseTokenizer,
        seq_len: int,
        local_batch_size: int,
        **kwargs,
    ):
        self.seed = config.seed
        self.dp_world_size, self.dp_rank = dp_world_size, dp_rank
        self.seq_len, self.local_batch_size = seq_len, local_batch_size

    def _global_batch(self, generator: torch.Generator) -> torch.Tensor:
        rows = self.local_batch_size * self.dp_world_size
        a = torch.randint(0, 8, (rows, 1), generator=generator) * 2 + 1
        b = torch.randint(0, VOCAB, (rows, 1), generator=generator)
        tokens = [torch.randint(0, VOCAB, (rows, 1), generator=generator)]
        for _ in range(self.seq_len):
            tokens.append((a * tokens[-1] + b) % VOCAB)
        return torch.cat(tokens, dim=1)

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed)
        rows = slice(self.dp_rank * self.local_batch_size, (self.dp_rank + 1) * self.local_batch_size)
        while True:
            batch = self._global_batch(generator)[rows]
            yield {"input": batch[:, :-1]}, batch[:, 1:]

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass


def llama3_debugmodel_cpu() -> Trainer.Config:
    """torchtitan's ``llama3_debugmodel`` with dense causal attention, the local token dataset, a short
    sequence and a fixed seed."""
    config = llama3_debugmodel()
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.tokenizer = TokenIds.Config()
    config.dataloader = AffineSequences.Config()
    config.training.seq_len = 64
    config.training.local_batch_size = 4
    config.training.steps = 10
    config.debug.seed = 0
    return config

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


class TextBatchesForQwen35(AffineSequences):
    """``AffineSequences`` with what torchtitan's Qwen3.5 forward takes from a text batch besides the
    tokens: the positions of its 1D RoPE, and the special tokens it looks images and videos up by (ids
    outside the vocabulary: a text batch holds none)."""

    @dataclass(kw_only=True, slots=True)
    class Config(AffineSequences.Config):
        pass

    def __iter__(self):
        special_tokens = {"image_id": VOCAB, "video_id": VOCAB + 1}
        for inputs, labels in super().__iter__():
            tokens = inputs["input"]
            positions = torch.arange(tokens.shape[1]).expand_as(tokens)
            yield {"input": tokens, "positions": positions, "special_tokens": special_tokens}, labels


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


def qwen35_debugmodel_cpu() -> Trainer.Config:
    """torchtitan's Qwen3.5 debug model (six Gated DeltaNet layers and two of full attention, offset
    norms, the gated norm after the delta rule; its vision encoder built, never fed) with the
    trainer settings of torchtitan's ``qwen35_debugmodel`` (whose module needs torchvision for its image
    dataloader), the local token dataset and its vocabulary, dense causal attention, a short sequence
    and a fixed seed."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import TrainingConfig
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    from .cpu import import_qwen35

    import_qwen35()
    from torchtitan.models.qwen3_5 import model_registry

    model_spec = model_registry("debugmodel")
    model = model_spec.model
    model.vocab_size = model.tok_embeddings.num_embeddings = model.lm_head.out_features = VOCAB
    for layer in model.layers:
        if layer.attention is not None:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = Trainer.Config(
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=VOCAB)),
        tokenizer=TokenIds.Config(),
        metrics=MetricsProcessor.Config(log_freq=1),
        model_spec=model_spec,
        dataloader=TextBatchesForQwen35.Config(),
        optimizer=default_adamw(lr=5e-3),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
        ),
        training=TrainingConfig(local_batch_size=4, seq_len=64, steps=10),
        activation_checkpoint=SelectiveAC.Config(),
    )
    config.debug.seed = 0
    return config

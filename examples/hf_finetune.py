"""Fine-tune a Hugging Face causal LM with ``Trainer`` on the neuron device.

    python examples/hf_finetune.py

``TrainingArguments`` picks ``neuron:0`` by itself (no ``use_cpu``, no device argument): the only
change from a CUDA script is none at all. The model is a tiny random Llama and the data random
token ids, so the script runs anywhere in a minute or two; the loss it prints must go down.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments  # noqa: E402

import torchneuron  # noqa: E402


class RepeatedSequences(torch.utils.data.Dataset):
    """A few random sequences, repeated: something a tiny model can learn."""

    def __init__(self, vocab: int, n: int = 64, length: int = 16):
        g = torch.Generator().manual_seed(0)
        self.base = torch.randint(3, vocab, (4, length), generator=g)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = self.base[i % len(self.base)]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def main() -> None:
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="hf-finetune-"), max_steps=20,
                             per_device_train_batch_size=8, learning_rate=3e-3, logging_steps=5,
                             report_to=[], save_strategy="no", disable_tqdm=True)
    print("training on", args.device)
    trainer = Trainer(model=model, args=args, train_dataset=RepeatedSequences(config.vocab_size))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print("losses:", [round(x, 3) for x in losses])
    print(torchneuron.metrics.summary())


if __name__ == "__main__":
    main()

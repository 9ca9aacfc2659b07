"""A frozen ``nn.MultiheadAttention`` tower in front of a LoRA-tuned Llama, HF Trainer, ZeRO-3, non-reentrant checkpointing.

The shape of a vision-language fine-tune: a frozen encoder (here ``nn.TransformerEncoder`` layers,
batch-first self-attention, so ``nn.MultiheadAttention`` gets the same tensor as query, key and
value) turns "patches" into a prefix of embeddings, a trainable patch embedding in front of it
gets gradients through it, and the language model behind it is trained with PEFT LoRA. Every
encoder layer and every Llama layer is checkpointed, non-reentrant. Same launchers and options as
``hf_trainer_lora.py``; the patches are random, fixed per sample. On CPU:

    DS_ACCELERATOR=cpu accelerate launch --config_file examples/accelerate_zero3.yaml \\
        examples/frozen_tower_lora.py --ddp-backend gloo
"""

import functools

import torch
from torch.utils.checkpoint import checkpoint

from hf_trainer_lora import RepeatingSequences, argument_parser, build_model, check_world_size, training_arguments
from clean_exit import process_groups_destroyed_at_exit
from lifecycle_probe import train_with_probe

PATCH_DIM = 48
PATCHES = 8
IGNORE_INDEX = -100


class PatchesAndText(RepeatingSequences):
    """``RepeatingSequences`` with ``PATCHES`` random patch vectors per sample, the same at every epoch."""

    def __getitem__(self, index):
        item = super().__getitem__(index)
        item["patches"] = torch.randn(PATCHES, PATCH_DIM, generator=torch.Generator().manual_seed(index))
        return item


class FrozenTower(torch.nn.Module):
    """``nn.TransformerEncoderLayer`` layers, frozen, each checkpointed when checkpointing is on (HF's convention)."""

    def __init__(self, hidden_size, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(hidden_size, nhead=4, dim_feedforward=2 * hidden_size, dropout=0.0,
                                             batch_first=True) for _ in range(layers))
        self.requires_grad_(False)
        self.gradient_checkpointing = False

    def forward(self, x):
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                x = layer._gradient_checkpointing_func(layer, x)
            else:
                x = layer(x)
        return x


class TowerThenLlama(torch.nn.Module):
    """Trainable patch embedding -> frozen tower -> prefix of the LoRA Llama's input embeddings."""

    def __init__(self, args):
        super().__init__()
        self.llm = build_model(args)
        self.patch_embed = torch.nn.Linear(PATCH_DIM, args.hidden_size)
        self.tower = FrozenTower(args.hidden_size, args.tower_layers)

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, **kwargs):
        """What the HF Trainer calls in ``train()`` when ``gradient_checkpointing=True``: the tower, then the Llama."""
        options = {"use_reentrant": True, **(activation_checkpointing_kwargs or {})}
        for layer in self.tower.layers:
            layer._gradient_checkpointing_func = functools.partial(checkpoint, **options)
        self.tower.gradient_checkpointing = True
        self.llm.activation_checkpointing_enable(activation_checkpointing_kwargs=options, **kwargs)

    def forward(self, patches, input_ids, labels):
        prefix = self.tower(self.patch_embed(patches))
        embeds = torch.cat([prefix, self.llm.get_input_embeddings()(input_ids)], dim=1)
        labels = torch.cat([labels.new_full(prefix.shape[:2], IGNORE_INDEX), labels], dim=1)
        return self.llm(inputs_embeds=embeds, labels=labels)


def main(argv=None):
    from transformers import Trainer
    parser = argument_parser(__doc__)
    parser.add_argument("--tower-layers", type=int, default=2)
    args = parser.parse_args(argv)
    training_args = training_arguments(args)
    check_world_size(training_args)
    dataset = PatchesAndText(args.batch_size * training_args.world_size, args.seq_len, args.vocab_size)
    trainer = Trainer(model=TowerThenLlama(args), args=training_args, train_dataset=dataset)
    train_with_probe(trainer, args.summary)


if __name__ == "__main__":
    with process_groups_destroyed_at_exit():
        main()

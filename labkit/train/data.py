"""Training data: megatron-core GPTDataset (or MockGPTDataset) built by BlendedMegatronDatasetBuilder, read in
Megatron's order (global batch after global batch; each data-parallel rank takes its slice of every micro-batch)."""
from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

from labkit.megatron.tokenizer import build_tokenizer as tokenizer_from_files


def build_tokenizer(args):
    return tokenizer_from_files(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file,
                                args.vocab_size)


def target_sizes(args) -> list[int]:
    """Samples needed per split, as Megatron-LM computes them."""
    train = args.train_iters * args.global_batch_size
    evals = (args.train_iters // args.eval_interval + 1) * args.eval_iters if args.eval_iters else 0
    return [train, evals * args.global_batch_size, args.eval_iters * args.global_batch_size]


def build_datasets(args, tokenizer):
    """(train, valid, test) datasets; valid/test are None when not requested or empty."""
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=(args.data_prefixes, args.data_weights) if args.data_prefixes else None,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,  # the causal mask is built inside attention
        mid_level_dataset_surplus=0.005,
    )
    cls = MockGPTDataset if args.mock_data else GPTDataset
    sizes = target_sizes(args)
    datasets = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()
    train, valid, test = datasets
    if train is None or len(train) == 0:
        raise ValueError(f"--split: {args.split} leaves no training data in {' '.join(args.data_prefixes)}")
    return train, valid, test


class MicroBatches:
    """An endless iterator of this rank's micro-batches, starting after `consumed` samples (for resuming)."""

    def __init__(self, dataset, micro_batch_size: int, consumed: int, device: torch.device):
        self.dataset, self.micro, self.device = dataset, micro_batch_size, device
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.next_sample = consumed

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        start = self.next_sample + self.dp_rank * self.micro
        self.next_sample += self.micro * self.dp_size
        samples = [self.dataset[(start + i) % len(self.dataset)] for i in range(self.micro)]
        return {key: torch.stack([s[key] for s in samples]).to(self.device, non_blocking=True)
                for key in ("tokens", "labels", "loss_mask", "position_ids")}


def data_iterators(args, dataset, consumed: int, device) -> list | None:
    """One iterator per model chunk (virtual pipeline stages each read the same stream), or None without data."""
    if dataset is None:
        return None
    chunks = args.virtual_pipeline_model_parallel_size or 1
    iterators = [MicroBatches(dataset, args.micro_batch_size, consumed, device) for _ in range(chunks)]
    return iterators if chunks > 1 else iterators[0]


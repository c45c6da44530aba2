"""Megatron's own rules, in one home beneath the spec, the estimator, the driver and the log reader.

- `labkit.megatron.sizes`: the sizes Megatron derives from the ones it is given (the MLP width, query groups, the
  padded vocabulary, the data-parallel size, layers per pipeline stage and per virtual stage), each written once and
  checked in tests against megatron-core's own objects.
- `labkit.megatron.rules`: every rule on Megatron's arguments (how the sizes fit together, what each feature needs),
  one function over a parsed command line that the driver and `labkit validate` both run.
- `labkit.megatron.flags`: each flag labkit writes or reads, with its type, default and help; the driver's parser.
- `labkit.megatron.sharding`: which implementation shards the model state (distributed optimizer, FSDP2,
  Megatron-FSDP, DeepSpeed), decided once.
- `labkit.megatron.shape` and `labkit.megatron.flops`: the model's sizes under the formulas' names, and the FLOPs of
  an iteration as Megatron-LM counts and logs them.
- `labkit.megatron.tokenizer`: the tokenizers by Megatron-LM's --tokenizer-type names, which size the vocabulary.

Nothing here imports the rest of labkit, so every other package may import it.
"""

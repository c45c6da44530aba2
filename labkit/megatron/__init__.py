"""Megatron's own rules, in one home beneath the spec, the estimator, the driver and the log reader.

- `labkit.megatron.sizes`: the sizes Megatron derives from the ones it is given (the MLP width, query groups, the
  padded vocabulary, the data-parallel size, layers per pipeline stage and per virtual stage), each written once and
  checked in tests against megatron-core's own objects.
- `labkit.megatron.rules`: how those sizes must fit together (heads and query groups over the tensor ranks, the world
  split, micro-batches over the data ranks), which `labkit validate` and the driver word with their own names.

Nothing here imports the rest of labkit, so every other package may import it.
"""

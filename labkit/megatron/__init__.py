"""Megatron's own rules, in one home beneath the spec, the estimator, the driver and the log reader.

- `labkit.megatron.sizes`: the sizes Megatron derives from the ones it is given (the MLP width, query groups, the
  padded vocabulary, the data-parallel size, layers per pipeline stage and per virtual stage), each written once and
  checked in tests against megatron-core's own objects.

Nothing here imports the rest of labkit, so every other package may import it.
"""

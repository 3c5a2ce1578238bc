"""Park and wake a model's weights: out of process memory while the engine sleeps, back on wake.

`tensor_walk` finds every tensor the runner's objects hold and the memory extents they occupy;
`stores` keeps the parked bytes (CPU: an unlinked file, mapped; CUDA: pinned host memory);
`weights.WeightParker` moves the extents there and back and repoints the tensors in place, so
every reference to a weight (modules, the lean forward's layer tables) keeps working.
"""

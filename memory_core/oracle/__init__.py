"""The dense-mask oracle: the paper's method written the literal way (one sequence, one boolean
mask), what every fused pass is tested against and the training benchmark's baseline.

May import: ``memory_core.weights`` only (``AdapterWeights``). It shares no code with the passes on
purpose, and nothing in memory_core imports it: tests and benchmarks do.
"""

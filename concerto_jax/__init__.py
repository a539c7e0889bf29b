"""concerto_jax: overlap communication with computation in JAX training steps.

Pipeline: capture (post-SPMD HLO) -> hlo_passes IR -> passes -> emit -> execute.
"""

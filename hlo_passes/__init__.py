"""HLO IR for concerto_jax: parse per-device HLO text into a graph IR, verify it, print it back."""

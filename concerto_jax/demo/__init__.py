"""What the main job (``python -m concerto_jax``) runs: a small GPT train step with Megatron
tensor parallelism (``gpt``) and the timelines of scheduled modules (``timeline``)."""

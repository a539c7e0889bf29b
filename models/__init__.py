"""Flax models of the Concerto evaluation (GPT, ViT, Evoformer, WideResNet), their parallel layouts and train steps."""

"""Flax models of the Concerto evaluation (GPT, ViT, Evoformer, WideResNet), their parallel layouts and train steps."""

from models.layouts import LAYOUTS, Layout, get_layout, make_mesh
from models.registry import MODELS, Case, list_cases, make_case
from models.train import OptimizerOptions, TrainState, TrainStep, build_train_step

__all__ = [
    "LAYOUTS",
    "MODELS",
    "Case",
    "Layout",
    "OptimizerOptions",
    "TrainState",
    "TrainStep",
    "build_train_step",
    "get_layout",
    "list_cases",
    "make_case",
    "make_mesh",
]

"""Checkpoint resolution and the streaming loader: weights go from the file to the device, one
tensor at a time, never through a full host copy of the model."""

from .checkpoint import Checkpoint, resolve_checkpoint
from .default_model import DEFAULT_MODEL, default_model_path
from .options import LoadOptions
from .pretrained import load_pretrained

__all__ = ["DEFAULT_MODEL", "Checkpoint", "LoadOptions", "default_model_path", "load_pretrained", "resolve_checkpoint"]

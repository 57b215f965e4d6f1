"""Checkpoint resolution and the streaming loader: weights go from the file to the device, one
tensor at a time, never through a full host copy of the model."""

from .checkpoint import Checkpoint, resolve_checkpoint
from .pretrained import load_pretrained

__all__ = ["Checkpoint", "load_pretrained", "resolve_checkpoint"]

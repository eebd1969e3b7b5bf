"""Built-in tasks and the tiny model that learns them."""

from .addition import AdditionTask
from .base import Task
from .gpt import GPTConfig, KVCache, TinyGPT, build_gpt

__all__ = ["AdditionTask", "GPTConfig", "KVCache", "Task", "TinyGPT", "build_gpt"]

from .cache import KVCache
from .config import ModelConfig
from .llama import ForwardOutput, Transformer
from .loading import REGISTRY, load_transformer, resolve

__all__ = ["KVCache", "ModelConfig", "ForwardOutput", "Transformer", "REGISTRY", "load_transformer", "resolve"]

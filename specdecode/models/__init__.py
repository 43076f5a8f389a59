from .cache import BatchKVCache, KVCache
from .config import ModelConfig
from .llama import BatchForwardOutput, ForwardOutput, Transformer
from .loading import REGISTRY, load_transformer, resolve

__all__ = ["BatchKVCache", "KVCache", "ModelConfig", "BatchForwardOutput", "ForwardOutput", "Transformer", "REGISTRY",
           "load_transformer", "resolve"]

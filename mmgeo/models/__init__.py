"""Models: the GeoRetriever, its config, and the registry of named variants.

Also here: ``checkpoint`` (save_model / load_model: one self-describing file, safetensors or torch, never
unpickling code) and ``hub`` (the two loading errors: missing download, unsafe pickle).
"""

from mmgeo.models.config import ModelConfig
from mmgeo.models.embedding import Embedding
from mmgeo.models.geo_retriever import GeoRetriever
from mmgeo.models.registry import create_model, list_models, model_config, register_model

__all__ = ["Embedding", "GeoRetriever", "ModelConfig", "create_model", "list_models", "model_config",
           "register_model"]

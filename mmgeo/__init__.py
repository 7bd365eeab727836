"""mmgeo: image–text retrieval with one attention space and two operators.

Public API (imports are lazy, so ``import mmgeo`` does no work):
    load_model(path) -> GeoRetriever with encode_text / encode_image / score
    create_model(name, **overrides), list_models()
    save_model(model, path)
"""

from importlib import import_module

_EXPORTS = {
    "load_model": "mmgeo.models.checkpoint",
    "save_model": "mmgeo.models.checkpoint",
    "create_model": "mmgeo.models",
    "list_models": "mmgeo.models",
    "model_config": "mmgeo.models",
    "GeoRetriever": "mmgeo.models",
    "ModelConfig": "mmgeo.models",
    "Embedding": "mmgeo.models",
    "GeometricAttentionBlock": "mmgeo.layers",
    "convert_attention": "mmgeo.layers",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mmgeo' has no attribute {name!r}")

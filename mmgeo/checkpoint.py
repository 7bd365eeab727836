"""Saving and loading models: one self-describing file (config + weights), loaded without unpickling code.

Format: ``{"format": "mmgeo", "version": 1, "config": dict, "state_dict": {...}}`` via ``torch.save``;
read back with ``torch.load(weights_only=True)``. Lightning checkpoints written by ``train.py`` carry
the same ``"mmgeo"`` entry and the model's weights under ``model.``; both load here.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import torch

from mmgeo.models import GeoRetriever, ModelConfig

FORMAT, VERSION = "mmgeo", 1


def model_record(model: GeoRetriever) -> dict:
    """The config part of a checkpoint (plain types only)."""
    return {"format": FORMAT, "version": VERSION, "config": dataclasses.asdict(model.cfg)}


def save_model(model: GeoRetriever, path: str | os.PathLike) -> Path:
    """Write config + weights atomically (temp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
        torch.save({**model_record(model), "state_dict": state}, f)
    os.replace(f.name, path)
    return path


def _config_from(record: dict) -> ModelConfig:
    if record.get("format") != FORMAT or record.get("version") != VERSION:
        raise ValueError(f"not an mmgeo v{VERSION} checkpoint (format={record.get('format')!r}, "
                         f"version={record.get('version')!r})")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = {k: v for k, v in record["config"].items() if k in known}
    unknown = sorted(set(record["config"]) - known)
    if unknown:
        raise ValueError(f"checkpoint config has fields this mmgeo does not know: {unknown}; upgrade mmgeo")
    # the weights come from the checkpoint: never fetch pretrained backbones again
    return ModelConfig(**{**cfg, "image_pretrained": False})


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu") -> GeoRetriever:
    """Rebuild a model from an mmgeo checkpoint or a train.py Lightning checkpoint; eval mode."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist; train one with "
                                "`python train.py --config configs/synthetic.yaml`")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - report any unpickling refusal the same way
        raise ValueError(f"{path} is not a checkpoint mmgeo can read safely (weights_only load failed: {err})") from err
    if "mmgeo" in ckpt:  # Lightning checkpoint from train.py
        record = ckpt["mmgeo"]
        state = {k[len("model."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    elif "config" in ckpt:
        record, state = ckpt, ckpt["state_dict"]
    else:
        raise ValueError(f"{path} holds no mmgeo model (no 'config' or 'mmgeo' entry)")
    model = GeoRetriever(_config_from(record))
    model.load_state_dict(state)
    return model.to(device).eval()

"""Saving and loading models: one self-describing file (config + weights), loaded without unpickling code.

Two formats, told apart by the file's content (not its name):

- ``*.safetensors`` (``save_model(model, "model.safetensors")``): the weights as safetensors tensors; the
  model record ``{"format": "mmgeo", "version": 1, "config": dict}`` as JSON under the metadata key
  ``"mmgeo"``. Nothing in the file is executable; the format to share models in.
- anything else: ``{**record, "state_dict": {...}}`` via ``torch.save``, read back only with
  ``torch.load(weights_only=True)``. Lightning checkpoints written by ``train.py`` carry the record under
  ``"mmgeo"`` and the weights under ``model.``; both load here.

A pickle that ``weights_only`` refuses (it names code to run) is never retried unsafely: ``load_model``
raises a ValueError saying how to convert the file.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from mmgeo.io import atomic_path
from mmgeo.models import GeoRetriever, ModelConfig
from mmgeo.models.hub import refused_pickle

FORMAT, VERSION = "mmgeo", 1
META_KEY = "mmgeo"  # safetensors metadata: the model record as JSON
ALIAS_KEY = "mmgeo_aliases"  # safetensors metadata: JSON {dropped name: kept name} of tied weights
CONVERT = ("if you trust its source, load it in an isolated, trusted environment and re-save it with "
           "mmgeo.save_model(model, 'model.safetensors')")


def model_record(model: GeoRetriever) -> dict:
    """The config part of a checkpoint (plain types only)."""
    return {"format": FORMAT, "version": VERSION, "config": dataclasses.asdict(model.cfg)}


def save_model(model: GeoRetriever, path: str | os.PathLike, state_dict: dict | None = None) -> Path:
    """Write config + weights atomically (``atomic_path``): safetensors when ``path`` ends with
    ``.safetensors``, else torch's format (read back with ``weights_only=True``). ``state_dict``: the
    weights to write instead of ``model.state_dict()`` (e.g. gathered from FSDP shards)."""
    path = Path(path)
    state = {k: v.detach().cpu() for k, v in (model.state_dict() if state_dict is None else state_dict).items()}
    with atomic_path(path) as tmp:
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            tensors, aliases = _unshare(state)
            save_file(tensors, tmp, metadata={META_KEY: json.dumps(model_record(model)),
                                              ALIAS_KEY: json.dumps(aliases)})
        else:
            torch.save({**model_record(model), "state_dict": state}, tmp)
    return path


def _unshare(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses tensors that share memory: tied weights (same view) are written once and the
    other names become aliases; partial overlaps are copied apart. -> (tensors, {dropped name: kept name})."""
    groups: dict[int, list[str]] = {}
    for name, t in state.items():
        groups.setdefault(t.untyped_storage().data_ptr(), []).append(name)
    tensors, aliases = {}, {}
    for names in groups.values():
        first = state[names[0]]
        view = (first.data_ptr(), first.shape, first.stride(), first.dtype)
        if all((state[n].data_ptr(), state[n].shape, state[n].stride(), state[n].dtype) == view for n in names):
            tensors[names[0]] = first.contiguous()
            aliases.update({n: names[0] for n in names[1:]})
        else:
            tensors.update({n: state[n].clone(memory_format=torch.contiguous_format) for n in names})
    return tensors, aliases


def _config_from(record: dict, path: Path) -> ModelConfig:
    if not isinstance(record, dict) or (record.get("format"), record.get("version")) != (FORMAT, VERSION) \
            or not isinstance(record.get("config"), dict):
        got = (record.get("format"), record.get("version")) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{path} is not an mmgeo v{VERSION} checkpoint (format, version = {got!r}); "
                         "save it with mmgeo.save_model, or upgrade mmgeo if it was written by a newer one")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = {k: v for k, v in record["config"].items() if k in known}
    unknown = sorted(set(record["config"]) - known)
    if unknown:
        raise ValueError(f"{path}: checkpoint config has fields this mmgeo does not know: {unknown}; upgrade mmgeo")
    # the weights come from the checkpoint: never fetch pretrained backbones again
    return ModelConfig(**{**cfg, "image_pretrained": False})


def _sniff(path: Path) -> str:
    """The file's format by content: "safetensors" (8-byte little-endian header length, then a JSON header
    that fits in the file), "torch" (torch.save's zip archive, or its legacy pickle) or "unknown"."""
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) == 9 and head[8:9] == b"{" and 8 + int.from_bytes(head[:8], "little") <= path.stat().st_size:
        return "safetensors"
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
        return "torch"
    return "unknown"


def _read_safetensors(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """-> (model record, state dict with tied names restored)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # noqa: BLE001 - safetensors' errors for a damaged header or body
        raise ValueError(f"{path} is a damaged safetensors file ({err}); re-save it with mmgeo.save_model") from err
    if META_KEY not in meta:
        raise ValueError(f"{path} is a safetensors file without mmgeo's model record (metadata key {META_KEY!r}): "
                         "bare weights, not an mmgeo model; save models with mmgeo.save_model(model, "
                         "'model.safetensors')")
    try:
        record = json.loads(meta[META_KEY])
        aliases = json.loads(meta.get(ALIAS_KEY, "{}"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: the model record in its safetensors metadata is not valid JSON ({err}); "
                         "re-save it with mmgeo.save_model") from err
    for dropped, kept in aliases.items():
        if kept not in state:
            raise ValueError(f"{path}: tied weight {dropped!r} points at {kept!r}, which the file lacks; "
                             "re-save it with mmgeo.save_model")
        state[dropped] = state[kept]
    return record, state


def _read_torch(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """-> (model record, state dict) through torch.load(weights_only=True) only."""
    try:
        with open(path, "rb") as f:  # a file object: torch.load would hand a "*.safetensors" path to safetensors
            ckpt = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - a refused pickle, a damaged archive, a truncated file
        reason = refused_pickle(err)
        if reason:
            raise ValueError(f"{path} was refused: it is a pickle that needs code to load ({reason}), and mmgeo "
                             f"reads torch checkpoints only with torch.load(weights_only=True); {CONVERT}") from err
        raise ValueError(f"{path} is a damaged torch checkpoint (weights_only load failed: {err}); "
                         "re-save it with mmgeo.save_model") from err
    if not isinstance(ckpt, dict):
        raise ValueError(f"{path} holds a {type(ckpt).__name__}, not an mmgeo model; save models with "
                         "mmgeo.save_model")
    if "mmgeo" in ckpt:  # Lightning checkpoint from train.py
        return ckpt["mmgeo"], {k[len("model."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    if "config" in ckpt:
        return ckpt, ckpt["state_dict"]
    raise ValueError(f"{path} holds no mmgeo model (no 'config' or 'mmgeo' entry); save models with "
                     "mmgeo.save_model")


def _read(path: Path, missing: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """-> (model config, state dict) of the mmgeo checkpoint ``path``; ``missing``: the hint when it is absent."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist; {missing}")
    kind = _sniff(path)
    if kind == "unknown":
        raise ValueError(f"{path} is neither a safetensors file nor a torch checkpoint (by its first bytes); "
                         "pass the model.pt or model.safetensors that train.py or mmgeo.save_model wrote")
    record, state = _read_safetensors(path) if kind == "safetensors" else _read_torch(path)
    return _config_from(record, path), state


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu") -> GeoRetriever:
    """Rebuild a model from an mmgeo checkpoint (safetensors or torch) or a train.py Lightning checkpoint;
    eval mode. Never unpickles code: torch files go through ``torch.load(weights_only=True)``."""
    cfg, state = _read(Path(path), "train one with `python train.py --config configs/synthetic.yaml`")
    model = GeoRetriever(cfg)
    model.load_state_dict(state)
    return model.to(device).eval()


def load_weights(model: GeoRetriever, path: str | os.PathLike) -> GeoRetriever:
    """Copy the weights of the mmgeo checkpoint ``path`` into ``model`` (a warm start: fine-tuning one recipe
    from another's model). The two model configs must agree on every field but ``image_pretrained``, and
    ``coverage_weight`` where ``model`` has none: a coverage fitted after training (docs/design.md §9) is left
    behind, since the run fits its own. The error names the fields that differ."""
    path = Path(path)
    cfg, state = _read(path, "pass a model.pt that train.py wrote to start from")
    theirs, ours = dataclasses.asdict(cfg), dataclasses.asdict(model.cfg)
    free = {"image_pretrained"}
    if not ours["coverage_weight"]:  # their fitted coverage, if any, stays behind
        free.add("coverage_weight")
        state = {k: v for k, v in state.items() if not k.startswith("salience.")}
    differ = sorted(k for k in ours if k not in free and ours[k] != theirs.get(k))
    if differ:
        shown = ", ".join(f"{k}: {theirs.get(k)!r} there, {ours[k]!r} here" for k in differ)
        raise ValueError(f"{path} holds a different model ({shown}); set model / model_args as it was trained")
    model.load_state_dict(state)
    return model

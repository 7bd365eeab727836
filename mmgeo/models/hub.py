"""Loading from model / dataset hubs without a network: the two errors every loader ends in.

- ``MissingDownloadError``: the thing is not in the local cache; the message names what to fetch and where.
- ``UnsafeWeightsError``: a weights file is a pickle that names code; it is refused, never retried unsafely.
"""

from __future__ import annotations

import pickle
import re


class MissingDownloadError(RuntimeError):
    """A model or dataset is not in the local cache and cannot be fetched here."""


class UnsafeWeightsError(ValueError):
    """A weights file is a pickle that ``torch.load(weights_only=True)`` refused: it names code to run."""


def refused_pickle(err: BaseException | None) -> str | None:
    """If ``err``, or an exception it wraps, is ``torch.load(weights_only=True)`` refusing a pickle that names
    code: the reason (e.g. "it names posix.system"); else None."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, pickle.UnpicklingError) and "weights only load failed" in str(err).lower():
            found = re.search(r"GLOBAL (\S+)", str(err))
            return f"it names {found.group(1)}" if found else str(err).splitlines()[0]
        err = err.__cause__ or err.__context__
    return None


def unsafe_weights(what: str, name: str, reason: str) -> UnsafeWeightsError:
    return UnsafeWeightsError(
        f"{what} {name!r} was refused: its weights file is a pickle that needs code to load ({reason}); weights "
        "are read only as safetensors or with torch.load(weights_only=True). If you trust its source, convert it "
        "to safetensors in an isolated, trusted environment (transformers: model.save_pretrained(folder); timm / "
        "open_clip: safetensors.torch.save_file(state_dict, 'model.safetensors')) and point mmgeo at the result.")


def missing_download(what: str, name: str, err: Exception) -> MissingDownloadError:
    return MissingDownloadError(
        f"{what} {name!r} is not in the local cache and nothing can be downloaded here ({type(err).__name__}). "
        f"On a machine with network access run `huggingface-cli download {name}` (or load it once "
        "in Python), then copy the cache (~/.cache/huggingface) to this machine or point HF_HOME at it; "
        "or pass a local directory path instead of the name.")
